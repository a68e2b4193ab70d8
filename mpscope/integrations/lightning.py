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
  the module, every optimizer in ``trainer.optimizers`` (the ``torch.optim.Optimizer`` itself; the
  first is ``run.meta["optimizer"]``) and the precision plugin's GradScaler
  (``trainer.precision_plugin.scaler``: present for ``"16-mixed"``, None for ``"bf16-mixed"`` and
  32-bit).
* Steps: one per training batch in which an optimizer of the module stepped, in every mode:
  automatic optimization, ``accumulate_grad_batches`` (the batches up to the optimizer step make
  one step), and manual optimization (``self.automatic_optimization = False``) with one or several
  optimizers, each stepped any number of times per batch or every few batches. A step ends at
  ``on_train_batch_end`` of a batch in which ``trainer.global_step`` moved (Lightning counts every
  optimizer step there, so in manual optimization with two optimizers stepped per batch
  ``global_step`` is twice the step index); ``optimizer.step()`` and ``GradScaler.update()`` end no
  step (:meth:`mpscope.Recorder.hold_steps`). So a step holds every forward, backward and
  optimizer step of its batches: a GAN's generator and discriminator updates are one step, one row
  per training iteration as the user counts them, and a forward stays in the step of the backward
  that trained it (a generator's output made before the discriminator's step and backpropagated
  after it). (Lightning 2.x takes several optimizers in manual optimization only.)
* ``loss``: the losses backpropagated in the step, summed (the micro-batches' under accumulation;
  the generator's and the discriminator's in a GAN); ``backward_count``: those backward passes;
  ``loss_scale``: the scale when the step's first loss was scaled, ``scale_after``: the scale at
  its end (an update within the step, a GAN generator's skipped step, changes the scale its later
  backward passes use: their ``activation_grad`` rows carry the step's ``loss_scale`` all the same).
* Gradients (``param_grad``) are read in ``on_before_optimizer_step`` of each optimizer step, as
  backward left them (with a GradScaler, unscaled by Lightning: rows carry ``loss_scale`` 1.0;
  before Lightning's own ``gradient_clip_val`` clipping, whose norm is the step's ``clip_norm``),
  one row per parameter of the stepping optimizer: a step holds every gradient of its batch,
  whatever the loop does with ``.grad`` afterwards (``opt.zero_grad()`` right after ``opt.step()``).
  A parameter stepped twice in one step (an optimizer stepped twice per batch) has its two gradients
  merged into one row (element counts added), as any tensor seen twice in a step. Weights and every
  optimizer's state are read at the step's end.
* Skipped steps: some optimizer step of the batch did not happen (the GradScaler found inf/NaN
  gradients for it); ``found_inf``: some update of the step found inf/NaN gradients.
* The autocast Lightning's precision plugin enters around ``training_step`` is recorded.
* Each time ``trainer.global_step`` passes a multiple of ``trainer.log_every_n_steps``, a few numbers
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
        rec = self.recorder = Recorder(pl_module, optimizers[0] if optimizers else None, scaler, out=self.out,
                                       **self.options)
        rec.attach()
        rec.hold_steps(optimizers)  # steps end at on_train_batch_end
        self.run = rec.run
        self._global_step = trainer.global_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.recorder is not None:
            self.recorder.before_optimizer_step(optimizer)  # its gradients, as this step uses them

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rec = self.recorder
        if rec is None or trainer.global_step == self._global_step:
            return  # accumulating: no optimizer step in this batch
        before, self._global_step = self._global_step, trainer.global_step
        if rec.attached:
            rec.step()
        every = max(1, trainer.log_every_n_steps)
        if self.log and trainer.is_global_zero and trainer.loggers and before // every != trainer.global_step // every:
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
