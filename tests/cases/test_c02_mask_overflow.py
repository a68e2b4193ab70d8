"""C02: a causal + padding mask built with finfo(float16).min overflows when added to the scores (op level).

The scores (1, 4, 4) are N(0, 20²) in float16; query 0 is padding (scores -20) and fully masked.
``-65504 + (-20)`` rounds to -inf in float16, so the masked row is all -inf and softmax returns NaN
for it. Module hooks see only the attention module's NaN output; the op recorder names the add.
"""

import numpy as np
import pytest
import torch
import torch.nn as nn

import mpscope
from mpscope.ops import op_findings

H = torch.float16
FMIN = torch.finfo(H).min


class MaskedSoftmax(nn.Module):
    """scores + mask (one combined mask, or causal and padding masks added one after the other)."""

    def __init__(self, clamp: bool = False):
        super().__init__()
        self.clamp = clamp

    def forward(self, scores, *masks):
        for m in masks:
            scores = scores + m
        if self.clamp:
            scores = torch.clamp(scores, min=torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1)


class Attention(nn.Module):
    def __init__(self, clamp: bool = False):
        super().__init__()
        self.attn = MaskedSoftmax(clamp)

    def forward(self, scores, *masks):
        return self.attn(scores, *masks)


def _inputs():
    torch.manual_seed(0)
    scores = (torch.randn(1, 4, 4) * 20).to(H)
    scores[:, 0, :] = -20.0  # query 0 is padding
    causal = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)
    padding = torch.zeros(4, 4, dtype=torch.bool)
    padding[0, :] = True
    zero = torch.zeros((), dtype=H)
    combined = torch.where(causal | padding, torch.tensor(FMIN, dtype=H), zero)[None]
    causal_m = torch.where(causal, torch.tensor(FMIN, dtype=H), zero)[None]
    padding_m = torch.where(padding, torch.tensor(FMIN, dtype=H), zero)[None]
    return scores, combined, causal_m, padding_m


def _record(model, *args):
    with mpscope.record(model, ops=True) as rec:
        out = model(*args)
        rec.step()
    return rec.run, out


def _np_sum16(*xs):
    """float16 result of adding float16 tensors one by one (NumPy oracle: exact in float32, then cast)."""
    acc = xs[0].numpy()
    with np.errstate(over="ignore"):
        for x in xs[1:]:
            acc = (acc.astype(np.float32) + x.numpy().astype(np.float32)).astype(np.float16)
    return acc


@pytest.fixture(scope="module")
def combined():
    scores, mask, _, _ = _inputs()
    run, out = _record(Attention(), scores, mask)
    return run, out, scores, mask


def test_c02_rows_show_minus_inf_then_a_nan_row(combined):
    run, out, scores, mask = combined
    ops = run.tensors[run.tensors.role == "op_output"].set_index(["module", "name"])
    summed = _np_sum16(scores, mask)
    n_inf = int(np.isinf(summed).sum())
    assert np.isneginf(summed[0, 0]).all()  # the padded query's row is all -inf
    add = ops.loc[("attn", "aten.add.Tensor#0")]
    assert int(add.inf_count) == n_inf and n_inf >= 4
    assert int(add.nan_count) == 0
    sm = ops.loc[("attn", "aten._softmax.default#0")]
    # softmax of an all -inf row is NaN even in float32
    oracle_nan = int(torch.softmax(torch.from_numpy(summed).float(), -1).isnan().sum())
    assert int(sm.nan_count) == oracle_nan == 4
    assert int(out.isnan().sum()) == 4


def test_c02_finding_points_at_the_mask_add(combined):
    run, *_ = combined
    rec = mpscope.advise(run)
    fs = [f for f in rec.findings if f.code == "mask_overflow"]
    assert fs, [f.code for f in rec.findings]
    f = fs[0]
    assert (f.module, f.role, f.name, f.step, f.severity) == ("attn", "op_output", "aten.add.Tensor#0", 0, "error")
    assert f.value == FMIN and f.threshold == torch.finfo(H).max
    assert "clamp" in f.fix.lower() and "finfo" in f.fix
    first = [f for f in rec.findings if f.code == "first_nonfinite"]
    assert first and (first[0].module, first[0].name) == ("attn", "aten.add.Tensor#0")


def test_c02_separate_masks_double_the_effect():
    """Added one after the other, causal and padding masks give -65504 - 65504 = -inf wherever both
    block, whatever the score."""
    scores, combined_mask, causal, padding = _inputs()
    run, out = _record(Attention(), scores, causal, padding)
    ops = run.tensors[run.tensors.role == "op_output"].set_index(["module", "name"])
    n_combined = int(np.isinf(_np_sum16(scores, combined_mask)).sum())
    n_separate = int(np.isinf(_np_sum16(scores, causal, padding)).sum())
    both = int(((causal.numpy() != 0) & (padding.numpy() != 0)).sum())
    assert both == 3 and n_separate >= n_combined
    assert np.isneginf(_np_sum16(torch.zeros(1, 4, 4, dtype=H), causal, padding)).sum() == both
    assert int(ops.loc[("attn", "aten.add.Tensor#1"), "inf_count"]) == n_separate
    codes = {(f.code, f.name) for f in op_findings(run)}
    assert ("mask_overflow", "aten.add.Tensor#0") in codes or ("mask_overflow", "aten.add.Tensor#1") in codes


def test_c02_clamping_fixes_it():
    scores, mask, _, _ = _inputs()
    run, out = _record(Attention(clamp=True), scores, mask)
    assert not out.isnan().any()
    ops = run.tensors[run.tensors.role == "op_output"].set_index(["module", "name"])
    assert int(ops.loc[("attn", "aten._softmax.default#0"), "nan_count"]) == 0
    # the -inf still appears in the add (the clamp repairs it afterwards), but no NaN follows
    assert not [f for f in op_findings(run) if f.code == "first_nonfinite" and "NaN" in f.message]


def test_c02_mask_constant_1e10_overflows_directly():
    """masked_fill refuses -1e10 in float16; torch.where materialises it as a float16 scalar: -inf."""
    scores, *_ = _inputs()
    causal = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)

    class Where(nn.Module):
        def forward(self, s):
            return torch.softmax(torch.where(causal, -1e10, s), -1)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Where()

        def forward(self, s):
            return self.attn(s)

    run, out = _record(M(), scores)
    fs = [f for f in op_findings(run) if f.code == "mask_overflow"]
    assert fs and fs[0].module == "attn" and fs[0].value == -1e10
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(-1e10))  # the oracle: NumPy's cast overflows too
