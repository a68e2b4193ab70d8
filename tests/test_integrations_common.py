"""The numbers the framework callbacks log (``mpscope.integrations._common.log_numbers``): the
underflow fraction of the format the run computes in, never of a format it did not use."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mpscope
from mpscope.integrations._common import log_numbers, run_format

GRAD_ROLES = ["activation_grad", "param_grad"]


class _Net(nn.Module):
    """Linear -> tanh under the caller's autocast, then an fp32 head: the head's gradients are
    float32 and small (the loss is scaled by 1e-5), so a good share of them would flush to zero in
    float16 but none in bfloat16."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        with torch.autocast("cpu", enabled=False):
            return self.head(h.to(self.head.weight.dtype))


def _record(kind: str, steps: int = 3):
    """A real recorded run: ``kind`` is "bf16" / "fp16" (CPU autocast; fp16 with a GradScaler),
    "bf16_weights" (the model cast to bfloat16, no autocast) or "fp32". Returns (recorder, log
    numbers taken while the recorder is live, as a callback takes them)."""
    torch.manual_seed(0)
    model = _Net()
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    if kind == "bf16_weights":
        model, x, y = model.to(torch.bfloat16), x.to(torch.bfloat16), y.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if kind == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(kind)
    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = 1e-5 * F.mse_loss(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        live = log_numbers(rec)
    return rec, live


def _last_grads(run):
    """The gradient rows of the run's last recorded step."""
    t = run.tensors
    last = int(run.steps[run.steps.recorded].step.iloc[-1])
    return t[(t.step == last) & t.role.isin(GRAD_ROLES)]


@pytest.fixture(scope="module")
def runs():
    return {kind: _record(kind) for kind in ("bf16", "fp16", "bf16_weights", "fp32")}


def test_a_bf16_run_logs_bf16_fractions_not_fp16(runs):
    rec, live = runs["bf16"]
    run = rec.run
    assert run.meta["autocast_dtype"] == "bfloat16" and run_format(run) == "bf16"
    grads = _last_grads(run)
    # the run's own rows: a good share of its gradients would flush in fp16, none do in bf16 --
    # logging the fp16 column would read as a large underflow that never happened
    assert grads.fp16_underflow_frac.max() > 0.2
    assert live["mpscope/bf16_underflow_frac"] == grads.bf16_underflow_frac.max() == 0.0
    assert not any("fp16" in k for k in live), live
    assert log_numbers(rec) == live  # the same after the recording ended


def test_an_fp16_run_logs_fp16_fractions(runs):
    rec, live = runs["fp16"]
    run = rec.run
    assert run.meta["autocast_dtype"] == "float16" and run_format(run) == "fp16"
    grads = _last_grads(run)
    assert live["mpscope/fp16_underflow_frac"] == pytest.approx(grads.fp16_underflow_frac.max())
    assert 0.0 < live["mpscope/fp16_underflow_frac"] < 1.0
    assert not any("bf16" in k for k in live), live
    assert live["mpscope/loss_scale"] == float(run.steps.scale_after.iloc[-1]) == 1.0


def test_a_model_cast_to_bf16_without_autocast_is_a_bf16_run(runs):
    rec, live = runs["bf16_weights"]
    assert rec.run.meta["autocast_dtype"] is None and run_format(rec.run) == "bf16"
    assert live["mpscope/bf16_underflow_frac"] == _last_grads(rec.run).bf16_underflow_frac.max()
    assert not any("fp16" in k for k in live), live


def test_a_float32_run_names_both_fractions_hypothetical(runs):
    rec, live = runs["fp32"]
    run = rec.run
    assert run_format(run) is None
    grads = _last_grads(run)
    assert live["mpscope/hypothetical_fp16_underflow_frac"] == pytest.approx(grads.fp16_underflow_frac.max())
    assert live["mpscope/hypothetical_fp16_underflow_frac"] > 0.2
    assert live["mpscope/hypothetical_bf16_underflow_frac"] == grads.bf16_underflow_frac.max() == 0.0
    assert {k for k in live if "underflow" in k} == {
        "mpscope/hypothetical_fp16_underflow_frac", "mpscope/hypothetical_bf16_underflow_frac"}
