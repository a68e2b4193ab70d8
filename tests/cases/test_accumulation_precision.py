"""accumulation_precision: a running sum kept in bfloat16 loses its increments (swamping).

The case: gradient accumulation over 16 micro-batches into the bfloat16 ``.grad`` of a character
MLP language model trained on the standard library's source. The second member: a bfloat16 EMA
buffer (a running-mean input normaliser) that stops following its inputs. Oracles: PyTorch's own
``(acc + g) == acc`` on the actual tensors, the same accumulation / EMA in float32, and the
buffer's own values before and after each update.
"""

from __future__ import annotations

import math

import pytest
import torch

import mpscope
from mpscope.advisor.accumulation import SWAMPED_MIN_FRAC

from . import accumulation as A
from . import scenarios as S
from .conftest import find


def _acc_findings(run):
    return [f for f in mpscope.advise(run).findings if f.code == "accumulation_precision"]


def test_grad_accumulation_swamped_increments_are_counted_exactly():
    d = A.grad_accum()
    g = d.run.tables["grad_accumulation"]
    per_step = g.groupby("step")[["increments", "swamped"]].sum()
    # the recorder's counts are the oracle's: torch's (acc + g) == acc on the same tensors
    assert per_step.increments.tolist() == d.increments
    assert per_step.swamped.tolist() == d.swamped
    assert all(s > 0 for s in d.swamped)
    assert set(g.micro_batches) == {15}  # micro-batches 2..16 add into an existing .grad
    assert set(g.dtype) == {"bfloat16"}
    assert (d.run.steps.backward_count == 16).all()
    # the float32 accumulation of the same increments differs from the bfloat16 .grad
    assert all(n > 0 for n in d.differ_fp32)


def test_grad_accumulation_finding():
    d = A.grad_accum()
    rec = mpscope.advise(d.run)
    f = find(rec, "accumulation_precision")[0]
    frac = sum(d.swamped) / sum(d.increments)
    assert frac > SWAMPED_MIN_FRAC
    assert (f.severity, f.role, f.step, f.threshold) == ("warning", "param_grad", 0, SWAMPED_MIN_FRAC)
    assert f.value == pytest.approx(frac, rel=1e-12)
    assert f"{sum(d.swamped)} (" in f.message and "16 micro-batches" in f.message and "bfloat16" in f.message
    assert "float32" in f.fix and "autocast" in f.fix
    # the recommendation keeps parameters (and so .grad) in float32, without a GradScaler
    assert rec.param_dtype == "float32" and rec.grad_scaler is None


def test_bf16_ema_buffer_stops_following_its_inputs():
    e = A.ema()
    f = e.run.tables["op_facts"]
    f = f[f.acc_increments.notna()]
    assert f.acc_increments.astype(int).tolist() == e.increments
    assert f.acc_swamped.astype(int).tolist() == e.swamped
    # the float32 EMA of the same batch means follows the drifting data; the bfloat16 one lags
    assert (e.target - e.ema_fp32).abs().mean() < (e.target - e.ema).abs().mean()
    rec = mpscope.advise(e.run)
    fd = find(rec, "accumulation_precision", module="0")[0]
    assert fd.role == "op_output" and fd.name.startswith("aten.lerp_")
    assert fd.value == pytest.approx(sum(e.swamped) / sum(e.increments), rel=1e-12)
    frozen = sum(s == n for s, n in zip(e.swamped, e.increments))
    assert f"{frozen} of the {len(e.increments)} updates changed nothing" in fd.message
    assert "float32" in fd.fix


BUILDERS = {"grad_accum": (A.grad_accum, A.grad_accum_train), "ema": (A.ema, A.ema_train)}


