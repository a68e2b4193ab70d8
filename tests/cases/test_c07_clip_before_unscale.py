"""C07: clip_grad_norm_ called before scaler.unscale_ clips the scaled gradients."""

import math

from . import scenarios as S
from .conftest import find


def test_c07_recorded_clip_norm_is_scale_times_true_norm():
    d = S.c07()
    bad, good = d["bad"], d["good"]
    s = bad["run"].steps
    assert s.clip_scaled.all()  # every clip saw scaled gradients
    # where the gradients were finite, the norm the clip saw is loss_scale x the true norm
    finite = [(i, n) for i, n in enumerate(bad["norms"]) if math.isfinite(n)]
    i, n = finite[0]
    assert s.clip_norm.iloc[i] == n
    ratio = n / s.loss_scale.iloc[i]
    assert 0.5 < ratio / good["norms"][i] < 2.0  # same order as the true (unscaled) norm
    # the case's outcome: weights barely move and the loss stays high
    assert bad["moved"] < 1e-3 < 0.5 < good["moved"]
    assert bad["final_loss"] > 10 * good["final_loss"]


def test_c07_advice():
    rec = S.mpscope.advise(S.c07()["bad"]["run"])
    f = find(rec, "clip_before_unscale")[0]
    assert f.severity == "error" and "unscale_" in f.fix
    assert f.threshold == S.c07()["bad"]["run"].steps.loss_scale.iloc[int(f.step)]
    assert "unscale_" in rec.to_text()
