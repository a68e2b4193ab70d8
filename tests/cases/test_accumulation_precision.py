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
