"""The fp32 shadow (``record(model, ..., shadow=True)``): how far each module's output is from an
fp32 reference of the same batch, and how much of that error the module adds itself.

On every recorded step, each forward of the recorded model runs twice:

1. **The reference**, first, from the model's forward pre-hook: the same arguments with floating
   tensors cast up to float32, autocast disabled (for the CPU and the model's device), the float32
   master parameters (parameters and buffers stored in float16/bfloat16 are replaced by float32
   copies for the pass), ``torch.no_grad()``, mpscope's own recording off. Every selected module's inputs and
   outputs are kept as float32 copies (memory: about one fp32 copy of the forward's activations,
   freed when the real forward returns).
2. **The real forward**, unchanged. In each selected module's forward hook its output is compared
   with the reference output of the same call (same module, same call index in this forward, same
   flattened output name), and the module is run once more for its **own contribution**: fed the
   reference's inputs, each floating input rounded to the dtype the real call received, under the
   same autocast state as the real call and from the same RNG state as the real call's start. The
   difference from the reference is then the error this module adds to exact inputs; the difference
   of the real output is the error it adds plus the error it inherits.

Training is untouched: bitwise the same with and without the shadow, side effects of the model's
forward included (:mod:`mpscope.recording.isolation` has the details). Each extra pass runs with
``torch.no_grad()``, on clones of the module's buffers passed through ``torch.func.functional_call``
(BatchNorm running statistics and any in-place buffer state are never written; nothing is restored
with an in-place copy, so autograd's version counters are untouched), and:

* **RNGs saved and restored**: torch's default generators (CPU and the model's accelerator), Python's
  ``random``, NumPy's global RNG, and every RNG object held as a module attribute
  (``torch.Generator``, ``random.Random``, NumPy's). The real forward draws what it would draw
  without mpscope; the reference starts from the real forward's start state, so it draws the same
  dropout masks, stochastic-depth decisions and noise, and an own contribution starts from the state
  at its real call's entry.
* **Module attributes saved and restored**: each module's ``__dict__`` (a counter ``self.calls +=
  1``, an attribute set or added on the first call) and the contents of its lists, dicts, sets and
  deques (a cache filled on the first call: the real forward fills it as without mpscope); tensors
  held as plain attributes are cloned for the pass. An own contribution starts from the module's
  attributes at its real call's entry (a warm-up ramp sees the step the real call saw).
* **Foreign hooks skipped**: forward hooks and pre-hooks that are neither PyTorch's (pruning,
  ``weight_norm``, lazy modules, ...) nor mpscope's do not run in the extra passes, so their side
  effects (a feature list a distillation loss sums) happen once. The reference then lacks what such
  a hook changes: in each recorded real forward the inputs/attributes before and after a module's
  pre-hooks, and its output before and after its forward hooks, are compared (object identity and
  tensor versions); when a foreign hook changes them, the shadow stops with a ``RuntimeWarning``
  naming the module and the hook, and that step's rows are dropped. (Hooks registered after the
  first recorded step began, and global module hooks, are not watched.)

Not covered (nothing detects them): state outside the modules' own attributes (closures, globals,
I/O, a custom object an attribute refers to, an element of a container changed in place). A model
with uninitialised lazy parameters gets no reference until its real forward has initialised them.

**A reference that is not float32** (autocast entered inside the model's ``forward``, where the
reference cannot turn it off; or float16/bfloat16 casts that do not depend on autocast) would give
meaningless numbers (SQNR +inf where both sides are bf16). When autocast is enabled at a selected
module's entry during the reference, or a selected module (or, with ``ops=True``, an op) of the
reference returns float16/bfloat16, or the model's output is, the shadow stops with a
``RuntimeWarning`` saying so, before comparing anything.

Cost per recorded step: one float32 forward (the reference) plus one forward of every selected
module's subtree (the own contributions: about ``depth`` forwards for a network ``depth`` modules
deep), no backward, and a float32 copy of the parameters for the reference (a forward that changes
a parameter in place changes the copy, and the shadow stops with a warning before any other pass
runs). Use ``every=`` and ``modules=`` to bound it. The root module's own contribution
is its total error (its inputs are the batch itself) and costs nothing. Saving and restoring the
RNGs and attributes adds about 0.1-0.2 ms of Python per selected module and recorded forward
(NumPy's RNG state is the largest part).

Per compared tensor the statistics, over all elements (float64 on the tensor's device, no host
sync; the step's values reach the host in one copy):

* ``sqnr_db = 10 * log10(sum(ref**2) / sum((x - ref)**2))``: +inf when ``x == ref`` exactly.
* ``max_abs_err = max |x - ref|``, ``ref_absmax = max |ref|``, ``max_rel_err = max_abs_err / ref_absmax``.
* ``own_*``: the same for the own-contribution output (NaN where it could not be run).

With ``record(..., ops=True)`` every op output of the forward is compared too (role ``op_output``,
name ``<aten op overload>#<k>``, module the innermost selected module running it, ``k`` the op's
call index within that module in one forward), with the reference of precision forensics
(:mod:`mpscope.recording.forensics`, on with ``shadow=True`` and ``ops=True`` together): its shadow
of each value, the op evaluated in float64 (float32 for values cast to 16 bits) from the float32
master parameters and the batch. That reference replaces the passes above: no reference pass and
no own contribution (NaN, but the root's, which is its total error; the engine's local error per op
says which op adds error). Where the engine is off (it stopped), the reference pass runs as above and
a dispatch mode keeps a float32 copy of each op output of it for the real pass's op of the same key. Casts
(``_to_copy``, which autocast inserts), copies, views and ``empty*`` outputs
(uninitialised memory) are not compared, and an op
whose output shape differs from the reference's is skipped. Op rows have no own contribution (NaN).

Several calls of one module in a step (micro-batches, a shared module) merge: the signal and noise
powers add, maxima combine. Rows go to ``run.tables["precision"]`` (``run.precision``), columns
:data:`mpscope.run.PRECISION_COLUMNS`.

Compiled models: the extra passes run compiled regions eagerly (``torch.compiler.set_stance
("force_eager")``, PyTorch >= 2.6), so they compile no graph of their own and the regions' compiled
code is left as it was; modules inside a compiled region (see :func:`mpscope.compiled.hook_targets`)
get no shadow hooks and no rows (dynamo would trace the hooks into the graph), and a model whose own
call is compiled in place (``model.compile()``) stops the shadow at attach with a warning (pass
``torch.compile(model)``, whose hooks run outside the region, or compile its submodules).

An exception inside an extra pass (model code that cannot run in float32, say) stops the shadow with
a ``RuntimeWarning``, as the checks above do; training and the rest of the recording go on. Why it
stopped is kept in ``run.meta["shadow"]["stopped"]``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections import defaultdict

import numpy as np
import pandas as pd
import torch
from torch.nn.parameter import is_lazy
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from mpscope import compiled as _compiled
from mpscope.formats import dtype_name
from mpscope.model_hooks import ModelHook
from mpscope.recording.isolation import (Fingerprint, ModuleState, RngState, foreign_hooks, foreign_hooks_off,
                                         hook_name, protect_tensors)
from mpscope.recording.outputs import flatten_outputs as _flatten
from mpscope.schema import PRECISION_COLUMNS
from mpscope.stats import to_host_async

#: Reference passes running now (nested shadows count once each): see :func:`reference_pass_active`.
_ACTIVE_REFERENCES = [0]
#: Statistics per comparison, in this order, in one float64 vector on the tensor's device.
_FIELDS = ("signal", "noise", "max_abs_err", "ref_absmax", "own_noise", "own_max_abs_err")
_LOW = (torch.float16, torch.bfloat16)


def reference_pass_active() -> bool:
    """True while a shadow's float32 reference forward runs. Code that stands in for the training
    loop's autocast (``mpscope.apply`` enters autocast per forward when the loop has none) checks it
    and leaves autocast off, so that the reference stays float32."""
    return _ACTIVE_REFERENCES[0] > 0


def compare(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``[sum(ref**2), sum((x - ref)**2), max|x - ref|, max|ref|]`` as a float64 tensor of shape (4,)
    on ``ref``'s device, computed in float64 (exact differences of float16/bfloat16/float32 values;
    no host sync). ``x`` and ``ref`` must have the same shape."""
    r = ref.detach().to(torch.float64)
    return torch.cat([_signal(r)[:1], _errors(x, r), _signal(r)[1:]])