@pytest.mark.parametrize("member", list(BUILDERS))
def test_apply_round_trip_and_fp32_control(member):
    """record -> advise -> mpscope.apply -> record again: parameters and buffers kept in float32
    under bfloat16 autocast (the healthy control: the same loop with fp32 parameters) give no
    accumulation_precision finding and (by the same oracle, in float32) at most a negligible
    fraction of the increments is swamped; the loss stays finite and decreases."""
    recorded, train = BUILDERS[member]
    rec = mpscope.advise(recorded().run)
    assert "accumulation_precision" in {f.code for f in rec.findings}
    after = train(apply=rec)
    assert not _acc_findings(after.run)
    assert "grad_accumulation" not in after.run.tables
    assert sum(after.increments) > 0 and sum(after.swamped) < SWAMPED_MIN_FRAC * sum(after.increments)
    assert not mpscope.advise(after.run).errors
    assert all(math.isfinite(v) for v in after.losses) and after.losses[-1] < after.losses[0]


def test_healthy_controls_have_no_accumulation_finding(tmp_path):
    assert not _acc_findings(S.c08().run)
    run = mpscope.demo.run_demo(steps=2, out=tmp_path, device="cpu", quiet=True, batch_size=2)
    assert not _acc_findings(run)


def test_bf16_weight_ema_updated_in_the_loop():
    """A third member, outside the model: an EMA copy of bfloat16 weights (decay 0.999) updated with
    lerp_ in the training loop. Nearly every update is below half an ulp of the EMA weights, so the
    EMA barely moves; the op recorder sees it (module "", the root) and counts it exactly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ema = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(64, 16).to(torch.bfloat16), torch.randn(64, 1)
    increments = swamped = frozen = updates = 0
    with mpscope.record(model, optimizer=opt, ops=True) as r:
        for _ in range(6):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema, model.parameters()):
                    old = e.clone()
                    e.lerp_(p, 1 - 0.999)
                    moves = p != old  # the oracle: the EMA tensors themselves, before and after
                    n, lost = int(moves.sum()), int((moves & (e == old)).sum())
                    increments, swamped, updates = increments + n, swamped + lost, updates + (n > 0)
                    frozen += n > 0 and lost == n
    assert swamped > 0.9 * increments > 0
    f = find(mpscope.advise(r.run), "accumulation_precision", module="")[0]
    assert f.value == pytest.approx(swamped / increments, rel=1e-12) and f.name.startswith("aten.lerp_")
    assert f"{swamped} of {increments} non-zero increments" in f.message
    assert f"{frozen} of the {updates} updates changed nothing" in f.message


def test_bound_without_per_increment_counts():
    """A run without ``tables["grad_accumulation"]`` (saved by an older mpscope) falls back to the
    documented bound: N micro-batches > 2 * absmax / ulp(absmax), the ulp from torch.finfo. A bias
    trained on a constant target with 520 micro-batches of one sample: its gradient increments are
    all alike, so the bound and the exact count agree; with the 16 micro-batches of the MLP case the
    bound stays silent (it needs >= 256 in bfloat16)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(1, 4).to(torch.bfloat16)
    n = 520  # above 512: every bfloat16 element is past the bound (2 * absmax / ulp < 512)
    with mpscope.record(model, optimizer=opt) as r:
        opt.zero_grad()
        for _ in range(n):
            (model(x).float() - 4.0).pow(2).mean().backward()
        opt.step()
    run = r.run
    exact = _acc_findings(run)
    assert exact and exact[0].role == "param_grad"
    del run.tables["grad_accumulation"]
    t = run.tensors
    pg = t[(t.role.astype(str) == "param_grad")]
    eps = torch.finfo(torch.bfloat16).eps
    bounds = {str(row["name"]): 2 * row.absmax / math.ldexp(eps, math.frexp(row.absmax)[1] - 1)
              for _, row in pg.iterrows()}
    f = _acc_findings(run)[0]
    assert f.value == n and f.threshold == pytest.approx(bounds[f.name]) and f.threshold < n
    assert "a bound" in f.message
    quiet = A.grad_accum().run
    saved = quiet.tables.pop("grad_accumulation")
    try:
        assert not _acc_findings(quiet)
    finally:
        quiet.tables["grad_accumulation"] = saved
