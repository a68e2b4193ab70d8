"""What op recording knows of a tensor during one step, by the tensor's identity.

An id counts only while its weak reference still points at that tensor: ids of dead tensors are
reused. A view takes its base's marks (it shares its memory).
"""

from __future__ import annotations

import weakref

import torch


class TensorMarks:
    """Per tensor of the step: its stats (``ds``: a :class:`~mpscope.stats.DeviceStats`, one row),
    whether an ``op_output`` row of this step shows its values (``rowed``), the seq of the
    low-precision cast of non-integer data its values come from (``taint``), the pass of the model it
    is an output of (``passes``: a :class:`~mpscope.recording.passes.Pass`, or None for the model's
    values of no pass), and the autocast weight cast it is (``casts``: ``(pass, module, id)``)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """A step begins: nothing is known."""
        self.refs: dict[int, weakref.ref] = {}
        self.ds: dict = {}
        self.rowed: set[int] = set()
        self.taint: dict[int, int] = {}
        self.tainted = False  # some tensor carries a taint this step
        self.passes: dict[int, object] = {}
        self.casts: dict = {}

    def known(self, t: torch.Tensor) -> int | None:
        """``id(t)`` when ``t`` has an entry this step, else None."""
        i = id(t)
        r = self.refs.get(i)
        return i if r is not None and r() is t else None

    def claim(self, t: torch.Tensor) -> int:
        """``id(t)``, with an entry for ``t`` this step (a dead tensor's entry under that id dropped)."""
        i = id(t)
        r = self.refs.get(i)
        if r is None or r() is not t:
            if r is not None:
                self.ds.pop(i, None)
                self.rowed.discard(i)
                self.taint.pop(i, None)
                self.passes.pop(i, None)
                self.casts.pop(i, None)
            self.refs[i] = weakref.ref(t)
        return i

    def alive(self, i: int):
        """The tensor of entry ``i`` if it is still alive, else None."""
        r = self.refs.get(i)
        return r() if r is not None else None

    def view(self, base: torch.Tensor, out: torch.Tensor) -> "tuple | None":
        """``out`` is a view of ``base``: it takes ``base``'s marks. Returns ``base``'s cast entry
        (None if it is none)."""
        i = id(base)
        r = self.refs.get(i)
        if r is None or r() is not base:
            return None
        ds, rowed, src, cast = self.ds.get(i), i in self.rowed, self.taint.get(i), self.casts.get(i)
        has_pass = i in self.passes
        if ds is None and not rowed and src is None and not has_pass and cast is None:
            return None
        j = self.claim(out)
        if cast is not None:  # (a weight cast's transpose, as Linear uses it)
            self.casts[j] = cast
        if ds is not None:
            self.ds[j] = ds
        if rowed:
            self.rowed.add(j)
        if src is not None:
            self.taint[j] = src
        if has_pass:
            self.passes[j] = self.passes[i]
        return cast
