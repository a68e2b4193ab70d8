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
  ``"<overload>#<k>.<i>"`` for output ``i``.
* keeps, per step, two tables that :meth:`OpRecorder.__exit__` puts on the run:

  - ``run.tables["ops"]``, the **autocast audit**: one row per (step, phase, module, op, input dtypes,
    output dtype, flags) with a call count; see :data:`AUDIT_COLUMNS`.
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
from torch.utils.weak import WeakIdKeyDictionary

from mpscope import distributed as _dist
from mpscope import stats as _stats_mod
from mpscope.formats import FORMATS, dtype_name
from mpscope.recording.autocast_policy import (
    ACCUMULATING,
    BOUNDARIES,
    DISTINCT_MAX_FLOAT,
    DISTINCT_MAX_INT,
    MASKING,
    MATMULS,
    PERIODIC,
    POLES,
    SUMMING,
    may_overflow,
    op_info,
    periodic_coarse,
    reduction_len,
)
from mpscope.schema import AUDIT_COLUMNS, FACT_COLUMNS

LOW = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TAG = "mpscope_module"
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


class _Mode(TorchDispatchMode):
    def __init__(self, owner: "OpRecorder"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        before = None
        if owner._enabled and owner.recorder.recording:
            try:
                before = owner._running_value(func, args)
            except Exception as e:  # never break the user's training because of mpscope
                owner._fail(e)
        out = func(*args, **kwargs)
        if owner._enabled and owner.recorder.recording:
            try:
                owner._on_op(func, args, kwargs, out, before)
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
        self._stack: list[tuple[str, int, bool]] = []  # (name, seq threshold, autocast on)
        self._root_autocast = False
        self._in_optimizer = 0
        self._step = 0
        self._failed = False
        self._audit_rows: list[tuple] = []
        self._fact_frames: list[pd.DataFrame] = []
        self._pending: list = []  # (step, records, sizes, copies) whose host copy may not have landed
        self._reset_step()

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> "OpRecorder":
        self._handles = [
            register_optimizer_step_pre_hook(self._opt_pre),
            register_optimizer_step_post_hook(self._opt_post),
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
            if self._records:
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
        self._stack.append((name, torch._C._autograd._get_sequence_nr(), on))

    def _post_hook(self, module, args, output) -> None:
        name = self._names.get(module)
        if name is None or not self._stack:
            return
        # pop to this module (a forward that raised may have left inner entries behind)
        while self._stack:
            top, threshold, _ = self._stack.pop()
            if top == name:
                break
        if self._enabled and torch.is_grad_enabled():
            _tag_graph(output, name, threshold)

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
        self._audit: dict = {}
        self._records: list = []  # host part of each recorded output
        self._dev: list = []  # device part of each record: _DevFacts, same order
        self._stats = WeakIdKeyDictionary()  # tensor -> its DeviceStats (one row) this step
        self._rowed = WeakIdKeyDictionary()  # tensors whose values op_output rows of this step show
        # outputs whose values come from a low-precision cast of non-integer data -> that cast's seq
        self._taint = WeakIdKeyDictionary()

    def _context(self, args, running: bool = False):
        """(module, phase, autocast) for the op being run, or None to skip it. ``running``: the op
        updates a running value in place (kept also outside every module: a metric in the loop)."""
        if self._in_optimizer:
            return None
        f = sys._getframe(1)  # walk past _on_op, __torch_dispatch__ and torch's wrappers to the op's caller
        while f is not None and f.f_globals.get("__name__") in _WRAPPER_FRAMES:
            f = f.f_back
        if f is not None and f.f_globals.get("__name__", "").startswith(_MPSCOPE_INTERNAL):
            return None
        if self._stack:
            name, _, on = self._stack[-1]
            return name, "forward", on
        if torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            if node is None:
                return "", "backward", False
            if node.name().endswith("AccumulateGrad"):
                return None
            return node.metadata.get(_TAG, ""), "backward", False
        if running or (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            return "", "forward", self._root_autocast
        return None

    def _running_value(self, func, args):
        """Before an in-place update of a running value (:data:`ACCUMULATING` on a float16/bfloat16
        tensor that does not require grad, outside ``optimizer.step()``): a copy of that value, so
        that the update's lost increments can be counted after it (None for every other op)."""
        if self._in_optimizer or op_info(func).packet not in ACCUMULATING or not args:
            return None
        a = args[0]
        if not isinstance(a, torch.Tensor) or a.dtype not in LOW or a.requires_grad or not a.numel():
            return None
        if self._context(args, running=True) is None:
            return None
        return a.detach().clone()

    def _on_op(self, func, args, kwargs, out, before=None) -> None:
        info = op_info(func)
        if info.view:
            # a view shares its base's memory: reuse the base's non-finite count (an upper bound for a
            # slice; it only matters once the base already holds inf/NaN, i.e. after the first one)
            if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
                base = self._stats.get(args[0])
                if base is not None:
                    self._stats[out] = base
                if args[0] in self._rowed:
                    self._rowed[out] = True
                src = self._taint.get(args[0]) if len(self._taint) else None
                if src is not None:
                    self._taint[out] = src
            return
        if isinstance(out, torch.Tensor):
            outs = [out] if out.dtype in FLOATS and out.numel() else []
            multi = False
        elif isinstance(out, (tuple, list)):
            outs = [o if isinstance(o, torch.Tensor) and o.dtype in FLOATS and o.numel() else None for o in out]
            multi = True
            if not any(o is not None for o in outs):
                return
        else:
            return
        if not outs:
            return
        ctx = self._context(args, running=before is not None)
        if ctx is None:
            return
        module, phase, autocast = ctx
        key = (module, info.name)
        k = self._counters.get(key, 0)
        self._counters[key] = k + 1

        flat = list(args) + list(kwargs.values())
        # floating tensor inputs, also inside lists (cat, stack); out= targets are no input
        tin = [a for a in _tensor_args(args if info.out_variant else flat) if a.dtype in FLOATS and a.numel()]
        first = next(o for o in outs if o is not None)
        red_len = reduction_len(info, args, first) if info.reduction else 0
        param_lowp = autocast and any(a.dtype in LOW and isinstance(a, torch.nn.Parameter) for a in tin)
        audit_key = (phase, module, info.name, ",".join(dtype_name(a.dtype) for a in tin),
                     dtype_name(first.dtype), bool(autocast), info.inplace, info.out_variant,
                     bool(param_lowp), info.reduction or "")
        agg = self._audit.get(audit_key)
        if agg is None:
            self._audit[audit_key] = [1, first.numel(), red_len]
        else:
            agg[0] += 1
            agg[1] += first.numel()
            agg[2] = max(agg[2], red_len)

        # taint: which tensors carry values of a low-precision cast of non-integer data (see _facts);
        # it flows through every op, also those the op filter or the PRESERVING rule give no row
        periodic_src = math.nan
        if len(self._taint):
            src = next((self._taint[a] for a in tin if a in self._taint), None)
            if src is not None:
                if info.packet in PERIODIC:
                    periodic_src = src
                if not info.reduction:  # elementwise ops, casts, cat, ...: the values flow on
                    for o in outs:
                        if o is not None:
                            self._taint[o] = src

        if (self._modules is not None and module not in self._modules) or \
                (self._op_set is not None and info.short not in self._op_set):
            return  # not selected (the audit above still counts it)
        if self._skippable(info, tin, outs):
            self._skipped += 1
            for o in outs:
                if o is not None:
                    self._rowed[o] = True
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

        if info.cast and phase == "forward" and first.dtype in LOW and len(outs) == 1:
            # a vector of non-integer data (timesteps, positions, angles; not weights or activations)
            x = args[1] if info.packet == "copy_" else (args[0] if args else None)
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != first.dtype \
                    and not x.requires_grad and x.numel() <= DISTINCT_MAX_FLOAT \
                    and x.numel() == max(x.shape, default=1):
                self._taint[first] = len(self._records)  # this output's seq
        # device facts: views of stats taken anyway (the outputs' and the inputs' rows), plus a few
        # op-specific values; they stay on the device until the step's single copy
        in_stats = [self._stats_of(a) for a in tin]
        absmax_in = self._absmax_inputs(info, tin, in_stats) if lowp else ()
        for i, o in enumerate(outs):
            if o is None:
                continue
            name = f"{info.name}#{k}.{i}" if multi else f"{info.name}#{k}"
            if phase == "backward":  # gradients flow scaled by the loss scale, as activation_grad rows
                ds = self.recorder._observe(module, "op_output", name, o, scaled=True)
            else:
                ds = self.recorder._observe(module, "op_output", name, o)
            if ds is None:
                ds = self._stats_of(o)
            else:
                self._stats[o] = ds
                self._rowed[o] = True
            with torch.no_grad():
                fields, vals, host = self._facts(info, args, tin, o, lowp, phase, in_stats)
                if before is not None and o is args[0]:
                    fields, vals = fields + [_FIELD["acc_increments"], _FIELD["acc_swamped"]], \
                        vals + list(_swamped(info, args, kwargs, before, o))
                vals = torch.stack([v.to(device=o.device, dtype=torch.float64) for v in vals]) if vals else None
            self._dev.append(_DevFacts(ds, in_stats, absmax_in, fields, vals))
            host["in_nan"] = scalar_nan
            host["in_inf"] = scalar_inf
            self._records.append(((len(self._records), phase, module, name, info.name, dtype_name(o.dtype),
                                   o.numel(), info.reduction or "", red_len, scalar, scalar_lost, scalar_overflow,
                                   scalar_rounded, periodic_src),
                                  host))

    def _skippable(self, info, tin, outs) -> bool:
        """A :data:`PRESERVING` op whose outputs keep their inputs' dtype and whose floating inputs
        all have rows this step (see :data:`PRESERVING`)."""
        if not (info.preserving and SKIP_PRESERVING and tin):
            return False
        dtype = tin[0].dtype
        return all(a.dtype == dtype and a in self._rowed for a in tin) and \
            all(o is None or o.dtype == dtype for o in outs)

    def _stats_of(self, t: torch.Tensor):
        """The DeviceStats (one row) of ``t`` this step: a recorded op's output, or taken now."""
        ds = self._stats.get(t)
        if ds is None:
            ds = _stats_mod.device_stats([t.detach()], False, getattr(self.recorder, "_fused", True))
            self._stats[t] = ds
        return ds

    @staticmethod
    def _absmax_inputs(info, tin, in_stats) -> tuple:
        """(k, DeviceStats) of the inputs whose largest |x| is ``in_absmax<k>`` for this op."""
        if not tin:
            return ()
        p = info.packet
        if info.reduction in SUMMING:
            j = [1, 2] if p in ("addmm", "baddbmm", "addbmm", "addmv") else [0, 1]
            j = j[: 2 if p in MATMULS else 1]
        elif p in MASKING or p in ("mul", "mul_", "pow", "div", "div_", "square", "addcmul"):
            j = [0, 1]
        elif p in PERIODIC and tin[0].dtype in LOW:  # float_precision: the argument's largest |x|
            j = [0]
        else:
            return ()
        return tuple((k, in_stats[i]) for k, i in enumerate(j) if i < len(tin))

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
        pole = POLES.get(info.packet)
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
                        or src.dtype == torch.bool:
                    src = None
            if src is not None and src.device.type == "cpu" and src.dtype in FLOATS and src.numel() \
                    and self._taint.get(o) != len(self._records) \
                    and _finite_absmax_on_host(self._stats_of(src)) <= 2.0 / FORMATS[dtype_name(o.dtype)].eps:
                # every finite value is below 2 / eps, where the target format holds every integer:
                # no integer can collide, and a constant this small cannot overflow (host read of a
                # CPU tensor: no device to wait for; on CUDA the facts below stay on the device).
                # A taint source (a short vector of non-integer data whose values may reach a sin/cos)
                # keeps them: float_precision reads its in_absmax, distinct values and cast_err.
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
        host, two ``cat``s and one copy per device (on CUDA non-blocking into pinned memory,
        processed once it has landed: no host synchronisation; on the CPU at once)."""
        records, dev, audit = self._records, self._dev, self._audit
        self._reset_step()
        for key, (calls, numel, red_len) in audit.items():
            self._audit_rows.append((step, *key, calls, numel, red_len))
        if records:
            pieces: dict = {}  # (device, kind) -> list of tensors; kind 0: int64 counts, 1: float64

            def put(t: torch.Tensor, kind: int):
                lst = pieces.setdefault((t.device, kind), [])
                lst.append(t)
                return (t.device, kind, len(lst) - 1)

            where = []
            for d in dev:
                nf = lambda ds: put(ds.counts[0, _NAN : _INF + 1], 0)  # noqa: E731
                where.append((nf(d.out), [nf(x) for x in d.ins],
                              [(k, put(x.extrema[0, :2], 1), nf(x)) for k, x in d.absmax],
                              (d.fields, put(d.vals, 1)) if d.fields else None))
            copies = []
            for (device, kind), lst in pieces.items():
                packed = torch.cat(lst)
                sizes = [t.numel() for t in lst]
                host, event = _stats_mod.to_host_async(packed)
                copies.append(((device, kind), host, sizes, event))
            self._pending.append((step, records, where, copies))
        self._drain(block=False)

    def _drain(self, block: bool) -> None:
        """Turn the landed copies into ``op_facts`` rows (all of them, waiting, when ``block``)."""
        while self._pending:
            step, records, where, copies = self._pending[0]
            if not block and any(ev is not None and not ev.query() for *_, ev in copies):
                return
            for *_, ev in copies:
                if ev is not None:
                    ev.synchronize()
            self._pending.pop(0)
            self._process(step, records, where, copies)

    def _process(self, step, records, where, copies) -> None:
        got = {}
        for key, host, sizes, _ in copies:
            flat = host.numpy()
            got[key] = np.split(flat, np.cumsum(sizes)[:-1]) if len(sizes) > 1 else [flat]

        def val(loc):
            device, kind, i = loc
            return got[(device, kind)][i]

        values = np.full((len(records), len(_DEV_FIELDS)), np.nan)
        values[:, 2:4] = 0.0
        for i, ((_, host), (out, ins, absmax, extra)) in enumerate(zip(records, where)):
            values[i, 0:2] = val(out)
            for loc in ins:
                values[i, 2:4] += val(loc)
            for k, ext, nf in absmax:
                nan, inf = val(nf)
                values[i, _FIELD[f"in_absmax{k}"]] = math.nan if nan else (math.inf if inf else float(np.abs(val(ext)).max()))
            if extra is not None:
                values[i, extra[0]] = val(extra[1])
            for field, v in host.items():
                j = _FIELD[field]
                values[i, j] = values[i, j] + v if field in ("in_nan", "in_inf") else v
        rows = [r[0] for r in records]
        cols = ["seq", "phase", "module", "name", "op", "out_dtype", "numel", "reduction", "reduction_len",
                "scalar", "scalar_lost", "scalar_overflow", "scalar_rounded", "periodic_src"]
        frame = pd.DataFrame(rows, columns=cols)
        for j, c in enumerate(_DEV_FIELDS):
            frame[c] = values[:, j]
        frame.insert(0, "step", step)
        frame = frame[FACT_COLUMNS]
        keep = ((frame.out_nan + frame.out_inf) > 0) | (frame.in_zero > 0) \
            | frame.scalar_lost.notna() | frame.scalar_overflow.notna() | frame.scalar_rounded.notna() \
            | frame.periodic_src.notna() | frame.seq.isin(frame.periodic_src.dropna()) | (frame.in_pole > 0) \
            | periodic_coarse(frame) | frame.acc_increments.notna() \
            | ((frame.int_valued == 1) & (frame.changed > 0)) \
            | may_overflow(frame)
        if keep.any():
            self._fact_frames.append(frame[keep].reset_index(drop=True))

    def _publish(self) -> None:
        self._drain(block=True)
        run = self.recorder.run
        audit = pd.DataFrame(self._audit_rows, columns=AUDIT_COLUMNS)
        facts = (pd.concat(self._fact_frames, ignore_index=True) if self._fact_frames
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
_NAN, _INF = _stats_mod.COUNT_NAMES.index("nan"), _stats_mod.COUNT_NAMES.index("inf")


class _DevFacts:
    """The device part of one op-output record: its stats, its floating inputs' stats, the inputs
    whose largest |x| is kept ((k, stats) for ``in_absmax<k>``), and extra facts (field indices,
    float64 values)."""

    __slots__ = ("out", "ins", "absmax", "fields", "vals")

    def __init__(self, out, ins, absmax, fields, vals):
        self.out, self.ins, self.absmax, self.fields, self.vals = out, ins, absmax, fields, vals


def _tensor_args(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _finite_absmax_on_host(ds) -> float:
    """Largest finite |x| from a CPU tensor's stats (reads host memory; no device involved)."""
    e = ds.extrema.numpy()[0]
    return float(max(abs(e[0]), abs(e[1]))) if np.isfinite(e[0]) else 0.0


def _fact_dtype(c: str):
    if c in ("phase", "module", "name", "op", "out_dtype", "reduction"):
        return object
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


def _tag_graph(output, name: str, threshold: int) -> None:
    """Tag the autograd nodes created during this module's forward (sequence number >= threshold)."""
    stack = []
    for t in _flat_tensors(output):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        seq = node._sequence_nr()
        if seq < threshold or seq == _NO_SEQ:
            continue
        md = node.metadata
        if _TAG in md:
            continue
        md[_TAG] = name
        stack.extend(n for n, _ in node.next_functions)


def _flat_tensors(obj):
    try:
        leaves, _ = tree_flatten(obj)
    except Exception:  # pragma: no cover - exotic containers (HF ModelOutput is a dict subclass)
        leaves = [obj]
    if not leaves and hasattr(obj, "values"):
        leaves = list(obj.values())
    return [t for t in leaves if isinstance(t, torch.Tensor)]
