"""The recorder: ``record(model, ...)`` attaches to a model for a ``with`` block and fills a Run.

What is recorded, and when (the roles of :class:`mpscope.schema.Role`): ``activation`` and
``activation_grad`` from hooks on the selected modules' outputs
(:mod:`mpscope.recording.activations`); ``param_grad``, ``weight`` and ``optimizer_state`` at the
end of each recorded step, in one batch (:meth:`~mpscope.recording.observer.Observer.record_parameters`;
a framework loop that ends its own steps, :meth:`Recorder.hold_steps`, gives the gradients just
before each optimizer step instead); ``loss``: the tensor passed to ``GradScaler.scale`` (with a scaler) or the scalar ``backward()`` is
called on (without one); with ``ops=True`` every op's output (:mod:`mpscope.recording.op_recorder`);
with ``param_grad``, the gradient increments lost while float16/bfloat16 ``.grad`` accumulate
(:mod:`mpscope.recording.grad_accumulation`).

Step boundaries and the step's scalars come from the :class:`~mpscope.recording.clock.StepClock`;
which forward passes and backwards of a step train the model (the others' rows are dropped) from the
:class:`~mpscope.recording.passes.PassLedger`, whose module docstring holds the rule's table. A
tensor becomes a row through the :class:`~mpscope.recording.observer.Observer`. Collaborators talk
to these three through the events of :mod:`mpscope.recording.events`; the :class:`Recorder` here
composes them, keeps the options, and attaches and detaches everything.

Recording reads tensors and never writes them: losses and weights are bitwise equal with and without
it. No hook reads a device value on the host; a recorded step's stats are copied to the host in one
transfer when the step ends (non-blocking into pinned memory on CUDA). Everything attached is
removed on exit, on exception and on KeyboardInterrupt; rows recorded before an exception stay in
``recorder.run``.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import warnings
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mpscope import compiled as _compiled
from mpscope import distributed as _dist
from mpscope import kernel as _kernel
from mpscope import stats as _stats
from mpscope._version import __version__
from mpscope.formats import dtype_name
from mpscope.model_hooks import ModelHook
from mpscope.recording.activations import ActivationHooks
from mpscope.recording.autocast_policy import check_op_filter
from mpscope.recording.clock import StepClock
from mpscope.recording.grad_accumulation import GradAccumulationProbe
from mpscope.recording.hook_state import HookState
from mpscope.recording.observer import Observer
from mpscope.recording.op_recorder import OpRecorder
from mpscope.recording.passes import PassLedger, StepFacts
from mpscope.recording.patches import Patches, stage_unscaled
from mpscope.recording.shadow import Shadow
from mpscope.recording.step_buffer import StepBuffer
from mpscope.run import Run
from mpscope.schema import DEFAULT_ROLES, ROLES


class RecorderError(RuntimeError):
    """Misuse of the recorder (bad arguments, nested recording of one model, ...)."""


class _Attached:
    """Which recorder records which model, kept here rather than on the model (a scripted or traced
    model refuses new attributes, and nothing of mpscope's should stay on a user's object)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, "Recorder"]] = {}

    def get(self, model) -> "Recorder | None":
        entry = self._by_id.get(id(model))
        return entry[1] if entry is not None and entry[0]() is model else None

    def __setitem__(self, model, recorder: "Recorder") -> None:
        self._by_id[id(model)] = (weakref.ref(model), recorder)

    def __delitem__(self, model) -> None:
        self._by_id.pop(id(model), None)


_ATTACHED = _Attached()


