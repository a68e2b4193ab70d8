"""The hooks' usual path in C++ (the kernel's ``forward_hook`` and ``observe_now``) does what the Python
form (``ActivationHooks.on_forward``, ``Observer.observe_now``, ``GradHooks.add``) does: the same frames,
row for row, on real training with the same kernel statistics, as a CPU run records (host rows) and
as a GPU run records (staged rows); and each path really runs where it should."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest
import torch

import mpscope
from mpscope.recording import step_buffer
from mpscope.recording.activations import ActivationHooks
from mpscope.recording.observer import Observer

transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


class _CheckpointedMLP(torch.nn.Module):
    """A body (in-place ReLU, Identity) run under non-reentrant activation checkpointing, and a head."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(inplace=True), torch.nn.Identity(),
                                        torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False))


def _mlp():
    torch.manual_seed(0)
    return _CheckpointedMLP()


def _train(make, fast: bool, monkeypatch, counts: dict):
    """Four steps of float16 autocast training with a GradScaler, an evaluation pass between steps,
    activation checkpointing in the MLP's body, the C++ path on (``fast``) or off."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    begin, on_forward, observe_now = Observer.begin_step, ActivationHooks.on_forward, Observer.observe_now

    def begin_step(self, *args):
        begin(self, *args)
        if not fast:
            self.fast = None

    def counted(name, f):
        def run(self, *a, **k):
            counts[name] = counts.get(name, 0) + 1
            return f(self, *a, **k)
        return run

    with monkeypatch.context() as m, warnings.catch_warnings():
        m.setattr(Observer, "begin_step", begin_step)
        m.setattr(ActivationHooks, "on_forward", counted("python forward", on_forward))
        m.setattr(Observer, "observe_now", counted("python observe", observe_now))
        warnings.filterwarnings("error", message=".*internal error.*")
        with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
            for step in range(4):
                with torch.autocast("cpu", dtype=torch.float16):
                    if isinstance(model, transformers.GPT2LMHeadModel):
                        ids = torch.randint(0, 97, (2, 16), generator=g)
                        loss = model(ids, labels=ids).loss
                    else:
                        x = torch.randn(8, 12, generator=g) * 10.0 ** (step - 2)
                        loss = model(x).float().square().mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                with torch.no_grad():  # an evaluation pass: its rows are dropped
                    model(torch.randn(2, 12)) if not isinstance(model, transformers.GPT2LMHeadModel) else \
                        model(torch.randint(0, 97, (1, 8), generator=g))
    assert rec.run.meta.get("recording_error") is None
    return rec.run


@pytest.mark.parametrize("staged", [False, True], ids=["host rows", "staged rows"])
@pytest.mark.parametrize("make", [_gpt2, _mlp], ids=["gpt2", "mlp"])
def test_the_cpp_hook_path_records_what_the_python_form_records(fused, monkeypatch, make, staged):
    monkeypatch.setattr(step_buffer.StepBuffer, "stage_cpu", staged)
    python_counts, fast_counts = {}, {}
    slow = _train(make, False, monkeypatch, python_counts)
    fast = _train(make, True, monkeypatch, fast_counts)
    for name in ("tensors", "steps", "histograms"):
        a, b = getattr(slow, name), getattr(fast, name)
        assert len(a) > 0
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True), check_exact=True)
    # the C++ path took the usual hooks: the Python form only what it leaves (outputs in containers,
    # re-runs inside backward; the first step's new keys, tensors seen again: a Dropout(p=0) returns
    # its input, and its gradient flows on as the same tensor)
    assert fast_counts.get("python forward", 0) < python_counts["python forward"] / 3
    # (in the MLP about 60 %: its checkpointed body's re-run, the Identity's input seen again and the
    # first step's new keys are the Python form's, and which steps the GradScaler skips varies)
    assert fast_counts.get("python observe", 0) < python_counts["python observe"] * 0.7
