"""C03: a hand-written float16 layer norm with eps = 1e-12, below float16's smallest subnormal (op level).

eps rounds to 0 in float16; the padded row (all zeros) has zero variance, rsqrt(0) = inf and
0 · inf = NaN: all 16 elements of that row are NaN.
"""

import numpy as np
import pytest
import torch
import torch.nn as nn

import mpscope
from mpscope.ops import op_findings

H = torch.float16


class HandLayerNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        xc = x - mu
        var = (xc * xc).mean(-1, keepdim=True)
        return xc * torch.rsqrt(var + self.eps) * self.weight + self.bias


class Encoder(nn.Module):
    def __init__(self, eps: float):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.norm = HandLayerNorm(16, eps)

    def forward(self, x):
        return self.norm(self.proj(x))


def _scenario(eps: float):
    torch.manual_seed(0)
    model = Encoder(eps).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 16).to(H)
    with torch.no_grad():
        model.proj.bias.zero_()
    x[0] = 0  # row 0 is padding: proj(0) = 0 with zero bias
    with mpscope.record(model, optimizer=opt, ops=True) as rec:
        out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
    return rec.run, out


@pytest.fixture(scope="module")
def bad():
    return _scenario(1e-12)


def test_c03_eps_is_below_the_smallest_subnormal():
    tiny = torch.finfo(H).tiny * torch.finfo(H).eps  # 2^-24, float16's smallest subnormal
    assert 1e-12 < tiny == 2.0**-24
    assert float(torch.tensor(1e-12, dtype=H)) == 0.0 and np.float16(1e-12) == 0


def test_c03_rows_show_the_nan_row(bad):
    run, out = bad
    assert int(out[0].isnan().sum()) == 16 and not out[1].isnan().any()
    t = run.tensors
    act = t[(t.role == "activation") & (t.module == "norm") & (t.step == 0)].iloc[0]
    assert int(act.nan_count) == 16
    ops = t[(t.role == "op_output") & (t.module == "norm") & (t.step == 0)].set_index("name")
    assert int(ops.loc["aten.add.Tensor#0", "zero_frac"] * 2) == 1  # var + eps is 0 on the padded row
    assert int(ops.loc["aten.rsqrt.default#0", "inf_count"]) == 1
    # NumPy oracle of the same arithmetic in float16
    xc = np.zeros(16, np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.float16(1) / np.sqrt(np.float16(0) + np.float16(1e-12))
        assert np.isnan(xc * r).sum() == 16


def test_c03_finding_names_the_constant(bad):
    run, _ = bad
    rec = mpscope.advise(run)
    fs = [f for f in rec.findings if f.code == "norm_statistics" and f.role == "op_output"]
    assert fs, [(f.code, f.module, f.name) for f in rec.findings]
    f = fs[0]
    assert (f.module, f.name, f.step) == ("norm", "aten.add.Tensor#0", 0)
    assert f.value == 1e-12 and f.threshold == 2.0**-24
    assert "16 NaN" in f.message
    assert "float32" in f.fix and "1e-5" in f.fix
    first = [f for f in rec.findings if f.code == "first_nonfinite"]
    assert first and first[0].module == "norm" and first[0].name == "aten.rsqrt.default#0"


def test_c03_eps_1e_5_is_fine():
    run, out = _scenario(1e-5)
    assert not out.isnan().any()
    assert not [f for f in op_findings(run) if f.code in ("norm_statistics", "first_nonfinite")]
    assert float(torch.tensor(1e-5, dtype=H)) > 0  # representable (a subnormal) in float16


class NormalizedLogits(nn.Module):
    """Cosine logits: F.normalize (eps 1e-12, lost in float16) then exp of logits / 0.01 (overflows)."""

    def forward(self, x):
        z = torch.nn.functional.normalize(x, dim=-1)
        e = torch.exp(z @ z.t() / 0.01)
        return e / e.sum(-1, keepdim=True)


def test_a_lost_epsilon_is_not_blamed_for_a_nan_its_module_makes_elsewhere():
    """Second member: the epsilon is lost as in C03, but no row has a zero norm (oracle: the float32
    norms); the NaN comes from exp overflowing (inf / inf), so the finding tells no NaN count."""
    x = torch.randn(8, 16).half()
    assert float(x.float().norm(dim=-1).min()) > 0.1
    assert bool(torch.isinf(torch.exp(torch.tensor(100.0, dtype=H))))  # exp(1/0.01) past float16's max
    m = NormalizedLogits()
    with mpscope.record(m, ops=True) as rec:
        out = m(x)
        rec.step()
    assert bool(torch.isnan(out).any())
    findings = mpscope.advise(rec.run).findings
    fs = [f for f in findings if f.code == "norm_statistics" and f.role == "op_output"]
    assert fs and fs[0].value == 1e-12
    assert "NaN" not in fs[0].message and "would give" in fs[0].message
