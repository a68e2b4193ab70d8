"""The fp32 shadow (``record(model, ..., shadow=True)``): how far each module's output is from an
fp32 reference of the same batch, and how much of that error the module adds itself.

On every recorded step, each forward of the recorded model runs twice:

1. **The reference**, first, from the model's forward pre-hook: the same arguments with floating
   tensors cast up to float32, autocast disabled (for the CPU and the model's device), the float32
   master parameters (parameters stored in float16/bfloat16 are replaced by float32 copies for the
   pass), ``torch.no_grad()``, mpscope's own recording off. Every selected module's inputs and
   outputs are kept as float32 copies (memory: about one fp32 copy of the forward's activations,
   freed when the real forward returns).
2. **The real forward**, unchanged. In each selected module's forward hook its output is compared
   with the reference output of the same call (same module, same call index in this forward, same
   flattened output name), and the module is run once more for its **own contribution**: fed the
   reference's inputs, each floating input rounded to the dtype the real call received, under the
   same autocast state as the real call and from the same RNG state as the real call's start. The
   difference from the reference is then the error this module adds to exact inputs; the difference
   of the real output is the error it adds plus the error it inherits.

Training is untouched: both extra passes run under ``torch.random.fork_rng`` (the RNG stream of the
real forward is what it would be without mpscope, and the reference draws the same dropout masks
as the real forward because it starts from the same state), with ``torch.no_grad()``, and on
clones of the module's buffers passed through ``torch.func.functional_call`` (BatchNorm running
statistics and any in-place buffer state of the model are never written; nothing is restored with
an in-place copy, so autograd's version counters are untouched). User hooks on the model run in the
extra passes as in the real one (they are part of what the model computes); Python attributes a
module's ``forward`` mutates are not restored.

Cost per recorded step: one float32 forward (the reference) plus one forward of every selected
module's subtree (the own contributions: about ``depth`` forwards for a network ``depth`` modules
deep), no backward. Use ``every=`` and ``modules=`` to bound it. The root module's own contribution
is its total error (its inputs are the batch itself) and costs nothing.

Per compared tensor the statistics, over all elements (float64 on the tensor's device, no host
sync; the step's values reach the host in one copy):

* ``sqnr_db = 10 * log10(sum(ref**2) / sum((x - ref)**2))``: +inf when ``x == ref`` exactly.
* ``max_abs_err = max |x - ref|``, ``ref_absmax = max |ref|``, ``max_rel_err = max_abs_err / ref_absmax``.
* ``own_*``: the same for the own-contribution output (NaN where it could not be run).

With ``record(..., ops=True)`` every op output of the forward is compared too (role ``op_output``,
name ``<aten op overload>#<k>``, module the innermost selected module running it, ``k`` the op's
call index within that module in one forward): a dispatch mode keeps a float32 copy of each op
output of the reference pass and compares the real pass's op output of the same key with it at
once. Casts (``_to_copy``, which autocast inserts), copies, views and ``empty*`` outputs
(uninitialised memory) are not compared, and an op
whose output shape differs from the reference's is skipped. Op rows have no own contribution (NaN).

Several calls of one module in a step (micro-batches, a shared module) merge: the signal and noise
powers add, maxima combine. Rows go to ``run.tables["precision"]`` (``run.precision``), columns
:data:`mpscope.run.PRECISION_COLUMNS`.

An exception inside an extra pass (model code that cannot run in float32, say) stops the shadow with
a ``RuntimeWarning``; training and the rest of the recording go on.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import defaultdict

import numpy as np
import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from mpscope.formats import dtype_name
from mpscope.model_hooks import ModelHook
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
    """``[sum(r**2), max|r|]`` of a float64 reference."""
    return torch.stack([torch.dot(r.reshape(-1), r.reshape(-1)), r.abs().amax()])


def _errors(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``[sum((x - r)**2), max|x - r|]`` against a float64 reference ``r``."""
    d = x.detach().to(device=r.device, dtype=torch.float64).reshape(-1) - r.reshape(-1)
    return torch.stack([torch.dot(d, d), d.abs().amax()])


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
        self._entry_rng: dict = defaultdict(list)  # module id -> stack of RNG states at its real entry
        self._copies = _Copies()
        self._obs: list = []  # (module, role, name, dtype, device vector) of this step
        self._stack: list[str] = []  # selected modules running now (reference and real pass)
        self._op_calls: dict = defaultdict(int)  # (module, op) -> calls in the current pass
        self._op_ref: dict = {}  # (module, op, k) -> float32 copies of the op's floating outputs
        self._op_mode = _OpShadow(self) if ops else None
        self._op_mode_on = False
        self._pending: list = []  # (step, keys, host tensor, event) copies on their way to the host
        self._frames: list[pd.DataFrame] = []
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._cuda = [dev] if dev.type == "cuda" else []
        self._device_type = dev.type

    # ------------------------------------------------------------------ lifecycle
    def attach(self) -> None:
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
                if self.select(name, mod):
                    self._module_handles.append(
                        mod.register_forward_pre_hook(ModelHook(self._pre), with_kwargs=True, prepend=True))
                    self._module_handles.append(mod.register_forward_hook(ModelHook(self._post), prepend=True))

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
        self._stack.clear()
        self._op_calls.clear()
        self._op_ref.clear()
        self._phase = None
        self._ref.clear()
        self._calls.clear()
        self._entry_rng.clear()
        self._copies.clear()

    def _fail(self, e: BaseException) -> None:
        self._failed = True
        self._unhook_modules()
        self._reset_forward()
        warnings.warn(f"mpscope: the fp32 shadow stopped after an error in its extra forward pass: {e!r}. "
                      "Training continues unchanged; the rest of the recording is unaffected.",
                      RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ the reference pass
    def _root_pre(self, module, args, kwargs):
        if (self._phase is not None or not self.state.recording or self._failed
                or torch._C._current_graph_task_id() != -1):  # a checkpoint re-run in backward
            return None
        self._reset_forward()
        state = {n: b.clone() for n, b in self.model.named_buffers()}
        # the float32 master parameters: 16-bit parameters are replaced by float32 copies
        state.update({n: p.detach().float() for n, p in self.model.named_parameters() if p.dtype in _LOW})
        a, k = _tree_map(_upcast, (args, kwargs))
        root = self._names.get(id(module), "")
        base = [root] if self.select(root, module) else []
        self._stack[:] = base
        try:
            if self._op_mode is not None:
                with self._op_mode:
                    self._extra_pass("reference", torch.func.functional_call, self.model, state, a, k)
            else:
                self._extra_pass("reference", torch.func.functional_call, self.model, state, a, k)
        except Exception as e:  # never break the user's training because of mpscope
            self._fail(e)
            return None
        self._calls.clear()
        self._op_calls.clear()
        self._stack[:] = base
        self._phase = "real"
        if self._op_mode is not None:
            self._op_mode.__enter__()
            self._op_mode_on = True
        return None

    def _root_post(self, module, args, output):
        if self._phase == "real":
            self._reset_forward()  # free the reference copies (and leave the op comparisons)
        return None

    def _extra_pass(self, phase: str, fn, *args, rng=None):
        """Run ``fn(*args)`` as ``phase`` with recording off, no grad, autocast off for the reference,
        and the RNG state forked (set to ``rng``, a (cpu, cuda) pair of states, when given)."""
        outer, self._phase = self._phase, phase
        reference = int(phase == "reference")
        _ACTIVE_REFERENCES[0] += reference
        try:
            with self.paused(), torch.random.fork_rng(devices=self._cuda, device_type=self._device_type), \
                    torch.no_grad(), _autocast_off(self._device_type, phase == "reference"):
                if rng is not None:
                    torch.set_rng_state(rng[0])
                    if rng[1] is not None:
                        torch.cuda.set_rng_state(rng[1], self._cuda[0])
                return fn(*args)
        finally:
            _ACTIVE_REFERENCES[0] -= reference
            self._phase = outer

    # ------------------------------------------------------------------ module hooks
    def _pre(self, module, args, kwargs):
        mid = id(module)
        if self._phase in ("reference", "real") and module is not self.model:
            self._stack.append(self._names.get(mid, "?"))
        if self._phase == "reference":  # keep this call's inputs (float32 copies)
            leaves, spec = tree_flatten((args, kwargs))
            key = (mid, self._calls[mid])
            self._ref[key] = [([self._copies.get(x) if _floating(x) else x for x in leaves], spec), {}]
        elif self._phase == "real" and self.state.recording:
            cuda = torch.cuda.get_rng_state(self._cuda[0]) if self._cuda else None
            self._entry_rng[mid].append((torch.get_rng_state(), cuda))
        return None

    def _post(self, module, args, output):
        mid = id(module)
        if self._phase in ("reference", "real") and module is not self.model and self._stack:
            self._stack.pop()
        if self._phase == "reference":
            key = (mid, self._calls[mid])
            self._calls[mid] += 1
            entry = self._ref.setdefault(key, [None, {}])
            entry[1] = {n: self._copies.get(t) for n, t in _flatten(output, "output") if _floating(t)}
            return None
        if self._phase != "real" or not self.state.recording:
            return None
        k = self._calls[mid]
        self._calls[mid] += 1
        rng = self._entry_rng[mid].pop() if self._entry_rng[mid] else None
        ref = self._ref.get((mid, k))
        if ref is None or not ref[1]:
            return None
        try:
            with self.paused():  # the comparison's own ops are not the model's (op recording skips them)
                self._compare_call(module, args, output, ref, rng)
        except Exception as e:
            self._fail(e)
        return None

    def _compare_call(self, module, args, output, ref, rng) -> None:
        inputs, outs = ref
        real = [(n, t) for n, t in _flatten(output, "output")
                if _floating(t) and n in outs and t.shape == outs[n].shape and t.numel()]
        if not real:
            return
        root = module is self.model
        own = None
        if not root and inputs is not None and rng is not None:
            own = self._own(module, args, inputs, rng)
        mname = self._names.get(id(module), "?")
        for n, t in real:
            r = outs[n].to(torch.float64)
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
            self._op_ref[(module, op, k)] = [t.detach().to(torch.float64 if t.dtype == torch.float64
                                                           else torch.float32, copy=True) for t in floats]
            return
        refs = self._op_ref.get((module, op, k))
        if refs is None or len(refs) != len(floats):
            return
        with self.paused():  # the comparison's ops are not the model's
            for i, (t, r) in enumerate(zip(floats, refs)):
                if t.shape != r.shape or not t.numel():
                    continue
                r = r.to(torch.float64)
                nan = torch.full((2,), math.nan, dtype=torch.float64, device=r.device)
                sig = _signal(r)
                name = f"{op}#{k}" if len(floats) == 1 else f"{op}#{k}.{i}"
                self._obs.append((module, "op_output", name, dtype_name(t.dtype),
                                  torch.cat([sig[:1], _errors(t, r), sig[1:], nan])))

    def _own(self, module, args, inputs, rng):
        """The module run on the reference's inputs, each rounded to the real call's input dtype.
        (The real call's kwargs are not seen by a forward hook: the reference's are used as they
        are, float32.)"""
        leaves, spec = inputs
        n_args = len(tree_flatten(args)[0])
        real_args = tree_flatten(args)[0]
        cast = [r.to(x.dtype) if i < n_args and _floating(r) and _floating(x) else r
                for i, (r, x) in enumerate(zip(leaves, real_args + [None] * (len(leaves) - n_args)))]
        a, k = tree_unflatten(cast, spec)
        state = {n: b.clone() for n, b in module.named_buffers()}
        if state:
            out = self._extra_pass("own", torch.func.functional_call, module, state, tuple(a), k, rng=rng)
        else:  # nothing to protect: the plain call (functional_call's re-parametrisation costs time)
            out = self._extra_pass("own", lambda: module(*a, **k), rng=rng)
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
    f["has_own"] = ~np.isnan(f.own_noise.to_numpy())
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
