"""C14: float timesteps rounded by a bf16 cast before a sinusoidal embedding (precision, not range)."""

import math

import pytest
import torch

from . import breadth as B
from .conftest import find

BF16 = torch.bfloat16


def _spacing(x: float, dtype) -> float:
    """ulp at |x| by the format itself: the gap between x (rounded) and the next value up."""
    v = torch.tensor(x, dtype=dtype)
    return float(torch.nextafter(v, torch.tensor(math.inf, dtype=dtype)) - v)


def test_c14_rows_and_oracle():
    d = B.c14()
    assert d.distinct_in == 256 and 180 <= d.distinct_out <= 200  # the case: 256 -> 194
    assert 1.9 <= d.max_move <= 2.0 and 1.0 < d.emb_err < 2.0  # "up to 2", "up to 1.6"
    assert _spacing(600.0, BF16) == 4.0  # bf16's spacing between 512 and 1024
    ff = d.run.tables["op_facts"]
    cast = ff[(ff.op == "aten._to_copy.default") & ff.distinct_in.notna()].iloc[0]
    assert (int(cast.distinct_in), int(cast.distinct_out)) == (d.distinct_in, d.distinct_out)
    assert float(cast.cast_err) == d.max_move
    assert ff.periodic_src.notna().sum() >= 2  # the sin and the cos


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_c14_finding(dtype):
    d = B.c14(dtype)
    rec = B.mpscope.advise(d.run)
    f = find(rec, "float_precision")[0]
    assert (f.severity, f.module, f.step) == ("warning", "", 0) and f.name.startswith("aten._to_copy")
    absmax = float(d.t.max())
    assert f.value == _spacing(float(torch.tensor(absmax, dtype=dtype).float()) * 0.999, dtype) or \
        f.value == _spacing(absmax, dtype)
    assert f.threshold == 2.0**-3
    if dtype == BF16:
        assert f"{d.distinct_in} distinct values became {d.distinct_out}" in f.message
    assert "float32" in f.fix and "sin" in f.message


def test_c14_second_member_rotary_angles_in_bf16():
    """Rotary angles computed by a matmul under bf16 autocast: the cos/sin argument itself is bf16."""
    d = B.c14_rotary()
    rec = B.mpscope.advise(d.run)
    fs = find(rec, "float_precision")
    names = {f.name.split("#")[0] for f in fs}
    assert {"aten.cos.default", "aten.sin.default"} <= names
    f = fs[0]
    ff = d.run.tables["op_facts"]
    arg = float(ff[ff.name == f.name].in_absmax0.iloc[0])  # the largest bf16 angle the op received
    assert 1024 <= arg <= 2048 and d.angle_max == 2047.0
    assert f.value == _spacing(arg * 0.999, BF16) >= 8.0
    assert d.cos_err > 1.0  # the oracle: cos of the rounded angles vs cos in fp32
    assert "float32" in f.fix


def test_c14_fp32_embedding_is_quiet():
    """Control: the timesteps kept in fp32 (no cast) give no float_precision finding."""
    model, x, t = B.c14_data()
    model.forward = lambda x, t, m=model: m.mlp(m.inp(x) + m.temb(t))
    with B.mpscope.record(model, ops=True) as r:
        with torch.autocast("cpu", dtype=BF16):
            model(x, t)
        r.step()
    del model.forward
    assert not [f for f in B.mpscope.advise(r.run).findings if f.code == "float_precision"]
