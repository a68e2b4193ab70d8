"""C16: GradScaler.scale without scaler.step / update: scaled gradients reach the optimizer."""

import math

import torch

from . import breadth as B
from .conftest import find


def test_c16_one_step_row_per_optimizer_step():
    d = B.c16()
    s = d.run.steps
    assert len(s) == d.optimizer_steps == 12 and list(s.step) == list(range(12))
    assert s.opt_scaled.all() and (s.loss_scale == 2.0**16).all() and not s.skipped.any()
    assert d.nan_weights > 0  # the optimizer applied 65536x too large gradients, unchecked


def test_c16_finding():
    rec = B.mpscope.advise(B.c16().run)
    f = find(rec, "amp_misuse")[0]
    assert (f.severity, f.step, f.value) == ("error", 0, 2.0**16)
    assert "scaler.step(optimizer)" in f.fix and "scaler.update()" in f.fix
    assert "12 of 12 steps" in f.message


def test_c16_second_member_unscale_then_optimizer_step():
    """The loop unscales and calls optimizer.step() itself, then update(): the scaler's inf check is
    ignored, so steps with inf gradients are applied (found_inf but not skipped)."""
    d = B.c16("unscale_then_step")
    s = d.run.steps
    assert len(s) == 12 and not s.opt_scaled.any()
    assert (s.found_inf & ~s.skipped).sum() >= 1 and d.nan_weights > 0
    rec = B.mpscope.advise(d.run)
    f = find(rec, "amp_misuse")[0]
    assert f.step == int(s.step[s.found_inf].iloc[0]) and f.value == float((s.found_inf & ~s.skipped).sum())
    assert "scaler.step(optimizer)" in f.fix
    # a loop that steps through the scaler gets no amp_misuse (oracle: the proper loop of C07)
    from . import scenarios as S

    assert not [x for x in B.mpscope.advise(S.c07().bad.run).findings if x.code == "amp_misuse"]
    assert math.isfinite(float(s.loss.iloc[0]))