def _signal(r: torch.Tensor) -> torch.Tensor:
    """``[sum(r**2), max|r|]`` of a reference (float64 values, computed in ``r``'s format)."""
    return torch.stack([torch.dot(r.reshape(-1), r.reshape(-1)), r.abs().amax()]).to(torch.float64)


def _errors(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``[sum((x - r)**2), max|x - r|]`` against a reference ``r``, computed in ``r``'s format (float64
    values)."""
    d = x.detach().to(device=r.device, dtype=r.dtype).reshape(-1) - r.reshape(-1)
    return torch.stack([torch.dot(d, d), d.abs().amax()]).to(torch.float64)


def _wide(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The format a comparison of ``x`` with reference ``r`` runs in: float64, but float32 for a 16-bit
    ``x`` against the engine's float32 shadow (its differences are then exact up to float32's rounding
    of a difference 2^13 or more times larger: far below what a dB shows)."""
    return r if r.dtype == torch.float32 and x.dtype in _LOW else r.to(torch.float64)


def sqnr_db(signal, noise):
    """10·log10(signal / noise) in dB, elementwise over NumPy arrays or floats: +inf when the noise
    is 0 (exact), NaN when either is NaN."""
    s = np.asarray(signal, dtype=np.float64)
    n = np.asarray(noise, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = 10.0 * np.log10(s / n)
    out = np.where(n == 0, np.inf, out)
    out = np.where(np.isnan(s) | np.isnan(n), np.nan, out)
    return out if out.ndim else float(out)


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _upcast(t):
    """Floating tensors below float32 -> float32 (float32/float64 kept); anything else as is."""
    if _floating(t) and t.dtype in _LOW:
        return t.detach().to(torch.float32)
    return t.detach() if isinstance(t, torch.Tensor) else t


def _eager():
    """Compiled regions run eagerly inside the block (``torch.compiler.set_stance("force_eager")``,
    PyTorch >= 2.6): an extra pass compiles no graph of its own (float32, no grad: new guards) and
    leaves the region's compiled code as it was. Earlier PyTorch: nothing."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


class _Copies:
    """Float32 copies (float64 kept) of the reference pass's tensors, one per (tensor, version): a
    module that returns its child's output, or feeds on its predecessor's, shares the copy."""

    def __init__(self):
        self._by_id: dict = {}

    def get(self, t: torch.Tensor) -> torch.Tensor:
        key = (id(t), t._version) if not t.is_inference() else None
        hit = self._by_id.get(key) if key is not None else None
        if hit is not None and hit[0]() is t:
            return hit[1]
        c = t.detach().to(torch.float64 if t.dtype == torch.float64 else torch.float32, copy=True)
        if key is not None:
            self._by_id[key] = (weakref.ref(t), c)
        return c

    def clear(self) -> None:
        self._by_id.clear()


class Shadow:
    """The fp32 shadow of one recording (``record(..., shadow=True)``).

    Args:
        model: the recorded model; ``run``: its Run (``run.tables["precision"]``, ``run.meta``);
        select: ``select(name, module)``, the ``modules=`` selection.
        state: the recording's :class:`~mpscope.recording.hook_state.HookState` (``recording``:
            whether this step is recorded).
        paused: ``paused()``, a context manager inside which no recording hook and no op recording
            sees what runs (the extra passes and the comparisons' own ops).
        step_index: ``step_index()``, the open step's index.
        ops: compare every op output too (``record(..., ops=True)``).

    The recorder calls :meth:`attach` when it attaches, :meth:`begin_step` when a step starts,
    :meth:`end_step` when it ends and :meth:`close` when it detaches.
    """

    def __init__(self, model, run, select, state, paused, step_index, ops: bool = False):
        self.model = model
        self.run, self.select, self.state, self.paused, self.step_index = run, select, state, paused, step_index
        self._root_handles: list = []
        self._module_handles: list = []
        self._names: dict[int, str] = {}
        self._phase: str | None = None  # "reference" | "real" | "own" while a shadowed forward runs
        self._failed = False
        self._ref: dict = {}  # (module id, call) -> [inputs (leaves, spec) or None, {name: fp32 output}]
        self._calls: dict = defaultdict(int)  # module id -> calls in the current pass
        self._entry: dict = defaultdict(list)  # module id -> stack of (RngState, ModuleState) at its real entry
        self._not_fp32: str | None = None  # what made this forward's reference not float32
        self._watch: dict = {}  # (module id, "pre" | "post") -> the module's foreign hooks (see _watch_hooks)
        self._prints: dict = defaultdict(list)  # (module id, "pre" | "post") -> stack of Fingerprints
        self._copies = _Copies()
        self._obs: list = []  # (module, role, name, dtype, device vector) of this step
        self._stack: list[str] = []  # selected modules running now (reference and real pass)
        self._op_calls: dict = defaultdict(int)  # (module, op) -> calls in the current pass
        self._op_ref: dict = {}  # (module, op, k) -> float32 copies of the op's floating outputs
        self._op_mode = _OpShadow(self) if ops else None
        #: precision forensics (``mpscope.recording.forensics.Forensics``): while on, its shadow of each value
        #: is the reference of the module and op rows, and no reference pass runs
        self.engine = None
        self._op_mode_on = False
        self._by_engine = False  # this forward's reference is the engine's shadow (no reference pass)
        self._pending: list = []  # (step, keys, host tensor, event) copies on their way to the host
        self._frames: list[pd.DataFrame] = []
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._devices = [dev] if dev.type not in ("cpu", "meta") else []  # default generators besides the CPU's
        self._device_type = dev.type
        #: modules whose hooks dynamo would trace (inside a compiled region): the shadow hooks none
        self._inside = {id(m) for _, m, inside in _compiled.hook_targets(model) if inside}

    # ------------------------------------------------------------------ lifecycle
    def attach(self) -> None:
        if id(self.model) in self._inside:
            self.run.meta["shadow"] = {"reference": "float32"}
            self._fail(ShadowStop("finding the model's own call compiled in place (model.compile()): the shadow's "
                                  "hooks would be traced into its graph. Compile its submodules, or pass "
                                  "torch.compile(model), whose hooks run outside the compiled region"))
            return
        self._root_handles = [
            self.model.register_forward_pre_hook(ModelHook(self._root_pre), with_kwargs=True),
            self.model.register_forward_hook(ModelHook(self._root_post), always_call=True),
        ]
        self.run.meta["shadow"] = {"reference": "float32"}

    def begin_step(self, recording: bool) -> None:
        """Module hooks on the selected modules during recorded steps only."""
        if not recording or self._failed:
            self._unhook_modules()
        elif not self._module_handles:
            for name, mod in self.model.named_modules():
                self._names[id(mod)] = name
                if self.select(name, mod) and id(mod) not in self._inside:
                    self._module_handles.append(
                        mod.register_forward_pre_hook(ModelHook(self._pre), with_kwargs=True, prepend=True))
                    self._module_handles.append(mod.register_forward_hook(ModelHook(self._post), prepend=True))
            self._watch_hooks()

    def _watch_hooks(self) -> None:
        """Fingerprints around the foreign hooks (the user's: skipped in the extra passes) of every
        module: one before them (prepended) and one after them (appended), in the real forward. A
        difference means a hook changes what the model computes, which the reference lacks."""
        self._watch.clear()
        for mod in self.model.modules():
            if id(mod) in self._inside:  # (a compiled region runs its hooks as traced: none added there)
                continue
            pre, post = foreign_hooks(mod)
            if mod is self.model:
                post = []  # the root's output feeds nothing in the model; its pre-hook fingerprint comes from _root_pre
            if pre:
                self._watch[(id(mod), "pre")] = pre
                if mod is not self.model:
                    self._module_handles.append(mod.register_forward_pre_hook(
                        ModelHook(self._pre_head), with_kwargs=True, prepend=True))
                self._module_handles.append(mod.register_forward_pre_hook(ModelHook(self._pre_tail), with_kwargs=True))
            if post:
                self._watch[(id(mod), "post")] = post
                self._module_handles.append(mod.register_forward_hook(ModelHook(self._post_head), prepend=True))
                self._module_handles.append(mod.register_forward_hook(ModelHook(self._post_tail)))

    def end_step(self, step: int) -> None:
        """Start the copy of step ``step``'s comparisons to the host (non-blocking on CUDA)."""
        obs, self._obs = self._obs, []
        if obs:
            packed = torch.stack([v.to(obs[0][4].device) for *_, v in obs])
            keys = [o[:4] for o in obs]
            host, event = to_host_async(packed)
            self._pending.append((step, keys, host, event))
        self._drain(block=False)

    def close(self) -> None:
        """Remove every hook and publish ``run.tables["precision"]`` (also after an exception)."""
        for h in self._root_handles + self._module_handles:
            h.remove()
        self._root_handles, self._module_handles = [], []
        self._reset_forward()
        if self._obs:
            self.end_step(self.step_index())
        self._drain(block=True)
        frames = [f for f in self._frames if len(f)]
        run = self.run
        run.tables["precision"] = pd.concat(frames, ignore_index=True) if frames else run.precision

    def _unhook_modules(self) -> None:
        for h in self._module_handles:
            h.remove()
        self._module_handles.clear()

    def _reset_forward(self) -> None:
        if self._op_mode_on:  # the real forward raised before the root's forward hook ran
            self._op_mode_on = False
            self._op_mode.__exit__(None, None, None)
        if self._by_engine:
            self.engine.op_listener = None
            self._by_engine = False
        self._stack.clear()
        self._op_calls.clear()
        self._op_ref.clear()
        self._phase = None
        self._ref.clear()
        self._calls.clear()
        self._entry.clear()
        self._prints.clear()
        self._not_fp32 = None
        self._copies.clear()

    def _fail(self, e: BaseException) -> None:
        """Stop the shadow for the rest of the recording, with one RuntimeWarning (also in
        ``run.meta["shadow"]["stopped"]``)."""
        self._failed = True
        self._unhook_modules()
        self._reset_forward()
        why = str(e) if isinstance(e, ShadowStop) else f"an error in its extra forward pass: {e!r}"
        self.run.meta.setdefault("shadow", {})["stopped"] = why
        warnings.warn(f"mpscope: the fp32 shadow stopped after {why}. "
                      "Training continues unchanged; the rest of the recording is unaffected.",
                      RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ the reference pass
    def _root_pre(self, module, args, kwargs):
        if (self._phase is not None or not self.state.recording or self._failed
                or torch._C._current_graph_task_id() != -1  # a checkpoint re-run in backward
                or any(is_lazy(t) for t in self.model.parameters())  # the real forward initialises them
                or any(is_lazy(t) for t in self.model.buffers())):
            return None
        self._reset_forward()
        root = self._names.get(id(module), "")
        base = [root] if self.select(root, module) else []
        self._by_engine = self.engine is not None and self.engine.on
        if self._by_engine:  # the engine's shadow is the reference: no reference pass
            self.engine.op_listener = self._on_op if self._op_mode is not None else None
        elif not self._reference(module, args, kwargs, base):
            return None
        self._calls.clear()
        self._op_calls.clear()
        self._stack[:] = base
        self._phase = "real"
        if (id(module), "pre") in self._watch:  # the inputs the reference ran on
            self._prints[(id(module), "pre")].append(Fingerprint((args, kwargs), module))
        if self._op_mode is not None and not self._by_engine:
            self._op_mode.__enter__()
            self._op_mode_on = True
        return None

    def _reference(self, module, args, kwargs, base) -> bool:
        """The float32 reference pass of the model's call; False when the shadow stopped."""
        # buffers as copies, 16-bit ones cast up (a .half() BatchNorm's running statistics beside a float32 input)
        state = {n: b.float() if b.dtype in _LOW else b.clone() for n, b in self.model.named_buffers()}
        # the float32 master parameters, copies (16-bit parameters cast up): a forward that changes a
        # parameter in place changes a copy, which says so (below)
        params = {n: p.detach().float() if p.dtype in _LOW else p.detach().clone()
                  for n, p in self.model.named_parameters()}
        state.update(params)
        a, k = _tree_map(_upcast, (args, kwargs))
        self._stack[:] = base
        scope = list(self.model.modules())
        try:
            with self._op_mode if self._op_mode is not None else contextlib.nullcontext():
                out = self._extra_pass("reference", torch.func.functional_call, self.model, state, a, k, scope=scope)
            moved = next((n for n, c in params.items() if c._version), None)
            if moved is not None:
                raise ShadowStop(f"finding that the model's forward changes its parameter {moved!r} in place (in "
                                 "the reference pass, on a copy): its other extra passes would change the real one. "
                                 "Nothing of the training run was changed")
            low = next((t.dtype for t in tree_flatten(out)[0] if _floating(t) and t.dtype in _LOW), None)
            if self._not_fp32 is None and low is not None:
                self._not_fp32 = f"the model's output is {dtype_name(low)}"
            if self._not_fp32 is not None:
                raise ShadowStop(
                    f"finding that its float32 reference is not float32 ({self._not_fp32}): its numbers would be "
                    "meaningless. Enter autocast around the model's call in the training loop, not inside the "
                    "model's forward, and cast to float16/bfloat16 only under autocast")
        except Exception as e:  # never break the user's training because of mpscope
            self._fail(e)
            return False
        return True

    def _root_post(self, module, args, output):
        if self._phase == "real":
            self._reset_forward()  # free the reference copies (and leave the op comparisons)
        return None

    def _extra_pass(self, phase: str, fn, *args, scope: list, entry=None):
        """Run ``fn(*args)`` as ``phase`` over the modules ``scope`` with recording off, no grad,
        autocast off for the reference, foreign hooks off and plain tensor attributes cloned, and put
        every RNG and the modules' Python state back afterwards (:mod:`mpscope.recording.isolation`).
        ``entry``, an (RngState, ModuleState) pair, is the state the pass starts from (the real
        call's, for an own contribution)."""
        outer, self._phase = self._phase, phase
        reference = int(phase == "reference")
        _ACTIVE_REFERENCES[0] += reference
        rngs, attrs = RngState(self._devices, scope), ModuleState(scope)
        try:
            if entry is not None:
                for saved in entry:
                    saved.restore()
            with self.paused(), torch.no_grad(), _autocast_off(self._device_type, phase == "reference"), \
                    foreign_hooks_off(scope), _eager():
                protect_tensors(scope)
                return fn(*args)
        finally:
            _ACTIVE_REFERENCES[0] -= reference
            self._phase = outer
            rngs.restore()
            attrs.restore()

    # ------------------------------------------------------------------ module hooks
    def _pre(self, module, args, kwargs):
        mid = id(module)
        if self._phase in ("reference", "real") and module is not self.model:
            self._stack.append(self._names.get(mid, "?"))
        if self._phase == "reference":  # keep this call's inputs (float32 copies)
            if self._not_fp32 is None and _autocast_on(self._device_type):
                name = self._names.get(mid, "?")
                self._not_fp32 = f"autocast is enabled in module {name!r}: inside the model's forward"
            leaves, spec = tree_flatten((args, kwargs))
            key = (mid, self._calls[mid])
            self._ref[key] = [([self._copies.get(x) if _floating(x) else x for x in leaves], spec), {}]
        elif self._phase == "real" and self.state.recording and not self._by_engine:
            scope = list(module.modules())
            self._entry[mid].append((RngState(self._devices, scope), ModuleState(scope)))
        return None

    def _pre_head(self, module, args, kwargs):
        if self._phase == "real":
            self._prints[(id(module), "pre")].append(Fingerprint((args, kwargs), module))

    def _pre_tail(self, module, args, kwargs):
        before = self._prints.get((id(module), "pre"))
        if self._phase == "real" and before and not before.pop().same(Fingerprint((args, kwargs), module)):
            self._hook_changed(module, "pre", "its inputs or attributes")

    def _post_head(self, module, args, output):
        if self._phase == "real":
            self._prints[(id(module), "post")].append(Fingerprint(output))

    def _post_tail(self, module, args, output):
        before = self._prints.get((id(module), "post"))
        if self._phase == "real" and before and not before.pop().same(Fingerprint(output)):
            self._hook_changed(module, "post", "its output")

    def _hook_changed(self, module, kind: str, what: str) -> None:
        """A foreign hook changed what the model computes: this step's comparisons are void."""
        if self._by_engine:  # (no extra pass: the engine's shadow followed what the hook did)
            return
        hooks = ", ".join(hook_name(h) for h in self._watch.get((id(module), kind), []))
        self._obs.clear()
        self._fail(ShadowStop(
            f"finding that a forward {'pre-' if kind == 'pre' else ''}hook on module "
            f"{self._names.get(id(module), '?')!r} ({hooks}) changes {what}: mpscope's extra forwards skip "
            "hooks that are not PyTorch's or mpscope's (so that their side effects happen once), so the "
            "float32 reference would not compute what the model computes"))

    def _post(self, module, args, output):
        mid = id(module)
        if self._phase in ("reference", "real") and module is not self.model and self._stack:
            self._stack.pop()
        if self._phase == "reference":
            key = (mid, self._calls[mid])
            self._calls[mid] += 1
            entry = self._ref.setdefault(key, [None, {}])
            outs = [(n, t) for n, t in _flatten(output, "output") if _floating(t)]
            low = next((t.dtype for _, t in outs if t.dtype in _LOW), None)
            if self._not_fp32 is None and low is not None:
                self._not_fp32 = f"module {self._names.get(mid, '?')!r} returns {dtype_name(low)}"
            entry[1] = {n: self._copies.get(t) for n, t in outs}
            return None
        if self._phase != "real" or not self.state.recording:
            return None
        k = self._calls[mid]
        self._calls[mid] += 1
        start = self._entry[mid].pop() if self._entry[mid] else None
        ref = self._ref.get((mid, k)) if not self._by_engine else \
            [None, {n: s for n, t in _flatten(output, "output") if _floating(t)
                    for s in [self.engine.shadow_now(t)] if s is not None}]
        if ref is None or not ref[1]:
            return None
        try:
            with self.paused():  # the comparison's own ops are not the model's (op recording skips them)
                self._compare_call(module, args, output, ref, start)
        except Exception as e:
            self._fail(e)
        return None

    def _compare_call(self, module, args, output, ref, start) -> None:
        inputs, outs = ref
        real = [(n, t) for n, t in _flatten(output, "output")
                if _floating(t) and n in outs and t.shape == outs[n].shape and t.numel()]
        if not real:
            return
        root = module is self.model
        own = None
        if not root and inputs is not None and start is not None:
            own = self._own(module, args, inputs, start)
        mname = self._names.get(id(module), "?")
        for n, t in real:
            r = _wide(t, outs[n]) if self._by_engine else outs[n].to(torch.float64)
            sig, err = _signal(r), _errors(t, r)
            if root:  # the root's inputs are the batch itself: its own error is its error
                extra = err
            elif own is not None and n in own and own[n].shape == t.shape:
                extra = _errors(own[n], r)
            else:
                extra = torch.full((2,), math.nan, dtype=torch.float64, device=r.device)
            self._obs.append((mname, "activation", n, dtype_name(t.dtype), torch.cat([sig[:1], err, sig[1:], extra])))

    def dispatch(self, func, args, kwargs):
        """Run an op under the op comparison's dispatch mode and compare (or keep) its output."""
        out = func(*args, **kwargs)
        if not self._failed:
            try:
                self._on_op(func, out)
            except Exception as e:  # never break the user's training because of mpscope
                self._fail(e)
        return out

    def _on_op(self, func, out) -> None:
        """One op output of the reference pass (kept) or of the real pass (compared)."""
        if self._phase not in ("reference", "real") or not self._stack:
            return
        if self._phase == "real" and not self.state.recording:  # a comparison's own ops
            return
        op = str(func)
        if func.is_view or func in _NOT_COMPARED:
            return
        floats = [t for t in tree_flatten(out)[0] if _floating(t)]
        if not floats:
            return
        module = self._stack[-1]
        k = self._op_calls[(module, op)]
        self._op_calls[(module, op)] = k + 1
        if self._phase == "reference":
            low = next((t.dtype for t in floats if t.dtype in _LOW), None)
            if self._not_fp32 is None and low is not None:
                self._not_fp32 = f"{op} in module {module!r} returns {dtype_name(low)}"
            self._op_ref[(module, op, k)] = [t.detach().to(torch.float64 if t.dtype == torch.float64
                                                           else torch.float32, copy=True) for t in floats]
            return
        refs = [self.engine.shadow_now(t, just_made=True) for t in floats] if self._by_engine else \
            self._op_ref.get((module, op, k))
        if refs is not None and any(r is None for r in refs):
            return
        if refs is None or len(refs) != len(floats):
            return
        with self.paused():  # the comparison's ops are not the model's
            for i, (t, r) in enumerate(zip(floats, refs)):
                if t.shape != r.shape or not t.numel():
                    continue
                r = _wide(t, r) if self._by_engine else r.to(torch.float64)
                nan = torch.full((2,), math.nan, dtype=torch.float64, device=r.device)
                sig = _signal(r)
                name = f"{op}#{k}" if len(floats) == 1 else f"{op}#{k}.{i}"
                self._obs.append((module, "op_output", name, dtype_name(t.dtype),
                                  torch.cat([sig[:1], _errors(t, r), sig[1:], nan])))

    def _own(self, module, args, inputs, start):
        """The module run on the reference's inputs, each rounded to the real call's input dtype,
        from ``start``, the RNG and Python state at the real call's entry. (The real call's kwargs
        are not seen by a forward hook: the reference's are used as they are, float32.)"""
        leaves, spec = inputs
        n_args = len(tree_flatten(args)[0])
        real_args = tree_flatten(args)[0]
        cast = [r.to(x.dtype) if i < n_args and _floating(r) and _floating(x) else r
                for i, (r, x) in enumerate(zip(leaves, real_args + [None] * (len(leaves) - n_args)))]
        a, k = tree_unflatten(cast, spec)
        state = {n: b.clone() for n, b in module.named_buffers()}
        scope = list(module.modules())
        versions = [p._version for p in module.parameters()]
        own = self._own_pass(module, a, k, state, scope, start)
        if [p._version for p in module.parameters()] != versions:
            raise ShadowStop(f"finding that module {self._names.get(id(module), '?')!r} changed a parameter in "
                             "place in an own-contribution pass: this step's training may differ from a run "
                             "without the shadow")
        return own

    def _own_pass(self, module, a, k, state: dict, scope: list, start):
        if state:
            out = self._extra_pass("own", torch.func.functional_call, module, state, tuple(a), k,
                                   scope=scope, entry=start)
        else:  # nothing to protect: the plain call (functional_call's re-parametrisation costs time)
            out = self._extra_pass("own", lambda: module(*a, **k), scope=scope, entry=start)
        return {n: t for n, t in _flatten(out, "output") if _floating(t)}

    # ------------------------------------------------------------------ host side
    def _drain(self, block: bool) -> None:
        while self._pending:
            step, keys, host, event = self._pending[0]
            if event is not None:
                if not block and not event.query():
                    return
                event.synchronize()
            self._pending.pop(0)
            self._frames.append(_rows(step, keys, host.numpy()))


#: Ops whose outputs the op comparison skips: casts (autocast adds them in the real pass only) and copies.
_NOT_COMPARED = frozenset({torch.ops.aten._to_copy.default, torch.ops.aten.clone.default,
                           torch.ops.aten.copy_.default, torch.ops.aten.detach.default,
                           # uninitialised memory: nothing to compare
                           torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format,
                           torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default})


class _OpShadow(TorchDispatchMode):
    """The dispatch mode of the op comparison (``record(..., ops=True, shadow=True)``)."""

    def __init__(self, shadow: "Shadow"):
        super().__init__()
        self.shadow = shadow

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.shadow.dispatch(func, args, kwargs or {})


def _tree_map(fn, tree):
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([fn(x) for x in leaves], spec)


class ShadowStop(Exception):
    """The shadow stops on purpose (its numbers would be wrong); the message says why."""


def _autocast_on(device_type: str) -> bool:
    return any(torch.is_autocast_enabled(t) for t in dict.fromkeys(["cpu", device_type]) if t != "meta")


class _autocast_off:
    """Autocast disabled for the CPU and ``device_type`` inside the block when ``on``; else nothing."""

    def __init__(self, device_type: str, on: bool):
        types = dict.fromkeys(["cpu", device_type]) if on else {}
        self.ctxs = [torch.autocast(t, enabled=False) for t in types]

    def __enter__(self):
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctxs):
            c.__exit__(*exc)


def _rows(step: int, keys: list, vals: np.ndarray) -> pd.DataFrame:
    """One step's comparisons -> precision rows; repeated (module, role, name, dtype) merge (powers add,
    maxima combine), in first-seen order."""
    f = pd.DataFrame(vals, columns=list(_FIELDS))
    f.insert(0, "dtype", [k[3] for k in keys])
    f.insert(0, "name", [k[2] for k in keys])
    f.insert(0, "role", [k[1] for k in keys])
    f.insert(0, "module", [k[0] for k in keys])
    if len(set(keys)) == len(keys):  # (each key once: nothing to merge)
        m = f
    else:
        g = f.groupby(["module", "role", "name", "dtype"], sort=False)
        m = g.agg(signal=("signal", "sum"), noise=("noise", "sum"), max_abs_err=("max_abs_err", "max"),
                  ref_absmax=("ref_absmax", "max"), own_noise=("own_noise", lambda s: s.sum(min_count=len(s))),
                  own_max_abs_err=("own_max_abs_err", lambda s: s.max(skipna=False))).reset_index()
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = m.max_abs_err / m.ref_absmax
        own_rel = m.own_max_abs_err / m.ref_absmax
    out = pd.DataFrame({
        "step": np.full(len(m), step, dtype=np.int64), "module": m.module, "role": m.role,
        "name": m.name, "dtype": m.dtype, "sqnr_db": sqnr_db(m.signal, m.noise),
        "max_abs_err": m.max_abs_err, "max_rel_err": rel, "ref_absmax": m.ref_absmax,
        "own_sqnr_db": np.where(m.own_noise.isna(), np.nan, sqnr_db(m.signal, m.own_noise)),
        "own_max_abs_err": m.own_max_abs_err, "own_max_rel_err": own_rel,
    })
    return out[PRECISION_COLUMNS]
