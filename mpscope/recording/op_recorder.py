"""Op-level recording (``record(model, ops=True)``): the dispatch mode that sees every ATen op.

Module hooks see what enters and leaves an ``nn.Module``; many mixed-precision failures happen
between those boundaries (the residual add, the mask add, the variance inside a norm, the log of a
softmax). :class:`OpRecorder` pushes a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that
sees every ATen op *after* autocast has chosen its dtypes (the Python dispatch key sits below the
Autocast and Autograd keys), in forward and in backward, and

* hands every floating output to the recorder (``recorder._observe(module, "op_output", name, t)``),
  which takes the same exact, sync-free stats as for module outputs. ``module`` is the innermost
  module of ``model.named_modules()`` running the op (in backward: the module whose forward created
  the autograd node being executed); ops outside every module (the loss, ``scaler.scale``) belong to
  the root ``""``. ``name`` is ``"<aten overload>#<k>"`` (``aten.add.Tensor#0``), ``k`` counting the
  calls of that overload in that module within the step; an op with several floating outputs gives
  ``"<overload>#<k>.<i>"`` for output ``i``. Calls of a pass that did not train the model (found
  at the step's end) do not count: see :meth:`OpRecorder.renumber`.
* keeps, per step, two tables that :meth:`OpRecorder.__exit__` puts on the run:

  - ``run.tables["ops"]``, the **autocast audit**: one row per (step, phase, module, op, input dtypes,
    output dtype, flags) with a call count; see :data:`AUDIT_COLUMNS`. ``phase`` is ``"forward"``,
    ``"backward"``, or ``"eval"`` for a forward of the model under no_grad / inference_mode.

Each ``op_output`` row belongs to a pass (see :meth:`OpRecorder._pass_of`): in a step that trained
the model the recorder keeps the rows of the passes that trained it, as for module rows (an
evaluation pass, another model's forward and backward leave no row there).
  - ``run.tables["op_facts"]``: per-call facts that the stats of the output alone cannot give
    (non-finite counts of the inputs, input magnitudes, zeros fed to a log, integer collisions of a
    cast, scalar constants lost or overflowing in the op's dtype, increments a 16-bit running value
    lost), kept only for the calls where
    one of them is notable; see :data:`FACT_COLUMNS`. Device values are gathered in one copy per
    recorded step (non-blocking into pinned memory on CUDA, read once it has landed).

The advisor turns those rows into findings (:func:`mpscope.advisor.op_findings.op_findings`).

Ops that are skipped: views (their output is an input's memory), ``empty*`` (uninitialised memory),
ops issued by mpscope itself, ops in
``optimizer.step()``, ops outside every module that neither run in backward nor take an input that
requires grad (bookkeeping such as ``scaler.unscale_`` or gradient clipping; in-place updates of a
float16/bfloat16 running value, :data:`~mpscope.recording.autocast_policy.ACCUMULATING`, are kept
there too: a metric or EMA updated in the training loop), and ops of
``AccumulateGrad`` (parameter gradients are recorded by the module-level recorder as ``param_grad``),
and :data:`PRESERVING` ops (copies, concatenations, gathers) of values that already have rows. With
``record(ops=[...])`` only the named ops get rows, and only in modules the ``modules=`` selection
takes; the audit counts every op. The dispatch mode is on the stack during recorded steps only.

The mode never changes what an op computes: it calls the op with the arguments it received and
returns its result untouched; everything it measures is read-only. It is popped on exit and on
exception (the recorder's ``__exit__`` always calls :meth:`OpRecorder.__exit__`).
"""

from __future__ import annotations

import math
import sys
import warnings
import weakref
from collections import defaultdict

import numpy as np
import pandas as pd
import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

from mpscope import distributed as _dist
from mpscope import stats as _stats_mod
from mpscope.formats import FORMATS, dtype_name
from mpscope.model_hooks import ModelHook
from mpscope.recording.autocast_policy import (
    BOUNDARIES,
    DISTINCT_MAX_FLOAT,
    DISTINCT_MAX_INT,
    MASKING,
    MATMULS,
    PERIODIC,
    SUMMING,
    may_overflow_values,
    op_info,
    periodic_coarse_values,
    reduction_len,
)
from mpscope.recording.step_buffer import rootless_pass
from mpscope.schema import AUDIT_COLUMNS, FACT_COLUMNS

LOW = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOATS = frozenset(FLOATS)
_TAG = "mpscope_module"
_PASS = "mpscope_pass"  # the model's forward pass that made an autograd node
#: The pass of ops outside the model's modules on no value of the model's (another model, bookkeeping):
#: never a training pass, so a training step drops their op_output rows.
OUTSIDE = "outside"
_NO_PASS = 0  # in ``_passes``: a value of the model's forward outside a numbered pass (kept like it)
_NO_SEQ = 2**64 - 1  # sequence number of AccumulateGrad nodes (never created by an op in forward)
_DEV_FIELDS = ["out_nan", "out_inf", "in_nan", "in_inf", "in_absmax0", "in_absmax1", "in_zero",
               "int_valued", "in_absmax", "changed", "distinct_in", "distinct_out", "in_pole", "cast_err",
               "acc_increments", "acc_swamped"]
#: Switch for the PRESERVING skip (tests compare findings with and without it).
SKIP_PRESERVING = True
#: Modules whose own ops (taking stats, copying rows) are not the user's: skipped.
_MPSCOPE_INTERNAL = ("mpscope.stats", "mpscope.recorder", "mpscope.recording", "mpscope.run", "mpscope.formats")
#: Python frames between an op's caller and ``__torch_dispatch__`` (torch wraps modes to disable dynamo).
_WRAPPER_FRAMES = frozenset({__name__, "torch._compile", "torch._dynamo.eval_frame",
                             "torch.utils._python_dispatch"})


_has_data = _stats_mod.has_own_data  # (a wrapper subclass's rows are those of the plain ops it runs)


def _float_data(t: torch.Tensor) -> bool:
    """A non-empty floating tensor holding data of its own (:func:`mpscope.stats.has_own_data`): an
    op's output that gets a row, an input it reads."""
    return t.dtype in _FLOATS and bool(t.numel()) and _has_data(t)


