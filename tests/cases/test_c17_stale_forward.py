"""C17: one autocast region around the whole training loop: the forward keeps using step 0's weights."""

import pytest
import torch

from . import breadth as B
from .conftest import find


@pytest.mark.parametrize("variant", ["bf16_mlp", "fp16_conv"])
def test_c17_loss_bit_identical_while_weights_move(variant):
    d = B.c17(variant)
    losses = d.losses
    assert all(B.bitwise_equal(losses[0], x) for x in losses)  # the oracle: the loop's own losses
    assert d.moved > 0
    s = d.run.steps
    assert s.autocast_at_step.all()
    assert (s.loss == float(losses[0])).all()


@pytest.mark.parametrize("variant", ["bf16_mlp", "fp16_conv"])
def test_c17_finding(variant):
    rec = B.mpscope.advise(B.c17(variant).run)
    f = find(rec, "stale_forward")[0]
    assert (f.severity, f.step, f.value) == ("error", 0, 12.0)
    assert "optimizer.step()" in f.message and "autocast" in f.message
    assert "per forward" in f.fix and "cache_enabled=False" in f.fix


def test_c17_autocast_per_forward_is_not_stale():
    """Control: the same bf16 loop with autocast entered per forward trains (no stale_forward)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 16), torch.randn(32, 1)
    with B.mpscope.record(model, optimizer=opt) as rec:
        for _ in range(12):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            torch.nn.functional.mse_loss(out.float(), y).backward()
            opt.step()
    assert rec.run.steps.loss.nunique() > 1
    assert not [f for f in B.mpscope.advise(rec.run).findings if f.code == "stale_forward"]
