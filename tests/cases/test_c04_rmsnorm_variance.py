"""C04: the variance of a float16 RMSNorm overflows (op level, silent: no NaN anywhere).

x (6, 512) N(0, 1) with one element set to 300; variance = mean(x · x) in float16: 300² = 90000 >
65504 gives inf, rsqrt(inf) = 0 and the token's output row is all zeros (float32 gives |x| up to
about 22.6 there). A detector that looks only for NaN misses it.
"""

import numpy as np
import pytest
import torch
import torch.nn as nn

import mpscope
from mpscope.ops import op_findings

H = torch.float16
ROW, COL = 2, 7


class HalfRMSNorm(nn.Module):
    def __init__(self, d: int, fp32_stats: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.fp32_stats = fp32_stats

    def forward(self, x):
        if self.fp32_stats:  # the fix: statistics in float32, as LlamaRMSNorm does
            xf = x.float()
            return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight
        var = (x * x).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, fp32_stats=False):
        super().__init__()
        self.norm = HalfRMSNorm(512, fp32_stats)
        self.proj = nn.Linear(512, 512)

    def forward(self, x):
        return self.proj(self.norm(x))


def _x():
    torch.manual_seed(0)
    x = torch.randn(6, 512)
    x[ROW, COL] = 300.0
    return x


def _scenario(fp32_stats=False):
    x = _x()
    torch.manual_seed(0)
    model = Block(fp32_stats).half()
    with mpscope.record(model, ops=True) as rec:
        out = model.norm(x.to(H))  # the norm's output is what goes silent
        model.proj(out)
        rec.step()
    return rec.run, out.detach()


@pytest.fixture(scope="module")
def bad():
    return _scenario()


def _fp32_norm_row_absmax(x):
    xf = x.double()
    y = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)
    return y.abs().amax(-1)


def test_c04_silent_zero_row(bad):
    run, out = bad
    x = _x()
    assert float(out[ROW].abs().max()) == 0.0
    fp32 = _fp32_norm_row_absmax(x)
    assert 22.5 < float(fp32[ROW]) < 22.7  # the case's "fp32 gives 22.6"
    t = run.tensors
    assert int((t.nan_count).sum()) == 0  # no NaN anywhere: a NaN detector misses it
    act = t[(t.role == "activation") & (t.module == "norm")].iloc[0]
    assert act.zero_frac == pytest.approx(512 / out.numel())  # one row of six went to zero
    ops = t[(t.role == "op_output") & (t.module == "norm")].set_index("name")
    assert int(ops.loc["aten.mul.Tensor#0", "inf_count"]) == 1  # x·x: only 300² overflows
    assert int(ops.loc["aten.mean.dim#0", "inf_count"]) == 1  # the variance of that row
    assert float(ops.loc["aten.rsqrt.default#0", "zero_frac"]) == pytest.approx(1 / 6)


def test_c04_finding(bad):
    run, _ = bad
    rec = mpscope.advise(run)
    fs = [f for f in rec.findings if f.code == "forward_overflow" and f.role == "op_output"]
    assert fs, [(f.code, f.module, f.name) for f in rec.findings]
    f = fs[0]
    assert (f.module, f.name, f.step, f.severity) == ("norm", "aten.mul.Tensor#0", 0, "error")
    x = _x()
    assert f.value == float(x[ROW, COL]) ** 2 == 90000.0
    assert f.threshold == torch.finfo(H).max
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(300) * np.float16(300))  # NumPy oracle
    assert "float32" in f.fix and "silently" in f.message


def test_c04_norm_in_fp32_is_fine():
    run, out = _scenario(fp32_stats=True)
    assert float(out[ROW].abs().max()) > 20
    assert not [f for f in op_findings(run) if f.severity == "error"]
