"""C05: a Linear output overflows fp16 before a BatchNorm, whose fp32 running stats turn NaN."""

import torch

from . import scenarios as S
from .conftest import find


def test_c05_rows_and_buffer():
    d = S.c05()
    t = d.run.tensors
    lin = t[(t.role == "activation") & (t.module == "0")].iloc[0]
    assert int(lin.nan_count + lin.inf_count) == lin.numel == 20
    assert d.fp32_absmax > torch.finfo(torch.float16).max  # fp32 |x| up to ~9e4
    assert 8.5e4 < d.fp32_absmax < 9.5e4
    assert d.running_mean_dtype == torch.float32 and d.running_mean_nan == 9


def test_c05_advice():
    rec = S.mpscope.advise(S.c05().run)
    first = find(rec, "first_nonfinite")[0]
    assert (first.module, first.role) == ("0", "activation")  # the Linear, not the BatchNorm
    find(rec, "forward_overflow", "0")
    ns = find(rec, "norm_statistics", "1")[0]
    assert "consequence" in ns.message and "running" in ns.message
    assert rec.dtype == "bfloat16"