class _Mode(TorchDispatchMode):
    def __init__(self, owner: "OpRecorder"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if not (owner._enabled and owner.recorder.recording):
            return func(*args, **kwargs)
        try:
            info = op_info(func)
        except Exception as e:  # never break the user's training because of mpscope
            owner._fail(e)
            return func(*args, **kwargs)
        if info.view:  # the most common op: only its base's entries follow it
            out = func(*args, **kwargs)
            if owner._enabled and args and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
                try:
                    owner._on_view(args[0], out)
                except Exception as e:  # never break the user's training because of mpscope
                    owner._fail(e)
            return out
        before = None
        if info.accumulating:
            try:
                before = owner._running_value(args)
            except Exception as e:  # never break the user's training because of mpscope
                owner._fail(e)
        out = func(*args, **kwargs)
        if owner._enabled and owner.recorder.recording:
            try:
                owner._on_op(info, args, kwargs, out, before)
            except Exception as e:  # never break the user's training because of mpscope
                owner._fail(e)
        return out


class OpRecorder:
    """Op-level recording for one :class:`~mpscope.recorder.Recorder` (used by ``record(ops=True)``).

    Args:
        recorder: an object with ``model`` (the ``nn.Module``), ``run`` (the Run, whose ``tables``
            receive the audit), ``recording`` (bool: this step is recorded) and
            ``_observe(module, role, name, tensor)`` (takes the stats of one tensor).

    Use as a context manager; call :meth:`on_step_end` at every step boundary.
    """

    def __init__(self, recorder):
        self.recorder = recorder
        model = recorder.model
        self._names = {m: n for n, m in _dist.named_modules(model)}  # wrapper prefixes left out
        self._params = {id(p) for p in model.parameters()}  # values of the model's outside any pass
        select = getattr(recorder, "_select", None)
        #: modules whose ops get rows (None: all), from the recorder's ``modules=`` selection
        self._modules = None if select is None else {n for m, n in self._names.items() if select(n, m)}
        #: short op names that get rows (None: all), from ``record(ops=[...])``
        self._op_set = getattr(recorder, "_op_filter", None)
        self._skipped = 0  # op outputs whose row the PRESERVING rule skipped
        self._device_type = _model_device_type(model)
        self._mode: _Mode | None = None
        self._handles: list = []
        self._module_handles: list = []
        self._pushed = False
        self._opt_popped = False  # the mode stepped off the stack for an optimizer step
        self._below = None  # the dispatch mode under ours when it left the stack
        self._enabled = False
        # (name, seq threshold, autocast on, the nodes its submodules' graph walks stopped at (see
        # _tag_graph), the backward graph task it runs in: -1 outside backward, see _context)
        self._stack: list[tuple[str, int, bool, list, int]] = []
        self._kinds: dict = {}  # id(module globals) -> (globals, kind), see _caller_kind
        self._root_autocast = False
        self._in_optimizer = 0
        self._step = 0
        self._failed = False
        self._audit_rows: list[tuple] = []
        # kept op_facts rows, per step: (step, host columns by row, (rows, fields) values, whether a
        # record of the step had no periodic_src: the column is float then, as a frame of them all)
        self._fact_parts: list[tuple] = []
        self._pending: list = []  # (step, records, sizes, copies) whose host copy may not have landed
        self._reset_step()

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> "OpRecorder":
        self._handles = [
            register_optimizer_step_pre_hook(self._opt_pre),
            register_optimizer_step_post_hook(self._opt_post),
            self.recorder.model.register_forward_pre_hook(ModelHook(self._model_inputs), with_kwargs=True),
        ]
        self._module_handles = [
            register_module_forward_pre_hook(self._pre_hook),
            register_module_forward_hook(self._post_hook, always_call=True),
        ]
        self._mode = _Mode(self)
        self._mode.__enter__()
        self._pushed = True
        self._enabled = True
        return self

    def set_recording(self, on: bool) -> None:
        """Called at each step's start: the dispatch mode and the global module hooks are present
        during recorded steps only, so the ops of the steps in between (``every=N``) take PyTorch's
        plain path. The mode leaves the stack only when it is on top and comes back only onto the
        stack it left (another mode entered meanwhile stays undisturbed: then this step's ops are
        not recorded, and ``run.meta["ops_missed_steps"]`` says so)."""
        if self._mode is None:
            return
        if not on:
            if self._pushed and _get_current_dispatch_mode() is self._mode:
                self._mode.__exit__(None, None, None)
                self._pushed = False
                self._below = _get_current_dispatch_mode()
            if not self._pushed:  # off the stack (also when an optimizer step took it off)
                self._opt_popped = False
                for h in self._module_handles:
                    h.remove()
                self._module_handles = []
        elif not self._pushed:
            if _get_current_dispatch_mode() is not self._below:
                self.recorder.run.meta.setdefault("ops_missed_steps", []).append(self._step)
                return
            if not self._module_handles:
                self._module_handles = [
                    register_module_forward_pre_hook(self._pre_hook),
                    register_module_forward_hook(self._post_hook, always_call=True),
                ]
            self._opt_popped = False
            self._mode.__enter__()
            self._pushed = True

    def __exit__(self, exc_type, exc, tb) -> None:
        self._enabled = False
        try:
            if self._mode is not None and self._pushed:
                self._mode.__exit__(None, None, None)
        finally:
            self._mode = None
            self._pushed = False
            for h in self._handles + self._module_handles:
                h.remove()
            self._handles = []
            self._module_handles = []
            self._stack.clear()
            if self._rows:
                self._flush(self._step)
            self._publish()

    def on_step_end(self, step: int) -> None:
        """Close step ``step``: start the copy of its device facts to the host (one transfer), reset
        call indices."""
        enabled, self._enabled = self._enabled, False
        try:
            self._flush(step)
        finally:
            self._enabled = enabled
        self._step = step + 1

    # ----------------------------------------------------------------- hooks
    def _pre_hook(self, module, args) -> None:
        name = self._names.get(module)
        if name is None:
            return
        on = torch.is_autocast_enabled(self._device_type)
        if not self._stack:
            self._root_autocast = on
        self._stack.append((name, torch._C._autograd._get_sequence_nr(), on, [],
                            torch._C._current_graph_task_id()))

    def _post_hook(self, module, args, output) -> None:
        name = self._names.get(module)
        if name is None or not self._stack:
            return
        # pop to this module (a forward that raised may have left inner entries behind)
        while self._stack:
            top, threshold, _, handed, _ = self._stack.pop()
            if top == name:
                break
        if self._enabled and torch.is_grad_enabled():
            below = _tag_graph(output, name, threshold, getattr(self.recorder, "_pass", None), handed)
            if self._stack:  # the enclosing module's walk goes on from there
                self._stack[-1][3].extend(below)

    def _model_inputs(self, model, args, kwargs) -> None:
        """The model's forward starts: an input that another model made (a GAN's generator feeding
        the recorded discriminator, positionally or as ``inputs_embeds=``) gets its autograd nodes
        tagged :data:`OUTSIDE` (:meth:`_input_pass`), so that model's backward through it, which the
        model's loss runs, is not the model's."""
        if self._enabled and self._pushed and torch.is_grad_enabled():
            for a in _flat_tensors((args, kwargs)):
                if a.requires_grad and a.grad_fn is not None:
                    self._input_pass(a)

    def _opt_pre(self, *args, **kwargs) -> None:
        """``optimizer.step()`` starts: none of its ops is recorded, so the dispatch mode steps off
        the stack (when on top) and its ops take PyTorch's plain path."""
        self._in_optimizer += 1
        if self._in_optimizer == 1 and self._pushed and _get_current_dispatch_mode() is self._mode:
            self._mode.__exit__(None, None, None)
            self._pushed, self._opt_popped = False, True
            self._below = _get_current_dispatch_mode()

    def _opt_post(self, *args, **kwargs) -> None:
        self._in_optimizer = max(0, self._in_optimizer - 1)
        if self._in_optimizer == 0 and self._opt_popped:
            self._opt_popped = False
            if self._mode is not None and self.recorder.recording and _get_current_dispatch_mode() is self._below:
                self._mode.__enter__()
                self._pushed = True

    # ----------------------------------------------------------------- per op
    def _reset_step(self) -> None:
        self._counters: dict = {}
        # every call counted in _counters, in call order: (counter key, pass, phase, outputs named
        # "#k.i": their number, else 0), and the passes among them; see renumber
        self._call_log: list[tuple] = []
        self._call_passes: set = set()
        self._final: list | None = None  # renumber's (phase, k) by call; None: as counted
        self._dropped: set = set()  # renumber's passes that did not train the model
        self._moved: set = set()  # renumber's casts of evaluation passes that a training pass used
        self._rerun = None  # (graph task, module) of the step's latest checkpointed re-run (see _context)
        self._inner_of = None  # _context's graph task that re-ran the checkpoint whose backward this op is in
        # id(output or a view of it) -> (pass, module, id(output)), of the casts autocast keeps for its region
        self._casts: dict = {}
        self._cast_users: dict = defaultdict(set)  # such a cast's pass -> the passes of the ops using it
        self._audit: dict = {}
        # One entry per recorded output, in flat lists of atomic values (few objects for the
        # garbage collector to track): the row's host columns plus (scalar NaNs, scalar infs,
        # noted), its host facts by record (only where there are some), and the device part: the
        # output's DeviceStats, its floating inputs' (record, DeviceStats), the inputs whose largest
        # |x| is kept (record, column, DeviceStats), extra device facts (record, fields, float64 values).
        self._rows: list[tuple] = []
        self._hosts: dict[int, dict] = {}
        self._out_ds: list = []
        self._in_rec: list[int] = []
        self._in_ds: list = []
        self._ab_rec: list[int] = []
        self._ab_col: list[int] = []
        self._ab_ds: list = []
        self._extra: list[tuple] = []
        # What is known of a tensor this step, by id(tensor): a weakref to it (an id counts only while
        # its weakref still points at that tensor: ids of dead tensors are reused), its DeviceStats
        # (one row), whether an op_output row of this step shows its values, and the seq of the
        # low-precision cast of non-integer data its values come from.
        self._refs: dict[int, weakref.ref] = {}
        self._ds: dict = {}
        self._rowed: set[int] = set()
        self._taint: dict[int, int] = {}
        self._tainted = False  # some tensor carries a taint this step
        self._passes: dict[int, object] = {}  # outputs of the model's forward passes -> the pass
        self._periodic_srcs: set = set()  # seqs that some recorded sin/cos/tan's periodic_src names

    def _known(self, t: torch.Tensor) -> int | None:
        """``id(t)`` when ``t`` has an entry this step (see :meth:`_reset_step`), else None."""
        i = id(t)
        r = self._refs.get(i)
        return i if r is not None and r() is t else None

    def _claim(self, t: torch.Tensor) -> int:
        """``id(t)``, with an entry for ``t`` this step (a dead tensor's entry under that id dropped)."""
        i = id(t)
        r = self._refs.get(i)
        if r is None or r() is not t:
            if r is not None:
                self._ds.pop(i, None)
                self._rowed.discard(i)
                self._taint.pop(i, None)
                self._passes.pop(i, None)
                self._casts.pop(i, None)
            self._refs[i] = weakref.ref(t)
        return i

    def _caller_kind(self, f) -> int:
        """0: a frame of torch's wrappers around ``__torch_dispatch__`` (or of this module) or of a
        ``__torch_function__`` (a TorchFunctionMode's, such as the one ``with torch.device(...)`` and
        ``torch.set_default_device`` install, or a tensor subclass's: it passes on an op whose caller
        is below it), 1: a frame of mpscope's own code, 2: any other (the op's caller). Cached per
        module globals (the ``__torch_function__`` check per frame)."""
        g = f.f_globals
        hit = self._kinds.get(id(g))
        if hit is not None and hit[0] is g:
            kind = hit[1]
        else:
            name = g.get("__name__", "")
            kind = 0 if name in _WRAPPER_FRAMES else (1 if name.startswith(_MPSCOPE_INTERNAL) else 2)
            self._kinds[id(g)] = (g, kind)
        return 0 if kind == 2 and f.f_code.co_name == "__torch_function__" else kind

    def _context(self, args, running: bool = False):
        """(module, phase, autocast) for the op being run, or None to skip it. ``running``: the op
        updates a running value in place (kept also outside every module: a metric in the loop)."""
        if self._in_optimizer:
            return None
        f = sys._getframe(1)  # walk past _on_op, __torch_dispatch__ and torch's wrappers to the op's caller
        kind = 0
        while f is not None:
            kind = self._caller_kind(f)
            if kind:
                break
            f = f.f_back
        if kind == 1:
            return None
        if self._stack:
            name, _, on, _, task = self._stack[-1]
            if task != -1 and self.recorder._rerun_pass(task) is None:
                # a forward re-run in backward (checkpointing): the first forward's ops have the rows
                self._rerun = (task, name)
                return None
            return name, "forward", on
        task = torch._C._current_graph_task_id()
        if task != -1:
            self._inner_of = None
            node = torch._C._current_autograd_node()
            if kind == 2 and _recomputing(f):  # a checkpointed function (no module) re-run: as above
                self._rerun = (task, node.metadata.get(_TAG, "") if node is not None else "")
                return None
            if node is None:
                return "", "backward", False
            if node.name().endswith("AccumulateGrad"):
                return None
            module = node.metadata.get(_TAG)
            if node.metadata.get(_PASS) is None and self._rerun is not None and self._rerun[0] != task \
                    and _recomputing(f, inner=True):
                # the backward through a reentrant checkpoint's re-run: a graph task of its own
                # inside the backward that re-ran it, whose pass and module it takes (_pass_of)
                self._inner_of = self._rerun[0]
                return (self._rerun[1] if module is None else module), "backward", False
            return module or "", "backward", False
        if running or (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            return "", "forward", self._root_autocast
        return None

    def _pass_of(self, phase: str, args, outs):
        """Which pass of the model an op belongs to, by the rule the module rows follow (the
        recorder keeps a training step's rows of passes that trained the model): inside the model's
        forward, the recorder's current pass (negative under no_grad); outside its modules, the pass
        some input that requires grad comes from (by its identity, else by its autograd graph:
        :func:`_graph_pass`), else :data:`OUTSIDE` (another model, bookkeeping);
        in backward, the backward itself (``("backward", graph task id)``, training when a
        parameter of the model gets its gradient in it) with the pass that made the node being run
        (``("backward", task, pass)``: kept when either trained the model, see :meth:`renumber`; a
        node made by a pass that did not train it, as autocast's cached weight casts made by the
        first forward of an autocast region, can run in the backward of one that did). An input of
        :data:`OUTSIDE` has the node that made it tagged so (:func:`_tag_outside`): the backward ops
        of another model that trains along (a teacher in the loss) are no pass's of the model either."""
        if phase == "backward":
            node = torch._C._current_autograd_node()
            p = node.metadata.get(_PASS) if node is not None else None
            task = torch._C._current_graph_task_id()
            if p is None:
                return ("backward", task) if self._inner_of is None else ("backward", task, ("backward", self._inner_of))
            return p if p == OUTSIDE else ("backward", task, p)
        if self._stack:
            p = getattr(self.recorder, "_pass", None)
            if p is None:
                p = rootless_pass()  # (a submodule called directly under no_grad: evaluation)
        else:
            p = OUTSIDE
            for a in args:
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    q = self._input_pass(a)
                    if p == OUTSIDE:
                        p = q
            if p == _NO_PASS:
                p = None
        if p is None or (isinstance(p, int) and p > 0):
            for o in outs:
                if o is not None:
                    self._passes[self._claim(o)] = _NO_PASS if p is None else p
        return p

    def _input_pass(self, a: torch.Tensor):
        """The pass of the model that ``a`` (a tensor that requires grad, entering an op outside the
        model's modules or the model itself) comes from: by its identity, else by its autograd graph
        (:func:`_graph_pass`); :data:`_NO_PASS` for a parameter of the model; :data:`OUTSIDE` when
        none, and then the nodes that made it are tagged so (:func:`_tag_outside`): their backward
        ops are another model's."""
        if id(a) in self._params:  # a parameter of the model (an EMA updated from it in the loop)
            return _NO_PASS
        i = self._known(a)
        q = self._passes.get(i, OUTSIDE) if i is not None else _graph_pass(a)
        if q == OUTSIDE:
            _tag_outside(a)
        return q

    def _running_value(self, args):
        """Before an in-place update of a running value (:data:`ACCUMULATING` on a float16/bfloat16
        tensor that does not require grad, outside ``optimizer.step()``): a copy of that value, so
        that the update's lost increments can be counted after it (None for every other op)."""
        if self._in_optimizer or not args:
            return None
        a = args[0]
        if not isinstance(a, torch.Tensor) or a.dtype not in LOW or a.requires_grad or not a.numel():
            return None
        if self._context(args, running=True) is None:
            return None
        return a.detach().clone()

    def _tag_cast(self, cast) -> None:
        """Tag the autograd node of a cast autocast keeps (``cast``: its entry in ``_casts``), once it
        has one, with its module and pass, as a module's walk tags its nodes (:func:`_tag_graph`):
        one made under ``no_grad`` has autograd history but no module walked it."""
        r = self._refs.get(cast[2])
        t = r() if r is not None else None
        if t is not None and t.grad_fn is not None and _TAG not in t.grad_fn.metadata:
            t.grad_fn.metadata[_TAG], t.grad_fn.metadata[_PASS] = cast[1], cast[0]

    def _on_view(self, base: torch.Tensor, out: torch.Tensor) -> None:
        """A view shares its base's memory: it takes the base's marks. Its stats are the base's (its
        non-finite count is an upper bound for a slice; that only matters once the base already holds
        inf/NaN, i.e. after the first one)."""
        i = id(base)
        r = self._refs.get(i)
        if r is None or r() is not base:
            return
        ds, rowed, src, p = self._ds.get(i), i in self._rowed, self._taint.get(i), self._passes.get(i)
        cast = self._casts.get(i)
        if ds is None and not rowed and src is None and p is None and cast is None:
            return
        j = self._claim(out)
        if cast is not None:  # (a weight cast's transpose, as Linear uses it)
            self._casts[j] = cast
            self._tag_cast(cast)
        if ds is not None:
            self._ds[j] = ds
        if rowed:
            self._rowed.add(j)
        if src is not None:
            self._taint[j] = src
        if p is not None:
            self._passes[j] = p

    def _on_op(self, info, args, kwargs, out, before=None) -> None:
        if isinstance(out, torch.Tensor):
            if not _float_data(out):
                return
            outs = [out]
            multi = False
        elif isinstance(out, (tuple, list)):
            outs = [o if isinstance(o, torch.Tensor) and _float_data(o) else None for o in out]
            multi = True
            if not any(o is not None for o in outs):
                return
        else:
            return
        ctx = self._context(args, running=before is not None)
        if ctx is None:
            return
        module, phase, autocast = ctx
        pass_id = self._pass_of(phase, args, outs)
        if isinstance(pass_id, int) and pass_id < 0:
            phase = "eval"  # a forward of the model under no_grad / inference_mode: its own label
        if info.cast and autocast and pass_id.__class__ is int and pass_id and _autocast_cached(args, outs[0]):
            # autocast keeps this cast for its region (also one made under no_grad): the pass that
            # uses it may be a later one (see renumber)
            pass_id = ("cast", pass_id)
            i = self._claim(outs[0])
            self._casts[i] = (pass_id, module, i)
        # another model's op, or bookkeeping: no row, no call count, no audit (its values still carry taints)
        outside = pass_id == OUTSIDE
        if not outside:
            # evaluation ops count their calls apart: the training ops keep their names
            key = (module, info.name) if phase != "eval" else (module, info.name, "eval")
            k = self._counters.get(key, 0)
            self._counters[key] = k + 1
            call = len(self._call_log)
            self._call_log.append((key, pass_id, phase, len(outs) if multi else 0))
            self._call_passes.add(pass_id)

        flat = list(args) + list(kwargs.values()) if kwargs else list(args)
        # floating tensor inputs, also inside lists (cat, stack); out= targets are no input
        tin = []
        for a in (args if info.out_variant else flat):
            if isinstance(a, torch.Tensor):
                if _float_data(a):
                    tin.append(a)
            elif isinstance(a, (list, tuple)):
                tin.extend(t for t in a if isinstance(t, torch.Tensor) and _float_data(t))
        first = next(o for o in outs if o is not None)
        red_len = reduction_len(info, args, first) if info.reduction else 0
        param_lowp = autocast and any(a.dtype in LOW and isinstance(a, torch.nn.Parameter) for a in tin)
        # the dtypes' names are written once per key at the step's end; with the pass: a forward
        # pass that turns out not to train the model is counted as "eval"
        if not outside:
            audit_key = (phase, module, info.name, tuple(a.dtype for a in tin), first.dtype, bool(autocast),
                         info.inplace, info.out_variant, bool(param_lowp), info.reduction or "",
                         pass_id)
            agg = self._audit.get(audit_key)
            if agg is None:
                self._audit[audit_key] = [1, first.numel(), red_len]
            else:
                agg[0] += 1
                agg[1] += first.numel()
                agg[2] = max(agg[2], red_len)
        ids = [self._known(a) for a in tin]  # None: no entry
        if self._casts:  # the passes that use a cast autocast keeps (see renumber)
            for i in ids:
                c = self._casts.get(i)
                if c is not None and c[0] != pass_id:
                    self._cast_users[c[0]].add(pass_id)
                    self._tag_cast(c)

        # taint: which tensors carry values of a low-precision cast of non-integer data (see _facts);
        # it flows through every op, also those the op filter or the PRESERVING rule give no row
        periodic_src = math.nan  # the seq of the cast whose values reach this sin/cos/tan
        if self._tainted:
            src = next((self._taint[i] for i in ids if i is not None and i in self._taint), None)
            if src is not None:
                if info.periodic:
                    periodic_src = src
                if not info.reduction:  # elementwise ops, casts, cat, ...: the values flow on
                    for o in outs:
                        if o is not None:
                            self._taint[self._claim(o)] = src

        if outside or (self._modules is not None and module not in self._modules) or \
                (self._op_set is not None and info.short not in self._op_set):
            return  # not selected (the audit above still counts it)
        if self._skippable(info, tin, ids, outs):
            self._skipped += 1
            for o in outs:
                if o is not None:
                    self._rowed.add(self._claim(o))
            return

        # host facts: python scalars that the op's dtype cannot hold, or that are inf / NaN
        scalar_lost = scalar_overflow = scalar_rounded = math.nan
        scalar_nan = scalar_inf = 0
        scalar = next((float(a) for a in flat if isinstance(a, (int, float)) and not isinstance(a, bool)), math.nan)
        lowp = first.dtype in LOW
        fmt = FORMATS[dtype_name(first.dtype)] if lowp else None
        for a in flat:
            if isinstance(a, float):
                if math.isnan(a):
                    scalar_nan += 1
                elif math.isinf(a):
                    scalar_inf += 1
                elif lowp and 0 < abs(a) <= fmt.underflow_threshold and math.isnan(scalar_lost):
                    scalar_lost = a
                elif lowp and abs(a) >= fmt.overflow_threshold and math.isnan(scalar_overflow):
                    scalar_overflow = a
                elif lowp and math.isnan(scalar_rounded) and abs(abs(a) - 1.0) <= fmt.eps \
                        and a not in BOUNDARIES and _round_to(a, first.dtype) in BOUNDARIES:
                    scalar_rounded = a

        if info.cast and phase == "forward" and lowp and len(outs) == 1:
            # a vector of non-integer data (timesteps, positions, angles; not weights or activations)
            x = args[1] if info.packet == "copy_" else (args[0] if args else None)
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != first.dtype \
                    and not x.requires_grad and x.numel() <= DISTINCT_MAX_FLOAT \
                    and x.numel() == max(x.shape, default=1):
                self._taint[self._claim(first)] = len(self._rows)  # this output's seq
                self._tainted = True
        # a row the step's fact filter must look at whatever its device values (see _process)
        noted = not (math.isnan(scalar_lost) and math.isnan(scalar_overflow) and math.isnan(scalar_rounded)) \
            or info.periodic
        summing = phase == "forward" and bool(info.reduction)
        # device facts: views of stats taken anyway (the outputs' and the inputs' rows), plus a few
        # op-specific values; they stay on the device until the step's single copy
        in_stats = [self._stats_of(a) if i is None or i not in self._ds else self._ds[i] for a, i in zip(tin, ids)]
        absmax_in = self._absmax_inputs(info, tin, in_stats) if lowp else ()
        # ops whose outputs can have extra facts (see _facts): the others skip it
        facts = info.log or info.pole is not None or before is not None
        cast_facts = info.cast or info.packet == "arange"
        for i, o in enumerate(outs):
            if o is None:
                continue
            name = f"{info.name}#{k}.{i}" if multi else f"{info.name}#{k}"
            if phase == "backward":  # gradients flow scaled by the loss scale, as activation_grad rows
                ds = self.recorder._observe(module, "op_output", name, o, scaled=True, pass_id=pass_id)
            else:
                ds = self.recorder._observe(module, "op_output", name, o, pass_id=pass_id)
            if ds is None:
                ds = self._stats_of(o)
            else:
                j = self._claim(o)
                self._ds[j] = ds
                self._rowed.add(j)
            fields, vals, host = (), None, None
            low = o.dtype in LOW
            if facts or (cast_facts and low):
                with torch.no_grad():
                    fields, vals, host = self._facts(info, args, tin, o, lowp, phase, in_stats)
                    if before is not None and o is args[0]:
                        fields, vals = fields + [_FIELD["acc_increments"], _FIELD["acc_swamped"]], \
                            vals + list(_swamped(info, args, kwargs, before, o))
                    vals = torch.stack([v.to(device=o.device, dtype=torch.float64) for v in vals]) if vals else None
            seq = len(self._rows)
            self._out_ds.append(ds)
            self._in_rec.extend([seq] * len(in_stats))
            self._in_ds.extend(in_stats)
            for col, x in absmax_in:
                self._ab_rec.append(seq)
                self._ab_col.append(col)
                self._ab_ds.append(x)
            if fields:
                self._extra.append((seq, fields, vals))
            if host:
                self._hosts[seq] = host
            if not isinstance(periodic_src, float):
                self._periodic_srcs.add(periodic_src)
            self._rows.append((seq, phase, module, name, info.name, dtype_name(o.dtype), o.numel(),
                               info.reduction or "", red_len, scalar, scalar_lost, scalar_overflow, scalar_rounded,
                               periodic_src, scalar_nan, scalar_inf, noted or (summing and low), call))

    def renumber(self, keep: set) -> tuple[set, dict]:
        """At the end of a step that trained the model, number the op calls of the passes the
        recorder keeps (``keep``: the passes that trained it) as if the others had not run: a
        forward with grad enabled whose output is never backpropagated (validation without
        ``no_grad``) leaves the training pass's ``#k`` names as they are in every other step. Its
        calls become ``"eval"`` calls (audit and ``op_facts``, numbered with those of the step's
        ``no_grad`` passes, in call order); backward calls of a graph task that did not train the
        model are numbered apart.

        Returns ``keep`` with this step's backward passes and autocast's casts that it keeps (those
        of a backward or a forward pass in ``keep``, casts a pass in ``keep`` used), and
        ``{(pass, module, old name): new name}`` for the kept calls' ``op_output`` rows whose name
        changes (empty when every pass of the step trained the model). An evaluation pass's cast that
        a training pass used is a ``"forward"`` call of the training calls."""
        keep = keep | {c for c, users in self._cast_users.items() if c[1] in keep or any(u is None or u in keep for u in users)}
        keep |= {p for p in self._call_passes if p.__class__ is tuple and len(p) == 3 and (p[:2] in keep or p[2] in keep)}

        def dropped(p):
            return p is not None and p != OUTSIDE and not (p.__class__ is int and p < 0) and p not in keep

        self._dropped = {p for p in self._call_passes if dropped(p)}
        # an evaluation pass's cast that a kept pass used: a training call (see _autocast_cached)
        self._moved = moved = {p for p in keep if p.__class__ is tuple and p[0] == "cast" and p[1] < 0}
        if not self._dropped and not moved:
            return keep, {}
        before: dict = {}  # counter key -> calls so far, as counted (the names given)
        after: dict = {}  # the same, for the final groups
        final, rename = [], {}
        for key, p, phase, outs in self._call_log:
            k = before.get(key, 0)
            before[key] = k + 1
            group = key
            if p in self._dropped:  # a backward's calls are numbered apart
                group = (key[0], key[1], "eval" if phase == "forward" else phase)
                phase = "eval" if phase == "forward" else phase
            elif p in moved:
                phase, group = "forward", key[:2]
            j = after.get(group, 0)
            after[group] = j + 1
            final.append((phase, j))
            if len(group) == 2 and (j != k or group != key):  # a kept call's row (the others have none)
                for name in ([f"{key[1]}#{k}.{i}" for i in range(outs)] if outs else [f"{key[1]}#{k}"]):
                    rename[p, key[0], name] = _renumbered(name, j)
        self._final = final
        return keep, rename

    def backward_passes(self) -> set:
        """The passes of this step's backward op calls (see :meth:`_pass_of`)."""
        return {p for p in self._call_passes if p.__class__ is tuple and p[0] == "backward"}

    def _skippable(self, info, tin, ids, outs) -> bool:
        """A :data:`PRESERVING` op whose outputs keep their inputs' dtype and whose floating inputs
        all have rows this step (see :data:`PRESERVING`)."""
        if not (info.preserving and SKIP_PRESERVING and tin):
            return False
        dtype = tin[0].dtype
        return all(a.dtype == dtype and i is not None and i in self._rowed for a, i in zip(tin, ids)) and \
            all(o is None or o.dtype == dtype for o in outs)

    def _stats_of(self, t: torch.Tensor):
        """The DeviceStats (one row) of ``t`` this step: a recorded op's output, or taken now."""
        i = self._claim(t)
        ds = self._ds.get(i)
        if ds is None:
            ds = self._ds[i] = _stats_mod.device_stats([t.detach()], False, getattr(self.recorder, "_fused", True))
        return ds

    @staticmethod
    def _absmax_inputs(info, tin, in_stats) -> tuple:
        """(column of ``in_absmax<k>``, DeviceStats) of the inputs whose largest |x| this op's row keeps."""
        if not tin:
            return ()
        p = info.packet
        if info.reduction in SUMMING:
            j = [1, 2] if p in ("addmm", "baddbmm", "addbmm", "addmv") else [0, 1]
            j = j[: 2 if p in MATMULS else 1]
        elif p in MASKING or p in ("mul", "mul_", "pow", "div", "div_", "square", "addcmul"):
            j = [0, 1]
        elif info.periodic and tin[0].dtype in LOW:  # float_precision: the argument's largest |x|
            j = [0]
        else:
            return ()
        return tuple((_ABSMAX_COLS[k], in_stats[i]) for k, i in enumerate(j) if i < len(tin))

    def _facts(self, info, args, tin, o, lowp, phase, in_stats):
        """Extra device facts of one output: (field indices, device scalars, host values by field)."""
        F = _FIELD
        fields: list[int] = []
        vals: list[torch.Tensor] = []
        host: dict = {}

        def put(field, value):
            fields.append(F[field])
            vals.append(value)

        if info.log and tin:
            put("in_zero", (tin[0] == 0).sum())
        pole = info.pole
        if pole is not None and tin and phase == "forward":
            x = tin[1] if info.packet in ("div", "div_") and len(tin) > 1 else tin[0]  # the divisor / the argument
            if info.packet in ("div", "div_") and len(tin) < 2:
                x = None  # a Python divisor: its zero is visible on the host
        else:
            x = None
        if x is not None:
            put("in_pole", (x.detach().abs() == 1).sum() if pole == 1.0 else (x.detach() == pole).sum())
        if o.dtype in LOW:
            src = None
            if info.cast:
                src = args[1] if info.packet == "copy_" else args[0]
                if not isinstance(src, torch.Tensor) or src.dtype == o.dtype or src.is_complex() \
                        or src.dtype == torch.bool or not _has_data(src):
                    src = None
            if src is not None and src.device.type == "cpu" and src.dtype in FLOATS and src.numel():
                i = self._known(o)
                if (i is None or self._taint.get(i) != len(self._rows)) \
                        and _finite_absmax_on_host(self._stats_of(src)) <= 2.0 / FORMATS[dtype_name(o.dtype)].eps:
                    # every finite value is below 2 / eps, where the target format holds every integer:
                    # no integer can collide, and a constant this small cannot overflow (host read of a
                    # CPU tensor: no device to wait for; on CUDA the facts below stay on the device).
                    # A taint source (a short vector of non-integer data whose values may reach a
                    # sin/cos) keeps them: float_precision reads its in_absmax, distinct values and cast_err.
                    src = None
            if src is not None:
                x = src.detach()
                if x.is_floating_point():
                    fin = torch.isfinite(x)
                    put("int_valued", ((x == torch.round(x)) | ~fin).all())
                    put("in_absmax", torch.where(fin, x.abs(), 0).amax())
                    # weights, activations and gradients are not positions: no sort for them
                    limit = 0 if (phase == "backward" or src.requires_grad or isinstance(src, torch.nn.Parameter)) \
                        else DISTINCT_MAX_FLOAT
                else:
                    host["int_valued"] = 1.0
                    put("in_absmax", x.abs().amax())
                    limit = DISTINCT_MAX_INT
                if o.numel() == x.numel():
                    y = o.detach().reshape(x.shape)
                    put("changed", (y.to(x.dtype) != x).sum())
                    if x.is_floating_point() and limit:
                        put("cast_err", torch.where(torch.isfinite(x), (y.to(x.dtype) - x).abs(), 0).amax())
                    if x.numel() <= limit:
                        put("distinct_in", _distinct(x))
                        put("distinct_out", _distinct(y))
            elif info.packet == "arange":
                nums = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
                if all(float(a).is_integer() for a in nums) and o.numel() <= DISTINCT_MAX_INT:
                    host["int_valued"] = 1.0
                    host["distinct_in"] = float(o.numel())
                    put("in_absmax", o.detach().abs().amax())  # the values asked for, as rounded
                    put("distinct_out", _distinct(o.detach()))
                    # elements whose value the low-precision arange changed: vs an exact float64 arange
                    ref = torch.arange(*nums, dtype=torch.float64, device=o.device)
                    if ref.numel() == o.numel():
                        put("changed", (o.detach().to(torch.float64) != ref).sum())
        return fields, vals, host

    def _flush(self, step: int) -> None:
        """End of a recorded step: store its audit rows and start the copy of its device facts to the
        host: the non-finite counts and extrema of every distinct stats row the records point at, and
        the extra facts, in two ``cat``s and one copy per device (on CUDA non-blocking into pinned
        memory, processed once it has landed: no host synchronisation; on the CPU at once)."""
        rows, hosts, audit, periodic = self._rows, self._hosts, self._audit, self._periodic_srcs
        out_ds, in_rec, in_ds, ab_rec, ab_col, ab_ds, extra = (self._out_ds, self._in_rec, self._in_ds, self._ab_rec,
                                                               self._ab_col, self._ab_ds, self._extra)
        final, dropped, moved = self._final, self._dropped, self._moved
        self._reset_step()
        merged: dict = {}  # the audit by its row's key: the passes summed, those that did not train as "eval"
        for (phase, *rest, p), (calls, numel, red_len) in audit.items():
            key = ("eval" if p in dropped else ("forward" if p in moved else phase), *rest)
            agg = merged.get(key)
            merged[key] = [calls, numel, red_len] if agg is None else [agg[0] + calls, agg[1] + numel,
                                                                       max(agg[2], red_len)]
        for (phase, module, op, in_dtypes, out_dtype, *flags), (calls, numel, red_len) in merged.items():
            self._audit_rows.append((step, phase, module, op, ",".join(dtype_name(d) for d in in_dtypes),
                                     dtype_name(out_dtype), *flags, calls, numel, red_len))
        if final is not None:  # renumber's names and phases
            rows = [(r[0], final[r[17]][0], r[2], _renumbered(r[3], final[r[17]][1]), *r[4:]) for r in rows]
        if rows:
            stats: list = []  # distinct DeviceStats, first seen first
            where: dict = {}  # id(DeviceStats) -> position in stats
            for ds in (*out_ds, *in_ds, *ab_ds):
                if id(ds) not in where:
                    where[id(ds)] = len(stats)
                    stats.append(ds)
            by_device: dict = {}  # device -> positions in stats
            for p, ds in enumerate(stats):
                by_device.setdefault(ds.counts.device, []).append(p)
            row = np.empty(len(stats), dtype=np.int64)  # position in stats -> row of the host arrays
            copies, base = [], 0
            for device, ps in by_device.items():
                counts, order = _first_rows([stats[p].counts for p in ps], _NAN, _INF + 1)
                extrema, order_e = _first_rows([stats[p].extrema for p in ps], 0, 2)
                vals = [v for _, _, v in extra if v.device == device]
                floats = torch.cat([extrema.reshape(-1), *vals]) if vals else extrema.reshape(-1)
                row[ps] = base + np.arange(len(ps))
                base += len(ps)
                (c, ev), (f, ev2) = _stats_mod.to_host_async(counts.reshape(-1)), _stats_mod.to_host_async(floats)
                copies.append((device, c, order, f, order_e, [e for e in (ev, ev2) if e is not None]))

            def at(lst):
                return row[np.fromiter((where[id(ds)] for ds in lst), dtype=np.int64, count=len(lst))]

            plan = (at(out_ds), np.asarray(in_rec, dtype=np.int64), at(in_ds), np.asarray(ab_rec, dtype=np.int64),
                    np.asarray(ab_col, dtype=np.int64), at(ab_ds),
                    [(i, f, v.device, v.numel()) for i, f, v in extra])
            self._pending.append((step, rows, hosts, plan, copies, periodic))
        self._drain(block=False)

    def _drain(self, block: bool) -> None:
        """Turn the landed copies into ``op_facts`` rows (all of them, waiting, when ``block``)."""
        while self._pending:
            step, rows, hosts, plan, copies, periodic = self._pending[0]
            events = [ev for *_, evs in copies for ev in evs]
            if not block and any(not ev.query() for ev in events):
                return
            for ev in events:
                ev.synchronize()
            self._pending.pop(0)
            self._process(step, rows, hosts, plan, copies, periodic)

    def _process(self, step, rows, hosts, plan, copies, periodic) -> None:
        """The step's ``op_facts`` rows: every record's facts as a (records, fields) array, the fact
        filter applied to it, and a frame made of the rows it keeps (often none)."""
        out_at, in_rec, in_at, ab_rec, ab_col, ab_at, extra = plan
        counts, extrema, vals = [], [], {}
        for device, c, order, f, order_e, _ in copies:
            n = len(order)
            c_rows, e_rows = np.empty((n, 2)), np.empty((n, 2))
            c_rows[order] = c.numpy().reshape(n, 2)  # back to first-seen order
            e_rows[order_e] = f.numpy()[: 2 * n].reshape(n, 2)
            counts.append(c_rows)
            extrema.append(e_rows)
            vals[device] = f.numpy()[2 * n:]
        counts = np.concatenate(counts)  # (distinct stats, 2): nan, inf
        extrema = np.concatenate(extrema)  # (distinct stats, 2): largest, smallest finite
        n = len(rows)
        values = np.full((n, len(_DEV_FIELDS)), np.nan)
        values[:, 0:2] = counts[out_at]
        inputs = np.zeros((n, 2))  # the inputs' non-finite counts, then the Python scalars'
        np.add.at(inputs, in_rec, counts[in_at])
        values[:, 2:4] = inputs + np.array([r[14:16] for r in rows], dtype=np.float64).reshape(n, 2)
        if len(ab_rec):
            with np.errstate(invalid="ignore"):
                a = np.where(counts[ab_at, 1] > 0, np.inf, np.abs(extrema[ab_at]).max(axis=1))
            values[ab_rec, ab_col] = np.where(counts[ab_at, 0] > 0, np.nan, a)
        offset = dict.fromkeys(vals, 0)
        for i, fields, device, m in extra:
            values[i, fields] = vals[device][offset[device]: offset[device] + m]
            offset[device] += m
        for i, host in hosts.items():
            for field, v in host.items():
                values[i, _FIELD[field]] = v
        # the fact filter: the rows with a notable device value, and those with a host fact
        # (``noted``: a lost / overflowing / rounded constant, a sin/cos/tan, a forward reduction in
        # float16/bfloat16), on which the frame-level rules decide
        F, v = _FIELD, values
        with np.errstate(invalid="ignore"):
            keep = (v[:, F["out_nan"]] + v[:, F["out_inf"]] > 0) | (v[:, F["in_zero"]] > 0) | (v[:, F["in_pole"]] > 0) \
                | ~np.isnan(v[:, F["acc_increments"]]) | ((v[:, F["int_valued"]] == 1) & (v[:, F["changed"]] > 0))
        noted = np.flatnonzero([r[16] or r[0] in periodic for r in rows])
        if len(noted):
            sub = [rows[i] for i in noted]
            host_fact = np.array([not (math.isnan(r[10]) and math.isnan(r[11]) and math.isnan(r[12]))
                                  or not isinstance(r[13], float) or r[0] in periodic for r in sub])
            dtypes = [r[5] for r in sub]
            keep[noted] |= host_fact \
                | periodic_coarse_values([r[4].split(".")[1] in PERIODIC for r in sub], v[noted, F["in_absmax0"]], dtypes) \
                | may_overflow_values([r[1] == "forward" for r in sub], [r[7] != "" for r in sub], dtypes,
                                      np.array([r[8] for r in sub]), v[noted, F["in_absmax0"]], v[noted, F["in_absmax1"]])
        if keep.any():
            idx = np.flatnonzero(keep)
            self._fact_parts.append((step, [rows[i][:14] for i in idx], values[idx],
                                     any(isinstance(r[13], float) for r in rows)))

    def _publish(self) -> None:
        self._drain(block=True)
        run = self.recorder.run
        audit = pd.DataFrame(self._audit_rows, columns=AUDIT_COLUMNS)
        facts = (_facts_frame(self._fact_parts) if self._fact_parts
                 else pd.DataFrame({c: pd.Series(dtype=_fact_dtype(c)) for c in FACT_COLUMNS}))
        run.tables["ops"] = audit
        run.tables["op_facts"] = facts
        run.meta.setdefault("ops", True)

    def _fail(self, e: Exception) -> None:
        self._enabled = False
        if not self._failed:
            self._failed = True
            warnings.warn(f"mpscope: op-level recording stopped after an internal error: {e!r}. "
                          "Training continues unchanged; module-level recording is unaffected.",
                          RuntimeWarning, stacklevel=2)


_FIELD = {f: i for i, f in enumerate(_DEV_FIELDS)}
_ABSMAX_COLS = (_FIELD["in_absmax0"], _FIELD["in_absmax1"])
#: host columns of an op_facts row, as kept per record
_ROW_COLUMNS = ["seq", "phase", "module", "name", "op", "out_dtype", "numel", "reduction", "reduction_len", "scalar",
                "scalar_lost", "scalar_overflow", "scalar_rounded", "periodic_src"]
_NAN, _INF = _stats_mod.COUNT_NAMES.index("nan"), _stats_mod.COUNT_NAMES.index("inf")


def _autocast_cached(args, out: torch.Tensor) -> bool:
    """The cast of an op that autocast runs (``autocast`` on where it runs) is one that autocast
    caches for the rest of its region, shared by every forward pass in it: a float32 leaf that
    requires grad (a weight) cast to the lower precision, with the cache enabled (the conditions of
    ``cached_cast`` in PyTorch's ``aten/src/ATen/autocast_mode.h``; under ``no_grad`` too, and the
    cast keeps its autograd history). A pass that did not train the model may have run it for one
    that did."""
    x = args[0] if args else None
    return (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.is_leaf and x.requires_grad
            and out.dtype in LOW and torch.is_autocast_cache_enabled())


def _recomputing(f, inner: bool = False) -> bool:
    """The op called from frame ``f`` (Python code running inside a backward, outside every module)
    is a checkpointed function's forward re-run by ``torch.utils.checkpoint``: a checkpoint frame
    is reached going up before a frame of ``torch.autograd`` (a custom Function's backward, or the
    backward of a reentrant checkpoint's re-run, is called by the autograd engine from there).
    ``inner``: the op is run by the autograd engine inside such a re-run's backward (a checkpoint
    frame is reached at all: reentrant checkpointing calls ``torch.autograd.backward`` itself)."""
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name == "torch.utils.checkpoint":
            return True
        if name.startswith("torch.autograd") and not inner:
            return False
        f = f.f_back
    return False


def _renumbered(name: str, k: int) -> str:
    """``name`` (``"<overload>#<j>"`` or ``"<overload>#<j>.<i>"``) with call index ``k`` for ``j``."""
    base, _, rest = name.rpartition("#")
    _, dot, i = rest.partition(".")
    return f"{base}#{k}{dot}{i}"


def _first_rows(tensors: list[torch.Tensor], lo: int, hi: int) -> tuple[torch.Tensor, np.ndarray]:
    """Columns ``lo:hi`` of the first row of each (rows, columns) tensor, one row each, and which
    tensor each row comes from (tensors of one shape are concatenated by one op, so rows come grouped
    by shape)."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(tuple(t.shape), []).append(i)
    parts, order = [], []
    for shape, idx in groups.items():
        g = torch.cat([tensors[i] for i in idx]) if len(idx) > 1 else tensors[idx[0]]
        if shape[0] != 1:
            g = g.reshape(len(idx), shape[0], shape[1])[:, 0]
        parts.append(g[:, lo:hi])
        order.extend(idx)
    return (torch.cat(parts) if len(parts) > 1 else parts[0]), np.asarray(order, dtype=np.int64)


def _finite_absmax_on_host(ds) -> float:
    """Largest finite |x| from a CPU tensor's stats (reads host memory; no device involved)."""
    e = ds.extrema.numpy()[0]
    return float(max(abs(e[0]), abs(e[1]))) if np.isfinite(e[0]) else 0.0


def _facts_frame(parts: list[tuple]) -> pd.DataFrame:
    """``run.tables["op_facts"]`` from the kept rows of every step (see ``OpRecorder._fact_parts``)."""
    frame = pd.DataFrame([r for _, rows, _, _ in parts for r in rows], columns=_ROW_COLUMNS)
    if any(p[3] for p in parts):
        frame["periodic_src"] = frame["periodic_src"].astype(np.float64)
    values = np.concatenate([p[2] for p in parts])
    for j, c in enumerate(_DEV_FIELDS):
        frame[c] = values[:, j]
    frame.insert(0, "step", np.concatenate([np.full(len(rows), step, dtype=np.int64) for step, rows, _, _ in parts]))
    return frame[FACT_COLUMNS]


def _fact_dtype(c: str):
    if c in ("phase", "module", "name", "op", "out_dtype", "reduction"):
        return "str"  # (what pandas infers for the text columns of a frame of rows)
    return "int64" if c in ("step", "seq", "numel", "reduction_len") else "float64"


def _swamped(info, args, kwargs, before: torch.Tensor, after: torch.Tensor):
    """(increments, swamped) of one in-place update ``before -> after`` of a running value: the
    elements whose exact update (computed in float64) changes the value, and those of them the
    low-precision update left equal to ``before``."""
    old = before.to(torch.float64)
    x = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("end"))
    x = x.to(torch.float64) if isinstance(x, torch.Tensor) else float(x)
    if info.packet == "lerp_":
        w = args[2] if len(args) > 2 else kwargs.get("weight")
        w = w.to(torch.float64) if isinstance(w, torch.Tensor) else float(w)
        exact = old + w * (x - old)
    else:
        alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
        exact = old + (alpha if info.packet == "add_" else -alpha) * x
    moved = (exact != old).expand(old.shape)
    return moved.sum().to(torch.float64), (moved & (after == before)).sum().to(torch.float64)


def _distinct(t: torch.Tensor) -> torch.Tensor:
    """Number of distinct values of ``t`` (sort + adjacent differences; no host sync)."""
    s = torch.sort(t.reshape(-1))[0]
    if s.numel() < 2:
        return torch.tensor(float(s.numel()), dtype=torch.float64, device=t.device)
    return ((s[1:] != s[:-1]).sum() + 1).to(torch.float64)


def _round_to(x: float, dtype: torch.dtype) -> float:
    """``x`` as ``dtype`` holds it (round to nearest even, as ``tensor.to(dtype)``)."""
    return float(torch.tensor(x, dtype=torch.float64).to(dtype))


def _model_device_type(model: torch.nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    for b in model.buffers():
        return b.device.type
    return "cpu"


def _tag_graph(output, name: str, threshold: int, pass_id=None, handed=()) -> list:
    """Tag the autograd nodes created during this module's forward (sequence number >= threshold)
    with the module's name and the model's forward pass (``pass_id``); return the untagged nodes
    the walk stopped at below ``threshold`` (made before this forward: its inputs' nodes).

    The walk starts at the output's nodes and at ``handed``, the nodes where the walks of the
    submodules this forward ran stopped, and stops at nodes already tagged (a submodule's, walked by
    it). A module whose forward ends in a submodule (``return self.proj(h)``) thus still tags its own
    ops behind the submodule's nodes, and no node is walked twice: each module's walk hands the
    nodes below its threshold up to its parent's (see ``OpRecorder._post_hook``)."""
    stack = []
    for t in _flat_tensors(output):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
    stack.extend(handed)
    seen = set()
    below = []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        md = node.metadata
        if _TAG in md:
            continue
        seq = node._sequence_nr()
        if seq == _NO_SEQ:
            continue
        if seq < threshold:
            below.append(node)
            continue
        md[_TAG] = name
        md[_PASS] = pass_id
        stack.extend(n for n, _ in node.next_functions)
    return below


def _tag_outside(t: torch.Tensor) -> None:
    """Tag the autograd nodes that made ``t`` (an op's input of no pass of the model's, see
    ``OpRecorder._pass_of``) as :data:`OUTSIDE` the model, under the root's name: ``t.grad_fn`` and
    the untagged nodes above it (the ops of another model or of bookkeeping, on values of no pass:
    their inputs were of no pass either, or :func:`_graph_pass` would have found the model's tag),
    up to tagged nodes and leaves. In backward their ops belong to no pass of the model (a training
    step drops their rows). Each node is walked once: the next walk stops at its tag."""
    stack = [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        md = node.metadata
        if _TAG in md or node._sequence_nr() == _NO_SEQ:
            continue
        md[_TAG] = ""
        md[_PASS] = OUTSIDE
        stack.extend(n for n, _ in node.next_functions)


#: Most autograd nodes :func:`_graph_pass` visits (an untagged chain outside the model's modules is
#: the loop's own few ops on the model's output; a longer walk would only cost time).
_GRAPH_WALK = 16


def _graph_pass(t: torch.Tensor):
    """The pass of the model's forward that ``t`` comes from, read from the autograd graph: the tag
    :func:`_tag_graph` left on the nearest tagged node of the model at or above ``t.grad_fn`` (at most
    :data:`_GRAPH_WALK` nodes), :data:`_NO_PASS` for a tag outside a numbered pass, else
    :data:`OUTSIDE`. For a tensor the op recorder has not seen by identity: a new Python object
    over the model's values, as ``Tensor.as_subclass`` makes (e.g. a module or the loop wrapping
    the model's output in a tensor subclass)."""
    todo, seen = [t.grad_fn], set()
    while todo and len(seen) < _GRAPH_WALK:
        node = todo.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        md = node.metadata
        if _TAG in md:
            p = md[_PASS]
            if p == OUTSIDE:
                continue  # no value of the model's above (see _tag_outside): another path may hold one
            return _NO_PASS if p is None else p
        todo.extend(n for n, _ in node.next_functions)
    return OUTSIDE


def _flat_tensors(obj):
    try:
        leaves, _ = tree_flatten(obj)
    except Exception:  # pragma: no cover - exotic containers (HF ModelOutput is a dict subclass)
        leaves = [obj]
    if not leaves and hasattr(obj, "values"):
        leaves = list(obj.values())
    return [t for t in leaves if isinstance(t, torch.Tensor)]
