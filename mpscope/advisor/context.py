"""The frames and metadata of one run that every detector reads (computed once per ``advise()``)."""

from __future__ import annotations

from typing import Any

from mpscope.advisor import _frames
from mpscope.advisor.op_precision import pole_only_steps


class Context:
    """Frames and metadata the detectors share (computed once per advise())."""

    def __init__(self, run: Any):
        self.run = run
        self.t = _frames.tensors(run)
        self.s = _frames.steps(run)
        self.meta = _frames.meta(run)
        self.types = _frames.module_types(run)
        self.autocast = _frames.autocast_dtype(run)
        self.device = _frames.device_type(run)
        self.t["_nonfinite"] = (self.t.nan_count + self.t.inf_count) > 0
        self.n_steps = int(len(self.s)) if len(self.s) else int(self.t.step.nunique())
        sc = self.meta.get("scaler") or None
        self.scaler = sc if sc and sc.get("enabled", True) else None
        #: steps whose forward inf/NaN came from poles only (op-level evidence): not overflows
        self.pole_steps = pole_only_steps(run)
        self.uses_scaler = self.scaler is not None or bool((self.s.loss_scale != 1.0).any()) if len(self.s) else False

    @property
    def fp16_run(self) -> bool:
        return self.autocast == "float16" or bool((self.t.dtype == "float16").any())

    def handled_steps(self) -> set:
        """Steps whose non-finite gradients the GradScaler caught and skipped (normal operation)."""
        if not self.uses_scaler or self.s.empty:
            return set()
        return set(self.s.step[self.s.found_inf & self.s.skipped].tolist())
