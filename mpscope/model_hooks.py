"""Hooks on the recorded model that a copy of the model leaves behind.

PyTorch stores a module's forward hooks (and a parameter's gradient hooks) in dicts on the module,
so ``copy.deepcopy(model)`` (an EMA or best-model snapshot, a target network) copies them, and a
bound method copies its object: the whole recorder, which cannot be copied. ``torch.save(model)``
pickles them too. Every hook mpscope puts on the model is wrapped in :class:`ModelHook`, which a
deep copy and pickling turn into :func:`inert`: the copy is neither recorded nor broken, and the
original keeps its hooks.
"""

from __future__ import annotations

import functools


def inert(*args, **kwargs) -> None:
    """What a copied or unpickled mpscope hook does: nothing (returns None: no output replaced)."""
    return None


class ModelHook(functools.partial):
    """``ModelHook(fn)`` calls ``fn`` as a hook does (a ``functools.partial`` with nothing bound:
    one C-level call more); ``copy.deepcopy`` and pickling give :func:`inert` instead (both
    reduce an object the same way)."""

    def __reduce__(self):
        return _inert, ()


def _inert():
    """Rebuilds an unpickled :class:`ModelHook` (pickled by this name) as :func:`inert`."""
    return inert
