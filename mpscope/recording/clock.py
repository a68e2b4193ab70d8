"""The step clock: where steps end, and the per-step scalars (loss, loss scale, found_inf, clip norm,
grad reset) the training loop's own calls reveal.

Step boundaries: ``scaler.update()`` when a GradScaler is recorded, else ``optimizer.step()`` when
an optimizer is, else the user's ``recorder.step()``. While ``held`` (a framework loop that ends each
step itself: :meth:`mpscope.Recorder.hold_steps`) only ``recorder.step()`` ends a step: the optimizer
steps and GradScaler updates in between are noted in the open step (which optimizers were about to
step and which stepped, the inf / NaN each update found). A *training backward* is one in which some
parameter of the model accumulates a gradient (its post-accumulate-grad hooks fire): only those
count in ``backward_count``, and only their loss becomes the step's loss. With a GradScaler that is
the loss given to ``scaler.scale`` whose output was backpropagated (a discriminator's loss scaled by
the same scaler never counts); without one, the scalar backpropagated. Gradients that arrive
without the ``Tensor.backward`` wrapper (``torch.autograd.backward(loss)``, a framework's own
engine call) still count as one backward with the last scaled loss. Where no parameter hook can
fire (no parameter requires grad) every ``Tensor.backward`` call counts, and
``run.meta["training_backward"]`` says so.

The clock writes each step's scalars into its row of the device buffer with in-place ops only
(:class:`~mpscope.recording.step_buffer.StepBuffer`); the host learns them at the step's copy. It
receives the :class:`~mpscope.recording.events.LoopEvents` the patched PyTorch entry points send.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable

import torch

from mpscope import stats as _stats
from mpscope.recording.patches import stage_unscaled, unscaled
from mpscope.recording.step_buffer import CLIP, CLIP32, CLIP_GMAX, FOUND_INF, LOSS, RESET, SCALE, SCALE_AFTER, StepFlags

_graph_task = torch._C._current_graph_task_id


class StepClock:
    """Step boundaries and scalars of one recording.

    Args:
        state: the :class:`~mpscope.recording.hook_state.HookState` (this clock keeps ``grad_tick``).
        steps: the :class:`~mpscope.recording.step_buffer.StepBuffer` whose open ``row`` it writes.
        observer: the :class:`~mpscope.recording.observer.Observer` (the loss row, the parameters).
        ledger: the :class:`~mpscope.recording.passes.PassLedger` (told of training graph tasks).
        optimizer, scaler: the recorded ``torch.optim.Optimizer`` and GradScaler (None: none yet;
            the recorder sets them when it adopts one).
        guard: ``guard(where, fn, *args)`` runs a hook body so that an error never reaches training.
        close: ends the step where no ``update()`` follows; ``end()`` / ``finish(pending)``: the two
            halves of a step's end around the GradScaler's own ``update()``.
    """

    def __init__(self, state, steps, observer, ledger, optimizer, scaler, guard: Callable, close: Callable,
                 end: Callable, finish: Callable, device_type: str) -> None:
        self.state, self.steps, self.observer, self.ledger = state, steps, observer, ledger
        self.optimizer, self.scaler = optimizer, scaler
        self.guard, self.close, self.end, self.finish = guard, close, end, finish
        self.device_type = device_type
        self.meta = observer.meta
        self.roles = observer.roles
        #: (auto) ``adopt_scaler(scaler, outputs)`` and ``adopt_optimizer(optimizer)``: set by the
        #: recorder while it may still adopt what the loop uses
        self.adopt_scaler: Callable | None = None
        self.adopt_optimizer: Callable | None = None
        self.step_index = 0  #: the open step's index
        #: the caller ends every step (``recorder.step()``); optimizer steps and GradScaler updates
        #: are noted, not ends (see :meth:`mpscope.Recorder.hold_steps`)
        self.held = False
        self.tick_seen = 0  # grad_tick when the last backward was accounted for
        self.ticks_work = False  # some parameter hook has fired (none may: no parameter needing grad)
        #: the model's parameters that require grad (their gradients are compared at unscale_)
        self.trained_params: list = []
        self._snap_queued = False  # a snapshot is queued to run when the current backward ends
        self.reset()

    def reset(self) -> None:
        """A step begins."""
        self.loss_seen = self.scale_seen = self.clip_seen = False  # written to this step's row
        self.pending_losses: list = []  # (weakref to scaler.scale's output, loss) not yet backpropagated
        self.backward_scaled = True  # the step's training backward ran on scaler.scale's output (or none was seen)
        self.calls: list = []  # backward calls' scalars, for runs whose parameter hooks never fire
        self.grad_calls: list = []  # (loss, weakrefs of the gradients) of the step's autograd.grad calls
        self.reset_seen = False
        # the model's gradients as the last training backward left them: id(param) -> (grad, version),
        # compared when the GradScaler unscales (an in-place change in between ran on scaled gradients)
        self.grad_snap: dict = {}
        self.backward_count = 0
        self.opt_stepped = False
        # (held) ids of the optimizers announced about to step / that stepped, this step
        self.stepping: set = set()
        self.stepped: set = set()
        self.opt_scaled = False  # an optimizer stepped on gradients still multiplied by the loss scale
        self.autocast_at_step = False  # autocast was enabled when the optimizer stepped
        self.clipped_before_unscale = False
        self.clip_input_seen = False  # clip_grad_norm_ measured gradients (CLIP32 / CLIP_GMAX written)
        self.grads_scaled = True
        self._task_told = None  # the graph task the ledger last heard a parameter gradient of

    # ------------------------------------------------------------------ LoopEvents
    @property
    def attached(self) -> bool:
        return self.state.attached

    def loss_scaled(self, scaler, loss: torch.Tensor, scaled: torch.Tensor) -> None:
        """``scaler.scale(loss)`` returned ``scaled``: keep the loss until a backward of ``scaled``
        trains the model (a loss of another model, e.g. a GAN's discriminator, never counts), and
        note the scale (while ``held``, the step's first: an update within the step may change it)."""
        if loss.numel() == 1 and loss.is_floating_point():
            self.pending_losses.append((weakref.ref(scaled), loss.detach()))
        if scaler._scale is not None and not (self.held and self.scale_seen):
            self.write_scale(self.steps.row[SCALE])
            self.scale_seen = True

    def scaler_used(self, scaler, outputs=None) -> bool:
        """(``auto``) The recorded code used ``scaler`` (``outputs``: what ``scale`` was given,
        None for ``update``); True when it is (now) the recorded one."""
        if self.adopt_scaler is not None and outputs is not None:
            self.adopt_scaler(scaler, outputs)
        return self.scaler is scaler

    def scaler_stepping(self, optimizer) -> None:
        """``scaler.step(optimizer)`` is about to run: (auto) adopt the optimizer here, since on a
        skipped step ``optimizer.step()`` never runs."""
        if self.optimizer is None and self.adopt_optimizer is not None:
            self.adopt_optimizer(optimizer, None, None, False)

    def unscaling(self, scaler, optimizer) -> None:
        """``scaler.unscale_(optimizer)`` is about to run (also from ``scaler.step``): gradients of
        the model changed in place since the last training backward (clipped by any function, or by
        hand, or rescaled) were changed while still multiplied by the loss scale. Observed by effect
        (each ``.grad``'s identity and version counter), whatever code changed them; listed in
        ``run.meta["grads_changed_before_unscale"]`` (steps, at most 100), not as a clip."""
        if scaler is not self.scaler or stage_unscaled(getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))):
            return
        snap = self.grad_snap
        if not snap:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                was = snap.get(id(p))
                if was is not None and (p.grad is not was[0] or p.grad._version != was[1]):
                    # no clip helper saw it: a clip by hand, or a harmless uniform rescale (dividing by
                    # the accumulation steps); the effect alone cannot tell them apart, so it is noted
                    # in meta and not taken for a clip
                    if not self.clipped_before_unscale:
                        seen = self.meta.setdefault("grads_changed_before_unscale", [])
                        if len(seen) < 100 and self.step_index not in seen:
                            seen.append(self.step_index)
                    return

    def update_began(self, scaler):
        """``scaler.update()`` is about to run: end the step before it resets the scaler's
        per-optimizer state; returns what :meth:`update_ended` needs after it. While ``held`` the step
        goes on: the inf / NaN this update found is added into its row (None returned)."""
        self.grads_scaled = not unscaled(scaler)
        if self.held:
            self._write_found_inf(self.steps.row[FOUND_INF], add=True)
            return None
        return self.end()

    def update_ended(self, pending) -> None:
        """``scaler.update()`` returned: the step's end, with the scale after it."""
        self.finish(pending)

    def optimizer_stepped(self, optimizer) -> None:
        """``optimizer.step()`` ran (its step post-hook)."""
        self.opt_stepped = True
        self.stepped.add(id(optimizer))
        self.autocast_at_step = torch.is_autocast_enabled(self.device_type)
        if self.scaler is None:
            if not self.held:
                self.close()
            return
        state = getattr(self.scaler, "_per_optimizer_states", {}).get(id(optimizer))
        # (an optimizer that unscales itself, fused Adam, gets the scale from scaler.step as
        # `grad_scale` / `found_inf` attributes: that is the scaler's own step)
        if self.scale_seen and not stage_unscaled(state) and not hasattr(optimizer, "found_inf"):
            # optimizer.step() called directly on gradients the scaler multiplied (not scaler.step):
            # mark it; when no optimizer went through the scaler this step, no update() will follow
            # (PyTorch refuses update() without an inf check), so the optimizer step ends the step
            self.opt_scaled = True
            if not unscaled(self.scaler) and not self.held:
                self.close()

    def backward_began(self, tensor: torch.Tensor | None) -> None:
        """A backward of ``tensor`` (the loss: see :func:`~mpscope.recording.patches.objective`;
        None when it has no one-element floating part) is about to run."""
        self.account_unwrapped_backward()
        if not self.reset_seen and self.state.recording:
            self._note_grad_reset()
        # the loss is kept only while no parameter hook has fired (then each call counts, with its loss)
        keep = not self.ticks_work and tensor is not None and tensor.numel() == 1 and tensor.is_floating_point()
        self.calls.append(tensor.detach() if keep else None)

    def holds_parameters(self, tensors: list) -> bool:
        """Whether ``tensors`` hold one of the model's parameters (``torch.autograd.grad``'s inputs)."""
        mine = {id(p) for p in self.trained_params}
        return any(id(t) in mine for t in tensors)

    def gradients_taken(self, loss: torch.Tensor | None, inputs: list, grads) -> None:
        """``grads = torch.autograd.grad(loss, inputs)`` returned, ``inputs`` holding parameters.
        No gradient hook fires: whether it trained the model is seen at the step's end
        (:meth:`settle_gradient_calls`)."""
        if self.calls:
            self.calls.pop()  # backward_began's entry: this call is decided by its effect instead
        mine = {id(p) for p in self.trained_params}
        refs = [weakref.ref(g) for t, g in zip(inputs, grads) if id(t) in mine and isinstance(g, torch.Tensor)]
        self.grad_calls.append((None if loss is None else loss.detach(), refs))

    def settle_gradient_calls(self) -> None:
        """At the step's end: a ``torch.autograd.grad`` call of the step trained the model when a
        parameter's ``.grad`` holds (shares the memory of) a gradient it returned; it counts as a
        training backward, with its loss. A monitor's gradients, thrown away or kept aside, do not."""
        calls, self.grad_calls = self.grad_calls, []
        if not calls:
            return
        held = {p.grad.data_ptr() for p in self.trained_params
                if p.grad is not None and p.grad.layout == torch.strided and p.grad.numel()}
        for loss, refs in calls:
            if any((g := r()) is not None and g.layout == torch.strided and g.numel() and g.data_ptr() in held
                   for r in refs):
                self._count_training_backward(loss)
            else:
                self._forget_pending(loss)

    def backward_ended(self, tensor: torch.Tensor) -> None:
        """``tensor.backward()`` returned: it trained the model when some parameter of the model
        accumulated a gradient during it (its post-accumulate-grad hooks fired)."""
        if self.state.grad_tick == self.tick_seen:
            self._forget_pending(tensor)
            return
        self.tick_seen = self.state.grad_tick
        self._count_training_backward(tensor)

    def clip_measuring(self, grads: list, norm_type) -> None:
        """``clip_grad_norm_`` is about to measure ``grads``: their float32 norm and largest |g|
        into this step's row on recorded steps, NaN otherwise (the buffer is uninitialised memory)."""
        row = self.steps.row
        row[CLIP32].fill_(math.nan)
        row[CLIP_GMAX].fill_(math.nan)
        self.clip_input_seen = True
        if self.state.recording:
            self.guard("clip_grad_norm_", self._note_clip_input, grads, norm_type)

    def clipped(self, norm, accounted: bool = False) -> None:
        """Gradients were clipped (``norm``: the total norm ``clip_grad_norm_`` returns, or None;
        ``accounted``: the clip itself allowed for the loss scale, as ``mpscope.apply``'s does)."""
        if self.scaler is not None and not unscaled(self.scaler):
            if accounted:  # this clip allowed for the loss scale: its change of the gradients is fine
                self.snapshot_grads()
            else:
                self.clipped_before_unscale = True
        if isinstance(norm, torch.Tensor):
            self.steps.row[CLIP].copy_(norm.detach().reshape(()))
            self.clip_seen = True

    def parameter_gradient(self, param) -> None:
        """A parameter of the model accumulated its gradient (its post-accumulate-grad hook)."""
        self.state.grad_tick += 1
        self.ticks_work = True
        task = _graph_task()
        if task != self._task_told:  # (the ledger hears of each graph task once in a row)
            self._task_told = task
            self.ledger.parameter_gradient(task)
        if not self._snap_queued and self.scaler is not None:
            self._snap_queued = True
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._grads_settled)
            except RuntimeError:  # not inside the autograd engine: nothing to wait for
                self._snap_queued = False

    # ------------------------------------------------------------------ accounting
    def account_unwrapped_backward(self) -> None:
        """Parameter gradients arrived since the last accounted backward without a wrapped
        ``Tensor.backward`` (``torch.autograd.backward(loss)``, a framework's own call): one more
        training backward, with the loss last given to ``scaler.scale``."""
        if self.state.grad_tick != self.tick_seen:
            self.tick_seen = self.state.grad_tick
            self._count_training_backward(None)

    def _count_training_backward(self, tensor: torch.Tensor | None) -> None:
        self.backward_count += 1
        if self.scaler is None:
            if tensor is not None and tensor.numel() == 1 and tensor.is_floating_point():
                self._note_loss(tensor)
            return
        loss = self._forget_pending(tensor)
        # (the loss itself, not scaler.scale's output, backpropagated: the scale was never applied)
        self.backward_scaled = loss is not None or not (tensor is not None and tensor.numel() and any(
            p.numel() and p.data_ptr() == tensor.data_ptr() for _, p in self.pending_losses))
        if loss is None and self.pending_losses:  # backward of a tensor derived from the scaled loss
            loss = self.pending_losses.pop()[1]
        if loss is not None:
            self._note_loss(loss)

    def count_every_backward(self) -> None:
        """Where the parameters' gradient hooks never fire (a model with no parameter needing grad),
        every ``Tensor.backward`` call of the step counts as training it."""
        calls, self.calls = self.calls, []
        self.backward_count = len(calls)
        # the Run says so: which backward trained the model could not be observed here
        self.meta["training_backward"] = "every Tensor.backward call (no parameter gradient hook fired)"
        if self.scaler is None:
            for loss in calls:
                if loss is not None:
                    self._note_loss(loss)
        else:
            for _, loss in self.pending_losses:
                self._note_loss(loss)
            self.pending_losses = []

    def _forget_pending(self, tensor: torch.Tensor | None):
        """Remove and return the loss whose ``scaler.scale`` output is ``tensor`` (None if none)."""
        for i, (ref, loss) in enumerate(self.pending_losses):
            if tensor is not None and ref() is tensor:
                del self.pending_losses[i]
                return loss
        return None

    def _note_loss(self, loss: torch.Tensor) -> None:
        if loss.numel() != 1 or not loss.is_floating_point():
            return
        slot = self.steps.row[LOSS]
        v = loss.detach()
        if v.dim():
            v = v.reshape(())
        if self.loss_seen:  # the step's losses (micro-batches) add up, in place
            slot.add_(v)
        else:
            slot.copy_(v)
            self.loss_seen = True
        if self.state.recording and "loss" in self.roles:
            self.observer.observe("", "loss", "loss", loss.detach())

    def _note_grad_reset(self) -> None:
        """Before the step's first backward: 1.0 into the row when every parameter's ``.grad`` is
        None or all zero (reset by ``zero_grad``), else 0.0 (device ops only, no host sync)."""
        slot = self.steps.row[RESET]
        grads = [p.grad for p in self.observer.all_parameters() if p.grad is not None]
        if not grads:
            slot.fill_(1.0)
            self.reset_seen = True
            return
        try:
            peaks = torch._foreach_norm(grads, math.inf)
            top = torch.stack([x.to(device=slot.device, dtype=slot.dtype) for x in peaks]).amax()
        except RuntimeError:  # e.g. sparse gradients: unknown (NaN), never break the user's backward
            return
        slot.copy_(top == 0)
        self.reset_seen = True

    def _note_clip_input(self, grads, norm_type) -> None:
        """Just before ``clip_grad_norm_``: the float32 norm and the largest |g| of the gradients it
        is about to measure, into this step's row."""
        grads = [g for g in grads if isinstance(g, torch.Tensor) and _stats.is_recordable(g)]
        row = self.steps.row
        if not grads:
            return
        nt = float(norm_type)
        per = torch._foreach_norm(grads, nt, dtype=torch.float32)
        stacked = torch.stack([x.to(row.device) for x in per])
        row[CLIP32].copy_(stacked.amax() if math.isinf(nt) else torch.linalg.vector_norm(stacked, nt))
        peaks = torch._foreach_norm(grads, math.inf)
        row[CLIP_GMAX].copy_(torch.stack([x.to(device=row.device, dtype=row.dtype) for x in peaks]).amax())

    def _grads_settled(self, again: bool = True) -> None:
        """The end of a backward that trained the model (an autograd final callback): snapshot its
        gradients' versions. Queued once more first, so that it runs after the callbacks queued
        during the backward (DDP copies its reduced buckets into ``.grad`` in one)."""
        if again:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._grads_settled(False))
            return
        self._snap_queued = False
        if self.state.attached:
            self.guard("gradient snapshot", self.snapshot_grads)

    def snapshot_grads(self) -> None:
        self.grad_snap = {id(p): (p.grad, p.grad._version) for p in self.trained_params if p.grad is not None}

    # ------------------------------------------------------------------ the step's row
    def write_scale(self, slot: torch.Tensor) -> None:
        """The GradScaler's current scale into ``slot`` (1.0 without a scaler), in place."""
        s = self.scaler
        if s is not None and getattr(s, "_scale", None) is not None:
            slot.copy_(s._scale.detach().reshape(()))
        else:
            slot.fill_(1.0)

    def _write_found_inf(self, slot: torch.Tensor, add: bool = False) -> None:
        """1.0 if the scaler found inf/NaN gradients for any optimizer or device this step, else 0.0
        (``add``: 1.0 also where ``slot`` holds 1.0 already: an earlier update of a held step)."""
        if not add:
            slot.fill_(0.0)
        s = self.scaler
        if s is None:
            return
        for state in getattr(s, "_per_optimizer_states", {}).values():
            for f in state.get("found_inf_per_device", {}).values():
                slot.add_(f.reshape(()).to(slot.device))
        slot.clamp_(max=1.0)

    def close_row(self, final: bool) -> StepFlags:
        """The step's scalars that wait for its end (loss scale, found_inf, no clip) into its row;
        returns what the host keeps of it. The row was opened blank: without a GradScaler a step
        that saw no loss, clip or grad-reset check writes nothing here."""
        row = self.steps.row
        if self.scaler is not None:
            if not self.scale_seen:
                self.write_scale(row[SCALE])
            # (held: the step's earlier updates added theirs; the blank row holds 0.0)
            self._write_found_inf(row[FOUND_INF], add=self.held)
        if self.clip_input_seen and not self.clip_seen:  # measured but not clipped: no clip
            row[CLIP32].fill_(math.nan)
            row[CLIP_GMAX].fill_(math.nan)
        return StepFlags(
            # a step cut short (exception, or the block ends mid-step) is not a skip
            # (held: some optimizer announced about to step did not step)
            skipped=(not final and (bool(self.stepping - self.stepped) if self.held
                                    else self.optimizer is not None and not self.opt_stepped)),
            recorded=self.state.recording,
            backward_count=self.backward_count,
            clipped_before_unscale=self.clipped_before_unscale,
            opt_scaled=self.opt_scaled,
            autocast_at_step=self.autocast_at_step,
            # an optimizer that takes the GradScaler's found_inf itself (fused Adam / AdamW:
            # `_step_supports_amp_scaling`) runs step() on every step and skips the update inside
            skips_inside=(self.scaler is not None and self.opt_stepped
                          and getattr(self.optimizer, "_step_supports_amp_scaling", False)),
            final=final,
        )

    def write_scale_after(self) -> None:
        """The scale after the step (the scaler's, after its update; 1.0 without one, as opened)."""
        if self.scaler is not None:
            self.write_scale(self.steps.row[SCALE_AFTER])
