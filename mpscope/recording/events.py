"""The events a recording's collaborators send its core, in one place.

The core is three objects the :class:`~mpscope.recorder.Recorder` composes: the
:class:`~mpscope.recording.clock.StepClock` (step boundaries and the step's scalars), the
:class:`~mpscope.recording.passes.PassLedger` (which passes train the model) and the
:class:`~mpscope.recording.observer.Observer` (a tensor in a role becomes a row). Collaborators
hold one of them, typed by the protocols below, and call nothing else of it:

========================================  ==========================================  ===============================
event                                     sent by                                     received by
========================================  ==========================================  ===============================
the loss was scaled by the GradScaler     ``GradScaler.scale`` wrapper (patches)      ``LoopEvents.loss_scaled``
a GradScaler was used (``auto``)          ``GradScaler`` class wrappers (patches)     ``LoopEvents.scaler_used``
``scaler.step`` / ``unscale_`` begins     ``GradScaler`` wrappers (patches)           ``scaler_stepping``, ``unscaling``
``scaler.update`` begins / ended          ``GradScaler.update`` wrapper (patches)     ``update_began``, ``update_ended``
a backward began / ended                  ``Tensor.backward``, ``torch.autograd.      ``backward_began``, ``backward_ended``
                                          backward`` wrappers (patches)
gradients of the parameters were taken    ``torch.autograd.grad`` wrapper (patches)   ``backward_began``, ``gradients_taken``
a parameter got its gradient              post-accumulate-grad hooks (recorder)       ``parameter_gradient``
gradients are measured / clipped          ``clip_grad`` helper wrappers (patches)     ``clip_measuring``, ``clipped``
the optimizer stepped                     optimizer step hook (recorder)              ``optimizer_stepped``
the model's forward began / ended         root hooks (activations)                    ``ForwardEvents.forward_began``,
                                                                                      ``forward_ended``
a module ran outside the model's forward  module hooks (activations)                  ``module_pass``
a pass's output got a gradient hook       module hooks (activations)                  ``hooked``
a gradient reached a pass's output        gradient hooks (activations)                ``gradient_reached``
a tensor was observed in a role           module hooks, op recording, compiled        ``Observations.observe``
                                          regions, DDP local gradients
========================================  ==========================================  ===============================

Every sender runs its receiver's call through the recorder's ``guard(where, fn, *args)``, so an
error inside mpscope never reaches the training loop (it warns once, keeps the rows recorded so
far and detaches). The shadow pauses the hooks around mpscope's own forwards with the recorder's
``paused()``; the rank merge hands the merged Run back from ``RankMerge.close()``.

What the hooks read on every call is one object shared with the C++ path:
:class:`~mpscope.recording.hook_state.HookState`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LoopEvents(Protocol):
    """What the training loop's own calls tell the :class:`~mpscope.recording.clock.StepClock`."""

    attached: bool

    def loss_scaled(self, scaler, loss: torch.Tensor, scaled: torch.Tensor) -> None: ...

    def scaler_used(self, scaler, outputs=None) -> bool: ...

    def scaler_stepping(self, optimizer) -> None: ...

    def unscaling(self, scaler, optimizer) -> None: ...

    def update_began(self, scaler): ...

    def update_ended(self, pending) -> None: ...

    def backward_began(self, tensor: torch.Tensor) -> None: ...

    def backward_ended(self, tensor: torch.Tensor) -> None: ...

    def holds_parameters(self, tensors: list) -> bool: ...

    def gradients_taken(self, loss: torch.Tensor, inputs: list, grads) -> None: ...

    def parameter_gradient(self, param) -> None: ...

    def clip_measuring(self, grads: list, norm_type) -> None: ...

    def clipped(self, norm, accounted: bool = False) -> None: ...

    def optimizer_stepped(self, optimizer) -> None: ...


class ForwardEvents(Protocol):
    """What the model's hooks tell the :class:`~mpscope.recording.passes.PassLedger`, and the passes
    they ask it for."""

    def forward_began(self, grad_enabled: bool, task: int) -> None: ...

    def forward_ended(self, trains_nothing: bool) -> None: ...

    def gradient_reached(self, p, task: int): ...

    def hooked(self, p) -> None: ...

    def module_pass(self, grad_enabled: bool): ...

    def rerun_pass(self, task: int): ...

    def backward(self, task: int): ...


class Observations(Protocol):
    """What collaborators hand the :class:`~mpscope.recording.observer.Observer`."""

    def observe(self, module: str, role: str, name: str, tensor, scaled: bool = False, pass_id=None): ...
