"""C11: rotary positions cast to float16 / bfloat16 collide (op level, precision not range).

arange(32768) cast to float16 keeps 6145 distinct values, to bfloat16 1153: integers are exact only
up to 2048 (float16) and 256 (bfloat16).
"""

import pytest
import torch
import torch.nn as nn

import mpscope
from mpscope.ops import op_findings


class Rotary(nn.Module):
    """cos/sin tables of rotary embeddings; the bug: positions built in the low-precision dtype."""

    def __init__(self, dim: int, dtype: torch.dtype, positions_fp32: bool = False):
        super().__init__()
        self.dtype = dtype
        self.positions_fp32 = positions_fp32
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, seq_len: int):
        pos = torch.arange(seq_len, device=self.inv_freq.device)
        if self.positions_fp32:
            angles = torch.outer(pos.float(), self.inv_freq)
        else:
            angles = torch.outer(pos.to(self.dtype), self.inv_freq.to(self.dtype))
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)


class Model(nn.Module):
    def __init__(self, dtype, positions_fp32=False):
        super().__init__()
        self.rotary = Rotary(2, dtype, positions_fp32)  # one frequency: the positions are the point

    def forward(self, n):
        return self.rotary(n)


def _scenario(dtype, positions_fp32=False):
    model = Model(dtype, positions_fp32)
    with mpscope.record(model, ops=True) as rec:
        model(32768)
        rec.step()
    return rec.run


@pytest.mark.parametrize("dtype, distinct, exact", [(torch.float16, 6145, 2048), (torch.bfloat16, 1153, 256)])
def test_c11_positions_collide(dtype, distinct, exact):
    # oracles: PyTorch's own cast and torch.finfo
    assert torch.arange(32768).to(dtype).unique().numel() == distinct
    assert 2 / torch.finfo(dtype).eps == exact
    run = _scenario(dtype)
    rec = mpscope.advise(run)
    fs = [f for f in rec.findings if f.code == "integer_precision"]
    assert fs, [(f.code, f.module, f.name) for f in rec.findings]
    f = fs[0]
    assert (f.module, f.role, f.name, f.step, f.severity) == (
        "rotary", "op_output", "aten._to_copy.default#0", 0, "warning")
    assert f.value == 32767 and f.threshold == exact
    assert f"32768 distinct values became {distinct}" in f.message
    assert "float32" in f.fix
    facts = run.tables["op_facts"].set_index(["module", "name"]).loc[("rotary", "aten._to_copy.default#0")]
    changed = int((torch.arange(32768).to(dtype).long() != torch.arange(32768)).sum())
    assert int(facts.distinct_out) == distinct and int(facts.changed) == changed


def test_c11_positions_in_fp32_are_fine():
    run = _scenario(torch.float16, positions_fp32=True)
    assert not [f for f in op_findings(run) if f.code == "integer_precision"]
