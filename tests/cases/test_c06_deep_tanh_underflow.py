"""C06: a deep tanh MLP's activation gradients underflow fp16 without a (large enough) loss scale."""

import math

import torch

from . import scenarios as S
from .conftest import find


def _agrad(run):
    t = run.tensors
    return t[t.role == "activation_grad"].set_index("module")


def test_c06_rows_at_scale_1_and_2_16():
    g1 = _agrad(S.c06(1.0).run)
    assert (g1.loc[[str(i) for i in range(12)], "zero_frac"] == 1.0).all()  # first layers: 100 % zero
    g16 = _agrad(S.c06(2.0**16).run)
    assert g16.loc["0", "subnormal_frac"] > 0.99  # layer 0: (almost) all subnormal
    inner = g16.drop(index=["16", ""])  # the gradients between layers (not the logits)
    largest = float((inner.absmax / inner.loss_scale).max())
    assert 5.5e-8 < largest < 6.1e-8  # "about 5.8e-8"


def test_c06_scale_1_reports_layers_not_learning():
    rec = S.mpscope.advise(S.c06(1.0).run)
    frozen = {f.module for f in find(rec, "frozen_layer")}
    assert {"0", "2", "4"} <= frozen
    find(rec, "grad_underflow", "0")
    # the recording lost the gradients it would need for a what-if: the advisor says so and takes
    # the largest safe scale; a plain backward at that scale keeps layer 0's gradient alive
    assert rec.evidence["whatif"]["lossy"] and "already flushed" in rec.to_text()
    scale = rec.grad_scaler["init_scale"]
    assert scale == 2.0 ** rec.evidence["whatif"]["k_max"]
    zero, sub = S.c06_layer_grads(scale)["0"]
    assert zero < 0.01 and sub < 0.01


def test_c06_recommends_a_large_init_scale():
    run = S.c06(2.0**16).run
    rec = S.mpscope.advise(run)
    find(rec, "grad_underflow", "0")
    assert rec.dtype == "float16" and rec.grad_scaler is not None
    k = math.log2(rec.grad_scaler["init_scale"])
    # the largest scale that keeps the largest recorded gradient a binade below 65504 ("near 2^24" or
    # above: any lower scale only leaves more of these gradients subnormal)
    assert k.is_integer() and k >= 22 and k == rec.evidence["whatif"]["k_max"]
    # oracle: a plain backward at that scale; layer 0's fp16 gradient, subnormal/zero at 2^16, is not
    before = S.c06_layer_grads(2.0**16)["0"]
    after = S.c06_layer_grads(rec.grad_scaler["init_scale"])["0"]
    assert sum(before) > 0.99 and sum(after) < 0.05
    # and nothing overflows: every layer's gradient stays finite
    assert all(not math.isnan(z) for z, _ in S.c06_layer_grads(rec.grad_scaler["init_scale"]).values())
