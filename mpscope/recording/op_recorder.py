"""Op-level recording (``record(model, ops=True)``): the dispatch mode that sees every ATen op.

Module hooks see what enters and leaves an ``nn.Module``; many mixed-precision failures happen
between those boundaries (the residual add, the mask add, the variance inside a norm, the log of a
softmax). :class:`OpRecorder` pushes a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that
sees every ATen op *after* autocast has chosen its dtypes (the Python dispatch key sits below the
Autocast and Autograd keys), in forward and in backward, and hands every floating output to the
recording's observer as an ``op_output`` row: ``module`` is the innermost module running the op (in
backward: the module whose forward made the autograd node being run; the root ``""`` outside every
module), ``name`` is ``"<aten overload>#<k>"`` (``aten.add.Tensor#0``; ``#<k>.<i>`` for output
``i`` of several), ``k`` counting the calls of that overload in that module within the step. Which
module and which pass an op belongs to is :mod:`~mpscope.recording.op_tracker`'s; the audit and the
per-call facts (``run.tables["ops"]`` and ``run.tables["op_facts"]``) are
:mod:`~mpscope.recording.op_facts`'. The advisor turns them into findings
(:func:`mpscope.advisor.op_findings.op_findings`).

Ops that are skipped: views (their output is an input's memory), ``empty*`` (uninitialised memory),
ops issued by mpscope itself, ops in ``optimizer.step()``, ops outside every module that neither
run in backward nor take an input that requires grad (bookkeeping such as ``scaler.unscale_`` or
gradient clipping; in-place updates of a float16/bfloat16 running value,
:data:`~mpscope.recording.autocast_policy.ACCUMULATING`, are kept there too: a metric or EMA updated
in the training loop), ops of ``AccumulateGrad`` (parameter gradients are ``param_grad`` rows), and
:data:`PRESERVING` ops (copies, concatenations, gathers) of values that already have rows. With
``record(ops=[...])`` only the named ops get rows, and only in modules the ``modules=`` selection
takes; the audit counts every op. The dispatch mode is on the stack during recorded steps only.

The mode never changes what an op computes: it calls the op with the arguments it received and
returns its result untouched; everything it measures is read-only. It is popped on exit and on
exception (the recorder's detach always calls :meth:`OpRecorder.__exit__`).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from mpscope import stats as _stats_mod
from mpscope.formats import dtype_name
from mpscope.model_hooks import ModelHook
from mpscope.recording.autocast_policy import DISTINCT_MAX_FLOAT, PRESERVING, op_info, reduction_len
from mpscope.recording.events import ForwardEvents, Observations
from mpscope.recording.hook_state import HookState
from mpscope.recording.forensics import Forensics
from mpscope.recording.op_facts import FactRecord, OpFacts, rules_for, scalar_facts
from mpscope.recording.op_marks import TensorMarks
from mpscope.recording.op_tracker import OpTracker, autocast_cached
from mpscope.recording.passes import OUTSIDE, OpPasses, PassKind

LOW = (torch.float16, torch.bfloat16)
_FLOATS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
#: Switch for the PRESERVING skip (tests compare findings with and without it).
SKIP_PRESERVING = True
_has_data = _stats_mod.has_own_data  # (a wrapper subclass's rows are those of the plain ops it runs)
_NUMBERED = (PassKind.FORWARD, PassKind.EVAL)


def _float_data(t: torch.Tensor) -> bool:
    """A non-empty floating tensor holding data of its own (:func:`mpscope.stats.has_own_data`): an
    op's output that gets a row, an input it reads."""
    return t.dtype in _FLOATS and bool(t.numel()) and _has_data(t)


