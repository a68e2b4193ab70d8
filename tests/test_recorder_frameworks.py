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


def _sgd_loop(model, opt, steps, rec_step=None, batch=None):
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(3)), torch.randn(8, 1)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        if rec_step is not None:
            rec_step()


def test_record_without_optimizer_adopts_the_one_stepping_the_model():
    model = _mlp()
    other = torch.nn.Linear(2, 2)  # an optimizer of another model is not adopted
    opt_other = torch.optim.SGD(other.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    opt.register_step_post_hook(lambda o, a, k: losses.append(None))
    with mpscope.record(model) as rec:
        other(torch.randn(1, 2)).sum().backward()
        opt_other.step()
        _sgd_loop(model, opt, 4)
    s = rec.run.steps
    assert len(s) == len(losses) == 4 and list(s.backward_count[1:]) == [1, 1, 1]
    assert rec.run.meta["optimizer"] == "SGD"
    # a loop that ends its steps by hand keeps doing so
    with mpscope.record(model) as rec:
        _sgd_loop(model, opt, 3, rec_step=lambda: rec.step())
    assert len(rec.run.steps) == 3 and list(rec.run.steps.backward_count) == [1, 1, 1]
    with mpscope.record(model, auto=False) as rec:
        _sgd_loop(model, opt, 3)
    assert len(rec.run.steps) == 1  # nothing ends the steps: one row, as asked


accelerate = pytest.importorskip("accelerate")


def _accelerator(mixed_precision):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, mixed_precision="bf16" if mixed_precision == "bf16" else "no",
                      gradient_accumulation_steps=2)
    if mixed_precision == "fp16":
        # Accelerate's GPU fp16 path (autocast float16 around forward, a GradScaler) on the CPU
        acc.state._mixed_precision = "fp16"
        acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu", init_scale=2.0**10)
    return acc


@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16"])
def test_accelerate_loop(mixed_precision):
    acc = _accelerator(mixed_precision)
    model = _mlp()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = torch.randn(32, 8, generator=torch.Generator().manual_seed(0)), torch.randn(32, 1)
    skipped, scales = [], []
    with mpscope.record(model, accelerator=acc) as rec:
        for i in range(8):  # 8 micro-batches, 4 optimizer steps
            with acc.accumulate(model):
                loss = F.mse_loss(model(x[i * 4:(i + 1) * 4]), y[i * 4:(i + 1) * 4])
                acc.backward(loss * (math.inf if i in (2, 3) else 1.0))
                opt.step()
                opt.zero_grad()
                if acc.sync_gradients:
                    skipped.append(acc.optimizer_step_was_skipped)
                    scales.append(acc.scaler.get_scale() if acc.scaler else 1.0)
    run = rec.run
    assert run.meta["optimizer"] == "AdamW"  # the torch optimizer under AcceleratedOptimizer
    assert run.meta["autocast_dtype"] == ("bfloat16" if mixed_precision == "bf16" else "float16")
    s = run.steps
    assert len(s) == 4 and list(s.backward_count) == [2] * 4
    assert s.skipped.tolist() == skipped
    assert s.scale_after.tolist() == scales
    if mixed_precision == "fp16":
        assert skipped == [False, True, False, False] and run.meta["scaler"]["init_scale"] == 2.0**10
    else:
        assert run.meta["scaler"] is None


def test_accelerator_argument_checked():
    with pytest.raises(mpscope.recorder.RecorderError, match="accelerate.Accelerator"):
        mpscope.record(_mlp(), accelerator=object())
