"""Recorder behaviour that training frameworks rely on: optimizers that skip inside step(),
autocast entered inside the model's forward, wrapped optimizers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mpscope


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def test_fused_adam_skip_is_a_skipped_step():
    """Fused Adam takes GradScaler's found_inf itself: step() runs and the update is skipped inside."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    assert opt._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    changed, stepped = [], []
    opt.register_step_post_hook(lambda *a: stepped.append(True))
    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        for i in range(3):
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y) * (math.inf if i == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            changed.append(not all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    assert stepped == [True] * 3  # step() ran every time
    assert changed == [True, False, True]  # the oracle: the update did not happen at step 1
    assert rec.run.steps.skipped.tolist() == [not c for c in changed]


class _AutocastInside(torch.nn.Module):
    """Enters autocast inside forward, as Accelerate's prepared models and some model code do."""

    def __init__(self, dtype):
        super().__init__()
        self.body, self.dtype = _mlp(), dtype

    def forward(self, x):
        with torch.autocast("cpu", dtype=self.dtype):
            return self.body(x).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_entered_inside_forward_is_recorded(dtype):
    model = _AutocastInside(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with mpscope.record(model, optimizer=opt) as rec:
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
            opt.step()
    run = rec.run
    assert run.meta["autocast_dtype"] == str(dtype).removeprefix("torch.")
    assert run.meta["autocast_device_type"] == "cpu"
    acts = run.tensors[(run.tensors.role == "activation") & (run.tensors.module == "body.0")]
    assert set(acts.dtype) == {run.meta["autocast_dtype"]}


def test_no_autocast_is_reported_off():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with mpscope.record(model, optimizer=opt) as rec:
        opt.zero_grad()
        F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
        opt.step()
    assert rec.run.meta["autocast_dtype"] is None


def test_import_loads_no_framework():
    import subprocess
    import sys

    code = ("import sys, mpscope, mpscope.integrations; mpscope.record; mpscope.advise; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'accelerate', 'lightning', 'pytorch_lightning'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
