"""C01: a bf16-pretrained FFN overflows fp16 in the forward pass (module level)."""

import math

import torch

from . import scenarios as S
from .conftest import find


def test_c01_rows_show_the_forward_overflow():
    d = S.c01()
    t = d.run.tensors
    act = t[t.role == "activation"].set_index("module")
    # the case's numbers, from the run itself and from an fp32 forward (the oracle)
    assert d.fp32_down0_absmax > torch.finfo(torch.float16).max
    assert 7.3e4 < d.fp32_down0_absmax < 7.5e4
    assert int(act.loc["blocks.0.down", "inf_count"]) == 4
    b1 = act.loc["blocks.1.down"]
    assert int(b1.nan_count + b1.inf_count) == 256
    head = act.loc["head"]
    assert int(head.nan_count + head.inf_count) == d.logits_nonfinite == 400
    assert d.bf16_finite


def test_c01_advice():
    d = S.c01()
    rec = S.mpscope.advise(d.run)
    first = find(rec, "first_nonfinite")[0]
    assert (first.module, first.role, first.step) == ("blocks.0.down", "activation", 0)
    fo = find(rec, "forward_overflow", "blocks.0.down")[0]
    assert fo.severity == "error" and "cannot fix" in fo.message
    assert fo.threshold == torch.finfo(torch.float16).max and math.isinf(fo.value)
    assert rec.dtype == "bfloat16" and rec.grad_scaler is None
    assert "blocks.0.down" in rec.evidence["fp16_fp32_modules"]
    assert "blocks.0.down" in rec.to_text()
