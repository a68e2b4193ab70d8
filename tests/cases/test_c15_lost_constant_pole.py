"""C15: a clamp bound 1 - 1e-6 that rounds to 1.0 in fp16, then log1p(-1) = -inf (a pole)."""

import math
import re

import torch

from . import breadth as B
from .conftest import find


def test_c15_constant_and_collapse():
    assert float(torch.tensor(1 - 1e-6, dtype=torch.float16)) == 1.0  # the cause, by casts
    assert float(torch.tensor(1 - 1e-6, dtype=torch.bfloat16)) == 1.0
    d = B.c15()
    assert 4.0 < d.logit_std < 6.5
    s = d.run.steps
    assert s.skipped.all() and s.found_inf.all() and math.isfinite(d.losses[0])
    assert len(set(d.losses)) == 1  # nothing trains
    assert (s.loss_scale.iloc[0], d.final_scale) == (2.0**16, 2.0**4)
    ff = d.run.tables["op_facts"]
    log1p = ff[(ff.op == "aten.log1p.default") & (ff.step == 0) & (ff.phase == "forward")].iloc[0]
    assert int(log1p.in_pole) == int(log1p.out_inf) > 0 and int(log1p.in_inf) == 0


def test_c15_findings_and_recommendation():
    rec = B.mpscope.advise(B.c15().run)
    lc = find(rec, "lost_constant", "nll")[0]
    assert lc.name == "aten.clamp.default#0" and lc.value == 1 - 1e-6 and lc.threshold == 1.0
    assert "bfloat16 does not help" in lc.message
    pole = find(rec, "pole", "nll")[0]
    assert pole.name == "aten.log1p.default#0" and pole.step == 0 and "not an overflow" in pole.message
    assert "lost_constant" in pole.message
    codes = {f.code for f in rec.findings}
    assert "forward_overflow" not in codes  # -inf from a pole is not "overflow above 65504"
    assert "nll" in rec.fp32_modules and rec.dtype != "bfloat16"
    assert rec.grad_scaler is not None and rec.dtype == "float16"
    for f in rec.findings:  # no "raise the loss scale", no bf16 advice
        assert not re.search(r"[Tt]rain in bfloat16|or bfloat16|bfloat16 instead", f.fix), (f.code, f.fix)
        assert "init_scale" not in f.fix and "Raise the loss scale" not in f.fix


def test_c15_second_member_atanh_in_bf16():
    """A Poincare distance: |z| clamped by 1 - 1e-5 (1.0 in bf16), then atanh(1) = inf."""
    assert float(torch.tensor(1 - 1e-5, dtype=torch.bfloat16)) == 1.0
    rec = B.mpscope.advise(B.c15_hyperbolic().run)
    lc = find(rec, "lost_constant", "dist")[0]
    assert lc.value == 1 - 1e-5 and lc.threshold == 1.0
    pole = find(rec, "pole", "dist")[0]
    assert pole.name.startswith("aten.atanh") and pole.value > 0
    assert "dist" in rec.fp32_modules
    assert not [f for f in rec.findings if f.code == "forward_overflow"]


class LogOneMinus(torch.nn.Module):
    """log1p(-p) guarded by clamp(max=1 - 1e-6), on probabilities that stay well below 1."""

    def forward(self, logits):
        return torch.log1p(-torch.sigmoid(logits).clamp(max=1 - 1e-6))


def test_a_lost_guard_that_no_value_reaches_is_a_warning():
    """Second member: the guard rounds onto 1.0 in float16 (oracle: the cast), but every probability is
    below 0.9, so no pole is reached (the outputs are finite): a risk, not an error."""
    assert float(torch.tensor(1 - 1e-6, dtype=torch.float16)) == 1.0
    logits = (torch.randn(64, 8) * 0.5).half()
    m = LogOneMinus()
    with B.mpscope.record(m, ops=True) as rec:
        out = m(logits)
        rec.step()
    assert bool(torch.isfinite(out).all()) and float(torch.sigmoid(logits.float()).max()) < 0.9
    lost = [f for f in B.mpscope.advise(rec.run).findings if f.code == "lost_constant"]
    assert lost and lost[0].value == 1 - 1e-6 and all(f.severity == "warning" for f in lost)