def record(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    *,
    every: int = 1,
    modules: str | re.Pattern | Callable[[str, torch.nn.Module], bool] | None = None,
    roles: Iterable[str] | None = None,
    max_steps: int | None = None,
    hist_every: int = 1,
    ops: bool | Iterable[str] = False,
    spill_dir: str | os.PathLike | None = None,
    spill_rows: int = 2_000_000,
    auto: bool | None = None,
    accelerator: Any = None,
    group: Any = None,
    out: str | os.PathLike | None = None,
    reduce_every: int = 1,
    shadow: bool = False,
) -> "Recorder":
    """Record a training run of ``model``; use as ``with mpscope.record(model, opt, scaler) as rec:``.

    Args:
        model: the ``torch.nn.Module`` being trained.
        optimizer: the ``torch.optim.Optimizer``; its ``step()`` ends a step when there is no scaler,
            and its state is recorded (role ``optimizer_state``).
        scaler: a ``torch.amp.GradScaler``; its ``update()`` ends a step and gives the loss scale,
            ``found_inf`` and ``scale_after``.
        every: record stats every ``every``-th step (steps 0, every, 2*every, ...); other steps only
            get a ``steps`` row (loss, scale, skipped) and cost no stats work.
        modules: which modules get activation / gradient / weight rows: a regex searched in the
            qualified module name (``""`` is the root), or ``callable(name, module) -> bool``.
            Default: all modules.
        roles: subset of ``activation, activation_grad, param_grad, weight, optimizer_state, loss``
            (and ``op_output`` with ``ops=True``). Default: all.
        max_steps: stop after this many steps; training goes on unobserved (all detached).
        hist_every: take exponent histograms on every ``hist_every``-th recorded step.
        ops: also record op outputs (role ``op_output``, see :mod:`mpscope.recording.op_recorder`): True for every op,
            or a list of op names (``["add", "softmax", "matmul"]``: ATen names, leading / trailing
            underscores optional, so ``"softmax"`` also takes ``aten._softmax`` and ``"add"`` also
            ``add_``). Only ops inside modules selected by ``modules`` get rows; the autocast audit
            still counts every op.
        spill_dir: directory to spill tensor rows to (Parquet parts) on long runs; with it, at most
            about ``spill_rows`` rows (~84 bytes each) stay in memory. Each recorder spills into its
            own new folder inside it (``run.spill_path``), so recorders may share one ``spill_dir``.
        auto: unless ``auto=False``, without a ``scaler`` the first enabled GradScaler that scales
            a loss of this model is adopted (also one made inside the block: its loss scale is
            recorded, not 1.0), and without an ``optimizer`` the optimizer that steps this
            model's parameters (its ``step()`` ends the steps); a loop that ends its steps with
            :meth:`Recorder.step` keeps doing so (adoption stops at its first call).
        accelerator: an ``accelerate.Accelerator`` whose prepared optimizer and GradScaler
            (``accelerator.scaler``: fp16 on GPUs; None for bf16 / fp32) are used where
            ``optimizer`` / ``scaler`` are not given.
        group: in a ``torch.distributed`` job (every rank calls ``record()`` with the same
            arguments): None merges over the default process group, a ``ProcessGroup`` or 1-D
            ``DeviceMesh`` (e.g. ``mesh["dp"]``) over that one, False never merges. Wrapper
            prefixes (``module.``, ``_fsdp_wrapped_module.``, ...) are left out of module names.
            On the group's rank 0 ``recorder.run`` becomes the merged Run when the block ends (the
            rank's own rows stay in ``recorder.local_run``); elsewhere it is the rank's own. See
            :mod:`mpscope.distributed`.
        out: directory; each rank writes its own rows there as they arrive
            (``out/ranks/<table>/rank=N/part-*.parquet``: every 8 recorded steps but at most once
            a second, at least every 10 s, and at once on the first NaN / inf; see
            :class:`mpscope.run.RankFiles`), and rank 0 writes the merged Run to ``out/merged`` at
            the end; read it back with ``mpscope.Run.load(out)`` (merged) or ``Run.load(out,
            rank=N)``; a killed process's steps load with ``run.meta["complete"] = False``. An
            ``out`` that is a file or holds another recording's rows becomes ``out-1`` (``-2``,
            ...; in a job the same one on every rank), with a warning: writing never ends a run.
        reduce_every: merge across ranks after every ``reduce_every``-th recorded step (rows of the
            steps between travel together) and once more when the block ends.
        shadow: on recorded steps, also run a float32 reference forward of the same batch (autocast
            off, float32 parameters, no grad, same RNG state, buffers untouched) and compare every
            selected module's output with it, and with the module run alone on the reference's
            inputs (its own contribution), and with ``ops=True`` every op output:
            ``run.precision`` (see :mod:`mpscope.recording.shadow`). Costs one float32 forward plus
            one forward per selected module's subtree per recorded step.

    Raises:
        TypeError / ValueError (:class:`RecorderError`): for arguments of the wrong type or value,
            with what to pass instead.
    """
    return Recorder(
        model,
        optimizer,
        scaler,
        every=every,
        modules=modules,
        roles=roles,
        max_steps=max_steps,
        hist_every=hist_every,
        ops=ops,
        spill_dir=spill_dir,
        spill_rows=spill_rows,
        auto=auto,
        accelerator=accelerator,
        group=group,
        out=out,
        reduce_every=reduce_every,
        shadow=shadow,
    )


def check_counts(every, hist_every, max_steps) -> None:
    """Raise :class:`RecorderError` for ``every`` / ``hist_every`` / ``max_steps`` :func:`record` refuses."""
    for name, v in (("every", every), ("hist_every", hist_every)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise RecorderError(f"{name} must be a positive int (1 = every step); got {v!r}.")
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1):
        raise RecorderError(f"max_steps must be a positive int or None; got {max_steps!r}.")


def check_options(every=1, modules=None, roles=None, hist_every=1, max_steps=None, ops=False) -> None:
    """Raise :class:`RecorderError` for the options :func:`record` would refuse (no model needed)."""
    check_counts(every, hist_every, max_steps)
    check_roles(roles, ops)
    selector(modules)


def check_roles(roles, ops) -> frozenset:
    """The roles to record (``roles``: None for the defaults, a role name or names; ``ops``: adds
    ``op_output``); :class:`RecorderError` for anything else, and for no role at all."""
    if roles is None:
        chosen = set(DEFAULT_ROLES)
    else:
        if isinstance(roles, str):
            roles = [roles]
        if not isinstance(roles, Iterable) or not all(isinstance(r, str) for r in roles):
            raise RecorderError(f"roles must be a role name or a list of them, e.g. ['activation', 'param_grad']; "
                                f"got {roles!r}.")
        chosen = set(roles)
        bad = chosen - set(ROLES)
        if bad:
            raise RecorderError(f"unknown roles {sorted(bad)}; choose from {list(ROLES)}.")
    if ops:
        chosen.add("op_output")
    if not chosen:
        raise RecorderError(f"roles={roles!r} records nothing; pass None for the default roles, or some of {list(ROLES)}.")
    return frozenset(chosen)


