"""Gradient hooks on activations: registered by the hundred per recorded step, removed together at its end.

:meth:`GradHooks.add` does what ``Tensor.register_hook`` does (PyTorch's ``torch/_tensor.py``: the
tensor's ``_backward_hooks`` dict, created on first use and registered with its ``grad_fn``, then
the hook under a fresh ``RemovableHandle`` id), without the ``RemovableHandle`` object and the
per-call import: about 1.2 µs instead of 2.4–3.5 µs per tensor on the benchmark CPU (hot caches, a
loop of either call). PyTorch runs such a hook exactly as one registered through
``register_hook``, in the same order with any other hook of the tensor. Tensor subclasses (a
``__torch_function__`` override may change ``register_hook``) and PyTorch builds without these
attributes go through ``register_hook`` itself.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch
from torch.utils.hooks import RemovableHandle

#: Hook ids taken from ``RemovableHandle.next_id`` at a time (each id is used once; a block left
#: over is never handed out again, as ids from ``register_hook`` are not).
ID_BLOCK = 1024

#: ``Tensor.register_hook``'s own bookkeeping is reachable (every PyTorch since 1.0 has it).
_DIRECT = hasattr(torch._C.TensorBase, "_backward_hooks")


class GradHooks:
    """The tensor gradient hooks a recording holds: :meth:`add` one, :meth:`clear` removes them all.

    ``entries`` (each hook: its tensor's hooks dict and id, or a ``RemovableHandle``), ``tags`` (id
    -> tag) and the ids ``next_id`` .. ``end_id`` left of the block taken are read and written by the
    kernel's C++ form of :meth:`add` too (``add_grad_hook`` in ``mpscope/_kernel.cpp``)."""

    def __init__(self) -> None:
        self.entries: list = []  # (the tensor's hooks dict, id), or a RemovableHandle
        self.tags: dict = {}  # id -> tag of the hooks added
        self.next_id = self.end_id = 0  # the ids left of the block taken from RemovableHandle

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, t: torch.Tensor, hook: Callable[[torch.Tensor], None], tag) -> bool:
        """Run ``hook(grad)`` when the gradient w.r.t. ``t`` is computed, as ``t.register_hook(hook)``
        would (``t`` requires grad; ``hook`` returns None: it reads the gradient, never replaces it),
        unless a hook added since the last :meth:`clear` under an equal ``tag`` is on ``t`` already
        (a leaf tensor keeps its hooks across a step's backward passes): then returns False."""
        hooks = t._backward_hooks
        if hooks is not None:
            tags = self.tags
            for hid in hooks:
                if tags.get(hid) == tag:
                    return False
        if t.__class__ is not torch.Tensor or not _DIRECT:
            h = t.register_hook(hook)
            self.entries.append(h)
            self.tags[h.id] = tag
            return True
        if hooks is None:
            hooks = t._backward_hooks = OrderedDict()
            fn = t.grad_fn
            if fn is not None:
                fn._register_hook_dict(t)
        hid = self.next_id
        if hid == self.end_id:
            # ids from the space register_hook uses (no clash with a user's hook), taken in blocks:
            # setting a class attribute per hook (it invalidates the type's attribute cache) costs about
            # 500 instructions
            hid = RemovableHandle.next_id
            RemovableHandle.next_id = self.end_id = hid + ID_BLOCK
        self.next_id = hid + 1
        hooks[hid] = hook
        self.tags[hid] = tag
        self.entries.append((hooks, hid))
        return True

    def clear(self) -> None:
        """Remove every hook added (a tensor still alive keeps no hook of this recording)."""
        for e in self.entries:
            if e.__class__ is tuple:
                e[0].pop(e[1], None)
            else:
                e.remove()
        self.entries.clear()
        self.tags.clear()
