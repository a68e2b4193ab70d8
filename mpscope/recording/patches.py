"""The PyTorch entry points a recorder replaces while it is attached, and how they are put back.

* ``GradScaler``: ``scale`` / ``update`` (and ``step``, while the optimizer is still to be adopted)
  of the scaler the recording uses, on the instance; with ``auto`` and no scaler yet, ``scale`` /
  ``update`` on the class until the recorded code uses an enabled one.
* ``torch.Tensor.backward``, ``torch.autograd.backward`` and ``torch.autograd.grad``.
* The ``torch.nn.utils.clip_grad`` helpers every clip looks up when it runs (:data:`CLIP_HELPERS`).

Each wrapper calls the original and tells the recording's step clock
(:class:`~mpscope.recording.events.LoopEvents`), each call run through the recorder's ``guard`` so
a recorder error never reaches the training loop. Every replacement is a
:class:`_Patch` in the process-wide list ``_LIVE``; :meth:`PatchSet.restore` puts the originals back
in any order of exit among recorders and ``mpscope.apply`` blocks (which replace through a
:class:`PatchSet` too).
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn.utils.clip_grad as cg
from torch.amp import GradScaler

from mpscope.recording.events import LoopEvents

#: The ``torch.nn.utils.clip_grad`` helpers that the recorder replaces (module globals).
CLIP_HELPERS = ("_get_total_norm", "_clip_grads_with_norm_", "_group_tensors_by_device_and_dtype")

_MISSING = object()


def _code(fn):
    """The code object of ``fn`` below its decorators (``__wrapped__``), or None."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return getattr(fn, "__code__", None)


class _Patch:
    __slots__ = ("obj", "attr", "original", "new")

    def __init__(self, obj, attr, original, new):
        self.obj, self.attr, self.original, self.new = obj, attr, original, new


#: Every mpscope patch in place in this process, oldest first (across recorders).
_LIVE: list[_Patch] = []


def _restore(saved: list[_Patch]) -> None:
    """Put every original back, last patch first. A patch another one was stacked on since is
    spliced out instead: the later patch will restore this one's original."""
    for p in reversed(saved):
        if p in _LIVE:
            _LIVE.remove(p)
        if p.obj.__dict__.get(p.attr, _MISSING) is p.new:
            if p.original is _MISSING:
                try:
                    delattr(p.obj, p.attr)
                except AttributeError:
                    pass
            else:
                setattr(p.obj, p.attr, p.original)
            continue
        for q in _LIVE:
            if q.obj is p.obj and q.attr == p.attr and q.original is p.new:
                q.original = p.original
    saved.clear()


def objective(tensors, grad_tensors=None):
    """The loss a backward of ``tensors`` with ``grad_tensors`` minimises, as autograd defines it:
    the tensor itself for one tensor without a gradient (so a GradScaler's output is matched by
    identity); else the sum of ``g * t`` over the one-element floating ones (``g`` = 1 where not
    given), detached, computed on the device (no host sync); None when there is none."""
    ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if grad_tensors is None or isinstance(grad_tensors, torch.Tensor) and len(ts) > 1:
        gs = [None] * len(ts)
    else:
        gs = [grad_tensors] if isinstance(grad_tensors, torch.Tensor) else list(grad_tensors)
    if len(ts) == 1 and gs[0] is None:
        return ts[0]
    parts = [t.detach().reshape(()) * (1 if g is None else g.detach().reshape(()))
             for t, g in zip(ts, gs) if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()
             and (g is None or isinstance(g, torch.Tensor) and g.numel() == 1)]
    return sum(parts[1:], parts[0]) if parts else None


def stage_unscaled(state) -> bool:
    """True when one optimizer's GradScaler state (``scaler._per_optimizer_states[id(opt)]``, or
    None) says its gradients were unscaled (``unscale_`` or ``step`` ran this step)."""
    return state is not None and getattr(state.get("stage"), "name", str(state.get("stage"))) != "READY"


def unscaled(scaler) -> bool:
    """True once the GradScaler has unscaled some optimizer's grads in this step (unscale_ or step)."""
    return any(stage_unscaled(st) for st in getattr(scaler, "_per_optimizer_states", {}).values())


class PatchSet:
    """Attributes one owner (a recorder, an ``mpscope.apply`` block) replaced, and how they are put
    back: :meth:`restore` works in any order of exit among every set of the process (see
    :func:`_restore`), so no exit order leaves an attribute replaced."""

    def __init__(self) -> None:
        self._saved: list[_Patch] = []

    def replace(self, obj, attr: str, new) -> None:
        """Set ``obj.attr = new``, remembering what ``obj`` itself held (or that it held nothing)."""
        p = _Patch(obj, attr, obj.__dict__.get(attr, _MISSING), new)
        self._saved.append(p)
        _LIVE.append(p)
        setattr(obj, attr, new)

    def restore(self) -> None:
        """Put back everything this set replaced; safe to call twice."""
        _restore(self._saved)


