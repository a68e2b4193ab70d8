"""Lightning callback: record a ``lightning.pytorch.Trainer`` fit with mpscope.

Usage::

    from mpscope.integrations.lightning import MPScopeCallback

    cb = MPScopeCallback(every=10, out="runs/lightning")
    trainer = lightning.pytorch.Trainer(precision="bf16-mixed", callbacks=[cb])
    trainer.fit(module, loader)
    cb.run            # mpscope.Run (also saved to "runs/lightning")
    cb.recommendation # mpscope.Recommendation (printed at fit end)

Importing this module imports ``lightning`` (``pip install 'mpscope[lightning]'``).

How it meets Lightning (2.x):

* At ``on_fit_start`` the LightningModule and its optimizers are set up: the recorder attaches to
  the module, the first optimizer in ``trainer.optimizers`` (the ``torch.optim.Optimizer`` itself)
  and the precision plugin's GradScaler (``trainer.precision_plugin.scaler``: present for
  ``"16-mixed"``, None for ``"bf16-mixed"`` and 32-bit).
* Steps: one per optimizer step, whatever ``accumulate_grad_batches`` is. The recorder ends a step
  at ``GradScaler.update()`` / ``optimizer.step()`` inside Lightning's optimizer step; at
  ``on_train_batch_end`` after an optimizer step (``trainer.global_step`` moved) that the recorder
  did not see end, the step is ended there.
* Gradients (``param_grad``) are read when the step ends; with a GradScaler Lightning has unscaled
  them before ``on_before_optimizer_step`` (rows carry ``loss_scale`` 1.0).
* Skipped steps: the GradScaler found inf/NaN gradients and the update did not happen.
* The autocast Lightning's precision plugin enters around ``training_step`` is recorded.
* Every ``trainer.log_every_n_steps`` optimizer steps, a few numbers
  (:func:`mpscope.integrations._common.log_numbers`) go to the trainer's loggers from rank zero.
* At ``on_fit_end`` (and on an exception, ``on_exception``) every hook is removed, the Run is saved
  to ``out`` and the recommendation printed (rank zero only).
"""

from __future__ import annotations

# lightning is this module's reason to exist: imported here, never by ``import mpscope``
from lightning.pytorch import Callback

from mpscope.integrations._common import CallbackState, finish, log_numbers
from mpscope.recorder import Recorder


class MPScopeCallback(CallbackState, Callback):
    """Record a Lightning fit; see the module docstring.

    Arguments and attributes: those of :class:`~mpscope.integrations._common.CallbackState`
    (``log=True`` sends the summary numbers to the trainer's loggers).
    """

    def __init__(self, every: int = 1, out=None, **options):
        super().__init__(every, out, **options)
        self._global_step = 0

    def on_fit_start(self, trainer, pl_module):
        optimizers = list(trainer.optimizers)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.recorder = Recorder(pl_module, optimizers[0] if optimizers else None, scaler, out=self.out, **self.options)
        self.recorder.attach()
        self.run = self.recorder.run
        self._ended_at, self._global_step = self.recorder.step_index, trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rec = self.recorder
        if rec is None or trainer.global_step == self._global_step:
            return  # accumulating: no optimizer step in this batch
        self._global_step = trainer.global_step
        if rec.attached and rec.step_index == self._ended_at:
            rec.step()  # the optimizer step ran no hook the recorder saw
        self._ended_at = rec.step_index
        if self.log and trainer.is_global_zero and trainer.loggers and trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            numbers = log_numbers(rec)
            for logger in trainer.loggers:
                logger.log_metrics(numbers, step=trainer.global_step)

    def on_fit_end(self, trainer, pl_module):
        self._finish(trainer)

    def on_exception(self, trainer, pl_module, exception):
        self._finish(trainer, exception)

    def _finish(self, trainer, error: BaseException | None = None) -> None:
        if self.recorder is None:
            return
        rec, self.recorder = self.recorder, None
        main = trainer.is_global_zero
        self.run, self.recommendation = finish(rec, self.show and main, error=error)
