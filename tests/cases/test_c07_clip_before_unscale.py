"""C07: clip_grad_norm_ called before scaler.unscale_ clips the scaled gradients."""

import math

import pytest

from . import scenarios as S
from .conftest import find


def test_c07_recorded_clip_norm_is_scale_times_true_norm():
    d = S.c07()
    bad, good = d.bad, d.good
    s = bad.run.steps
    assert s.clipped_before_unscale.all()  # every clip saw scaled gradients
    # where the gradients were finite, the norm the clip saw is loss_scale x the true norm
    finite = [(i, n) for i, n in enumerate(bad.norms) if math.isfinite(n)]
    i, n = finite[0]
    assert s.clip_norm.iloc[i] == n
    # both runs skipped the same overflowing steps before i, so their weights are equal at step i and
    # the clip-after-unscale run measured the true norm of the very same gradients
    assert bad.norms[:i] == good.norms[:i]
    assert n / s.loss_scale.iloc[i] == pytest.approx(good.norms[i], rel=1e-3)
    # the case's outcome: weights barely move and the loss stays high
    assert bad.moved < 1e-3 < 0.5 < good.moved
    assert bad.final_loss > 10 * good.final_loss


def test_c07_advice():
    rec = S.mpscope.advise(S.c07().bad.run)
    f = find(rec, "clip_before_unscale")[0]
    assert f.severity == "error" and "unscale_" in f.fix
    assert f.threshold == S.c07().bad.run.steps.loss_scale.iloc[int(f.step)]
    assert "unscale_" in rec.to_text()
