"""C09: Adam on an fp16 model with eps 1e-8 (rounds to 0 in fp16) writes NaN into the weights."""

import torch

from . import scenarios as S
from .conftest import find


def test_c09_rows():
    d = S.c09()
    bad = d.bad
    assert (bad.nan_params, bad.numel) == (28, 40)
    assert d.good.nan_params == 0  # eps 1e-4
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0  # the cause, by a cast
    t = bad.run.tensors
    st = t[t.role == "optimizer_state"]
    assert set(st.dtype.astype(str)) == {"float16"}
    assert (st.zero_frac > 0).any()
    w = t[(t.role == "weight")].iloc[-1]
    assert int(w.nan_count) == 28


def test_c09_advice():
    rec = S.mpscope.advise(S.c09().bad.run)
    f = find(rec, "optimizer_state_precision")[0]
    assert f.severity == "error"
    assert f.value == 1e-8 and f.threshold == torch.finfo(torch.float16).tiny * torch.finfo(torch.float16).eps
    assert "fp32" in f.fix and "28 of 40" in f.message
    first = find(rec, "first_nonfinite")[0]
    assert first.role == "weight"