def live() -> list[tuple[object, str]]:
    """``(obj, attr)`` of every replacement of any :class:`PatchSet` still in place in this process."""
    return [(p.obj, p.attr) for p in _LIVE]


def _unwrapped(fn):
    """``fn`` without the class-level wrappers of every recorder watching GradScaler
    (:meth:`Patches.watch_scalers`, each holding the one below as ``__mpscope_orig__``)."""
    while hasattr(fn, "__mpscope_orig__"):
        fn = fn.__mpscope_orig__
    return fn


class Patches(PatchSet):
    """The replacements one recorder made. ``loop``: the :class:`~mpscope.recording.events.LoopEvents`
    the wrappers report to (while ``loop.attached``); ``guard(where, fn, *args)``: runs each report."""

    def __init__(self, loop: LoopEvents, guard: Callable) -> None:
        super().__init__()
        self.loop = loop
        self.guard = guard

    def scaler(self, scaler, adopt_optimizer: bool) -> None:
        """Wrap ``scaler.scale`` (the loss and the scale of the step) and ``scaler.update`` (the
        step ends before the original ``update()``, ``scale_after`` is read after it) on the
        instance; ``scaler.step`` too when ``adopt_optimizer`` (a skipped step runs no
        ``optimizer.step()`` whose hook could adopt it)."""
        loop, guard = self.loop, self.guard
        cls = type(scaler)
        orig_scale = _unwrapped(cls.scale).__get__(scaler)
        orig_update = _unwrapped(cls.update).__get__(scaler)
        orig_step = cls.step.__get__(scaler)
        orig_unscale = cls.unscale_.__get__(scaler)

        def unscale_(optimizer):
            # before the original: the gradients as the clip (or any other in-place change) left them
            if loop.attached:
                guard("GradScaler.unscale_", loop.unscaling, scaler, optimizer)
            return orig_unscale(optimizer)

        def step(optimizer, *args, **kwargs):
            if loop.attached:
                guard("GradScaler.step", loop.scaler_stepping, optimizer)
            return orig_step(optimizer, *args, **kwargs)

        def scale(outputs):
            out = orig_scale(outputs)
            if isinstance(outputs, torch.Tensor) and loop.attached:
                guard("GradScaler.scale", loop.loss_scaled, scaler, outputs, out)
            return out

        def update(new_scale=None):
            if not loop.attached:
                return orig_update(new_scale)
            # before update() resets the scaler's per-optimizer state
            pending = guard("GradScaler.update", loop.update_began, scaler)
            result = orig_update(new_scale)  # a recorder error never stops the update itself
            if pending is not None and loop.attached:
                guard("GradScaler.update", loop.update_ended, pending)
            return result

        self.replace(scaler, "scale", scale)
        self.replace(scaler, "update", update)
        self.replace(scaler, "unscale_", unscale_)  # scaler.step calls it through the instance too
        if adopt_optimizer:
            self.replace(scaler, "step", step)

    def watch_scalers(self) -> None:
        """(``auto``) Wrap GradScaler's class methods until the recorded code uses a scaler:
        ``loop.scaler_used(scaler, outputs)`` says whether it is the recorded one (its instance
        wrappers then take the call); ``outputs`` is what ``scale`` was given (None for ``update``)."""
        loop, guard = self.loop, self.guard
        orig_scale, orig_update = GradScaler.scale, GradScaler.update

        def scale(s, outputs):
            used = guard("GradScaler.scale", loop.scaler_used, s, outputs)
            return s.scale(outputs) if used else orig_scale(s, outputs)

        def update(s, new_scale=None):
            return s.update(new_scale) if guard("GradScaler.update", loop.scaler_used, s) else orig_update(s, new_scale)

        scale.__mpscope_orig__, update.__mpscope_orig__ = orig_scale, orig_update

        self.replace(GradScaler, "scale", scale)
        self.replace(GradScaler, "update", update)

    def backward(self) -> None:
        """Wrap ``torch.Tensor.backward``, ``torch.autograd.backward`` and ``torch.autograd.grad``:
        the clock is told before and after, with the loss that was backpropagated (see
        :func:`objective`; the parameters' gradient hooks say in between whether a backward trained
        the model). ``grad`` fires no such hook: it is told only when its ``inputs`` hold a parameter
        of the model, with the gradients it returned (the clock sees at the step's end whether the
        loop made them the parameters' ``.grad``). A call from inside another (``Tensor.backward``
        calls ``torch.autograd.backward``) is not told twice."""
        loop, guard = self.loop, self.guard
        orig_tensor, orig_backward, orig_grad = torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad
        inside = []

        def told(where, loss, run, ended):
            if inside or not loop.attached:
                return run()
            inside.append(True)
            try:
                guard(where, loop.backward_began, loss)
                result = run()
                guard(where, ended, loss)
                return result
            finally:
                inside.pop()

        def backward(tensor, *args, **kwargs):
            return told("Tensor.backward", tensor, lambda: orig_tensor(tensor, *args, **kwargs), loop.backward_ended)

        def autograd_backward(tensors, grad_tensors=None, *args, **kwargs):
            return told("torch.autograd.backward", objective(tensors, grad_tensors),
                        lambda: orig_backward(tensors, grad_tensors, *args, **kwargs), loop.backward_ended)

        def autograd_grad(outputs, inputs, grad_outputs=None, *args, **kwargs):
            if not isinstance(inputs, torch.Tensor):
                inputs = list(inputs)  # (a generator is read once)
            listed = [inputs] if isinstance(inputs, torch.Tensor) else inputs
            if inside or not loop.attached or not guard("torch.autograd.grad", loop.holds_parameters, listed):
                return orig_grad(outputs, inputs, grad_outputs, *args, **kwargs)  # (e.g. torch.func's own)
            grads = []
            told("torch.autograd.grad", objective(outputs, grad_outputs),
                 lambda: grads.append(orig_grad(outputs, inputs, grad_outputs, *args, **kwargs)),
                 lambda loss: loop.gradients_taken(loss, listed, grads[0]))
            return grads[0]

        for name, new, orig in (("backward", autograd_backward, orig_backward), ("grad", autograd_grad, orig_grad)):
            new.__doc__, new.__wrapped__ = orig.__doc__, orig
            self.replace(torch.autograd, name, new)
        backward.__doc__ = orig_tensor.__doc__
        self.replace(torch.Tensor, "backward", backward)

    def clip(self) -> None:
        """Observe gradient clipping through the helpers ``torch.nn.utils.clip_grad`` looks up at
        every clip, so a clip function imported under any name (``from torch.nn.utils import
        clip_grad_norm_`` binds it before any patch) is seen: ``_get_total_norm`` (the gradients
        ``clip_grad_norm_`` measures), ``_clip_grads_with_norm_`` (it clips; its total norm) and
        ``_group_tensors_by_device_and_dtype`` when ``clip_grad_value_`` calls it (it clamps)."""
        loop, guard = self.loop, self.guard
        orig_total, orig_clip, orig_group = (getattr(cg, n) for n in CLIP_HELPERS)

        def total_norm(tensors, *args, **kwargs):
            if loop.attached:
                tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
                loop.clip_measuring(tensors, kwargs.get("norm_type", args[0] if args else 2.0))
            return orig_total(tensors, *args, **kwargs)

        inside = []  # clip_with_norm calls in progress

        def clip_with_norm(parameters, max_norm, total_norm, *args, **kwargs):
            # a clip that itself accounts for the loss scale (mpscope.apply's) is not "before unscale_"
            accounts = getattr(orig_clip, "accounts_for_loss_scale", None)
            accounted = bool(accounts and accounts())
            inside.append(True)
            try:
                result = orig_clip(parameters, max_norm, total_norm, *args, **kwargs)
            finally:
                inside.pop()
            if loop.attached:
                guard("clip_grad_norm_", loop.clipped, total_norm, accounted)
            return result

        def group(*args, **kwargs):
            # clip_grad_value_ itself groups the gradients it clamps (the norm helpers group too);
            # so does the original _clip_grads_with_norm_ when reached under another name
            # (torch.nn.utils.clip_grads_with_norm_ is that function object): its total norm is a local
            if loop.attached:
                caller = sys._getframe(1)
                if caller.f_code.co_name == "clip_grad_value_":
                    guard("clip_grad_value_", loop.clipped, None)
                elif caller.f_code is _code(orig_clip) and not inside:
                    guard("clip_grads_with_norm_", loop.clipped, caller.f_locals.get("total_norm"))
            return orig_group(*args, **kwargs)

        for name, new, orig in zip(CLIP_HELPERS, (total_norm, clip_with_norm, group), (orig_total, orig_clip, orig_group)):
            new.__wrapped__ = orig
            self.replace(cg, name, new)
