"""Hugging Face ``transformers.Trainer`` callback: record a Trainer run with mpscope.

Usage::

    from mpscope.integrations.hf import MPScopeCallback

    cb = MPScopeCallback(every=10, out="runs/trainer")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])   # or trainer.add_callback(cb)
    trainer.train()
    cb.run            # mpscope.Run (also saved to "runs/trainer")
    cb.recommendation # mpscope.Recommendation (printed at train end)

Importing this module imports ``transformers`` (``pip install 'mpscope[hf]'``).

How it meets the Trainer (transformers 4.40+ / 5.x with Accelerate):

* At ``on_train_begin`` the model the Trainer trains and its optimizer are known (the Trainer has
  built and prepared them by then). The optimizer it passes is Accelerate's ``AcceleratedOptimizer``:
  the recorder follows ``.optimizer`` to the ``torch.optim.Optimizer`` underneath and takes the
  GradScaler from ``.scaler`` (Accelerate's, present for fp16 on GPUs; none for bf16 and fp32).
* Steps: one per optimizer step, whatever ``gradient_accumulation_steps`` is. The recorder ends a
  step at ``GradScaler.update()`` / ``optimizer.step()`` inside the Trainer's optimizer step; at
  ``on_step_end`` (the Trainer's own end of an optimizer step) a step the recorder did not see end
  (an optimizer whose ``step()`` runs no hooks) is ended there.
* Gradients (``param_grad``) are read when the step ends, after the Trainer's
  ``accelerator.clip_grad_norm_`` and the GradScaler have unscaled them; rows say so
  (``loss_scale`` 1.0 on unscaled gradients).
* The loss recorded is what the Trainer back-propagates: per optimizer step, the sum over its
  micro-batches of the loss passed to ``accelerator.backward`` (the Trainer divides each by the
  number of micro-batches itself), which is what it logs as ``loss`` with ``logging_steps=1``.
* Skipped steps: the GradScaler found inf/NaN gradients and the update did not happen, either
  because ``optimizer.step()`` did not run or because the optimizer skips it itself (the
  Trainer's default fused AdamW; Accelerate's ``optimizer_step_was_skipped`` misses those).
* At ``on_log`` a few numbers (:func:`mpscope.integrations._common.log_numbers`) are added to the
  Trainer's logs, so they reach the loggers in ``report_to`` (TensorBoard, W&B, ...).
* At ``on_train_end`` every hook is removed, the Run is saved to ``out`` and the recommendation is
  printed. If ``trainer.train()`` raises inside a training step (forward, loss, backward), the
  recorder is detached before the exception propagates and ``cb.run`` holds the steps before it.

Only the main process (``state.is_world_process_zero``) writes ``out`` and prints.
"""

from __future__ import annotations

import sys

# transformers is this module's reason to exist: imported here, never by ``import mpscope``
from transformers import TrainerCallback

from mpscope.integrations._common import CallbackState, finish, log_numbers
from mpscope.recorder import Recorder


class MPScopeCallback(CallbackState, TrainerCallback):
    """Record a ``transformers.Trainer`` run; see the module docstring.

    Arguments and attributes: those of :class:`~mpscope.integrations._common.CallbackState`
    (``log=True`` adds the summary numbers to the Trainer's logs at each ``on_log``).
    """

    def __init__(self, every: int = 1, out=None, **options):
        super().__init__(every, out, **options)
        self._main = True
        self._trainer = None

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._drop_recorder()  # a previous train() that raised outside a training step
        self._main = state.is_world_process_zero
        self._trainer = _calling_trainer()
        self.recorder = Recorder(model, optimizer=optimizer, scaler=getattr(optimizer, "scaler", None), out=self.out,
                                 **self.options)
        self.recorder.attach()
        self._ended_at = self.recorder.step_index
        self.run = self.recorder.run
        if self._trainer is not None:
            self._guard_training_step(self._trainer)
            self._log_before_reporters(self._trainer)

    def on_step_end(self, args, state, control, **kwargs):
        rec = self.recorder
        if rec is not None and rec.attached and rec.step_index == self._ended_at:
            rec.step()  # the optimizer step ran no hook the recorder saw
        if rec is not None:
            self._ended_at = rec.step_index

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.log and logs is not None and self.recorder is not None:
            logs.update(log_numbers(self.recorder))

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is None:
            return
        rec, self.recorder = self.recorder, None
        self._unguard()
        self.run, self.recommendation = finish(rec, self.show and self._main)

    # ------------------------------------------------------------------ helpers
    def _drop_recorder(self, error: BaseException | None = None) -> None:
        if self.recorder is not None:
            rec, self.recorder = self.recorder, None
            rec.__exit__(type(error) if error is not None else None, error, None)
        self._unguard()

    def _guard_training_step(self, trainer) -> None:
        """Detach the recorder when training raises or is interrupted (the Trainer has no exception
        event): the Trainer methods of :data:`GUARDED` it has are wrapped, on the instance, for as
        long as the recording lasts (an epoch holds the data loading, the step and the optimizer)."""
        cb = self
        for name in GUARDED:
            original = getattr(trainer, name, None)
            if original is None:
                continue

            def guarded(*args, __original=original, **kwargs):
                try:
                    return __original(*args, **kwargs)
                except BaseException as e:
                    cb._drop_recorder(e)
                    raise

            guarded.__mpscope_orig__ = original
            setattr(trainer, name, guarded)

    def _unguard(self) -> None:
        t = self._trainer
        for name in GUARDED:
            if t is not None and hasattr(t.__dict__.get(name), "__mpscope_orig__"):
                delattr(t, name)  # back to the class's method

    def _log_before_reporters(self, trainer) -> None:
        """Move this callback before the reporting callbacks (TensorBoard, W&B, ...) so that the
        numbers it adds in ``on_log`` reach them (user callbacks come after them by default)."""
        handler = trainer.callback_handler
        cbs = [c for c in handler.callbacks if c is not self]
        from transformers.trainer_callback import (
            DefaultFlowCallback,  # transformers: optional (the "hf" extra)
        )

        at = next((i + 1 for i, c in enumerate(cbs) if isinstance(c, DefaultFlowCallback)), 0)
        cbs.insert(at, self)
        handler.callbacks = cbs  # a new list: the event loop running now keeps iterating the old one


#: ``transformers.Trainer`` methods run inside ``train()`` that the callback wraps to detach on an
#: exception: an epoch (transformers 5: data loading, steps, optimizer), and for older versions the
#: step and the batch fetch.
GUARDED = ("_run_epoch", "training_step", "get_batch_samples")


def _calling_trainer():
    """The ``transformers.Trainer`` whose ``on_train_begin`` event is running (callbacks are not
    given the Trainer): the ``self`` of the nearest calling frame that is a Trainer, else None."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        frame = frame.f_back
    return None
