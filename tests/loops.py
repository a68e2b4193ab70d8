"""Small real training loops shared by tests (CPU fp16 autocast + GradScaler)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mpscope


def record_fp16(model, opt, scaler, batches, **record_kw):
    """Train ``model`` on the (x, y) ``batches`` (MSE, CPU autocast float16, GradScaler) under
    ``mpscope.record`` and return the Run."""
    with mpscope.record(model, optimizer=opt, scaler=scaler, **record_kw) as rec:
        for x, y in batches:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return rec.run


def record_fp16_mlp(steps: int = 3, activation=torch.nn.ReLU, optimizer=torch.optim.Adam, lr: float = 1e-2, **record_kw):
    """Train Linear(8,16) -> activation -> Linear(16,1) for ``steps`` steps on one batch and
    return the Run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), activation(), torch.nn.Linear(16, 1))
    opt = optimizer(model.parameters(), lr=lr)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    return record_fp16(model, opt, torch.amp.GradScaler("cpu"), [(x, y)] * steps, **record_kw)


class ReturnsItsParameter(torch.nn.Module):
    """A module whose output is its own Parameter of ``shape`` (a learned query or position table
    returned as it is): a leaf that requires grad even under no_grad, reused by every pass."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(*shape))

    def forward(self, x):
        return self.weight
