"""C13: clip_grad_norm_ over finite float16 gradients returns inf; the clip zeroes every gradient."""

import math

import pytest
import torch

from . import breadth as B
from .conftest import find

FP16_MAX = torch.finfo(torch.float16).max


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_c13_the_norm_overflows_although_every_gradient_is_finite(kind):
    d = B.c13(kind)
    # the oracle: the same gradients in float64, and the clip's own return value
    assert all(math.isinf(n) for n in d.norms)
    assert all(FP16_MAX < n < 1e7 for n in d.fp32_norm) and max(d.grad_absmax) < FP16_MAX
    assert d.moved == 0  # the weights never move
    s = d.run.steps
    assert len(s) == 12 and s.clip_norm.map(math.isinf).all()
    assert s.clip_norm_fp32.to_numpy() == pytest.approx(d.fp32_norm, rel=1e-3)
    assert list(s.clip_grad_absmax) == d.grad_absmax


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_c13_finding_and_recommendation(kind):
    d = B.c13(kind)
    rec = B.mpscope.advise(d.run)
    f = find(rec, "grad_norm_overflow")[0]
    assert (f.severity, f.step, f.role) == ("error", 0, "param_grad")
    assert f.value == pytest.approx(d.fp32_norm[0], rel=1e-3) and f.threshold == FP16_MAX
    assert "float32" in f.fix and "autocast" in f.fix
    codes = {x.code for x in rec.findings}
    assert not codes & {"frozen_layer", "grad_underflow", "stale_forward"}, rec.to_text()
    # fp16 parameters get "autocast over fp32 parameters", never a GradScaler on fp16 parameters
    assert rec.param_dtype == "float32"
    if rec.grad_scaler is not None:
        assert rec.dtype == "float16"
