"""compare(): align a float32 and a float16-autocast run of the same model and seed, and find where
they part."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mpscope
from mpscope.comparison import Comparison, compare, compare_precision

H = torch.float16


class MLP(nn.Module):
    """l0 -> ReLU -> l1 -> ReLU -> l2 -> head; ``wide_l2`` gives l2 weights N(0, 8²) (a bf16-trained
    layer), whose output leaves float16's range once the input grows."""

    def __init__(self, wide_l2: bool):
        super().__init__()
        self.l0 = nn.Linear(32, 64)
        self.l1 = nn.Linear(64, 64)
        self.l2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1)
        if wide_l2:
            with torch.no_grad():
                self.l2.weight.normal_(0.0, 8.0)

    def forward(self, x):
        return self.head(self.l2(torch.relu(self.l1(torch.relu(self.l0(x))))))


SPIKE_STEP = 2


def _step(spike: float):
    def train_step(model, opt, scaler, autocast, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, 32, generator=g) * (spike if i == SPIKE_STEP else 1.0)
        y = torch.randn(16, 1, generator=g)
        with autocast():
            loss = F.mse_loss(model(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return train_step


def test_the_overflowing_layer_and_step_come_first():
    def build():
        m = MLP(wide_l2=True)
        return m, torch.optim.SGD(m.parameters(), lr=1e-6)

    c = compare_precision(build, _step(spike=2000.0), steps=4, grad_scaler=False)
    assert isinstance(c, Comparison) and c.labels == ("float32", "float16")
    assert (c.first_step, c.first_module, c.first_role) == (SPIKE_STEP, "l2", "activation")
    # the oracle: in the float32 run l2's output exceeds float16's max at that step, and only there
    t = c.run_a.tensors
    act = t[(t.role == "activation") & (t.module == "l2")].set_index("step").absmax
    assert act[SPIKE_STEP] > torch.finfo(H).max and (act.drop(SPIKE_STEP).loc[:SPIKE_STEP] < 1000).all()
    t16 = c.run_b.tensors
    l2_16 = t16[(t16.role == "activation") & (t16.module == "l2") & (t16.step == SPIKE_STEP)].iloc[0]
    assert l2_16.inf_count > 0 and l2_16["dtype"] == "float16"
    d = c.divergence
    before = d[(d.step < SPIKE_STEP)]
    assert not before.diverged.any() and before.absmax_rel.max() < c.tol
    # upstream layers at the spike step agree to float16 rounding
    same_step = d[(d.step == SPIKE_STEP) & (d.role == "activation")].set_index("module")
    assert same_step.loc["l0", "absmax_rel"] < 2**-8 and same_step.loc["l1", "absmax_rel"] < 2**-8
    assert "step 2, module 'l2'" in c.to_text()


def test_with_ops_the_first_divergence_is_the_op():
    def build():
        m = MLP(wide_l2=True)
        return m, torch.optim.SGD(m.parameters(), lr=1e-6)

    c = compare_precision(build, _step(spike=2000.0), steps=SPIKE_STEP + 1, grad_scaler=False, ops=True)
    assert (c.first_step, c.first_module, c.first_role, c.first_name) == (
        SPIKE_STEP, "l2", "op_output", "aten.addmm.default#0")
    d = c.divergence
    assert (d.role == "op_output").sum() > 20 and not d[d.step < SPIKE_STEP].diverged.any()


def test_a_healthy_model_does_not_diverge():
    def build():
        m = MLP(wide_l2=False)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    c = compare_precision(build, _step(spike=1.0), steps=4)  # float16 + GradScaler (PyTorch defaults)
    assert c.first_step is None and not c.diverged
    assert c.first_module is None
    assert len(c.divergence) > 50 and c.divergence.absmax_rel.max() <= c.tol
    assert (c.losses.loss_rel <= c.tol).all()
    # float16 rounds to 11 significant bits: activations agree far better than the tolerance
    act = c.divergence[c.divergence.role == "activation"]
    assert act.absmax_rel.max() < 0.01
    assert "no divergence beyond tolerance" in c.to_text()


def _frames(rows, losses):
    cols = ["step", "module", "role", "name", "dtype", "numel", "min", "max", "absmax", "absmin_nonzero",
            "zero_frac", "subnormal_frac", "fp16_underflow_frac", "fp16_subnormal_frac", "fp16_overflow_frac",
            "bf16_underflow_frac", "bf16_subnormal_frac", "nan_count", "inf_count", "loss_scale"]
    t = pd.DataFrame([{c: r.get(c, 0.0) for c in cols} for r in rows])
    s = pd.DataFrame({"step": range(len(losses)), "loss": losses, "loss_scale": 1.0, "found_inf": False,
                      "skipped": False, "scale_after": 1.0, "recorded": True})
    return mpscope.Run.from_frames(t, s, meta={})


def _row(step, module, role, absmax, **kw):
    return dict(step=step, module=module, role=role, name="output", dtype="float32", numel=10, absmax=absmax, **kw)


def test_alignment_unscaling_and_one_sided_rows():
    a = _frames([_row(0, "x", "activation", 2.0), _row(0, "y", "activation_grad", 1e-3),
                 _row(0, "only_a", "activation", 1.0)], [1.0])
    b = _frames([_row(0, "x", "activation", 2.0 * (1 + 2**-10)),
                 _row(0, "y", "activation_grad", 1e-3 * 2**16, loss_scale=2.0**16),  # scaled grads: unscaled first
                 _row(0, "only_b", "activation", 1.0)], [1.0])
    with pytest.warns(UserWarning, match="recorded in a only: 'only_a'; 1 module.s. recorded in b only: 'only_b'"):
        c = compare(a, b)
    d = c.divergence.set_index("module")
    assert d.loc["x", "absmax_rel"] == pytest.approx(2**-10 / (1 + 2**-10))
    assert d.loc["y", "absmax_b"] == pytest.approx(1e-3) and d.loc["y", "absmax_rel"] == pytest.approx(0, abs=1e-12)
    assert (c.only_a, c.only_b) == (1, 1) and c.first_step is None


def test_flush_to_zero_and_non_finite_diverge():
    a = _frames([_row(0, "p", "activation", 1.0), _row(1, "p", "activation", 1.0),
                 _row(1, "q", "activation_grad", 3e-8, zero_frac=0.0)], [1.0, 1.0])
    b = _frames([_row(0, "p", "activation", 1.0), _row(1, "p", "activation", np.nan, inf_count=10),
                 _row(1, "q", "activation_grad", 0.0, zero_frac=1.0)], [1.0, float("inf")])
    c = compare(a, b)
    assert (c.first_step, c.first_module) == (1, "p")
    d = c.divergence.set_index(["step", "module"])
    assert d.loc[(1, "p"), "absmax_rel"] == np.inf and bool(d.loc[(1, "q"), "diverged"])
    assert d.loc[(1, "q"), "zero_diff"] == 1.0
    assert bool(c.losses.diverged.iloc[1]) and not bool(c.losses.diverged.iloc[0])


def test_bad_input_says_what_to_do():
    a = _frames([_row(0, "p", "activation", 1.0)], [1.0])
    b = _frames([_row(5, "other", "activation", 1.0)], [1.0])
    with pytest.raises(TypeError, match="mpscope.Run"):
        compare(a, "runs/b")
    with pytest.raises(ValueError, match="share no"), pytest.warns(UserWarning, match="in b only: 'other'"):
        compare(a, b)
    with pytest.raises(ValueError, match="positive"):
        compare(a, a, tol=0)
    with pytest.raises(ValueError, match="float16"):
        compare_precision(lambda: None, lambda *a: None, dtype="float32")


def test_mpscope_compare_is_the_function_even_after_importing_the_module():
    import mpscope.comparison as module  # the module has its own name: mpscope.compare stays the function

    a = _frames([_row(0, "p", "activation", 1.0)], [1.0])
    assert mpscope.compare(a, a).first_step is None and module.compare(a, a).first_step is None
    assert mpscope.compare_precision is compare_precision


def _record_mlp(widths, names, steps=3, every=1):
    torch.manual_seed(0)
    layers = torch.nn.Sequential()
    for i, name in enumerate(names):
        layers.add_module(name, torch.nn.Linear(widths[i], widths[i + 1]))
    opt = torch.optim.SGD(layers.parameters(), lr=0.01)
    with mpscope.record(layers, optimizer=opt, every=every) as rec:
        for _ in range(steps):
            layers(torch.randn(4, widths[0])).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return rec.run


@pytest.mark.parametrize("b_kw, says", [
    (dict(widths=(8, 16, 1), names=("enc", "head")), r"2 module\(s\) recorded in a only: 'fc1', 'fc2'; 2 module\(s\) recorded in b only: 'enc', 'head'"),
    (dict(widths=(8, 16, 1), names=("fc1", "fc2"), steps=5, every=2), r"different every= settings: a 1, b 2; different step counts: a 3, b 5"),
])
def test_runs_of_different_models_or_settings_are_compared_with_a_warning_naming_the_difference(b_kw, says):
    a = _record_mlp((8, 32, 1), ("fc1", "fc2"))
    b = _record_mlp(**b_kw)
    with pytest.warns(UserWarning, match=says) as caught:
        c = compare(a, b)
    assert len(caught) == 1
    assert any(d in c.to_text() for d in c.differences) and c.differences


def test_a_float32_and_an_autocast_run_of_one_model_compare_without_a_warning(recwarn):
    a = _record_mlp((8, 32, 1), ("fc1", "fc2"))
    b = _record_mlp((8, 32, 1), ("fc1", "fc2"))
    b.meta["autocast_dtype"] = "float16"
    c = compare(a, b)
    assert not [w for w in recwarn if "mpscope.compare" in str(w.message)]
    assert c.differences == ["different autocast dtypes: a none, b float16"]
    assert "different autocast dtypes: a none, b float16" in c.to_text()