class _Mode(TorchDispatchMode):
    """The dispatch mode: every op goes to :meth:`OpRecorder.dispatch`."""

    def __init__(self, owner: "OpRecorder"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.owner.dispatch(func, args, kwargs or {})


class OpRecorder:
    """Op-level recording for one recording (``record(ops=True)``).

    Args:
        model: the recorded ``nn.Module``; ``run``: its Run (receives ``tables["ops"]`` and
            ``tables["op_facts"]``, and ``meta``).
        state: the :class:`~mpscope.recording.hook_state.HookState` (``recording``, ``pass_id``).
        observer: the :class:`~mpscope.recording.observer.Observer` taking the ``op_output`` rows.
        ledger: the :class:`~mpscope.recording.passes.PassLedger`.
        select: the ``modules=`` selection (ops of other modules get no rows); ``op_filter``: the
            short op names that get rows (None: all), from ``record(ops=[...])``.

    Use as a context manager; call :meth:`set_recording` when a step begins and :meth:`on_step_end`
    when it ends.
    """

    def __init__(self, model: torch.nn.Module, run, state: HookState, observer: Observations, ledger: ForwardEvents,
                 select=None, op_filter=None, loss_scale=None, scale_tensor=None):
        self.model, self.run, self.state, self.observer = model, run, state, observer
        self.marks = TensorMarks()
        self.tracker = OpTracker(model, state, ledger, self.marks)
        self.facts = OpFacts(self.marks, lambda: observer.fused)
        names = self.tracker.names
        #: modules whose ops get rows (None: all), from the recorder's ``modules=`` selection
        self._selected = None if select is None else {n for m, n in names.items() if select(n, m)}
        self._op_set = op_filter
        self._mode: _Mode | None = None
        self._handles: list = []
        self._module_handles: list = []
        self._pushed = False
        self._opt_popped = False  # the mode stepped off the stack for an optimizer step
        self._below = None  # the dispatch mode under ours when it left the stack
        self._enabled = False
        self._in_optimizer = 0
        self._step = 0
        self._failed = False
        #: precision forensics (``record(ops=True, shadow=True)``): ``loss_scale`` given
        self.forensics = None if loss_scale is None else Forensics(model, run, self.tracker.place, loss_scale,
                                                                                     scale_tensor)

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> "OpRecorder":
        self._handles = [
            register_optimizer_step_pre_hook(self._opt_pre),
            register_optimizer_step_post_hook(self._opt_post),
            self.model.register_forward_pre_hook(ModelHook(self._model_inputs), with_kwargs=True),
        ]
        self._hook_modules()
        self._mode = _Mode(self)
        self._mode.__enter__()
        self._pushed = True
        self._enabled = True
        return self

    def _hook_modules(self) -> None:
        self._module_handles = [
            register_module_forward_pre_hook(self._pre_hook),
            register_module_forward_hook(self._post_hook, always_call=True),
        ]

    def set_recording(self, on: bool) -> None:
        """Called at each step's start: the dispatch mode and the global module hooks are present
        during recorded steps only, so the ops of the steps in between (``every=N``) take PyTorch's
        plain path. The mode leaves the stack only when it is on top and comes back only onto the
        stack it left (another mode entered meanwhile stays undisturbed: then this step's ops are
        not recorded, and ``run.meta["ops_missed_steps"]`` says so)."""
        if self._mode is None:
            return
        if self.forensics is not None:
            self.forensics.begin_step(on)
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
                self.run.meta.setdefault("ops_missed_steps", []).append(self._step)
                return
            if not self._module_handles:
                self._hook_modules()
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
            self.tracker.stack.clear()
            if self.facts.seq:
                self._flush(self._step)
            self.facts.publish(self.run)
            if self.forensics is not None:
                self.forensics.end_step(self._step)
                self.forensics.publish()

    def on_step_end(self, step: int) -> None:
        """Close step ``step``: start the copy of its device facts to the host (one transfer), reset
        call indices."""
        enabled, self._enabled = self._enabled, False
        try:
            self._flush(step)
            if self.forensics is not None:
                self.forensics.end_step(step)
        finally:
            self._enabled = enabled
        self._step = step + 1

    def _flush(self, step: int) -> None:
        tracker = self.tracker
        self.facts.flush(step, tracker.final, tracker.dropped, tracker.moved)
        tracker.reset()
        self.marks.clear()

    def passes(self) -> OpPasses:
        """The passes of this step's op calls (see :func:`~mpscope.recording.passes.kept_passes`)."""
        return self.tracker.passes()

    def renumber(self, keep: frozenset) -> dict:
        """The kept calls' new ``op_output`` names (see :meth:`~mpscope.recording.op_tracker.OpTracker.renumber`)."""
        return self.tracker.renumber(keep)

    # ----------------------------------------------------------------- hooks
    def _pre_hook(self, module, args) -> None:
        self.tracker.enter(module)

    def _post_hook(self, module, args, output) -> None:
        self.tracker.leave(module, output, self._enabled and torch.is_grad_enabled())
        if module is self.model and self.forensics is not None and self.forensics.on:
            self.forensics.model_output(output)

    def _model_inputs(self, model, args, kwargs) -> None:
        if self._enabled and self._pushed and torch.is_grad_enabled():
            self.tracker.model_inputs(args, kwargs)

    def _opt_pre(self, *args, **kwargs) -> None:
        """``optimizer.step()`` starts: none of its ops is recorded, so the dispatch mode steps off
        the stack (when on top) and its ops take PyTorch's plain path."""
        self._in_optimizer += 1
        fx = self.forensics
        if fx is not None and fx.on:  # forensics traces the step too: the mode stays
            if self._in_optimizer == 1 and args:
                fx.optimizer_stepping(args[0])
            return
        if self._in_optimizer == 1 and self._pushed and _get_current_dispatch_mode() is self._mode:
            self._mode.__exit__(None, None, None)
            self._pushed, self._opt_popped = False, True
            self._below = _get_current_dispatch_mode()

    def _opt_post(self, *args, **kwargs) -> None:
        self._in_optimizer = max(0, self._in_optimizer - 1)
        if self._in_optimizer == 0 and self._opt_popped:
            self._opt_popped = False
            if self._mode is not None and self.state.recording and _get_current_dispatch_mode() is self._below:
                self._mode.__enter__()
                self._pushed = True

    # ----------------------------------------------------------------- per op
    def dispatch(self, func, args, kwargs):
        """Run one op (the dispatch mode's call) and record it (and trace it, with forensics on)."""
        if not (self._enabled and self.state.recording):
            return func(*args, **kwargs)
        if self.forensics is not None and self.forensics.on:
            return self.forensics.dispatch(func, args, kwargs, self._record, self._in_optimizer > 0)
        return self._record(func, args, kwargs)

    def _record(self, func, args, kwargs):
        try:
            info = op_info(func)
        except Exception as e:  # never break the user's training because of mpscope
            self._fail(e)
            return func(*args, **kwargs)
        if info.view:  # the most common op: only its base's entries follow it
            out = func(*args, **kwargs)
            if self._enabled and args and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
                try:
                    cast = self.marks.view(args[0], out)
                    if cast is not None:
                        self.tracker.tag_cast(cast)
                except Exception as e:  # never break the user's training because of mpscope
                    self._fail(e)
            return out
        before = None
        if info.accumulating:
            try:
                before = self._running_value(args)
            except Exception as e:  # never break the user's training because of mpscope
                self._fail(e)
        out = func(*args, **kwargs)
        if self._enabled and self.state.recording:
            try:
                self._on_op(info, args, kwargs, out, before)
            except Exception as e:  # never break the user's training because of mpscope
                self._fail(e)
        return out

    def _running_value(self, args):
        """Before an in-place update of a running value (:data:`ACCUMULATING` on a float16/bfloat16
        tensor that does not require grad, outside ``optimizer.step()``): a copy of that value, so
        that the update's lost increments can be counted after it (None for every other op)."""
        if self._in_optimizer or not args:
            return None
        a = args[0]
        if not isinstance(a, torch.Tensor) or a.dtype not in LOW or a.requires_grad or not a.numel():
            return None
        if self.tracker.context(args, running=True) is None:
            return None
        return a.detach().clone()

    def _on_op(self, info, args, kwargs, out, before=None) -> None:
        """One op's call: its pass, call count, audit count and taint; then its rows."""
        if isinstance(out, torch.Tensor):
            if not _float_data(out):
                return
            outs, multi = [out], False
        elif isinstance(out, (tuple, list)):
            outs = [o if isinstance(o, torch.Tensor) and _float_data(o) else None for o in out]
            multi = True
            if not any(o is not None for o in outs):
                return
        else:
            return
        tracker = self.tracker
        ctx = None if self._in_optimizer else tracker.context(args, running=before is not None)
        if ctx is None:
            return
        module, phase, autocast = ctx
        pass_id = tracker.pass_of(phase, args, outs)
        if pass_id is not None and pass_id.kind is PassKind.EVAL:
            phase = "eval"  # a forward of the model under no_grad / inference_mode: its own label
        if info.cast and autocast and pass_id is not None and pass_id.kind in _NUMBERED \
                and autocast_cached(args, outs[0]):
            pass_id = tracker.cast_made(pass_id, module, outs[0])
        # another model's op, or bookkeeping: no row, no call count, no audit (its values still carry taints)
        outside = pass_id == OUTSIDE
        k = call = None
        if not outside:
            k, call = tracker.count(module, info.name, phase, pass_id, len(outs) if multi else 0)
        flat = list(args) + list(kwargs.values()) if kwargs else list(args)
        tin = _float_inputs(args if info.out_variant else flat)  # (out= targets are no input)
        first = next(o for o in outs if o is not None)
        red_len = reduction_len(info, args, first) if info.reduction else 0
        if not outside:
            param_lowp = autocast and any(a.dtype in LOW and isinstance(a, torch.nn.Parameter) for a in tin)
            self.facts.count(phase, module, info.name, tuple(a.dtype for a in tin), first.dtype, bool(autocast),
                             info.inplace, info.out_variant, bool(param_lowp), info.reduction or "", pass_id,
                             first.numel(), red_len)
        marks = self.marks
        ids = [marks.known(a) for a in tin]  # None: no entry
        tracker.casts_used(ids, pass_id)
        periodic_src = self._carry_taint(info, ids, outs)
        if outside or (self._selected is not None and module not in self._selected) or \
                (self._op_set is not None and info.short not in self._op_set):
            return  # not selected (the audit above still counts it)
        if self._skippable(info, tin, ids, outs):
            for o in outs:
                if o is not None:
                    marks.rowed.add(marks.claim(o))
            return
        self._rows(info, args, kwargs, flat, tin, ids, outs, multi, module, phase, pass_id, k, call, red_len,
                   periodic_src, before)

    def _carry_taint(self, info, ids, outs):
        """Taint: which tensors carry values of a low-precision cast of non-integer data (see
        :func:`~mpscope.recording.op_facts._cast_source`); it flows through every op, also those the
        op filter or the PRESERVING rule give no row. Returns the seq of the cast whose values reach
        this op when it is a sin/cos/tan, else NaN."""
        marks = self.marks
        if not marks.tainted:
            return math.nan
        src = next((marks.taint[i] for i in ids if i is not None and i in marks.taint), None)
        if src is None:
            return math.nan
        if not info.reduction:  # elementwise ops, casts, cat, ...: the values flow on
            for o in outs:
                if o is not None:
                    marks.taint[marks.claim(o)] = src
        return src if info.periodic else math.nan

    def _rows(self, info, args, kwargs, flat, tin, ids, outs, multi, module, phase, pass_id, k, call, red_len,
              periodic_src, before) -> None:
        """The ``op_output`` rows of one call's floating outputs, and their ``op_facts`` records."""
        marks, facts = self.marks, self.facts
        first = next(o for o in outs if o is not None)
        lowp = first.dtype in LOW
        scalar, lost, overflow, rounded, nans, infs = scalar_facts(flat, first.dtype)
        if info.cast and phase == "forward" and lowp and len(outs) == 1:
            # a vector of non-integer data (timesteps, positions, angles; not weights or activations)
            x = args[1] if info.packet == "copy_" else (args[0] if args else None)
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != first.dtype \
                    and not x.requires_grad and x.numel() <= DISTINCT_MAX_FLOAT \
                    and x.numel() == max(x.shape, default=1):
                marks.taint[marks.claim(first)] = facts.seq  # this output's seq
                marks.tainted = True
        # a row the step's fact filter must look at whatever its device values (see op_facts._notable)
        noted = not (math.isnan(lost) and math.isnan(overflow) and math.isnan(rounded)) or info.periodic
        summing = phase == "forward" and bool(info.reduction)
        # device facts: views of stats taken anyway (the outputs' and the inputs' rows), plus a few
        # op-specific values; they stay on the device until the step's single copy
        in_stats = [facts.stats_of(a) if i is None or i not in marks.ds else marks.ds[i] for a, i in zip(tin, ids)]
        absmax_in = facts.absmax_inputs(info, tin, in_stats) if lowp else ()
        # outputs that can have extra facts (see op_facts.rules_for): the others skip them
        rules = rules_for(info)
        some = info.log or info.pole is not None or before is not None
        cast_facts = info.cast or info.packet == "arange"
        observe = self.observer.observe
        for i, o in enumerate(outs):
            if o is None:
                continue
            name = f"{info.name}#{k}.{i}" if multi else f"{info.name}#{k}"
            # gradients flow scaled by the loss scale, as activation_grad rows
            ds = observe(module, "op_output", name, o, scaled=phase == "backward", pass_id=pass_id)
            if ds is None:
                ds = facts.stats_of(o)
            else:
                j = marks.claim(o)
                marks.ds[j] = ds
                marks.rowed.add(j)
            low = o.dtype in LOW
            fields, vals, host = (), None, None
            if some or (cast_facts and low):
                fields, vals, host = facts.device_facts(rules, info, args, kwargs, tin, o, phase, before)
            facts.add(FactRecord(facts.seq, phase, module, name, info.name, dtype_name(o.dtype), o.numel(),
                                 info.reduction or "", red_len, scalar, lost, overflow, rounded, periodic_src, nans, infs,
                                 noted or (summing and low), call), ds, in_stats, absmax_in, fields, vals, host)

    def _skippable(self, info, tin, ids, outs) -> bool:
        """A :data:`PRESERVING` op whose outputs keep their inputs' dtype and whose floating inputs
        all have rows this step (see :data:`PRESERVING`)."""
        if not (info.preserving and SKIP_PRESERVING and tin):
            return False
        dtype = tin[0].dtype
        rowed = self.marks.rowed
        return all(a.dtype == dtype and i is not None and i in rowed for a, i in zip(tin, ids)) and \
            all(o is None or o.dtype == dtype for o in outs)

    def _fail(self, e: Exception) -> None:
        self._enabled = False
        if not self._failed:
            self._failed = True
            warnings.warn(f"mpscope: op-level recording stopped after an internal error: {e!r}. "
                          "Training continues unchanged; module-level recording is unaffected.",
                          RuntimeWarning, stacklevel=2)


def _float_inputs(args) -> list[torch.Tensor]:
    """The floating tensors among ``args``, also inside lists (cat, stack)."""
    tin = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if _float_data(a):
                tin.append(a)
        elif isinstance(a, (list, tuple)):
            tin.extend(t for t in a if isinstance(t, torch.Tensor) and _float_data(t))
    return tin


__all__ = ["OpRecorder", "PRESERVING", "SKIP_PRESERVING"]
