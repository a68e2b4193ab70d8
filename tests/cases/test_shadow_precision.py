"""Precision losses without a range signature (C11 positions, C14 timesteps, a running sum), found by
the fp32 shadow: the culprit has the lowest own-contribution SQNR, ``precision_loss`` names it, the
fp32 modules chosen from the shadow bring the output back, and the healthy controls stay quiet."""

from __future__ import annotations

import contextlib
import copy
import functools
import math

import numpy as np
import pytest
import torch

import mpscope
from mpscope.advisor.precision import OUTPUT_TARGET_MARGIN_DB, PRECISION_LOSS_MARGIN_DB
from mpscope.formats import BF16

from .shadow_scenarios import SCENARIOS

STEPS = 3


def _train(name: str, fixed: bool, advice=None, start: dict | None = None):
    """A few real AdamW steps under CPU autocast(bfloat16), recorded with the shadow; with ``advice``
    the unchanged loop runs inside ``mpscope.apply(model, advice)``. ``start`` (a dict) receives the
    untrained model and the first batch."""
    cls, batch, _ = SCENARIOS[name]
    torch.manual_seed(0)
    model = cls(fixed=fixed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [batch() for _ in range(STEPS)]
    if start is not None:
        start.update(model=copy.deepcopy(model), batch=batches[0])
    applied = mpscope.apply(model, advice) if advice is not None else contextlib.nullcontext()
    with mpscope.record(model, opt, shadow=True) as rec, applied:
        for args in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(*args)
            loss = out.float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return rec.run


@functools.lru_cache(maxsize=None)
def scenario(name: str, fixed: bool):
    run = _train(name, fixed)
    return run, mpscope.advise(run)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_culprit_has_the_lowest_own_sqnr_and_is_named(name):
    culprit = SCENARIOS[name][2]
    run, advice = scenario(name, False)
    p = run.precision
    assert sorted(set(p.step)) == list(range(STEPS))
    ideal = BF16.ideal_sqnr_db
    assert ideal == pytest.approx(20 * math.log10(2) * (-math.log2(torch.finfo(torch.bfloat16).eps) + 1))
    for step, g in p[p.module != ""].groupby("step"):
        worst = g.sort_values("own_sqnr_db").iloc[0]
        assert worst.module == culprit, (step, g[["module", "own_sqnr_db"]])
        assert worst.own_sqnr_db < ideal - PRECISION_LOSS_MARGIN_DB
        # every other module adds no more than a few roundings of its own
        others = g[g.module != culprit].own_sqnr_db
        assert (others > ideal - 10).all(), g[["module", "own_sqnr_db"]]
    fs = [f for f in advice.findings if f.code == "precision_loss"]
    assert [f.module for f in fs] == [culprit]
    f = fs[0]
    assert (f.severity, f.role, f.name, f.step) == ("warning", "activation", "output", 0)
    own = p[p.module == culprit].own_sqnr_db
    assert f.value == pytest.approx(float(np.median(own))) and f.threshold == pytest.approx(ideal - 20)
    assert f"'{culprit}'" in f.message and "float32" in f.fix
    assert advice.fp32_modules == [culprit]
    assert advice.evidence["fp32_modules_from"] == "fp32 shadow"
    assert advice.evidence["shadow"]["modules"] == [culprit]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_healthy_controls_have_no_precision_loss(name):
    run, advice = scenario(name, True)
    assert not [f for f in advice.findings if f.code == "precision_loss"]
    assert advice.fp32_modules == []
    out = run.precision[run.precision.module == ""].sqnr_db
    assert (out > BF16.ideal_sqnr_db - OUTPUT_TARGET_MARGIN_DB).all()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fp32_modules_from_the_shadow_restore_the_output(name):
    run, advice = scenario(name, False)
    target = advice.evidence["shadow"]["target_db"]
    assert target == pytest.approx(BF16.ideal_sqnr_db - OUTPUT_TARGET_MARGIN_DB)
    before = run.precision[run.precision.module == ""].sqnr_db
    assert (before < target).all()
    assert advice.dtype == "bfloat16" and advice.fp32_modules
    # the unchanged loop with the recommendation applied (mpscope.apply: the chosen modules run with
    # autocast off and float32 inputs), recorded with the shadow again
    start: dict = {}
    fixed = _train(name, False, advice=advice, start=start)
    after = fixed.precision[fixed.precision.module == ""].sqnr_db
    assert (after >= target).all(), after
    # oracle outside the shadow: the untrained model on the first batch, applied recommendation
    # under the loop's autocast against a plain float32 forward, compared in NumPy float64
    model, args = start["model"], start["batch"]
    with torch.no_grad():
        ref = model(*args).double().numpy()
        with mpscope.apply(model, advice), torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(*args).double().numpy()
    measured = 10 * np.log10(np.sum(ref ** 2) / np.sum((low - ref) ** 2))
    assert measured >= target
    assert float(after.iloc[0]) == pytest.approx(measured, rel=1e-9)


@pytest.mark.parametrize("name", ["positions", "timesteps"])
def test_shadow_check_ranks_the_culprit_first(name):
    cls, batch, culprit = SCENARIOS[name]
    torch.manual_seed(0)
    model = cls()
    inputs = batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    chk = mpscope.shadow_check(model, inputs, dtype=torch.bfloat16)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert chk.culprits.module.iloc[0] == culprit and chk.culprits.flagged.iloc[0]
    assert not chk.culprits.flagged.iloc[1:].any()
    assert [f.module for f in chk.findings] == [culprit]
    assert chk.output_sqnr_db < chk.target_db <= chk.fixed_output_sqnr_db
    assert chk.fp32_modules == [culprit]
    assert set(chk.table.module) == {n for n, _ in model.named_modules()}
    assert culprit in str(chk)
    # the measured set, applied as mpscope.apply applies a recommendation, gives the measured SQNR
    advice = mpscope.Recommendation(dtype="bfloat16", grad_scaler=None, fp32_modules=chk.fp32_modules)
    with torch.no_grad():
        ref = model(*inputs).double().numpy()
        with mpscope.apply(model, advice), torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(*inputs).double().numpy()
    measured = 10 * np.log10(np.sum(ref ** 2) / np.sum((low - ref) ** 2))
    assert chk.fixed_output_sqnr_db == pytest.approx(measured, rel=1e-9)
