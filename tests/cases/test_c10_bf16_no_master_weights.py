"""C10: bf16 weights updated in place by Adam never change: every update is below half an ulp."""

import torch

from . import scenarios as S
from .conftest import find


def test_c10_rows():
    d = S.c10()
    assert d.bad.changed == 0 and d.good.changed == 768
    t = d.bad.run.tensors
    w = t[t.role == "weight"]
    assert set(w.dtype.astype(str)) == {"bfloat16"} and w.step.nunique() == 100
    assert (w["max"] == 1.0).all() and (w["min"] == 1.0).all()
    g = t[t.role == "param_grad"]
    assert (g.absmax > 0).all()
    # the cause, by a cast: 1 + lr rounds back to 1 in bf16
    assert torch.tensor(1 + 6e-4, dtype=torch.bfloat16).item() == 1.0


def test_c10_advice():
    rec = S.mpscope.advise(S.c10().bad.run)
    f = find(rec, "stagnant_low_precision_weights")[0]
    assert f.severity == "warning" and f.name == "w"
    assert f.threshold == 2.0**-9 and f.value < f.threshold
    assert "master weights" in f.fix
