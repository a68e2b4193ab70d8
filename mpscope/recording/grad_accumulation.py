"""Exact evidence of gradient increments lost while they accumulate in a float16/bfloat16 ``.grad``.

With parameters kept in float16 or bfloat16 (a model cast with ``.half()`` / ``.to(torch.bfloat16)``),
``.grad`` is 16-bit too, and gradient accumulation (``backward()`` on several micro-batches before
``optimizer.step()``) adds each micro-batch's gradient into it in that dtype. An increment below half
an ulp of the running sum is lost entirely (``acc + g == acc`` while ``g != 0``: swamping), and every
add rounds the rest to 8 (bfloat16) or 11 (float16) significant bits.

:class:`GradAccumulationProbe` measures that exactly. A tensor hook on each 16-bit parameter sees
the incoming gradient ``g`` *before* PyTorch's ``AccumulateGrad`` adds it to ``.grad``; when a
``.grad`` already exists the hook computes, with device ops only (no host sync), ``acc + g`` in the
gradient's dtype (the same add, so the same rounding, as the accumulation), and counts the non-zero
increments, the swamped ones, their |g| sums and the |g| the add rounded away. Per recorded step
and parameter the counts become one row of ``run.tables["grad_accumulation"]``
(:data:`mpscope.schema.GRAD_ACCUMULATION_COLUMNS`), copied to the host once per step (non-blocking
into pinned memory on CUDA). The hook returns nothing, so the gradient PyTorch accumulates is
untouched; float32 parameters (the usual autocast set-up) get no hook and cost nothing.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import pandas as pd
import torch

from mpscope.formats import dtype_name
from mpscope.model_hooks import ModelHook
from mpscope.stats import to_host_async
from mpscope.schema import GRAD_ACCUMULATION_COLUMNS

LOW = (torch.float16, torch.bfloat16)
#: Device accumulator layout per parameter: micro_batches, increments, swamped, increment_abs,
#: swamped_abs, rounded_abs (float64).
_SLOTS = 6


class GradAccumulationProbe:
    """Swamping counts for the 16-bit parameters of one recording.

    Args:
        params: ``(module, name, parameter)`` for each parameter to watch; only float16/bfloat16
            ones that require grad are hooked.
        recording: callable returning True while the current step is recorded.
        safe: ``safe(where, fn, *args)`` runs a hook body so that an error never reaches training.
    """

    def __init__(self, params: Iterable[tuple[str, str, torch.nn.Parameter]], recording: Callable[[], bool],
                 safe: Callable):
        self._recording = recording
        self._safe = safe
        self._handles: list = []
        self._keys: list[tuple[str, str, str]] = []  # (module, name, dtype) per watched parameter
        self._acc: dict[int, torch.Tensor] = {}  # index into _keys -> this step's device counts
        self._pending: list = []  # (step, indices, host tensor, event or None)
        self._frames: list[pd.DataFrame] = []
        for module, name, p in params:
            if p.dtype in LOW and p.requires_grad:
                i = len(self._keys)
                self._keys.append((module, name, dtype_name(p.dtype)))
                self._handles.append(p.register_hook(ModelHook(self._hook(i, p))))

    @property
    def active(self) -> bool:
        """True when some parameter is watched."""
        return bool(self._handles)

    def _hook(self, i: int, p: torch.nn.Parameter):
        def hook(g: torch.Tensor) -> None:
            if self._recording() and p.grad is not None:
                self._safe("gradient accumulation hook", self._measure, i, p.grad, g)
        return hook

    def _measure(self, i: int, acc: torch.Tensor, g: torch.Tensor) -> None:
        if acc.dtype not in LOW or g.dtype != acc.dtype or acc.is_sparse or g.is_sparse or acc.shape != g.shape:
            return
        with torch.no_grad():
            new = acc + g  # the accumulation's own add, in the gradient's dtype
            nz = g != 0
            swamped = (new == acc) & nz
            # float32 holds every 16-bit value and (up to exponent gaps above 16) their exact sum;
            # sums over elements are taken in float64
            g32 = g.abs().float()
            rounded = (new.float() - acc.float() - g.float()).abs()
            vals = torch.stack([
                torch.ones((), dtype=torch.float64, device=g.device),
                nz.sum().to(torch.float64),
                swamped.sum().to(torch.float64),
                g32.sum(dtype=torch.float64),
                torch.where(swamped, g32, 0.0).sum(dtype=torch.float64),
                torch.where(torch.isfinite(rounded), rounded, 0.0).sum(dtype=torch.float64),
            ])
        slot = self._acc.get(i)
        if slot is None:
            self._acc[i] = vals
        else:
            slot.add_(vals)

    def on_step_end(self, step: int) -> None:
        """Close step ``step``: start the host copy of its counts (one transfer)."""
        if not self._acc:
            return
        idx = sorted(self._acc)
        packed = torch.stack([self._acc[i] for i in idx])
        self._acc = {}
        host, event = to_host_async(packed)
        self._pending.append((step, idx, host, event))

    def close(self) -> pd.DataFrame:
        """Remove the hooks and return every step's rows (:data:`GRAD_ACCUMULATION_COLUMNS`)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        rows = []
        for step, idx, host, event in self._pending:
            if event is not None:
                event.synchronize()
            vals = host.numpy()
            for i, v in zip(idx, vals):
                module, name, dtype = self._keys[i]
                rows.append((step, module, name, dtype, int(v[0]), int(v[1]), int(v[2]), float(v[3]), float(v[4]),
                             float(v[5])))
        self._pending = []
        frame = pd.DataFrame(rows, columns=GRAD_ACCUMULATION_COLUMNS)
        return frame.astype({"step": np.int64, "micro_batches": np.int64, "increments": np.int64,
                             "swamped": np.int64})