def selector(modules) -> Callable[[str, torch.nn.Module], bool]:
    """``modules=`` as ``select(name, module) -> bool``; :class:`RecorderError` for a bad one."""
    if modules is None:
        return lambda name, mod: True
    if isinstance(modules, str):
        try:
            pattern = re.compile(modules)
        except re.error as e:
            raise RecorderError(f"modules={modules!r} is not a valid regular expression: {e}.") from None
        return lambda name, mod: pattern.search(name) is not None
    if isinstance(modules, re.Pattern):
        return lambda name, mod: modules.search(name) is not None
    if callable(modules):
        return modules
    raise RecorderError(
        f"modules must be a regex string, a compiled pattern or callable(name, module) -> bool; got {type(modules).__name__}."
    )


def _check_arguments(model, optimizer, scaler, every, hist_every, max_steps, reduce_every, spill_dir, spill_rows) -> None:
    if isinstance(model, torch.jit.RecursiveScriptModule):
        raise RecorderError(
            "record() cannot hook a torch.jit.script model (TorchScript modules take no Python hooks); "
            "record the eager model before scripting it (torch.jit.trace models are fine)."
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise RecorderError(
            f"optimizer must be a torch.optim.Optimizer or None; got {type(optimizer).__name__}."
        )
    if scaler is not None and not all(hasattr(scaler, a) for a in ("scale", "update", "get_scale")):
        raise RecorderError(
            f"scaler must be a torch.amp.GradScaler or None; got {type(scaler).__name__}."
        )
    check_counts(every, hist_every, max_steps)
    if not isinstance(reduce_every, int) or isinstance(reduce_every, bool) or reduce_every < 1:
        raise RecorderError(f"reduce_every must be a positive int (1 = every recorded step); got {reduce_every!r}.")
    if not isinstance(spill_rows, int) or isinstance(spill_rows, bool) or spill_rows < 1:
        raise RecorderError(f"spill_rows must be a positive int; got {spill_rows!r}.")
    if spill_dir is not None:
        if not isinstance(spill_dir, (str, os.PathLike)):
            raise RecorderError(f"spill_dir must be a directory path (str or pathlib.Path) or None; "
                                f"got {type(spill_dir).__name__}.")
        if os.path.exists(spill_dir) and not os.path.isdir(spill_dir):
            raise RecorderError(f"spill_dir={str(spill_dir)!r} is a file; pass a directory (it is created if missing).")


class Recorder:
    """Hooks on one model for the duration of a ``with`` block; see :func:`record`.

    Attributes:
        run: the :class:`~mpscope.run.Run` being filled (on a multi-rank job's rank 0, the merged
            Run once the block ends).
        local_run: this rank's own rows.
        step_index: index of the current (not yet ended) step.
        recording: whether the current step's stats are being taken.
        model, optimizer, scaler: what is recorded (``optimizer`` / ``scaler`` may be adopted).
    """

    def __init__(self, model, optimizer=None, scaler=None, *, every=1, modules=None, roles=None,
                 max_steps=None, hist_every=1, ops=False, spill_dir=None, spill_rows=2_000_000, auto=None, accelerator=None,
                 group=None, out=None, reduce_every=1, shadow=False):
        if not isinstance(model, torch.nn.Module):
            raise RecorderError(
                f"record() needs a torch.nn.Module as model; got {type(model).__name__}. "
                "Pass the model you train, e.g. mpscope.record(model, optimizer=opt, scaler=scaler)."
            )
        if accelerator is not None:
            optimizer, scaler = _from_accelerator(accelerator, model, optimizer, scaler)
        optimizer = _unwrap_optimizer(optimizer)
        _check_arguments(model, optimizer, scaler, every, hist_every, max_steps, reduce_every, spill_dir, spill_rows)
        try:
            self._op_filter = check_op_filter(ops) if not isinstance(ops, bool) else None
        except ValueError as e:
            raise RecorderError(str(e)) from None
        self.model = model
        self.every, self.hist_every, self.max_steps = every, hist_every, max_steps
        self.ops = bool(ops)
        roles = check_roles(roles, self.ops)
        self._select = selector(modules)
        self.auto = bool(auto)
        self._adopt = optimizer is None and auto is not False  # adopt the optimizer stepping the model
        self._adopt_scalers = scaler is None and auto is not False  # adopt the GradScaler scaling its loss
        self._adopted_handle = None  # the adopted optimizer's step hook
        self._foreign_steps = 0  # (adoption) steps of optimizers that hold none of the model's parameters
        self._held: list | None = None  # hold_steps(): every optimizer of the model (boundaries by step())
        try:
            plan = _dist.plan(model, group)
        except (TypeError, ValueError) as e:
            raise RecorderError(str(e)) from None
        if plan is not None and plan.wrapper == "ddp" and "param_grad" in roles:
            roles = roles | {"param_grad_local"}  # each rank's gradient before the all-reduce
        self.roles = roles
        self.run = Run(spill_dir=spill_dir, max_rows_in_memory=spill_rows)
        self.local_run = self.run  # this rank's own rows (``run`` becomes the merged Run on rank 0)
        builder = self.local_run.builder()
        self._state = state = HookState(self.run.meta, builder.key_index)
        self._steps = StepBuffer(builder)  # the step rows on the device and their host copy
        self._ledger = PassLedger(state)
        self._observer = Observer(state, builder, self._steps, model, roles, self._select)
        scaler = scaler if (scaler is not None and getattr(scaler, "is_enabled", lambda: True)()) else None
        self._clock = StepClock(state, self._steps, self._observer, self._ledger, optimizer, scaler, self._safe,
                                self._close_step, self._end_step, self._finish_step, None)
        self._activations: ActivationHooks | None = None
        self._handles: list = []
        self._patches = Patches(self._clock, self._safe)  # the PyTorch entry points replaced while attached
        self._failed = False
        self._ops: OpRecorder | None = None
        self._accum: GradAccumulationProbe | None = None  # swamped increments of 16-bit .grad
        self._device_type: str | None = None  # the model's device type (its first parameter's), taken at attach
        self._hook_guards = None  # dynamo's hook-guard setting to restore at detach
        #: A CPU run with mpscope._core (which takes its statistics at the extension's speed): the
        #: extension's build, on a cold cache, starts when the recorder detaches, not while it
        #: records. Even at idle priority a build starting beside the first recorded steps (Python
        #: and torch imports, the compiler's memory traffic) slowed them by up to 2x on 2 CPUs.
        self._defer_build = False
        self._ranks = None
        if plan is not None or out is not None or _dist.job_rank() is not None:
            settings = {"every": every, "hist_every": hist_every, "reduce_every": reduce_every, "max_steps": max_steps,
                        "roles": sorted(roles)}
            self._ranks = _dist.RankMerge(builder, model, self._select, self._observer, settings,
                                          lambda: self._clock.scaler is not None, self._drain_all, plan, out,
                                          reduce_every)
        self._shadow = Shadow(model, self.run, self._select, state, self._paused, lambda: self._clock.step_index,
                              self.ops) if shadow else None

    # ------------------------------------------------------------------ what users read
    # (attributes of the parts, read and written here as the recorder's own)
    optimizer = property(lambda self: self._clock.optimizer, lambda self, v: setattr(self._clock, "optimizer", v),
                         doc="The recorded optimizer (None: none yet; ``auto`` adopts one).")
    scaler = property(lambda self: self._clock.scaler, lambda self, v: setattr(self._clock, "scaler", v),
                      doc="The recorded GradScaler (None: none yet).")
    step_index = property(lambda self: self._clock.step_index, lambda self, v: setattr(self._clock, "step_index", v),
                          doc="The index of the current (not yet ended) step.")
    recording = property(lambda self: self._state.recording, lambda self, v: setattr(self._state, "recording", v),
                         doc="Whether the current step's stats are being taken.")
    attached = property(lambda self: self._state.attached, lambda self, v: setattr(self._state, "attached", v),
                        doc="Whether the recorder's hooks are attached.")

    @contextlib.contextmanager
    def _paused(self):
        """No hook of this recording sees what runs inside (mpscope's own forwards: the shadow's)."""
        state = self._state
        was = state.recording
        state.recording = False
        try:
            yield
        finally:
            state.recording = was

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "Recorder":
        self.attach()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self._ranks is not None:
            self._ranks.failed = True  # no more exchanges: the other ranks may be elsewhere
        try:
            if self.attached:
                # a step cut short by an exception keeps every forward it saw (data before a crash)
                self._safe("the end of the recording", self._close_step, True, exc_type is not None)
        finally:
            try:
                self.detach()
            except Exception as e:
                if exc_type is None:
                    raise
                # the loop's own exception is the one the user must see
                warnings.warn(f"mpscope: while detaching after the loop raised {exc_type.__name__}: "
                              f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
        return None

    def attach(self) -> None:
        """Install every hook and wrapper (``__enter__`` calls this)."""
        if self.attached:
            raise RecorderError("this recorder is already attached; use one `with mpscope.record(...)` block at a time.")
        other = _ATTACHED.get(self.model)
        if other is not None and other.attached:
            raise RecorderError(
                "this model is already being recorded by another mpscope recorder; detach it first "
                "(leave its `with` block or run `%mpscope detach`)."
            )
        _ATTACHED[self.model] = self
        self._state.attached = True
        self._device_type = self._clock.device_type = self._device().type  # model.parameters() costs a walk
        try:
            self._install()
            self._fill_meta()
            if self._ranks is not None:
                self._ranks.attach()  # checks the ranks' settings and out= with one collective
        except BaseException as e:
            self._undo_attach()
            if isinstance(e, ValueError):
                raise RecorderError(str(e)) from None
            raise
        try:  # (what fails here, e.g. an accelerator out of memory, leaves no hook behind either)
            _stats.prepare(self._device())  # device constants now, so no hook ever copies host -> device
            # the fused kernel: loaded if built, else built in the background (mpscope._core or the
            # torch-op path records meanwhile; steps switch over when it is ready, see
            # Observer.begin_step). A CPU run takes its statistics from it; a run on an accelerator
            # its staging copies (StagedRows). A CPU run whose statistics mpscope._core takes starts
            # no build while it records: the build starts when it detaches (see _defer_build)
            self.run.meta["fused_kernel_from_step"] = None
            self._defer_build = self._device_type == "cpu" and _kernel.core() is not None
            _kernel.current(start=not self._defer_build)
            self._steps.allocate(self._device())
            self._begin_step()
        except BaseException:
            self._undo_attach()
            raise

    def _undo_attach(self) -> None:
        """An attach that failed part way: everything installed so far removed."""
        if self._ranks is not None:
            self._ranks.failed = True  # no exchange on the way out
        self.detach()

    def detach(self) -> None:
        """Remove everything installed; safe to call twice, in any order among recorders. Each part
        is removed even if another fails; the first failure is raised afterwards."""
        errors: list[Exception] = []

        def attempt(fn, *args):
            try:
                fn(*args)
            except Exception as e:  # keep removing the rest
                errors.append(e)

        if self._shadow is not None and self.attached:
            attempt(self._shadow.close)
        if self._ops is not None:
            attempt(self._ops.__exit__, None, None, None)
            self._ops = None
        if self._accum is not None:
            attempt(self._publish_accumulation)
        for h in self._handles:
            attempt(h.remove)
        self._handles.clear()
        if self._activations is not None:
            attempt(self._activations.remove)
        if self._ranks is not None:
            attempt(self._ranks.hook_grads, False)
        attempt(self._patches.restore)
        if self._hook_guards is not None:
            attempt(_compiled.unguard_hooks, self._hook_guards)
            self._hook_guards = None
        if _ATTACHED.get(self.model) is self:
            del _ATTACHED[self.model]
        was_attached = self.attached
        if was_attached and self.optimizer is None and self._foreign_steps:
            self.run.meta["untrained_model"] = self._foreign_steps
            warnings.warn(f"mpscope: optimizers stepped {self._foreign_steps} times while recording, but none holds "
                          f"a parameter of the recorded model ({type(self.model).__name__}): it is not the model being "
                          "trained, and its recording says little. Record the model whose parameters the optimizer "
                          "steps (or pass optimizer=).", RuntimeWarning, stacklevel=3)
        self._state.attached = self._state.recording = False
        if was_attached or not self._failed:
            attempt(self._drain, True)
        if self._ranks is not None:
            if self._failed:  # an internal error detached this rank alone: it exchanges no more
                self._ranks.failed = True
            attempt(self._close_ranks)
        self._steps.release()
        if was_attached and self._defer_build:
            # the build this CPU run deferred (see attach): started now, never waited for, so that the
            # next run finds the extension; it runs on CPU time left idle
            attempt(_kernel.build_for_next_run)
        if errors and not self._failed:
            raise errors[0]

    def _close_ranks(self) -> None:
        merged = self._ranks.close()
        if merged is not None:
            self.run = merged

    def on_internal_error(self, where: str, error: Exception) -> None:
        """An error inside mpscope while the training loop runs: warn once, keep the rows recorded
        so far (``run.meta["recording_error"]`` says what happened), detach, let training go on."""
        if self._failed:
            return
        self._failed = True
        self.run.meta["recording_error"] = f"{where}: {type(error).__name__}: {error}"[:500]
        warnings.warn(
            f"mpscope: internal error in {where} ({type(error).__name__}: {str(error)[:200]}); recording "
            f"stopped at step {self.step_index}, training goes on unobserved. The rows recorded so far stay "
            "in recorder.run. Please report this with the traceback (MPSCOPE_TRACEBACK=1 raises it).",
            RuntimeWarning, stacklevel=3,
        )
        if os.environ.get("MPSCOPE_TRACEBACK"):
            raise error
        try:
            self.detach()
        except Exception:  # everything removable was removed; the rest is already reported
            pass

    def _safe(self, where: str, fn: Callable, *args):
        """``fn(*args)`` for a hook or wrapper body: a recorder error never reaches the training loop."""
        try:
            return fn(*args)
        except Exception as e:
            self.on_internal_error(where, e)
            return None

    def _check_targets(self) -> None:
        """Refuse a recording that would measure nothing (and so give confident advice on nothing)."""
        named = list(_compiled.modules(self.model))
        names = [n for n, _ in named]
        if not any(self._select(n, m) for n, m in named):
            shown = ", ".join(repr(n) for n in names[:8]) + (" ..." if len(names) > 8 else "")
            raise RecorderError(
                f"modules= selects none of the model's {len(names)} modules (their names: {shown}); "
                "pass a regex that matches some of them, e.g. modules=r'^layers\\.0', or None for all."
            )
        if self.optimizer is not None:
            mine = {id(p) for p in self.model.parameters()}
            if mine and not any(id(p) in mine for g in self.optimizer.param_groups for p in g["params"]):
                raise RecorderError(
                    "the optimizer holds none of this model's parameters, so its steps would not train "
                    "this model; pass the optimizer built from model.parameters()."
                )

    def _install(self) -> None:
        self._check_targets()
        clock = self._clock
        if _compiled.is_compiled(self.model):
            self._hook_guards = _compiled.guard_hooks()  # undone in detach
        self._activations = ActivationHooks(self._state, self._ledger, self._observer, self.model, self._select,
                                            self._device_type, self._safe, self.on_internal_error)
        self._activations.install()
        # which backward passes train this model is seen by effect: its parameters' gradients
        # (under FSDP1 also its flat parameters: the original ones never accumulate a gradient)
        clock.trained_params = list({id(p): p for p in self.model.parameters() if p.requires_grad}.values())
        for p in _dist.grad_carriers(self.model):
            self._handles.append(p.register_post_accumulate_grad_hook(ModelHook(clock.parameter_gradient)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_post_hook(self._optimizer_post_hook))
        elif self._adopt:
            clock.adopt_optimizer = self._adopt_optimizer
            self._handles.append(register_optimizer_step_post_hook(self._adopt_optimizer))
        if self.scaler is not None:
            self._patches.scaler(self.scaler, self._adopt)
        elif self._adopt_scalers:
            clock.adopt_scaler = self._adopt_scaler
            self._patches.watch_scalers()
        self._patches.backward()
        self._patches.clip()
        if "param_grad" in self.roles:
            probe = GradAccumulationProbe(self._observer.selected_parameters(), lambda: self.recording, self._safe)
            self._accum = probe if probe.active else None
        if self.ops:
            self._ops = OpRecorder(self.model, self.run, self._state, self._observer, self._ledger, self._select,
                                   self._op_filter, self._loss_scale if self._shadow is not None else None,
                                   self._scale_tensor)
            self._ops.__enter__()
        if self._shadow is not None:
            if self._ops is not None:
                self._shadow.engine = self._ops.forensics
            self._shadow.attach()

    def _loss_scale(self) -> float:
        """The factor this step's loss was multiplied by before backward (precision forensics)."""
        s = self.scaler
        clock = self._clock
        return float(s.get_scale()) if s is not None and s.is_enabled() and clock.scale_seen and \
            clock.backward_scaled else 1.0

    def _scale_tensor(self):
        """The tensor ``scaler.scale(x)`` multiplies by (GradScaler's own), or None (precision forensics)."""
        s = self.scaler
        return getattr(s, "_scale", None) if s is not None and s.is_enabled() else None

    def _fill_meta(self) -> None:
        params = list(self.model.parameters())
        device = params[0].device if params else torch.device("cpu")
        meta = self.run.meta
        meta["device"] = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
        meta["device_name"] = platform.processor() or platform.machine()
        meta["cuda_capability"] = None
        if device.type == "cuda":
            meta["device_name"] = torch.cuda.get_device_name(device)
            meta["cuda_capability"] = list(torch.cuda.get_device_capability(device))
        meta["torch_version"] = torch.__version__
        meta.setdefault("autocast_dtype", None)  # kept when called again (an adopted optimizer)
        meta.setdefault("autocast_device_type", None)
        meta["model"] = _dist.type_name(_compiled.unwrap(next(_dist.named_modules(self.model))[1]))  # the user's, not DDP's
        meta["module_types"] = {name: _dist.type_name(m) for name, m in _compiled.modules(self.model)}
        meta["compiled"] = _compiled.is_compiled(self.model)
        meta.setdefault("unobserved", {})
        meta["param_count"] = int(sum(p.numel() for p in params))
        pd_ = defaultdict(int)
        for p in params:
            pd_[dtype_name(p.dtype)] += p.numel()
        meta["param_dtypes"] = dict(pd_)
        meta["optimizer"] = type(self.optimizer).__name__ if self.optimizer is not None else None
        meta["optimizer_hparams"] = _hparams(self.optimizer)
        s = self.scaler
        meta["scaler"] = None
        if s is not None:
            meta["scaler"] = {
                "init_scale": float(getattr(s, "_init_scale", s.get_scale())),
                "growth_factor": float(s.get_growth_factor()),
                "backoff_factor": float(s.get_backoff_factor()),
                "growth_interval": int(s.get_growth_interval()),
                "enabled": bool(s.is_enabled()),
            }
        meta["every"] = self.every
        meta["hist_every"] = self.hist_every
        meta["roles"] = sorted(self.roles)
        meta["mpscope_version"] = __version__

    # ------------------------------------------------------------------ steps
    def _begin_step(self) -> None:
        clock, state = self._clock, self._state
        clock.reset()
        self._ledger.reset()
        # the row opens as a step that saw nothing (BLANK_ROW): one copy, not one write per scalar
        self._steps.row.copy_(self._steps.blank)
        recording = state.recording = (clock.step_index % self.every == 0)
        hist = recording and (clock.step_index // self.every) % self.hist_every == 0
        self._observer.begin_step(recording, hist, self._device_type, self._defer_build, clock.step_index,
                                  self._ops is not None)
        self._activations.set_recording(recording)
        if self._ranks is not None:
            self._ranks.hook_grads(recording)
        if self._ops is not None:
            self._ops.set_recording(recording)
        if self._shadow is not None:
            self._shadow.begin_step(recording)

    def step(self) -> None:
        """End the current step by hand (loops with neither an optimizer nor a scaler).

        In a loop that also steps an optimizer the recorder adopted, the first call hands the step
        boundaries to these calls (a call right after the adopted optimizer's step, with nothing
        recorded since, ends nothing)."""
        if not self.attached:
            raise RecorderError("recorder.step() was called outside the `with mpscope.record(...)` block.")
        clock = self._clock
        if self._adopt:
            self._adopt = False  # boundaries come from these calls from now on
            clock.adopt_optimizer = None
            if self._adopted_handle is not None:
                self._adopted_handle.remove()
                self._adopted_handle = None
                clock.optimizer = None
                if clock.backward_count == 0 and not self._observer.observed() and not clock.loss_seen \
                        and self._state.grad_tick == clock.tick_seen:
                    return  # the adopted optimizer's step just ended this step
        self._safe("recorder.step()", self._close_step)

    def hold_steps(self, optimizers=()) -> None:
        """Hand every step boundary to :meth:`step`, for a framework loop that ends each step itself
        (the Lightning callback: one step per training batch in which an optimizer stepped). From
        now on neither an optimizer's ``step()`` nor ``GradScaler.update()`` ends a step; within the
        open step they are noted instead:

        * ``optimizers`` (every optimizer that trains the model, the recorded one among them or not)
          are watched; the step is ``skipped`` when an optimizer announced by
          :meth:`before_optimizer_step` did not step (the GradScaler found inf / NaN gradients);
        * ``found_inf``: some ``update()`` of the step found inf / NaN gradients; ``scale_after``: the
          scale when the step ends;
        * ``param_grad`` rows are those :meth:`before_optimizer_step` takes, not the ``.grad`` left at
          the step's end (a loop may have zeroed them by then); ``optimizer_state`` rows hold the
          state of every one of ``optimizers``.

        Call it once, after :meth:`attach`."""
        if not self.attached:
            raise RecorderError("hold_steps() needs an attached recorder (call attach() first).")
        optimizers = [_unwrap_optimizer(o) for o in optimizers]
        for o in optimizers:
            if o is not self.optimizer:
                self._handles.append(o.register_step_post_hook(self._optimizer_post_hook))
        self._held = optimizers
        self._clock.held = True

    def before_optimizer_step(self, optimizer) -> None:
        """(:meth:`hold_steps`) ``optimizer`` is about to step: on a recorded step its parameters'
        gradients are taken now, as that step will use them (``param_grad``: multiplied by the loss
        scale while the GradScaler has not unscaled them for ``optimizer``); the step is ``skipped``
        if ``optimizer`` does not step before it ends."""
        if self.attached and self._held is not None:
            self._safe("before_optimizer_step", self._before_optimizer_step, _unwrap_optimizer(optimizer))

    def _before_optimizer_step(self, optimizer) -> None:
        self._clock.stepping.add(id(optimizer))
        if not self.recording:
            return
        scaler = self.scaler
        state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer)) if scaler is not None else None
        scaled = scaler is not None and not stage_unscaled(state)
        share = self._ranks.replicated_share if self._ranks is not None else None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._observer.record_gradients(params, scaled, share)

    def _close_step(self, final: bool = False, cut: bool = False) -> None:
        """End the step where no GradScaler.update() follows (scale_after = the scale now)."""
        pending = self._end_step(final, cut)
        if pending is not None:
            self._finish_step(pending)

    def _end_step(self, final: bool = False, cut: bool = False):
        """Keep the rows of the passes that trained the model, take the step's parameter stats and
        write its scalars into its row of the device buffer (in-place ops only); returns what
        :meth:`_finish_step` needs (None when nothing happened since the last step's end)."""
        clock, observer = self._clock, self._observer
        idx = clock.step_index
        clock.settle_gradient_calls()
        clock.account_unwrapped_backward()
        if clock.calls and not clock.ticks_work:
            clock.count_every_backward()
        facts = StepFacts(cut=cut, final=final, after_first_step=idx > 0,
                          follows_training=self.optimizer is not None or self.scaler is not None or self.auto,
                          backward_count=clock.backward_count, optimizer_stepped=clock.opt_stepped,
                          parameter_hooks_fire=clock.ticks_work)
        keep = self._ledger.kept(facts, self._ops.passes() if self._ops is not None else None)
        if keep is not None:
            observer.keep(keep, self._ops.renumber(keep) if self._ops is not None else {})
        if final and not observer.observed() and clock.backward_count == 0 and not clock.loss_seen:
            return None  # nothing happened since the last boundary
        if self.recording and (not final or (self.optimizer is None and self.scaler is None)):
            share = self._ranks.replicated_share if self._ranks is not None else None
            if self._held is not None:  # (the gradients were taken before each optimizer step)
                observer.record_parameters(self._held, False, share, grads=False)
            else:
                observer.record_parameters(self.optimizer, clock.grads_scaled and self.scaler is not None, share)
        return idx, clock.close_row(final)

    def _finish_step(self, pending) -> None:
        """Write the scale after the step (the scaler's, after its update) and queue the step."""
        idx, flags = pending
        clock = self._clock
        clock.write_scale_after()
        # idle (not recorded) steps only fill their row of the device buffer; the rows reach the
        # host with the next recorded step's copy (or when the buffer is full, and on exit)
        self._steps.push(idx, flags, self._observer.take(), clock.step_index)
        if self._ranks is not None and not flags.final:
            self._ranks.step_end(idx, flags.recorded)
        clock.step_index += 1
        self._activations.step_ended()
        if self._ops is not None:
            self._ops.on_step_end(idx)
        if self._accum is not None:
            self._accum.on_step_end(idx)
        if self._shadow is not None:
            self._shadow.end_step(idx)
        if self.max_steps is not None and clock.step_index >= self.max_steps:
            self.detach()
            return
        self._begin_step()

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    # ------------------------------------------------------------------ adoption (auto)
    def _adopt_optimizer(self, optimizer, args, kwargs, call_hook: bool = True):
        """Global step hook (``auto``): adopt the first optimizer that steps this model's params."""
        if self.optimizer is not None or not self.attached or not self._adopt:
            return
        mine = {id(p) for p in self.model.parameters()}
        if not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
            self._foreign_steps += 1
            return
        self._clock.optimizer = optimizer
        self._adopted_handle = optimizer.register_step_post_hook(self._optimizer_post_hook)
        self._handles.append(self._adopted_handle)
        self._fill_meta()
        if call_hook:
            self._optimizer_post_hook(optimizer, args, kwargs)

    def _adopt_scaler(self, scaler, outputs) -> None:
        """(``auto``) The recorded code scaled ``outputs`` with ``scaler``: adopt it if it is
        enabled and ``outputs`` is a loss of this model (its autograd graph reaches one of the
        model's parameters; any loss, for a model with no parameter that requires grad). Its
        ``update()`` ends the steps from now on. A scaler of another model in the same loop (a
        GAN's discriminator, a second network) is never adopted."""
        if self.scaler is None and self.attached and scaler.is_enabled() and _reaches(outputs, self.model):
            self._clock.scaler = scaler
            self._patches.scaler(scaler, self._adopt)
            self._fill_meta()

    def _optimizer_post_hook(self, optimizer, args, kwargs):
        self._safe("optimizer step hook", self._clock.optimizer_stepped, optimizer)

    # ------------------------------------------------------------------ host side
    def _drain(self, block: bool) -> None:
        """Process the host copies that have landed (see :meth:`StepBuffer.drain`); with ``block``,
        first copy what waits (finished steps, this step's observations), then wait for all."""
        observer = self._observer
        obs = observer.take() if block and (self._steps.scalars or observer.observed()) else []
        self._steps.drain(block, obs, self.step_index)

    def _drain_all(self) -> None:
        self._drain(True)

    def _publish_accumulation(self) -> None:
        """Remove the accumulation hooks; their rows go to ``run.tables["grad_accumulation"]``."""
        probe, self._accum = self._accum, None
        frame = probe.close()
        if len(frame):
            self.run.tables["grad_accumulation"] = frame


def _reaches(outputs, model) -> bool:
    """Whether the autograd graph of ``outputs`` (a tensor, or a list / tuple / dict of them, as
    ``GradScaler.scale`` takes) accumulates into a parameter of ``model``; True when the model has
    no parameter that requires grad (nothing to tell by)."""
    params = {id(p) for p in model.parameters() if p.requires_grad}
    if not params:
        return True
    stack = [outputs]
    nodes, seen = [], set()
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            nodes.append(x.grad_fn)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if id(getattr(node, "variable", None)) in params:  # AccumulateGrad of a parameter
            return True
        nodes.extend(n for n, _ in node.next_functions)
    return False


def _hparams(optimizer) -> dict:
    """The scalar hyper-parameters of ``optimizer.param_groups[0]`` (tuples of numbers as lists)."""
    hp = {}
    if optimizer is not None and optimizer.param_groups:
        for k, v in optimizer.param_groups[0].items():
            if k == "params":
                continue
            if isinstance(v, (int, float, bool, str)) or v is None:
                hp[k] = v
            elif isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v):
                hp[k] = list(v)
    return hp


def _from_accelerator(accelerator, model, optimizer, scaler):
    """``(optimizer, scaler)`` with the ones an ``accelerate.Accelerator`` prepared filled in: its
    GradScaler, and the prepared optimizer holding ``model``'s parameters (None if there is none
    yet: it is adopted when it first steps)."""
    if not (hasattr(accelerator, "scaler") and hasattr(accelerator, "_optimizers")):
        raise RecorderError(
            f"accelerator must be an accelerate.Accelerator; got {type(accelerator).__name__}. "
            "Pass the Accelerator that prepared the model and optimizer."
        )
    if scaler is None:
        scaler = accelerator.scaler
    if optimizer is None and isinstance(model, torch.nn.Module):
        mine = {id(p) for p in model.parameters()}
        # Accelerate keeps the optimizers it prepared in `_optimizers` (no public list)
        for opt in accelerator._optimizers:
            inner = _unwrap_optimizer(opt)
            if any(id(p) in mine for g in inner.param_groups for p in g["params"]):
                optimizer = inner
                break
    return optimizer, scaler


def _unwrap_optimizer(optimizer):
    """The ``torch.optim.Optimizer`` under a framework's wrapper (Accelerate's
    ``AcceleratedOptimizer`` keeps it in ``.optimizer``): the object whose ``step()`` runs the step
    hooks and whose ``state`` holds the optimizer state."""
    while optimizer is not None and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


