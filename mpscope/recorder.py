"""Recorder: attach hooks to a model, find step boundaries, and turn tensors into Run rows.

What is recorded, and when (the roles of :class:`mpscope.schema.Role`):

* ``activation``: each selected module's forward output (tuple / list / dict outputs flattened to
  ``output.0``, ``output.key``, nested ``output.0.1``), from a forward hook.
* ``activation_grad``: the gradient w.r.t. that output as it flows in backward (multiplied by the
  loss scale), from a hook on the output tensor itself (``register_full_backward_hook`` is not used:
  it breaks on in-place ops).
* A module that returns the very same tensor object (unchanged: same version counter) again as the
  same output within one forward pass (a pass-through module such as ``nn.Identity``, or
  ``nn.Dropout`` in eval mode or with ``p=0``, called twice on one tensor; a module returning its
  Parameter or a cached tensor each call) has it counted once in both roles: autograd computes one
  gradient for a tensor, the sum over all its uses, and its activation row counts it once too. Each
  forward pass (each micro-batch) counts it again, as each backward gives it a gradient again.
  Different modules (or output names) returning one tensor each have their own rows.
* Activation checkpointing: the activations are those of the forward that trained the model (that
  gradients flowed through), once per forward. A re-run of part of the model in backward
  (``torch.utils.checkpoint`` of blocks, reentrant or not) adds no activation rows. When the whole
  model runs inside a reentrant checkpoint (``checkpoint(model, x, use_reentrant=True)``, or any
  autograd Function that runs it under ``no_grad`` and again in its backward, as Megatron-LM and
  DeepSpeed do), its first forward trains nothing: the activations are taken from the re-run in
  backward (with the RNG state restored, the same values). A non-reentrant checkpoint of the whole
  model measures its re-run too (one more stats pass per module) and then drops it, since no
  gradient flows through it.
* Forward passes: each call of the model (its root module) is one; in a step that trained the
  model, the rows of passes no gradient reached (evaluation under ``no_grad``, metrics) are
  dropped. Its modules run without a call of the model (the loop calling ``model.encoder``
  directly, ``checkpoint_sequential`` running a ``Sequential``'s children) belong to no pass: their
  rows are kept.
* ``param_grad``, ``weight``, ``optimizer_state``: at the end of the step, in one batched pass.
  With ``param_grad`` recorded, float16/bfloat16 parameters also get a tensor hook that counts the
  gradient increments lost while several backward passes accumulate into their 16-bit ``.grad``
  (``run.tables["grad_accumulation"]``, :mod:`mpscope.recording.grad_accumulation`).
* ``loss``: the tensor passed to ``GradScaler.scale`` (with a scaler) or the scalar ``backward()``
  is called on (without one).

Step boundaries: ``scaler.update()`` when a scaler is given, else ``optimizer.step()`` when an
optimizer is given, else :meth:`Recorder.step`. Several backward passes in one step (gradient
accumulation) merge into one row per tensor: counts add, min / max combine. A step the GradScaler
skips (inf/NaN gradients: ``optimizer.step()`` not run, or run by an optimizer that skips the
update itself, such as fused Adam / AdamW) is one step with ``skipped`` true.

Recording reads tensors and never writes them: losses and weights are bitwise equal with and without
it. No hook reads a device value on the host; a recorded step's stats are copied to the host in one
transfer when the step ends (non-blocking into pinned memory on CUDA). Everything attached (module
hooks, tensor hooks, the optimizer step hook, the wrapped ``GradScaler`` / ``Tensor.backward`` /
``clip_grad_*`` functions) is removed on exit, on exception and on KeyboardInterrupt; rows recorded
before an exception stay in ``recorder.run``.

The :class:`Recorder` keeps the options, attach / detach, the hooks and the step state; the wrapped
PyTorch functions are :mod:`mpscope.recording.patches`, the step buffer and its host copy
:mod:`mpscope.recording.step_buffer`.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import warnings
import weakref
from collections import OrderedDict, defaultdict
from functools import partial
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
from mpscope.recording import parameter_batch as _batch
from mpscope.recording.autocast_policy import check_op_filter
from mpscope.recording.grad_accumulation import GradAccumulationProbe
from mpscope.recording.grad_hooks import GradHooks
from mpscope.recording.op_recorder import OpRecorder
from mpscope.recording.patches import Patches, stage_unscaled, unscaled
from mpscope.recording.step_buffer import (CLIP, CLIP32, CLIP_GMAX, FOUND_INF, LOSS, RESET, SCALE, SCALE_AFTER,
                                           Observation, StepBuffer, rootless_pass)
from mpscope.recording.outputs import flatten_outputs as _flatten
from mpscope.recording.outputs import flatten_outputs_list as _flatten_list
from mpscope.recording.shadow import Shadow
from mpscope.run import Run
from mpscope.schema import DEFAULT_ROLES, ROLES

#: The dtypes the fused CPU kernel takes (float64 goes through the torch-op path).
_FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
_measurable = _stats.recordable_dtype
_tensor_facts = _stats.tensor_facts
_FUSED_STATS_INTO = _kernel.fused_stats_into  # (the kernel's own; see Recorder._fast_state)
#: Largest number of elements concatenated into one batched stats pass (bounds the extra memory).
BATCH_ELEMENTS = 1 << 24
#: The pass of activations taken under no_grad inside a model compiled in place (no pre-hook numbers
#: its passes): negative like every no_grad pass, so never a training pass.
_NO_GRAD_PASS = -1


def _shard(t: torch.Tensor) -> torch.Tensor:
    """What the stats of an observed tensor are taken of: a DTensor's own shard (a tensor-parallel
    module's output or its gradient; no stats pass may issue a collective, as for parameters), taken
    without an autograd node (under no_grad ``to_local()`` returns the shard itself, the same object
    each time); a ``__torch_dispatch__`` wrapper subclass's values copied into a plain tensor; any
    other tensor as it is. (Only called for tensors whose class is not Tensor.)"""
    with torch.no_grad():
        t = _dist.local_tensor(t)
        if t.__class__ is not torch.Tensor and isinstance(t, torch.Tensor) and _stats.python_dispatch(t) \
                and _measurable(t) is not None:  # (not a nested jagged tensor: listed as not measured)
            # a __torch_dispatch__ wrapper subclass (a quantized tensor: torchao's float8 and NF4
            # tensors) has no storage of its own: its values as every op computes with them, copied
            # into a plain tensor (what the staging copy of a run on an accelerator takes too)
            t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
        return t


def _zeros_facts(t: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
    """For a tensor whose facts are None: an efficient zero tensor (no data) as the zeros it stands
    for and their :func:`~mpscope.stats.tensor_facts` (None for zeros the stats take no more than the
    tensor: an integer dtype, empty); any other tensor as it is, with None."""
    z = _stats.zeros_of(t)
    return (t, None) if z is None else (z, _tensor_facts(z))


_functorch = getattr(torch._C, "_functorch", None)
#: The level of the ``torch.func`` transform (``vmap``, ``grad``, ``jacrev`` ...) running now, None
#: outside any (one call per forward hook).
_transform_level = getattr(_functorch, "maybe_current_level", lambda: None)
#: Runs mpscope's own ops on plain tensors outside the transforms' dispatch (a ``grad`` transform
#: refuses an in-place write, such as a staging copy, into a tensor made outside it).
_outside_transforms = getattr(torch._C, "_DisableFuncTorch", contextlib.nullcontext)
#: Whether a tensor is one of functorch's wrappers (``vmap``'s ``BatchedTensor``, ``grad``'s
#: ``GradTrackingTensor``), and one of the batched tensors of ``torch.autograd.grad(...,
#: is_grads_batched=True)``.
_functorch_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", lambda t: False)
_legacy_batched = getattr(_functorch, "is_legacy_batchedtensor", lambda t: False)
_BATCHED_BACKWARD = "computed in a batched backward (autograd.grad with is_grads_batched=True or under vmap)"


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """A tensor seen inside a ``torch.func`` transform as the plain tensor that holds its values: its
    wrappers (``BatchedTensor`` under ``vmap``, ``GradTrackingTensor`` under ``grad``) peeled off. Under
    ``vmap`` that is every sample's values at once (the batch dimension is the plain tensor's own),
    as a batched forward without the transform holds them."""
    while _functorch_wrapped(t):
        t = _functorch.get_unwrapped(t)
    return t


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
        max_steps: stop after this many steps: everything is detached and training goes on
            unobserved.
        hist_every: take exponent histograms on every ``hist_every``-th recorded step.
        ops: also record op outputs (role ``op_output``, see :mod:`mpscope.recording.op_recorder`): True for every op,
            or a list of op names (``["add", "softmax", "matmul"]``: ATen names, leading / trailing
            underscores optional, so ``"softmax"`` also takes ``aten._softmax`` and ``"add"`` also
            ``add_``). Only ops inside modules selected by ``modules`` get rows; the autocast audit
            still counts every op.
        spill_dir: directory to spill tensor rows to (Parquet parts) on long runs; with it, at most
            about ``spill_rows`` rows (~84 bytes each) stay in memory. Each recorder spills into its
            own new folder inside it (``run.spill_path``), so recorders may share one ``spill_dir``.
        auto: also adopt the GradScaler that the recorded code uses (the first enabled one), also
            when it creates it inside the recorded block (``%%mpscope`` uses it). Without an
            ``optimizer``, the optimizer that steps this model's parameters is adopted (its
            ``step()`` ends the steps) unless ``auto=False``; a loop that ends its steps with
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
            (``out/ranks/<table>/rank=N/part-*.parquet``, flushed at once when a NaN / inf shows
            up), and rank 0 writes the merged Run to ``out/merged``; read it back with
            ``mpscope.Run.load(out)`` (merged) or ``Run.load(out, rank=N)``.
        reduce_every: merge across ranks after every ``reduce_every``-th recorded step (the rows of
            the steps in between travel together); a last merge runs when the block ends.
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


class Recorder:
    """Hooks on one model for the duration of a ``with`` block; see :func:`record`.

    Attributes:
        run: the :class:`~mpscope.run.Run` being filled.
        step_index: index of the current (not yet ended) step.
        recording: whether the current step's stats are being taken.
        model: the model.
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
        self._check_counts(every, hist_every, max_steps)
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
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if (scaler is not None and getattr(scaler, "is_enabled", lambda: True)()) else None
        self.every = every
        self.hist_every = hist_every
        self.max_steps = max_steps
        if not isinstance(ops, bool):
            try:
                self._op_filter = check_op_filter(ops)
            except ValueError as e:
                raise RecorderError(str(e)) from None
        else:
            self._op_filter = None
        ops = bool(ops)
        self.roles = self._check_roles(roles, ops)
        self._select = self._selector(modules)
        self.ops = ops
        self._compiled = False
        self._flag = _compiled.Flag()  # read by the hooks inside compiled regions
        self._traced: set[int] = set()  # modules carrying such a hook (kept until detach)
        self._hook_guards = None  # dynamo's hook-guard setting to restore at detach
        self.auto = bool(auto)
        self._adopt = optimizer is None and auto is not False  # adopt the optimizer stepping the model
        self._adopted_handle = None  # the adopted optimizer's step hook
        self.run = Run(spill_dir=spill_dir, max_rows_in_memory=spill_rows)
        self.local_run = self.run  # this rank's own rows (``run`` becomes the merged Run on rank 0)
        self.step_index = 0
        self.recording = False
        self.attached = False
        self._handles: list = []
        self._module_handles: list = []  # forward hooks, present during recorded steps only
        self._root_post = None  # the model's forward hook ending a pass (recorded steps only)
        self._grad_hooks = GradHooks()  # this step's gradient hooks on module outputs
        self._patches = Patches(self)  # the PyTorch entry points replaced while attached
        self._names: dict[int, str] = {}
        self._obs: list[Observation] = []  # this step's device stats, waiting for the host copy
        # this step's observed tensors: identity -> (weakref, Observation or table row, and the key,
        # pass and _grad_tick of that first observation); and (identity, key, pass, _grad_tick, that
        # first observation) of their later activation observations
        self._seen: dict = {}
        self._seen_again: set = set()
        self._param_handles: list = []  # post-accumulate-grad hooks on the model's parameters
        self._grad_tick = 0  # parameter gradients accumulated so far (from those hooks)
        self._tick_seen = 0  # _grad_tick when the last backward was accounted for
        self._ticks_work = False  # some parameter hook has fired (none may: no parameter needing grad)
        # the model's gradients as the last training backward left them: id(param) -> (grad, version),
        # compared when the GradScaler unscales (an in-place change in between ran on scaled gradients)
        self._trained_params: list = []  # the model's parameters that require grad (hooked at attach)
        self._snap_queued = False  # a snapshot is queued to run when the current backward ends
        self._pass_seq = 0
        self._failed = False
        self._steps = StepBuffer(self.run)  # the step rows on the device and their host copy
        self._ops = None
        self._accum: GradAccumulationProbe | None = None  # swamped increments of 16-bit .grad
        self._device_type: str | None = None  # the model's device type (its first parameter's), taken at attach
        self._fused = None  # the fused kernel for this step's CPU stats (None: the torch-op path)
        self._kern = None  # the kernel this recorded step found loaded, any device (None: not loaded)
        self._facts = _tensor_facts  # the kernel's tensor_facts once it is loaded (the same answers)
        self._fast = None  # (kernel, _fast_state()): the hooks' usual path in C++, once the kernel is loaded
        #: A CPU run with mpscope._core (which takes its statistics at the extension's speed): the
        #: extension's build, on a cold cache, starts when the recorder detaches, not while it
        #: records. Even at idle priority a build starting beside the first recorded steps (Python
        #: and torch imports, the compiler's memory traffic) slowed them by up to 2x on 2 CPUs.
        self._defer_build = False
        # the step buffer's host rows the fused kernel writes into (None: each observation gets its
        # own DeviceStats; so with op recording, which keeps and reads them)
        self._rows = None
        self._staged = None  # the step buffer's staged rows on an accelerator (StagedRows), same use
        self._key_index = self.local_run._keys.index  # (module, role, name, dtype) -> key
        self._param_plan = None  # (modules, their tree, _selected_parameters(), all parameters) of the last walk
        self._batch_plan = None  # the step end's parameter batch as last observed (a ParameterPlan)
        try:
            plan = _dist.plan(model, group)
        except (TypeError, ValueError) as e:
            raise RecorderError(str(e)) from None
        self._ranks = _dist.RankMerge(self, plan, out, reduce_every) if (plan is not None or out is not None) else None
        self._shadow = None
        if shadow:
            self._shadow = Shadow(self)
        self._reset_step_state()

    # ------------------------------------------------------------------ configuration
    @staticmethod
    def _check_counts(every, hist_every, max_steps) -> None:
        for name, v in (("every", every), ("hist_every", hist_every)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise RecorderError(f"{name} must be a positive int (1 = every step); got {v!r}.")
        if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1):
            raise RecorderError(f"max_steps must be a positive int or None; got {max_steps!r}.")

    @classmethod
    def _check_options(cls, every=1, modules=None, roles=None, hist_every=1, max_steps=None, ops=False) -> None:
        """Raise :class:`RecorderError` for the options :func:`record` would refuse (no model needed)."""
        cls._check_counts(every, hist_every, max_steps)
        cls._check_roles(roles, ops)
        cls._selector(modules)

    @staticmethod
    def _check_roles(roles, ops):
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
        return frozenset(chosen)

    @staticmethod
    def _selector(modules):
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
            self.detach()
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
        self.attached = True
        self._device_type = self._device().type  # read by the hooks: model.parameters() costs a walk
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
            # torch-op path records meanwhile; steps switch over when it is ready, see _begin_step). A
            # CPU run takes its statistics from it; a run on an accelerator its staging copies
            # (StagedRows). A CPU run whose statistics mpscope._core takes starts no build while it
            # records: the build starts when it detaches (see _defer_build)
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
        for h in self._handles + self._param_handles:
            attempt(h.remove)
        self._handles.clear()
        self._param_handles.clear()
        attempt(self._grad_hooks.clear)
        attempt(self._hook_modules, False)
        attempt(self._patches.restore)
        if self._hook_guards is not None:
            attempt(_compiled.unguard_hooks, self._hook_guards)
            self._hook_guards = None
        if _ATTACHED.get(self.model) is self:
            del _ATTACHED[self.model]
        was_attached, self.attached = self.attached, False
        self.recording = False
        if was_attached or not self._failed:
            attempt(self._drain, True)
        if self._ranks is not None:
            if self._failed:  # an internal error detached this rank alone: it exchanges no more
                self._ranks.failed = True
            attempt(self._ranks.close)
        self._steps.release()
        if was_attached and self._defer_build:
            # the build this CPU run deferred (see attach): started now, never waited for, so that the
            # next run finds the extension; it runs on CPU time left idle
            attempt(_kernel.build_for_next_run)
        if errors and not self._failed:
            raise errors[0]

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
        self._compiled = _compiled.is_compiled(self.model)
        if self._compiled:
            self._hook_guards = _compiled.guard_hooks()  # undone in detach
        if getattr(self.model, "_compiled_call_impl", None) is None:  # else its hooks run traced
            self._handles.append(self.model.register_forward_pre_hook(ModelHook(self._root_pre_hook)))
        # which backward passes train this model is seen by effect: its parameters' gradients
        # (under FSDP1 also its flat parameters: the original ones never accumulate a gradient)
        self._trained_params = list({id(p): p for p in self.model.parameters() if p.requires_grad}.values())
        for p in _dist.grad_carriers(self.model):
            self._param_handles.append(p.register_post_accumulate_grad_hook(ModelHook(self._param_grad_hook)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_post_hook(self._optimizer_post_hook))
        elif self._adopt:
            self._handles.append(register_optimizer_step_post_hook(self._adopt_optimizer))
        if self.scaler is not None:
            self._patches.scaler(self.scaler, self._adopt)
        elif self.auto:
            self._patches.watch_scalers()
        self._patches.backward()
        self._patches.clip()
        if "param_grad" in self.roles:
            probe = GradAccumulationProbe(self._selected_parameters(), lambda: self.recording, self._safe)
            self._accum = probe if probe.active else None
        if self.ops:
            self._ops = OpRecorder(self)
            self._ops.__enter__()
        if self._shadow is not None:
            self._shadow.attach()

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
        meta["compiled"] = self._compiled
        meta.setdefault("unobserved", {})
        meta["param_count"] = int(sum(p.numel() for p in params))
        pd_ = defaultdict(int)
        for p in params:
            pd_[dtype_name(p.dtype)] += p.numel()
        meta["param_dtypes"] = dict(pd_)
        meta["optimizer"] = type(self.optimizer).__name__ if self.optimizer is not None else None
        hp = {}
        if self.optimizer is not None and self.optimizer.param_groups:
            for k, v in self.optimizer.param_groups[0].items():
                if k == "params":
                    continue
                if isinstance(v, (int, float, bool, str)) or v is None:
                    hp[k] = v
                elif isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v):
                    hp[k] = list(v)
        meta["optimizer_hparams"] = hp
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

    # ------------------------------------------------------------------ step state
    def _reset_step_state(self) -> None:
        self._loss_seen = self._scale_seen = self._clip_seen = False  # written to this step's row
        self._pending_losses: list = []  # (weakref to scaler.scale's output, loss) not yet backpropagated
        self._calls: list = []  # backward calls' scalars, for runs whose parameter hooks never fire
        self._pass = None  # the pass of the model's forward running now (None outside one)
        self._reached: set = set()  # (pass, graph task) of the gradients that reached a pass's outputs
        self._training_tasks: set = set()  # graph tasks in which a parameter of the model got a gradient
        self._grad_tasks: set = set()  # graph tasks in which a gradient reached a module's output
        self._rerun = None  # (graph task id, pass) of the latest re-run of the whole model in backward
        self._hookless: set = set()  # grad-enabled passes none of whose outputs requires grad
        self._reset_seen = False
        self._grad_snap = {}
        self._backward_count = 0
        self._opt_stepped = False
        self._opt_scaled = False  # an optimizer stepped on gradients still multiplied by the loss scale
        self._autocast_at_step = False  # autocast was enabled when the optimizer stepped
        self._clipped_before_unscale = False
        self._clip_input_seen = False  # clip_grad_norm_ measured gradients (CLIP32 / CLIP_GMAX written)
        self._grads_scaled = True

    def _begin_step(self) -> None:
        self._reset_step_state()
        # the row opens as a step that saw nothing (BLANK_ROW): one copy, not one write per scalar
        self._steps.row.copy_(self._steps.blank)
        self.recording = (self.step_index % self.every == 0)
        kern = self._kern = _kernel.current(start=not self._defer_build) if self.recording else None
        self._facts = _tensor_facts if kern is None else kern.tensor_facts
        self._fast = None if kern is None else (kern, self._fast_state(kern))
        if self.recording and self._device_type == "cpu":
            # one implementation for the whole step: the PyTorch extension once it is ready, else
            # mpscope._core (compiled at install), else the torch ops
            self._fused = kern or _kernel.core()
            if kern is not None and self.run.meta.get("fused_kernel_from_step") is None:
                self.run.meta["fused_kernel_from_step"] = self.step_index
        # a single tensor's stats go into rows of the step: written by the fused kernel on the CPU,
        # staged and taken in batches on an accelerator (op recording reads each one's stats itself)
        steps = self._steps
        rowed = self.recording and self._ops is None
        steps.use_staged(rowed)
        self._staged = steps.staged if rowed else None
        if self._staged is not None:  # (the same copy with or without the kernel)
            self._staged.copier = kern.stage_copy if kern is not None else None
        self._rows = steps.tables if (rowed and self._staged is None and self._fused is not None) else None
        self._hist_now = self.recording and (self.step_index // self.every) % self.hist_every == 0
        steps.tables.hist = self._hist_now  # (the rows it logs there)
        steps.host_tables.kernel = kern if self._fused is not None else None  # (its hist_nonzero)
        self._hook_modules(self.recording)
        if self._ops is not None:
            self._ops.set_recording(self.recording)
        if self._shadow is not None:
            self._shadow.begin_step(self.recording)

    def _fast_state(self, kern) -> tuple:
        """The constants the kernel's ``forward_hook`` and ``observe_now`` take (the C++ form of
        :meth:`_on_forward` and :meth:`_observe_now` for their usual cases; see mpscope/_kernel.cpp):
        which roles they record, the stats' bit patterns, :mod:`mpscope.kernel` and its own
        ``fused_stats_into`` (a replacement found there is called instead of the kernel, as here),
        the kernel module, ``functools.partial`` and ``OrderedDict`` (what :class:`GradHooks` puts
        in a tensor's ``_backward_hooks``)."""
        return kern.hook_state(("activation" in self.roles, "activation_grad" in self.roles, _kernel.HOOK_BITS,
                                _kernel, _FUSED_STATS_INTO, kern, partial, OrderedDict))

    def _hook_modules(self, on: bool) -> None:
        """Forward hooks on the selected modules during recorded steps only: with ``every=N`` the
        steps in between run without them (a module with hooks takes PyTorch's slower call path)."""
        self._flag.on = on  # hooks inside compiled regions stay; this flag switches them
        if self._ranks is not None:
            self._ranks.hook_grads(on)
        if not on:
            for h in self._module_handles:
                h.remove()
            self._module_handles.clear()
            if self._root_post is not None:
                self._root_post.remove()
                self._root_post = None
            return
        if self._root_post is None and getattr(self.model, "_compiled_call_impl", None) is None:
            # the end of the model's forward ends its pass (passes are numbered on recorded steps
            # only; a model compiled in place has no pre-hook numbering them)
            self._root_post = self.model.register_forward_hook(ModelHook(self._root_post_hook), always_call=True)
        if not self._module_handles and self.roles & {"activation", "activation_grad"}:
            # modules created since the last recorded step (lazy submodules) get their names too;
            # prepend: mpscope sees the module's own output even if a user hook replaces it later
            added = False
            for name, mod, traced in _compiled.hook_targets(self.model):
                self._names[id(mod)] = name
                if not self._select(name, mod):
                    continue
                if not traced:
                    self._module_handles.append(mod.register_forward_hook(ModelHook(self._forward_hook), prepend=True))
                    continue
                if id(mod) not in self._traced:  # installed once: dynamo guards on the flag only
                    self._traced.add(id(mod))
                    grads = "activation_grad" in self.roles
                    hook = _compiled.traced_hook(self, self._flag, name, _flatten_list, grads)
                    self._handles.append(mod.register_forward_hook(ModelHook(hook), prepend=True))
                    added = True
            if added:  # code compiled before these hooks existed would run without them
                _compiled.forget_compiled(self.model)

    def _note_unobserved(self, names: list[str]) -> None:
        """Modules inside compiled regions whose outputs come in a container the compiled-graph hook
        cannot rebuild (named tuples, model-output classes): their activations are recorded, their
        activation gradients cannot be; listed in meta ``unobserved`` (role -> module names) and
        warned about once instead of silently missing."""
        if "activation_grad" not in self.roles:
            return
        have = self.run.meta.setdefault("unobserved", {}).setdefault("activation_grad", [])
        new = [n for n in names if n not in have]
        if new:
            have.extend(new)
            warnings.warn(
                f"mpscope: {len(new)} module(s) run inside a torch.compile'd region return their outputs in a "
                f"container mpscope cannot rebuild there (a named tuple or a model-output class); their "
                f"activations are recorded, their activation gradients are not: "
                f"{', '.join(repr(n) for n in new[:6])}{' ...' if len(new) > 6 else ''}. Parameters, "
                "gradients and optimizer state are recorded as usual.",
                stacklevel=2,
            )

    def _observe_traced(self, module: str, name: str, tensor: torch.Tensor, role: str) -> None:
        """A tensor handed over by ``mpscope::observe`` from inside a compiled graph: a module's
        output (``role`` ``activation``, or ``activation_untapped`` when its gradient cannot be
        observed) or the gradient arriving at it (``activation_grad``)."""
        if not self.recording:
            return
        if role == "activation_grad":
            self._grad_entry(module, name, None, tensor)
            return
        if role == "activation_untapped":
            self._note_unobserved([module])
        # the pass the root's pre-hook numbered (a torch.compile wrapper's runs outside the region);
        # a model compiled in place has none: a region traced under no_grad says so in ``role``
        pass_id = self._pass
        if pass_id is None and role == "activation_no_grad":
            pass_id = _NO_GRAD_PASS
        if _stats.is_recordable(tensor):
            self._note_autocast()
            self._observe(module, "activation", name, tensor, pass_id=pass_id)

    def step(self) -> None:
        """End the current step by hand (loops with neither an optimizer nor a scaler).

        In a loop that also steps an optimizer the recorder adopted, the first call hands the step
        boundaries to these calls (a call right after the adopted optimizer's step, with nothing
        recorded since, ends nothing)."""
        if not self.attached:
            raise RecorderError("recorder.step() was called outside the `with mpscope.record(...)` block.")
        if self._adopt:
            self._adopt = False  # boundaries come from these calls from now on
            if self._adopted_handle is not None:
                self._adopted_handle.remove()
                self._adopted_handle = None
                self.optimizer = None
                if self._backward_count == 0 and not self._observed() and not self._loss_seen and self._grad_tick == self._tick_seen:
                    return  # the adopted optimizer's step just ended this step
        self._safe("recorder.step()", self._close_step)

    def _close_step(self, final: bool = False, cut: bool = False) -> None:
        """End the step where no GradScaler.update() follows (scale_after = the scale now)."""
        pending = self._end_step(final, cut)
        if pending is not None:
            self._finish_step(pending)

    def _end_step(self, final: bool = False, cut: bool = False):
        """Take the step's parameter stats and write its scalars (loss, loss scale, found_inf,
        clip norm) into its row of the device buffer with in-place ops only (no allocation);
        returns what :meth:`_finish_step` needs (None when nothing happened since the last one)."""
        idx = self.step_index
        self._account_unwrapped_backward()
        if self._calls and not self._ticks_work:
            self._count_every_backward()
        trained = self._backward_count or (self._opt_stepped and self._reached)
        if not cut and (trained or (final and self.step_index > 0 and self._training_recording())):
            # a step that trained keeps only the forward passes that trained the model: a gradient
            # reached their outputs (or, none of them needing grad, a training backward followed);
            # evaluation after the last step of a training run is no step. A step without any
            # training backward (inference) keeps its passes. A step trained by
            # torch.autograd.grad(loss, params) (no gradient accumulates: no backward is counted)
            # is seen by its optimizer step and the gradients that reached a pass's outputs.
            keep = self._trained_passes() | (self._hookless if self._backward_count else set())
            if not self._ticks_work and self._ops is not None:  # which backward trained the model is not known: keep their ops
                keep |= self._ops.backward_passes()
            self._keep_passes(keep)
        if final and not self._observed() and self._backward_count == 0 and not self._loss_seen:
            return None  # nothing happened since the last boundary
        if self.recording and (not final or (self.optimizer is None and self.scaler is None)):
            self._record_parameters()
        # the row was opened blank (_begin_step): without a GradScaler a step that saw no
        # loss, clip or grad-reset check writes nothing here
        row = self._steps.row
        if self.scaler is not None:
            if not self._scale_seen:
                self._write_scale(row[SCALE])
            self._write_found_inf(row[FOUND_INF])
        if self._clip_input_seen and not self._clip_seen:  # measured but not clipped: no clip
            row[CLIP32].fill_(math.nan)
            row[CLIP_GMAX].fill_(math.nan)
        host = {
            # a step cut short (exception, or the block ends mid-step) is not a skip
            "skipped": (self.optimizer is not None and not self._opt_stepped and not final),
            "recorded": self.recording,
            "backward_count": self._backward_count,
            "clipped_before_unscale": self._clipped_before_unscale,
            "opt_scaled": self._opt_scaled,
            "autocast_at_step": self._autocast_at_step,
            # an optimizer that takes the GradScaler's found_inf itself (fused Adam / AdamW:
            # `_step_supports_amp_scaling`) runs step() on every step and skips the update inside
            "skips_inside": (self.scaler is not None and self._opt_stepped
                             and getattr(self.optimizer, "_step_supports_amp_scaling", False)),
            "final": final,
        }
        return idx, host

    def _trained_passes(self) -> set:
        """The passes that trained the model this step: a gradient reached their outputs in a
        backward in which a parameter of the model got its gradient (a saliency map's or a
        grad-norm monitor's ``autograd.grad``, a generator step through a frozen discriminator,
        trains none); where no such backward ran (``torch.autograd.grad(loss, params)`` and
        ``p.grad = g``: nothing accumulates), any gradient. With the backwards that trained it
        (``("backward", graph task)``), whose ops' rows op recording keeps, and the gradients those
        backwards brought to module outputs (``("grad", graph task)``: ``activation_grad`` rows)."""
        tasks = self._training_tasks
        if tasks:
            passes = {p for p, t in self._reached if t in tasks}
        elif self._opt_stepped or not self._ticks_work:  # (no parameter hook can fire: every backward trains)
            passes, tasks = {p for p, _ in self._reached}, self._grad_tasks
        else:  # (the run's end after its last step: a probe backpropagated there trained nothing)
            passes = set()
        return passes | {("backward", t) for t in tasks} | {("grad", t) for t in tasks}

    def _keep_passes(self, keep) -> None:
        """Drop this step's observations from forward passes not in ``keep`` (passes that did not
        train the model: evaluation, another model's step); observations outside a pass stay. A
        kept row that reused a dropped one's stats takes them over (a table row stays where it is).
        With ``ops=True`` the kept ``op_output`` rows take the names the op recorder numbers them
        by when the dropped passes' calls are not counted (:meth:`OpRecorder.renumber`)."""
        log = self._steps.tables.log
        rename = None
        if self._ops is not None:
            keep, rename = self._ops.renumber(keep)
        if rename:
            rows, intern = self.local_run._keys.rows, self.local_run._key

            def renamed(key: int, pass_id) -> int:
                module, role, name, dtype = rows[key]
                new = rename.get((pass_id, module, name)) if role == "op_output" else None
                return key if new is None else intern(module, role, new, dtype)

            for o in self._obs:
                o.keys = [renamed(k, o.pass_id) for k in o.keys]
            log[:] = [(renamed(e[0], e[4]), *e[1:]) for e in log]
        if {e[4] for e in log} <= keep | {None} and all(o.pass_id is None or o.pass_id in keep for o in self._obs):
            return
        flags = [o.pass_id is None or o.pass_id in keep for o in self._obs]
        kept = [o for o, f in zip(self._obs, flags) if f]
        for o in kept:
            if o.src is not None and not (o.src.pass_id is None or o.src.pass_id in keep):
                o.ds, o.src = o.src.ds, None
        self._obs = kept
        before = [0]  # kept observations before each original position (the log's ``at``)
        for f in flags:
            before.append(before[-1] + f)
        log[:] = [e[:5] + (before[e[5]],) for e in log if e[4] is None or e[4] in keep]

    def _observed(self) -> bool:
        """Some tensor was observed since the last host copy."""
        return bool(self._obs or self._steps.tables.log)

    def _training_recording(self) -> bool:
        """The recording follows training steps (an optimizer or scaler is known or adopted)."""
        return self.optimizer is not None or self.scaler is not None or self.auto

    def _count_every_backward(self) -> None:
        """Where the parameters' gradient hooks never fire (a model with no
        parameter needing grad), every ``Tensor.backward`` call of the step counts as training it."""
        calls, self._calls = self._calls, []
        self._backward_count = len(calls)
        # the Run says so: which backward trained the model could not be observed here
        self.run.meta["training_backward"] = "every Tensor.backward call (no parameter gradient hook fired)"
        if self.scaler is None:
            for loss in calls:
                if loss is not None:
                    self._note_loss(loss)
        else:
            for _, loss in self._pending_losses:
                self._note_loss(loss)
            self._pending_losses = []

    def _finish_step(self, pending) -> None:
        """Write the scale after the step (the scaler's, after its update) and queue the step."""
        idx, host = pending
        if self.scaler is not None:  # else 1.0, as the row was opened
            self._write_scale(self._steps.row[SCALE_AFTER])
        # idle (not recorded) steps only fill their row of the device buffer; the rows reach the
        # host with the next recorded step's copy (or when the buffer is full, and on exit)
        self._steps.push(idx, host, self._take_obs(), self.step_index)
        if self._ranks is not None and not host["final"]:
            self._ranks.step_end(idx, host["recorded"])
        self.step_index += 1
        self._grad_hooks.clear()
        if self._ops is not None:
            self._ops.on_step_end(idx)
        if self._accum is not None:
            self._accum.on_step_end(idx)
        if self._shadow is not None:
            self._shadow.end_step(idx)
        if self.max_steps is not None and self.step_index >= self.max_steps:
            self.detach()
            return
        self._begin_step()

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def _write_scale(self, slot: torch.Tensor) -> None:
        """The GradScaler's current scale into ``slot`` (1.0 without a scaler), in place."""
        s = self.scaler
        if s is not None and getattr(s, "_scale", None) is not None:
            slot.copy_(s._scale.detach().reshape(()))
        else:
            slot.fill_(1.0)

    def _write_found_inf(self, slot: torch.Tensor) -> None:
        """1.0 if the scaler found inf/NaN gradients for any optimizer or device this step, else 0.0."""
        slot.fill_(0.0)
        s = self.scaler
        if s is None:
            return
        for state in getattr(s, "_per_optimizer_states", {}).values():
            for f in state.get("found_inf_per_device", {}).values():
                slot.add_(f.reshape(()).to(slot.device))
        slot.clamp_(max=1.0)

    # ------------------------------------------------------------------ observing tensors
    def _observe(self, module: str, role: str, name: str, tensor, scaled: bool = False, pass_id: int | None = None):
        """Compute the stats of one tensor (no host sync) and keep them for the step's flush.

        ``scaled``: the tensor is multiplied by the current loss scale (gradients before unscale_).
        Repeated (module, role, name) within a step merge when the step is flushed. A tensor seen
        before in this step (the same object, unchanged: same version counter and data pointer)
        reuses its stats; like autograd, this cannot see in-place writes made through ``.data``.
        An ``activation`` seen again under the same (module, name, dtype) in the same pass with no
        parameter gradient accumulated since (the same output of one forward pass) is not logged
        again: one row per tensor, as autograd gives it one gradient.

        Returns the tensor's :class:`~mpscope.stats.DeviceStats` (one row, on its device), or None
        when nothing was recorded.
        """
        if not self.recording or role not in self.roles or not isinstance(tensor, torch.Tensor):
            return None
        if tensor.__class__ is not torch.Tensor:
            tensor = _shard(tensor)
        facts = self._facts(tensor, _tensor_facts)
        if facts is None:
            tensor, facts = _zeros_facts(tensor)
            if facts is None:
                return None
        o = self._observe_now(module, role, name, tensor, facts, scaled, pass_id)
        if o.__class__ is int:
            return self._steps.tables.stats(o, 1, self._hist_now)
        return o.ds if o.src is None else o.src.ds

    def _observe_now(self, module: str, role: str, name: str, tensor: torch.Tensor, facts: tuple,
                     scaled: bool, pass_id: int | None):
        """:meth:`_observe` after its checks (``facts``: the tensor's :func:`~mpscope.stats.tensor_facts`,
        not None): the per-tensor host path, kept to a few dict lookups. Returns the tensor's
        row of the step buffer's rows (an int, logged in ``tables.log``: the fused CPU kernel wrote
        its stats into a host row, or the tensor is staged on its device) or the
        :class:`Observation` appended."""
        dtype, numel, ident, fused_cpu = facts
        k = (module, role, name, dtype)
        key = self._key_index.get(k)
        if key is None:
            key = self.local_run._key(module, role, name, dtype)
        # ident: (id, version counter, data pointer); None for an inference tensor, which has no
        # version counter (it cannot be told apart from a changed one). A write through `.data`
        # bumps no version counter; replacing `.data` changes the data pointer
        seen = self._seen.get(ident) if ident is not None else None
        if seen is not None and seen[0]() is tensor:  # alive, so id() was not reused
            src = seen[1]
            if role == "activation":
                # the same output of the same module again in one forward pass (no parameter
                # gradient arrived since): one activation, as autograd gives it one gradient
                tick = self._grad_tick
                if seen[2] == key and seen[3] == pass_id and seen[4] == tick:
                    return src
                # (with src, the first observation of this very tensor: a tensor that took a dead
                # one's identity, as id and allocator reuse give it, gets a row of its own and no
                # repeat of the dead tensor's)
                again = (ident, key, pass_id, tick, src)
                if again in self._seen_again:
                    return src
                self._seen_again.add(again)
            if src.__class__ is int:
                self._steps.tables.log.append((key, src, numel, scaled, pass_id, len(self._obs)))
                return src
            o = Observation([key], [numel], [dtype], [scaled], None, self._hist_now, src, pass_id)
            self._obs.append(o)
            return o
        tables = self._rows
        if tables is not None and fused_cpu:
            # the fused kernel writes the row in place: nothing allocated per tensor
            o = tables.take(1)
            _kernel.fused_stats_into(self._fused, [tensor], self._hist_now, tables.counts, tables.extrema, o)
            tables.log.append((key, o, numel, scaled, pass_id, len(self._obs)))
        elif (staged := self._staged) is not None and dtype != "float64" and tensor.device == staged.device:
            # staged on its device: one copy kernel now, the stats in batches (StagedRows)
            o = staged.stage(tensor, numel)
            staged.log.append((key, o, numel, scaled, pass_id, len(self._obs)))
        else:
            ds = _stats.device_stats([tensor], self._hist_now, self._fused)
            o = Observation([key], [numel], [dtype], [scaled], ds, self._hist_now, None, pass_id)
            self._obs.append(o)
        if ident is not None:
            self._seen[ident] = (weakref.ref(tensor), o, key, pass_id, self._grad_tick)
        return o

    def _take_obs(self) -> list[Observation]:
        """Hand over the observations waiting for the host copy (and forget this step's tensors)."""
        obs, self._obs = self._obs, []
        self._seen = {}
        self._seen_again = set()
        return obs

    def _observe_batch(self, items: list[tuple[str, str, str, torch.Tensor, bool]]) -> None:
        """Stats of many tensors in batched passes, grouped by device and carrier format."""
        groups = defaultdict(list)
        for module, role, name, t, scaled in items:
            if t.__class__ is not torch.nn.Parameter and t.__class__ is not torch.Tensor:
                t = _shard(t)  # (a DTensor's own shard, a wrapper subclass's values: see _shard)
            if not isinstance(t, torch.Tensor) or _measurable(t) is None:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self._note_unmeasured(module, role, name, t)
                continue
            if role in self.roles:
                groups[t.device].append((module, role, name, t, scaled))  # device_stats splits float64 itself
        for group in groups.values():
            batch, size = [], 0
            for item in group + [None]:
                if item is None or (batch and size + item[3].numel() > BATCH_ELEMENTS):
                    if batch:
                        self._observe_together(batch)
                    batch, size = [], 0
                if item is not None:
                    batch.append(item)
                    size += item[3].numel()

    def _observe_together(self, batch: list[tuple[str, str, str, torch.Tensor, bool]]) -> None:
        """One stats pass over the tensors of ``batch`` (recordable, on one device)."""
        tensors = [b[3] for b in batch]
        dtypes = [_stats.RECORDABLE_NAMES[t.dtype] for t in tensors]
        index, key = self._key_index, self.local_run._key
        keys = []
        for (m, r, n, _, _), d in zip(batch, dtypes):
            k = index.get((m, r, n, d))
            keys.append(key(m, r, n, d) if k is None else k)
        numels = [t.numel() for t in tensors]
        scaled = [b[4] for b in batch]
        if self._rows is not None and all(t.is_cpu and t.dtype in _FUSED_DTYPES for t in tensors):
            self._fused_rows(tensors, keys, numels, dtypes, scaled)
            return
        ds = _stats.device_stats(tensors, self._hist_now, self._fused)
        self._obs.append(Observation(keys, numels, dtypes, scaled, ds, self._hist_now))

    def _fused_rows(self, tensors: list[torch.Tensor], keys: list[int], numels: list[int], dtypes: list[str],
                    scaled: list[bool]) -> None:
        """The fused kernel's stats of CPU float16/bfloat16/float32 ``tensors`` into the next rows of the
        step's host tables (``self._rows``), kept as one observation of those rows."""
        tables = self._rows
        row = tables.take(len(tensors))
        _kernel.fused_stats_into(self._fused, tensors, self._hist_now, tables.counts, tables.extrema, row)
        self._obs.append(Observation(keys, numels, dtypes, scaled, None, self._hist_now, row=row))

    def _record_parameters(self) -> None:
        """Observe the selected parameters, their gradients and the optimizer state in one batch.
        A step whose batch has the form and tensor layout of the last one reuses its plan (keys,
        sizes, batch split: :class:`~mpscope.recording.parameter_batch.ParameterPlan`)."""
        if not self.roles & {"param_grad", "weight", "optimizer_state"}:
            return
        want_w = "weight" in self.roles
        state = self.optimizer.state if (self.optimizer is not None and "optimizer_state" in self.roles) else {}
        params = self._selected_parameters()
        if self._ranks is not None:  # DDP: the same tensors on every rank, each rank records its share
            params = self._ranks.replicated_share(params)
        tensors, form = _batch.gather(params, "param_grad" in self.roles, want_w, state, self._kern)
        scaled = self._grads_scaled and self.scaler is not None
        plan, rows = self._batch_plan, self._rows is not None
        if plan is not None and plan.holds(params, form, tensors, rows, self._kern):
            hist = self._hist_now
            for start, end, keys, numels, dtypes, grads, unscaled, fused in plan.batches:
                part, sc = tensors[start:end], grads if scaled else unscaled
                if fused:
                    self._fused_rows(part, keys, numels, dtypes, sc)
                else:
                    self._obs.append(Observation(keys, numels, dtypes, sc, _stats.device_stats(part, hist, self._fused), hist))
            return
        items = _batch.items(params, form, tensors, want_w, scaled)
        first = len(self._obs)
        if items:
            self._observe_batch(items)
        self._batch_plan = _batch.ParameterPlan.make(params, form, items, self._obs[first:], rows)

    def _selected_parameters(self) -> list[tuple[str, str, torch.nn.Parameter]]:
        """``(module, parameter name, parameter)`` of the selected modules' own parameters, each
        parameter once (under its first module). Kept while the model's module tree and parameters
        are the same objects: checked on each call over the modules found the last time (the same
        children and parameters under the same names, in the same order, at each of them is the
        same tree): four tuples per module, compared by the kernel's ``same_module_tree`` when it is
        loaded (the same answer without making them)."""
        if self._module_tree_holds():
            return self._param_plan[2]
        out, seen = [], set()
        for name, mod in _compiled.modules(self.model):
            if not self._select(name, mod):
                continue
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, pname, p))
        try:
            mods = list(self.model.modules())
            self._param_plan = (mods, _module_tree(mods), out, _all_parameters(self.model))
        except Exception:  # module dicts that do not iterate as dicts (torch.jit.trace): no caching
            self._param_plan = None
        return out

    def _module_tree_holds(self) -> bool:
        """Whether the model's module tree is still the one :meth:`_selected_parameters` last walked
        (``self._param_plan``: its modules, their tree, the selected parameters and all of the
        model's): the same children and parameters under the same names, in the same order, at each
        module. Compared by the kernel's ``same_module_tree`` when it is loaded (no tuples made; it
        leaves a module dict that is not a plain dict, such as a reordered OrderedDict, to the
        Python form)."""
        plan = self._param_plan
        if plan is None:
            return False
        mods, tree = plan[0], plan[1]
        try:
            same = None if self._kern is None else self._kern.same_module_tree(mods, tree)
            # (None: a module dict that is not a plain dict, an OrderedDict: the Python form answers)
            return (_module_tree(mods) == tree) if same is None else same
        except Exception:  # a module dict replaced by something else: walk the tree again
            return False

    def _publish_accumulation(self) -> None:
        """Remove the accumulation hooks; their rows go to ``run.tables["grad_accumulation"]``."""
        probe, self._accum = self._accum, None
        frame = probe.close()
        if len(frame):
            self.run.tables["grad_accumulation"] = frame

    # ------------------------------------------------------------------ hooks
    def _root_pre_hook(self, module, args):
        return self._safe("forward pre-hook", self._begin_pass)

    def _root_post_hook(self, module, args, output):
        """The model's forward returned (or raised): its modules run from now on outside it (called
        directly, ``checkpoint_sequential`` running the children of a ``Sequential``) belong to no
        pass, not to this one (an evaluation pass would take them along when dropped). A forward that
        raised (``output`` None: the hook is registered with ``always_call``), or whose output holds
        no tensor that requires grad (all parameters frozen, ``functional_call`` on detached ones),
        trains nothing: its pass is no hookless pass kept for want of gradient hooks (its rows are
        dropped). Inside a ``torch.func`` transform the outputs are functorch's wrappers: not judged."""
        if self.recording:
            if self._pass is not None and self._pass in self._hookless and _transform_level() is None \
                    and not any(t.requires_grad for _, t in _flatten(output, "output")):
                self._hookless.discard(self._pass)
            self._pass = None
        return None

    def _note_autocast(self) -> None:
        """Record the autocast in effect (meta ``autocast_dtype`` / ``autocast_device_type``) the
        first time a forward runs under it. Checked before the model's forward and in the modules'
        forward hooks: frameworks enter autocast inside the model's ``forward`` (Accelerate replaces
        ``model.forward`` with an autocast-wrapped one), where the root's pre-hook cannot see it."""
        if self.run.meta.get("autocast_dtype") is None:
            dev = self._device_type
            if torch.is_autocast_enabled(dev):
                self.run.meta["autocast_dtype"] = dtype_name(torch.get_autocast_dtype(dev))
                self.run.meta["autocast_device_type"] = dev

    def _begin_pass(self) -> None:
        """A forward pass of the recorded model starts: number it. Passes under ``no_grad`` /
        ``inference_mode`` (evaluation) get a negative number: they never train the model."""
        self._note_autocast()
        if not self.recording:
            return  # not recorded, or an extra forward of mpscope's own (the shadow) inside the pass
        task = torch._C._current_graph_task_id()
        if task != -1:
            # re-run inside backward (activation checkpointing): the latest pass may be an
            # evaluation or unused one run since the forward being recomputed
            self._pass = None
            if torch.is_grad_enabled():
                # the whole model recomputed with grad: reentrant checkpointing (torch's
                # ``use_reentrant=True``, or any autograd Function that runs the model under no_grad
                # and again in its backward) backpropagates through this re-run, and its first
                # forward, under no_grad, trained nothing. The re-run is a pass of its own, kept when
                # a gradient reaches its outputs (non-reentrant recomputation, whose gradients flow
                # through the first forward's graph, never is)
                self._pass_seq += 1
                self._rerun = (task, self._pass_seq)
            return
        self._pass_seq += 1
        self._pass = self._pass_seq if torch.is_grad_enabled() else -self._pass_seq
        if self._pass > 0:
            self._hookless.add(self._pass)

    def _rerun_pass(self, task: int) -> int | None:
        """The pass of a forward re-run inside backward graph task ``task`` (activation
        checkpointing): a re-run of the whole model with grad (reentrant checkpointing, see
        :meth:`_begin_pass`) is a pass of its own, its number; any other re-run None: it recomputes
        values the first forward already gave (a checkpointed part, re-run for the first forward's
        graph or for a nested backward), which add no rows."""
        rerun = self._rerun
        return rerun[1] if rerun is not None and rerun[0] == task else None

    def _forward_hook(self, module, args, output):
        if self.recording:
            try:
                fast = self._fast
                if fast is None or self._pass is None or not fast[0].forward_hook(self, fast[1], module, output):
                    self._on_forward(module, output)
            except Exception as e:  # (``_safe`` written out: this runs once per module and pass)
                self.on_internal_error("forward hook", e)
        return None

    def _on_forward(self, module, output) -> None:
        # inside backward (task != -1), activation checkpointing re-runs the forward: the activation
        # was taken in the first forward; reentrant checkpointing backpropagates through the re-run
        # outputs (the first ran under no_grad), so their gradients are hooked here
        task = torch._C._current_graph_task_id()
        roles = self.roles
        if task == -1:
            if self.run.meta.get("autocast_dtype") is None:
                self._note_autocast()
            pass_id = self._pass
            if pass_id is None:
                pass_id = rootless_pass()
                if pass_id is None and torch.is_grad_enabled():
                    # a module run outside the root's forward with grad (the loop calling
                    # model.encoder): a pass of its own, kept when a gradient reaches its output
                    # in a backward that trains the model
                    self._pass_seq += 1
                    pass_id = self._pass_seq
            take = "activation" in roles
        else:
            # a re-run's outputs belong to the pass being backpropagated, not to the latest pass (an
            # evaluation or unused pass may have run since): their gradients mark no pass, and the
            # first forward took the activation. Except in a re-run of the whole model (see
            # _begin_pass), which is a pass of its own: its modules' outputs (not those of a
            # submodule's own checkpoint re-run, in a nested backward) are its activations
            pass_id = self._rerun_pass(task)
            take = pass_id is not None and "activation" in roles
        mname = self._names.get(id(module), "?")
        # no gradient hooks in a pass under no_grad: what requires grad there (a Parameter or an
        # input returned as it is) gets its gradient from a training pass, which hooks it itself
        # (the hooks of a leaf are per (module, output) and step, see GradHooks.add)
        hook_grads = (pass_id or 0) > 0 or (pass_id is None and "activation_grad" in roles)
        # inside a torch.func transform (per-sample gradients: vmap(grad(...)) over functional_call)
        # the outputs are functorch's wrappers: their values are measured, and their gradients, which
        # functorch computes without the tensor hooks of autograd, are noted as not measured
        inside = _transform_level() is not None
        facts = self._facts
        for name, t in (("output", output),) if output.__class__ is torch.Tensor else _flatten(output, "output"):
            v = t if t.__class__ is torch.Tensor else _shard(t)  # (the gradient hooks go on t itself)
            if inside:
                v = _unwrapped(v)
            f = facts(v, _tensor_facts)
            if f is None:
                v, f = _zeros_facts(v)  # (an efficient zero tensor: its zeros; the gradient hooks go on t)
                if f is None:
                    if v.is_floating_point():
                        self._note_unmeasured(mname, "activation", name, v)
                    continue
            if inside:
                if take:
                    with _outside_transforms():
                        self._observe_now(mname, "activation", name, v, f, False, pass_id)
                if hook_grads:
                    self._note_unmeasured(mname, "activation_grad", name, v, "computed inside a torch.func transform")
                continue
            if take:
                self._observe_now(mname, "activation", name, v, f, False, pass_id)
            if hook_grads and t.requires_grad:
                # a leaf output (a module returning a Parameter) keeps its hooks across the step's
                # micro-batches: hooked once per step (module, name), or its gradients would count twice
                if self._grad_hooks.add(t, partial(self._grad_entry, mname, name, pass_id), (mname, name)):
                    self._hookless.discard(pass_id)

    def _grad_entry(self, mname: str, name: str, pass_id: int | None, grad: torch.Tensor | None) -> None:
        """The gradient arriving at output ``name`` of module ``mname`` of forward pass ``pass_id``
        (the tensor hooks are ``functools.partial`` of this; compiled graphs call it too)."""
        if grad is None:
            # an undefined gradient: the output of a compiled graph whose consumers (a loss computed
            # inside the same graph) were differentiated there, so no gradient flows into it
            return
        try:
            task = torch._C._current_graph_task_id()
            if pass_id is not None and pass_id > 0:  # (passes under no_grad never train the model)
                self._reached.add((pass_id, task))  # (see _trained_passes)
            self._grad_tasks.add(task)
            # the row is the backward's: kept when that backward trained the model (_trained_passes)
            grad_pass = None if task == -1 else ("grad", task)
            if "activation_grad" in self.roles and self.recording:
                fast = self._fast  # (the kernel's observe_now: None for a tensor it leaves to this path)
                if fast is not None and fast[0].observe_now(self, fast[1], mname, "activation_grad", name, grad, True,
                                                            grad_pass) is not None:
                    return
                if grad.__class__ is not torch.Tensor:
                    grad = _shard(grad)
                try:
                    f = self._facts(grad, _tensor_facts)
                    if f is None:
                        grad, f = _zeros_facts(grad)
                    if f is not None:
                        self._observe_now(mname, "activation_grad", name, grad, f, True, grad_pass)
                    elif grad.is_floating_point():
                        self._note_unmeasured(mname, "activation_grad", name, grad)
                except RuntimeError:
                    if not (_legacy_batched(grad) or _functorch_wrapped(grad)):
                        raise
                    # a batched backward (torch.autograd.grad(..., is_grads_batched=True), or
                    # under torch.func.vmap: rows of a Jacobian, not the training gradient) hands
                    # the hooks vmap's batched tensors, which have no storage (data_ptr raises;
                    # checked here, off the hot path)
                    self._note_unmeasured(mname, "activation_grad", name, grad, _BATCHED_BACKWARD)
        except Exception as e:  # (``_safe`` written out: this runs once per tensor)
            self.on_internal_error("gradient hook", e)

    def _param_grad_hook(self, param) -> None:
        self._grad_tick += 1
        self._ticks_work = True
        self._training_tasks.add(torch._C._current_graph_task_id())
        if not self._snap_queued and self.scaler is not None:
            self._snap_queued = True
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._grads_settled)
            except RuntimeError:  # not inside the autograd engine: nothing to wait for
                self._snap_queued = False

    def _grads_settled(self, again: bool = True) -> None:
        """The end of a backward that trained the model (an autograd final callback): snapshot its
        gradients' versions. Queued once more first, so that it runs after the callbacks queued
        during the backward (DDP copies its reduced buckets into ``.grad`` in one)."""
        if again:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._grads_settled(False))
            return
        self._snap_queued = False
        if self.attached:
            self._safe("gradient snapshot", self._snapshot_grads)

    def _snapshot_grads(self) -> None:
        self._grad_snap = {id(p): (p.grad, p.grad._version) for p in self._trained_params if p.grad is not None}

    def _on_unscale(self, scaler, optimizer) -> None:
        """``scaler.unscale_(optimizer)`` is about to run (also from ``scaler.step``): gradients of
        the model changed in place since the last training backward (clipped by any function, or by
        hand, or rescaled) were changed while still multiplied by the loss scale. Observed by effect
        (each ``.grad``'s identity and version counter), whatever code changed them; listed in
        ``run.meta["grads_changed_before_unscale"]`` (steps, at most 100), not as a clip."""
        if scaler is not self.scaler or stage_unscaled(getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))):
            return
        snap = self._grad_snap
        if not snap:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                was = snap.get(id(p))
                if was is not None and (p.grad is not was[0] or p.grad._version != was[1]):
                    # no clip helper saw it: a clip by hand, or a harmless uniform rescale (dividing by
                    # the accumulation steps); the effect alone cannot tell them apart, so it is noted
                    # in meta and not taken for a clip
                    if not self._clipped_before_unscale:
                        seen = self.run.meta.setdefault("grads_changed_before_unscale", [])
                        if len(seen) < 100 and self.step_index not in seen:
                            seen.append(self.step_index)
                    return

    def _note_unmeasured(self, module: str, role: str, name: str, t: torch.Tensor, reason: str | None = None) -> None:
        """Record in ``run.meta["not_measured"]`` a tensor the stats pass cannot read (sparse, nested,
        quantized, meta) or the recorder cannot see (``reason``, e.g. a gradient computed inside a
        ``torch.func`` transform): ``"<role> <module>/<name>" -> reason`` (at most 100 entries)."""
        reason = reason or _stats.unmeasurable_reason(t)
        if reason is None or role not in self.roles:
            return
        notes = self.run.meta.setdefault("not_measured", {})
        if len(notes) < 100:
            notes.setdefault(f"{role} {module}/{name}", reason)

    def _adopt_optimizer(self, optimizer, args, kwargs, call_hook: bool = True):
        """Global step hook (``auto``): adopt the first optimizer that steps this model's params."""
        if self.optimizer is not None or not self.attached or not self._adopt:
            return
        mine = {id(p) for p in self.model.parameters()}
        if not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
            return
        self.optimizer = optimizer
        self._adopted_handle = optimizer.register_step_post_hook(self._optimizer_post_hook)
        self._handles.append(self._adopted_handle)
        self._fill_meta()
        if call_hook:
            self._optimizer_post_hook(optimizer, args, kwargs)

    def _on_scaler_seen(self, scaler) -> bool:
        """(``auto``) The recorded code used ``scaler``: adopt it if it is the first enabled one
        (its ``update()`` ends the steps from now on); True when it is the recorded scaler."""
        if self.scaler is None and self.attached and scaler.is_enabled():
            self.scaler = scaler
            self._patches.scaler(scaler, self._adopt)
            self._fill_meta()
        return self.scaler is scaler

    def _optimizer_post_hook(self, optimizer, args, kwargs):
        self._safe("optimizer step hook", self._on_optimizer_step, optimizer)

    def _on_optimizer_step(self, optimizer) -> None:
        self._opt_stepped = True
        self._autocast_at_step = torch.is_autocast_enabled(self._device_type)
        if self.scaler is None:
            self._close_step()
            return
        state = getattr(self.scaler, "_per_optimizer_states", {}).get(id(optimizer))
        # (an optimizer that unscales itself, fused Adam, gets the scale from scaler.step as
        # `grad_scale` / `found_inf` attributes: that is the scaler's own step)
        if self._scale_seen and not stage_unscaled(state) and not hasattr(optimizer, "found_inf"):
            # optimizer.step() called directly on gradients the scaler multiplied (not scaler.step):
            # mark it; when no optimizer went through the scaler this step, no update() will follow
            # (PyTorch refuses update() without an inf check), so the optimizer step ends the step
            self._opt_scaled = True
            if not unscaled(self.scaler):
                self._close_step()

    # ------------------------------------------------------------------ what the wrappers report
    def _on_scaler_step(self, optimizer) -> None:
        """``scaler.step(optimizer)`` is about to run: (auto) adopt the optimizer here, since on a
        skipped step ``optimizer.step()`` never runs."""
        if self.optimizer is None and self._adopt:
            self._adopt_optimizer(optimizer, None, None, False)

    def _on_update(self, scaler):
        """``scaler.update()`` is about to run: end the step before it resets the scaler's
        per-optimizer state; returns what :meth:`_finish_step` needs after it."""
        self._grads_scaled = not unscaled(scaler)
        return self._end_step()

    def _on_loss_scaled(self, scaler, loss: torch.Tensor, scaled: torch.Tensor) -> None:
        """``scaler.scale(loss)`` ran: keep the loss until a backward of ``scaled`` trains the model
        (a loss of another model, e.g. a GAN's discriminator, never counts), and note the scale."""
        if loss.numel() == 1 and loss.is_floating_point():
            self._pending_losses.append((weakref.ref(scaled), loss.detach()))
        if scaler._scale is not None:
            self._write_scale(self._steps.row[SCALE])
            self._scale_seen = True

    def _on_backward(self, tensor: torch.Tensor) -> None:
        """``tensor.backward()`` is about to run."""
        self._account_unwrapped_backward()
        if not self._reset_seen and self.recording:
            self._note_grad_reset()
        # the loss is kept only while no parameter hook has fired (then each call counts, with its loss)
        keep = not self._ticks_work and tensor.numel() == 1 and tensor.is_floating_point()
        self._calls.append(tensor.detach() if keep else None)

    def _on_backward_done(self, tensor: torch.Tensor) -> None:
        """``tensor.backward()`` returned: it trained the model when some parameter of the model
        accumulated a gradient during it (its post-accumulate-grad hooks fired)."""
        if self._grad_tick == self._tick_seen:
            self._forget_pending(tensor)
            return
        self._tick_seen = self._grad_tick
        self._count_training_backward(tensor)

    def _account_unwrapped_backward(self) -> None:
        """Parameter gradients arrived since the last accounted backward without a wrapped
        ``Tensor.backward`` (``torch.autograd.backward(loss)``, a framework's own call): one more
        training backward, with the loss last given to ``scaler.scale``."""
        if self._grad_tick != self._tick_seen:
            self._tick_seen = self._grad_tick
            self._count_training_backward(None)

    def _count_training_backward(self, tensor: torch.Tensor | None) -> None:
        self._backward_count += 1
        if self.scaler is None:
            if tensor is not None and tensor.numel() == 1 and tensor.is_floating_point():
                self._note_loss(tensor)
            return
        loss = self._forget_pending(tensor)
        if loss is None and self._pending_losses:  # backward of a tensor derived from the scaled loss
            loss = self._pending_losses.pop()[1]
        if loss is not None:
            self._note_loss(loss)

    def _forget_pending(self, tensor: torch.Tensor | None):
        """Remove and return the loss whose ``scaler.scale`` output is ``tensor`` (None if none)."""
        for i, (ref, loss) in enumerate(self._pending_losses):
            if tensor is not None and ref() is tensor:
                del self._pending_losses[i]
                return loss
        return None

    def _note_loss(self, loss: torch.Tensor) -> None:
        if loss.numel() != 1 or not loss.is_floating_point():
            return
        slot = self._steps.row[LOSS]
        v = loss.detach()
        if v.dim():
            v = v.reshape(())
        if self._loss_seen:  # the step's losses (micro-batches) add up, in place
            slot.add_(v)
        else:
            slot.copy_(v)
            self._loss_seen = True
        if self.recording and "loss" in self.roles:
            self._observe("", "loss", "loss", loss.detach())

    def _note_grad_reset(self) -> None:
        """Before the step's first backward: 1.0 into the row when every parameter's ``.grad`` is
        None or all zero (reset by ``zero_grad``), else 0.0 (device ops only, no host sync)."""
        slot = self._steps.row[RESET]
        params = self._param_plan[3] if self._module_tree_holds() else _all_parameters(self.model)
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            slot.fill_(1.0)
            self._reset_seen = True
            return
        try:
            peaks = torch._foreach_norm(grads, math.inf)
            top = torch.stack([x.to(device=slot.device, dtype=slot.dtype) for x in peaks]).amax()
        except RuntimeError:  # e.g. sparse gradients: unknown (NaN), never break the user's backward
            return
        slot.copy_(top == 0)
        self._reset_seen = True

    def _note_clip_input(self, grads, norm_type) -> None:
        """Just before ``clip_grad_norm_``: the float32 norm and the largest |g| of the gradients it
        is about to measure, into this step's row."""
        grads = [g for g in grads if isinstance(g, torch.Tensor) and _stats.is_recordable(g)]
        row = self._steps.row
        if not grads:
            return
        nt = float(norm_type)
        per = torch._foreach_norm(grads, nt, dtype=torch.float32)
        stacked = torch.stack([x.to(row.device) for x in per])
        row[CLIP32].copy_(stacked.amax() if math.isinf(nt) else torch.linalg.vector_norm(stacked, nt))
        peaks = torch._foreach_norm(grads, math.inf)
        row[CLIP_GMAX].copy_(torch.stack([x.to(device=row.device, dtype=row.dtype) for x in peaks]).amax())

    def _on_clip_input(self, grads: list, norm_type) -> None:
        """``clip_grad_norm_`` is about to measure ``grads``: their float32 norm and largest |g|
        into this step's row on recorded steps, NaN otherwise (the buffer is uninitialised memory)."""
        row = self._steps.row
        row[CLIP32].fill_(math.nan)
        row[CLIP_GMAX].fill_(math.nan)
        self._clip_input_seen = True
        if self.recording:
            self._safe("clip_grad_norm_", self._note_clip_input, grads, norm_type)

    def _on_clip(self, norm, accounted: bool = False) -> None:
        """Gradients were clipped (``norm``: the total norm ``clip_grad_norm_`` returns, or None;
        ``accounted``: the clip itself allowed for the loss scale, as ``mpscope.apply``'s does)."""
        if self.scaler is not None and not unscaled(self.scaler):
            if accounted:  # this clip allowed for the loss scale: its change of the gradients is fine
                self._snapshot_grads()
            else:
                self._clipped_before_unscale = True
        if isinstance(norm, torch.Tensor):
            self._steps.row[CLIP].copy_(norm.detach().reshape(()))
            self._clip_seen = True

    # ------------------------------------------------------------------ host side
    def _drain(self, block: bool) -> None:
        """Process the host copies that have landed (see :meth:`StepBuffer.drain`); with ``block``,
        first copy what waits (finished steps, this step's observations), then wait for all."""
        obs = self._take_obs() if block and (self._steps.scalars or self._observed()) else []
        self._steps.drain(block, obs, self.step_index)


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


def _module_tree(mods: list[torch.nn.Module]) -> list[tuple]:
    """What ``modules()`` and ``named_parameters()`` see of each of ``mods``: its children's and its own
    parameters' names and identities (``mods`` holds the modules, so no identity is reused)."""
    return [(tuple(m._modules), tuple(map(id, m._modules.values())), tuple(m._parameters),
             tuple(map(id, m._parameters.values()))) for m in mods]


def _all_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters ``model.parameters()`` yields (each module and parameter once; the order may
    differ), by a walk of the modules' ``_modules`` / ``_parameters`` dicts: about 35 against 80 us
    on the demo GPT's 69 parameters (hot loop). The check before each recorded step's first
    backward (:meth:`Recorder._note_grad_reset`) takes them from the parameter plan instead while
    the module tree holds."""
    out, seen_p, seen_m, stack = [], set(), {id(model)}, [model]
    while stack:
        m = stack.pop()
        for p in m._parameters.values():
            if p is not None and id(p) not in seen_p:
                seen_p.add(id(p))
                out.append(p)
        for c in m._modules.values():
            if c is not None and id(c) not in seen_m:
                seen_m.add(id(c))
                stack.append(c)
    return out
