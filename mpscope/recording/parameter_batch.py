"""The tensors a recorded step's end observes in one batch, and the plan that batch keeps between steps.

When a recorded step ends the recorder observes, per selected parameter in module order, its
gradient (when ``.grad`` is set), the parameter itself and its optimizer state tensors (those with
at least one dimension, the ``step`` counter left out): a few hundred tensors on a transformer,
whose keys, dtypes, sizes and batch split are the same from one step to the next. Working them out
per tensor costs several microseconds of Python each, which on a GPU (where a tensor's statistics
take microseconds) would cost more than the statistics themselves.

:func:`gather` lists those tensors in row order with the form they came in (which gradients are
set, which optimizer state keys are taken). :class:`ParameterPlan` keeps what the recorder worked
out from them the last time: each batch's rows (keys, element counts, dtype names) and how its
statistics were taken (the fused CPU kernel into the step's host rows, or one
:func:`mpscope.stats.device_stats` pass, the path of CUDA tensors). A later step reuses it when it
still holds: the same parameter list, the same form, the same way of taking statistics, and every
tensor of the same class, dtype, shape, layout and device (a parameter cast in place,
``module.to(torch.bfloat16)``, keeps its object but changes its dtype; a gradient set to None
changes the form; the optimizer's first step adds its state). It is checked on every use, about a
quarter of a microsecond per tensor in Python, about 15 ns by the fused kernel's ``same_looks``;
where it does not hold the recorder takes its general path and makes a new plan.
"""

from __future__ import annotations

from collections import defaultdict
from operator import attrgetter

import numpy as np
import torch
from torch import Tensor

from mpscope.stats import zeros_of

#: What a tensor's rows depend on besides its values (its key holds the dtype name; the kernel takes
#: CPU strided tensors of a plain tensor class; batches are per device; the element count follows
#: from the shape).
_LOOKS = attrgetter("__class__", "dtype", "shape", "layout", "device")
_PLAIN = (torch.Tensor, torch.nn.Parameter)

#: The kinds of optimizer ``state`` the kernel's ``gather`` reads as the Python form does (``get`` is
#: dict's own: torch.optim's defaultdict); a subclass that may override ``get`` takes the Python form.
_STATE_KINDS = (dict, defaultdict)

#: Marks in a batch's form: a parameter whose gradient is taken / not taken.
WITH_GRAD, NO_GRAD = object(), object()


def gather(params: list[tuple], want_grad: bool, want_weight: bool, state, kernel=None) -> tuple[list[torch.Tensor], list]:
    """The tensors of the step end's batch, in row order, and their form.

    ``params``: ``(module, parameter name, parameter)`` triples; ``state``: the optimizer's
    ``state`` (parameter -> dict) or an empty dict. Per parameter: its ``.grad`` (``want_grad``,
    when set), the parameter (``want_weight``), then its optimizer state tensors with at least one
    dimension in the state dict's order, ``step`` left out. A gradient that is an efficient zero
    tensor (no data) is taken as the zeros it stands for (:func:`mpscope.stats.zeros_of`). Returns ``(tensors, form)``; ``form``
    holds per parameter :data:`WITH_GRAD` or :data:`NO_GRAD` followed by the state keys taken.
    With ``kernel`` (the fused kernel's module, loaded) its ``gather`` makes the same lists (for a
    ``params`` list and a ``state`` dict or defaultdict whose per-parameter states are plain dicts).
    """
    if kernel is not None and params.__class__ is list and state.__class__ in _STATE_KINDS:
        got = kernel.gather(params, want_grad, want_weight, state, WITH_GRAD, NO_GRAD)
        if got is not None:  # (None: a parameter's state that is not a plain dict, taken below)
            return got
    tensors, form = [], []
    add, mark, get = tensors.append, form.append, state.get
    for _, _, p in params:
        g = p.grad if want_grad else None
        if g is None:
            mark(NO_GRAD)
        else:
            mark(WITH_GRAD)
            z = zeros_of(g)  # (an efficient zero tensor's values: zeros)
            add(g if z is None else z)
        if want_weight:
            add(p)
        st = get(p)
        if st:
            for k, v in st.items():
                if k != "step" and isinstance(v, Tensor) and v.dim():
                    add(v)
                    mark(k)
    return tensors, form


