"""simulate_scaler / scale_whatif against PyTorch's own GradScaler and casts (the oracles)."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mpscope
from mpscope.advisor.scaler import scaler_agreement, update_scale

from cases import scenarios as S


@pytest.mark.parametrize("growth_interval", [1, 3, 7])
@pytest.mark.parametrize("factors", [(2.0, 0.5), (4.0, 0.25), (1.5, 0.8)])
def test_update_rule_equals_amp_update_scale(growth_interval, factors):
    growth, backoff = factors
    rng = np.random.default_rng(0)
    found = rng.random(300) < 0.2
    scale_t = torch.tensor([2.0**16])
    tracker_t = torch.tensor([0], dtype=torch.int32)
    scale, tracker = np.float32(2.0**16), 0
    for f in found:
        torch._amp_update_scale_(scale_t, tracker_t, torch.tensor([float(f)]), growth, backoff, growth_interval)
        scale, tracker = update_scale(scale, tracker, bool(f), growth, backoff, growth_interval)
        assert float(scale) == scale_t.item() and tracker == tracker_t.item()


def test_update_rule_keeps_scale_finite_like_torch():
    scale_t = torch.tensor([2.0**127])
    tracker_t = torch.tensor([0], dtype=torch.int32)
    torch._amp_update_scale_(scale_t, tracker_t, torch.tensor([0.0]), 2.0, 0.5, 1)
    scale, tracker = update_scale(np.float32(2.0**127), 0, False, 2.0, 0.5, 1)
    assert float(scale) == scale_t.item() == 2.0**127 and tracker == tracker_t.item() == 0


def test_defaults_are_gradscalers():
    sig = inspect.signature(torch.amp.GradScaler.__init__).parameters
    ours = inspect.signature(mpscope.simulate_scaler).parameters
    for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval"):
        assert ours[k].default == sig[k].default


# ---------------------------------------------------------------- three recorded fp16 runs

def _hf_run():
    """A Hugging Face GPT-2 (small config, random weights) on real text, fp16 autocast + GradScaler."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    text = open(inspect.getsourcefile(inspect)).read()  # real text shipped with Python
    ids = torch.tensor([min(ord(c), 127) for c in text[: 24 * 8 * 32]]).view(24, 8, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=4)
    with mpscope.record(model, optimizer=opt, scaler=scaler, roles=S.GRAD_ROLES) as rec:
        for batch in ids:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(batch).logits
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, 128), batch[:, 1:].reshape(-1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return rec.run


RUNS = {"c08": lambda: S.c08().run, "c07": lambda: S.c07().bad.run, "hf_gpt2": _hf_run}


@pytest.fixture(scope="module")
def agreements():
    out = {}
    for name, make in RUNS.items():
        run = make()
        out[name] = (run, scaler_agreement(run))
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_replay_agrees_with_the_real_gradscaler(agreements, name):
    run, a = agreements[name]
    assert a["real_skipped"] > 0, "the run must exercise the scaler"
    assert a["agree_frac"] >= 0.95
    assert abs(a["sim_skipped"] - a["real_skipped"]) <= 1
    print(name, a)


def test_replay_reproduces_the_scale_trajectory(agreements):
    run, _ = agreements["c08"]
    cfg = run.meta["scaler"]
    sim = mpscope.simulate_scaler(run, cfg["init_scale"], cfg["growth_factor"], cfg["backoff_factor"],
                                  cfg["growth_interval"])
    s = run.steps
    assert (sim.scale.to_numpy() == s.loss_scale.to_numpy()).mean() >= 0.95
    assert list(sim.columns[:4]) == ["step", "scale", "found_inf", "skipped"]


def test_replay_predicts_another_config():
    """Replay C08 under another GradScaler config; retrain with that config for real and compare."""
    run = S.c08().run
    cfg = {"init_scale": 2.0**8, "growth_interval": 100}
    sim = mpscope.simulate_scaler(run, **cfg)
    real_skipped, _ = S.train_c08(cfg)
    assert abs(int(sim.skipped.sum()) - real_skipped) <= 2


def test_bad_arguments_raise():
    run = S.c08().run
    with pytest.raises(ValueError, match="growth_factor"):
        mpscope.simulate_scaler(run, growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        mpscope.simulate_scaler(run, backoff_factor=2.0)
    with pytest.raises(TypeError, match="mpscope.Run"):
        mpscope.simulate_scaler(object())


# ---------------------------------------------------------------- what-if vs casts

def test_whatif_matches_casts_of_recorded_gradients():
    """The what-if from histograms vs casting the actual unscaled gradients x 2^k to fp16."""
    model, x, y = S.c06_model()
    grads = []
    for m in model.children():
        m.register_forward_hook(lambda mod, i, o: o.register_hook(lambda g: grads.append(g.float())) and None)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with mpscope.record(model, optimizer=opt, roles=["activation_grad"]) as rec:
        S.c06_loss(model, x, y).float().backward()  # fp32 loss; the activation grads are fp16
        opt.step()
    w = mpscope.scale_whatif(rec.run, ks=range(10, 40, 3), roles=["activation_grad"]).set_index("k")
    allg = torch.cat([g.flatten() for g in grads[: len(grads)]])
    allg = allg[(allg != 0) & torch.isfinite(allg)].double()
    for k in w.index:
        cast = (allg * 2.0**k).to(torch.float16).float().abs()
        over = float((~torch.isfinite(cast)).double().mean())
        zero = float((cast == 0).double().mean())
        sub = float(((cast > 0) & (cast < torch.finfo(torch.float16).tiny)).double().mean())
        assert w.loc[k, "overflow_frac"] == pytest.approx(over, abs=1e-3)
        assert w.loc[k, "underflow_frac"] == pytest.approx(zero, abs=1e-3)
        assert w.loc[k, "subnormal_frac"] == pytest.approx(sub, abs=2e-3)


def test_whatif_per_module_sums_to_total():
    run = S.c06(2.0**16).run
    tot = mpscope.scale_whatif(run, ks=[16, 25]).set_index("k")
    per = mpscope.scale_whatif(run, ks=[16, 25], per_module=True)
    for k in (16, 25):
        p = per[per.k == k]
        weighted = (p.underflow_frac * p["count"]).sum() / p["count"].sum()
        assert weighted == pytest.approx(tot.loc[k, "underflow_frac"])
        assert p["count"].sum() == tot.loc[k, "count"]


def test_replay_with_sampled_steps():
    """Recording every 5th step only: unrecorded steps borrow the nearest recorded maximum,
    bounded by what the real scaler saw; agreement must still hold."""
    run = S.c08().run
    keep = run.tensors.step % 5 == 0
    steps = run.steps.assign(recorded=run.steps.step % 5 == 0)
    sampled = mpscope.Run.from_frames(run.tensors[keep].reset_index(drop=True), steps,
                                      run.histograms[run.histograms.step % 5 == 0], run.meta)
    a = scaler_agreement(sampled)
    assert a["agree_frac"] >= 0.95 and abs(a["sim_skipped"] - a["real_skipped"]) <= 1
