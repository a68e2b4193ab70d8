"""Efficient zero tensors (PyTorch's ``ZeroTensor``, ``torch._efficientzerotensor``) hold no data: some
derivative formulas and autograd Functions hand them to hooks as gradients, and a leaf's ``.grad``
can be one. Each place mpscope reads a tensor (a module's output, an activation's gradient, a
parameter's gradient in the step end's batch) records the zeros it stands for, on the fused kernel's
path and on the torch-op path alike, and the recording goes on. Op recording passes over them and
over the meta tensors PyTorch's ZeroTensor kernels compute shapes with (no data: no row)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import mpscope
from mpscope import kernel


class _ZeroGrad(torch.autograd.Function):
    """The identity, whose backward returns an efficient zero tensor."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return torch._efficientzerotensor(g.shape, dtype=g.dtype, device=g.device)


class _Gated(torch.nn.Module):
    """Scales by a weight whose gradient arrives as an efficient zero tensor (a leaf's .grad)."""

    def __init__(self, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * _ZeroGrad.apply(self.w)


class _Blocked(torch.nn.Module):
    """Passes values on and blocks their gradient (the input's gradient is an efficient zero tensor)."""

    def forward(self, x):
        return _ZeroGrad.apply(x)


class _ZeroOut(torch.nn.Module):
    """Returns an efficient zero tensor of its input's shape (a module's output)."""

    def forward(self, x):
        return x + torch._efficientzerotensor(x.shape, dtype=x.dtype)


def _train(model, path: str, monkeypatch, steps: int = 3, **options):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    if path == "torch ops":
        monkeypatch.setattr(kernel, "current", lambda start=True: None)
        monkeypatch.setattr(kernel, "core", lambda: None)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*internal error.*")  # (it would stop the recording)
        with mpscope.record(model, optimizer=opt, **options) as rec:
            for _ in range(steps):
                loss = model(torch.randn(4, 6, generator=g)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    return rec


def _zero_rows(frame, module: str, role: str, name: str, numel: int, steps: int) -> None:
    rows = frame[(frame.module == module) & (frame.role == role) & (frame.name == name)]
    assert sorted(rows.step) == list(range(steps)), f"{role} {module}/{name}: steps {sorted(rows.step)}"
    z = torch.zeros(numel)
    # the oracle: what PyTorch and NumPy casts say of zeros
    assert (rows.numel == numel).all()
    assert (rows.zero_frac == float((z.to(torch.float16) == 0).float().mean())).all()
    assert (rows.fp16_underflow_frac == 0).all() and (rows.bf16_overflow_frac == 0).all()
    assert (rows["max"] == float(np.float16(0))).all() and (rows["min"] == 0).all()
    assert rows.absmin_nonzero.isna().all()


@pytest.mark.parametrize("path", ["fused kernel", "torch ops"])
def test_zero_tensor_gradients_and_outputs_are_recorded_as_their_zeros(fused, path, monkeypatch):
    rec = _train(_model(), path, monkeypatch)
    df = rec.run.tensors
    assert rec.attached is False and not rec.run.meta.get("internal_error")
    assert len(rec.run.steps) == 3
    _zero_rows(df, "1", "param_grad", "w", 6, 3)  # a leaf's .grad: the step end's batch
    _zero_rows(df, "1", "activation_grad", "output", 24, 3)  # a gradient hook (below _Blocked)
    _zero_rows(df, "0", "activation_grad", "output", 24, 3)
    # the layers after the block still get real gradients and every layer its activation
    real = df[(df.module == "3") & (df.role == "activation_grad")]
    assert len(real) == 3 and (real.zero_frac < 1).all()
    assert set(df[df.role == "activation"].module) >= {"0", "1", "2", "3", "4", "5"}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), _Gated(6), _Blocked(), torch.nn.Linear(6, 6), _ZeroOut(),
                               torch.nn.Linear(6, 2))


def test_op_recording_passes_over_tensors_without_data(fused, monkeypatch):
    rec = _train(_model(), "fused kernel", monkeypatch, ops=True)
    df = rec.run.tensors
    assert len(rec.run.steps) == 3 and not rec.run.meta.get("internal_error")
    ops = df[df.role == "op_output"]
    assert len(ops) and set(ops.step) == {0, 1, 2}
    # the module rows are those of module recording, zeros included
    _zero_rows(df, "1", "param_grad", "w", 6, 3)
    _zero_rows(df, "1", "activation_grad", "output", 24, 3)