def items(params: list[tuple], form: list, tensors: list[torch.Tensor], want_weight: bool,
          scaled: bool) -> list[tuple[str, str, str, torch.Tensor, bool]]:
    """``(module, role, name, tensor, scaled)`` of each of ``tensors`` (:func:`gather` of ``params``
    with ``form``): roles ``param_grad`` (``scaled``: multiplied by the loss scale), ``weight`` and
    ``optimizer_state`` (named ``<parameter>.<state key>``)."""
    out, it, pit = [], iter(tensors), iter(params)
    for f in form:
        if f is WITH_GRAD or f is NO_GRAD:
            name, pname, _ = next(pit)
            if f is WITH_GRAD:
                out.append((name, "param_grad", pname, next(it), scaled))
            if want_weight:
                out.append((name, "weight", pname, next(it), False))
        else:
            out.append((name, "optimizer_state", f"{pname}.{f}", next(it), False))
    return out


class ParameterPlan:
    """The step end's batch as the recorder last observed it: the same calls, without working them out.

    ``batches``: ``(start, end, keys, numels, dtypes, grads, unscaled, fused)`` per statistics call,
    in row order: the call takes ``tensors[start:end]`` of :func:`gather`; ``keys`` and ``numels``
    are int64 arrays (the host copy takes them as they are, no conversion per step); ``grads[i]`` is
    True for a gradient (its rows are scaled by the loss scale while the GradScaler has not unscaled
    it), a bool array, and ``unscaled`` the same length of False (the flags once unscaled);
    ``fused``: through the fused CPU kernel into the step's host rows, else one
    :func:`mpscope.stats.device_stats` pass. ``rows``: whether the host rows were there.
    """

    __slots__ = ("params", "form", "looks", "batches", "rows")

    def __init__(self, params: list[tuple], form: list, looks: list, batches: list[tuple], rows: bool) -> None:
        self.params, self.form, self.looks, self.batches, self.rows = params, form, looks, batches, rows

    @classmethod
    def make(cls, params: list[tuple], form: list, batch: list[tuple], observations: list,
             rows: bool) -> ParameterPlan | None:
        """The plan of the batch ``batch`` (:func:`items`) whose observations (the step buffer's,
        made by the recorder's general path, in order; ``rows``: with the step's host rows there)
        are ``observations``; None unless each tensor was measured as itself, on one device (a
        tensor subclass such as a DTensor, an unmeasurable tensor or tensors on several devices
        take the general path on every step)."""
        if sum(len(o.keys) for o in observations) != len(batch):
            return None
        looks = [_LOOKS(b[3]) for b in batch]
        if any(look[0] not in _PLAIN for look in looks) or len({look[4] for look in looks}) > 1:
            return None
        grads = [b[1] == "param_grad" for b in batch]
        batches, start = [], 0
        for o in observations:
            end = start + len(o.keys)
            batches.append((start, end, np.asarray(o.keys, dtype=np.int64), np.asarray(o.numels, dtype=np.int64),
                            o.dtypes, np.asarray(grads[start:end], dtype=bool), np.zeros(end - start, dtype=bool),
                            o.row is not None))
            start = end
        return cls(params, form, looks, batches, rows)

    def holds(self, params: list[tuple], form: list, tensors: list[torch.Tensor], rows: bool, kernel=None) -> bool:
        """Whether ``tensors`` (:func:`gather` of ``params`` with ``form``; ``rows``: the step's host
        rows are there) get the rows of this plan, by the same calls. With ``kernel`` (the fused
        kernel's module, loaded) its ``same_looks`` compares the tensors' looks: the same answer
        without making a tuple, a ``torch.Size`` and a ``torch.device`` per tensor."""
        if params is not self.params or form != self.form or rows is not self.rows:
            return False
        try:
            if kernel is not None:
                return kernel.same_looks(tensors, self.looks)
            return list(map(_LOOKS, tensors)) == self.looks
        except RuntimeError:  # a strided nested tensor has no shape (a subclass's sizes may raise)
            return False
