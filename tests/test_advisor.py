"""advise(): device-aware dtype choice, findings on real runs, and the advisor's own consistency."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mpscope
from mpscope import Run
from mpscope.schema import GRAD_SCALER_DEFAULTS

from cases import scenarios as S


def _codes(rec):
    return {f.code for f in rec.findings}


def _with_meta(run, **meta):
    return Run.from_frames(run.tensors, run.steps, run.histograms, {**run.meta, **meta})


# ---------------------------------------------------------------- dtype, device-aware

def test_dtype_follows_the_device():
    run = S.c08().run  # healthy fp16 run: both dtypes fit
    assert mpscope.advise(run).dtype == "float16"  # CPU: the run's own choice is kept
    ampere = mpscope.advise(_with_meta(run, device="cuda:0", autocast_device_type="cuda", cuda_capability=[8, 0]))
    assert ampere.dtype == "bfloat16" and ampere.grad_scaler is None
    volta = mpscope.advise(_with_meta(run, device="cuda:0", autocast_device_type="cuda", cuda_capability=[7, 0]))
    assert volta.dtype == "float16" and volta.grad_scaler is not None


def test_forward_overflow_on_a_gpu_without_bf16_keeps_modules_in_fp32():
    run = S.c01().run
    rec = mpscope.advise(_with_meta(run, device="cuda:0", autocast_device_type="cuda", cuda_capability=[7, 5]))
    assert rec.dtype == "float16"
    assert {"blocks.0.down", "blocks.1.down"} <= set(rec.fp32_modules)
    assert not any(m.endswith("norm") for m in rec.fp32_modules)  # CUDA autocast already runs norms in fp32
    cpu = mpscope.advise(run)
    # CPU autocast leaves norms in fp16: those with a warning or error finding, and only those, go to fp32
    flagged = {f.module for f in cpu.findings if f.severity != "info"}
    norms = {m for m in set(run.tensors.module.astype(str)) if m.split(".")[-1] == "norm"}  # RMSNorm modules
    listed = norms & set(cpu.evidence["fp16_fp32_modules"])
    assert listed and listed == {n for n in norms if any(f == n or (f or "").startswith(n + ".") for f in flagged)}


def test_exported_fp32_modules_fix_the_c01_forward():
    """The fp16 fallback for C01, exported and applied to the model: the forward is finite."""
    rec = mpscope.advise(S.c01().run)
    fp16 = mpscope.Recommendation(dtype="float16", grad_scaler=None, fp32_modules=rec.evidence["fp16_fp32_modules"],
                                  device_type="cpu")
    mod = _load_snippet(fp16)
    torch.manual_seed(0)
    model = S.C01Model()
    ids = torch.randint(0, 100, (8, 32))
    with torch.no_grad(), mod.autocast():
        assert not torch.isfinite(model(ids)).all()
    mod.keep_in_fp32(model)
    with torch.no_grad(), mod.autocast():
        assert torch.isfinite(model(ids)).all()


# ---------------------------------------------------------------- findings on real runs

def _scaled_loop(model, opt, scaler, batches, zero_grad=True, roles=S.GRAD_ROLES):
    with mpscope.record(model, optimizer=opt, scaler=scaler, roles=roles) as rec:
        for x, y in batches:
            if zero_grad:
                opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(F.mse_loss(out.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
    return rec.run


def test_stale_grad_and_scale_collapse():
    """Never zeroing gradients: the first overflow stays in .grad and the scale collapses."""
    model, x, y = S.c08_setup()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    run = _scaled_loop(model, opt, scaler, [(x, y)] * 24, zero_grad=False)
    assert run.steps.skipped.all() and run.steps.loss_scale.min() < 1
    rec = mpscope.advise(run)
    assert {"stale_grad", "scale_collapse"} <= _codes(rec)
    collapse = [f for f in rec.findings if f.code == "scale_collapse"][0]
    assert collapse.value < 1 == collapse.threshold
    assert "zero_grad" in [f for f in rec.findings if f.code == "stale_grad"][0].fix


def test_init_scale_too_high():
    model, x, y = S.c08_setup()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    run = _scaled_loop(model, opt, scaler, [(x, y)] * 40)
    rec = mpscope.advise(run)
    f = [f for f in rec.findings if f.code == "init_scale_too_high"][0]
    lead = int(run.steps.skipped.cumprod().sum())
    assert f.value == lead >= 10 and f.severity == "warning"
    # the recommended init_scale avoids those skips: replay and real GradScaler agree
    assert rec.predictions["recommended"]["skipped"] < rec.predictions["pytorch_default"]["skipped"] + lead


def test_activation_headroom():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with torch.no_grad():
        model[0].weight.fill_(0.0)
        model[0].bias.copy_(torch.linspace(-4e4, 4e4, 8))
    with mpscope.record(model) as rec:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(4, 8))
        rec.step()
    assert torch.isfinite(out).all()
    f = [f for f in mpscope.advise(rec.run).findings if f.code == "activation_headroom"]
    assert {x.module for x in f} == {"0", "1"}
    assert f[0].threshold == 2.0**15 and 2.0**15 <= f[0].value <= torch.finfo(torch.float16).max


def test_norm_parameters_below_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with mpscope.record(model, optimizer=opt) as rec:
        model(torch.randn(4, 16, dtype=torch.float16)).float().pow(2).mean().backward()
        opt.step()
    f = [f for f in mpscope.advise(rec.run).findings if f.code == "norm_statistics"]
    assert [x.module for x in f] == ["1"] and "float16" in f[0].message


def test_bad_input():
    with pytest.raises(TypeError, match="mpscope.Run"):
        mpscope.advise({"tensors": None})
    with pytest.raises(ValueError, match="dtype"):
        mpscope.Recommendation(dtype="fp16")
    with pytest.raises(ValueError, match="grad_scaler"):
        mpscope.Recommendation(dtype="float16", grad_scaler={"init_scale": 1.0})


# ---------------------------------------------------------------- consistency: retrain with the export

def _load_snippet(rec, tmp=None):
    import tempfile

    d = tempfile.mkdtemp()
    path = rec.export(f"{d}/amp_config.py", format="torch")
    spec = importlib.util.spec_from_file_location("mpscope_amp_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _C10Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = S.C10Model(torch.float32)

    def forward(self, _):
        return self.inner()


def _setups():
    """Per fp16 case: (name, run, make) with make() -> (model, opt, batches, loss_fn, max_grad_norm)."""

    def c06():
        model, x, y = S.c06_model()
        return model, torch.optim.SGD(model.parameters(), lr=1.0), [(x, y)] * 8, \
            lambda o, t: 1e-4 * F.mse_loss(o, t), None

    def c07():
        torch.manual_seed(0)
        model = nn.Linear(16, 1)
        x = torch.randn(64, 16)
        y = x @ torch.randn(16, 1) * 0.5
        return model, torch.optim.SGD(model.parameters(), lr=0.1), [(x, y)] * 20, F.mse_loss, 1.0

    def c08():
        model, x, y = S.c08_setup()
        return model, torch.optim.SGD(model.parameters(), lr=1e-4), [(x, y)] * 200, F.mse_loss, None

    def c09():
        torch.manual_seed(0)
        model = nn.Embedding(10, 4)  # fp32 master weights, as the recommendation says
        ids = torch.tensor([1, 2, 3])
        return model, torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8), [(ids, None)] * 10, \
            lambda o, t: o.pow(2).sum(), None

    def c10():
        torch.manual_seed(0)
        model = _C10Net()
        return model, torch.optim.Adam(model.parameters(), lr=6e-4), [(None, None)] * 10, lambda o, t: o, None

    return [("c06", lambda: S.c06(2.0**16).run, c06), ("c07", lambda: S.c07().bad.run, c07),
            ("c08", lambda: S.c08().run, c08), ("c09", lambda: S.c09().bad.run, c09),
            ("c10", lambda: S.c10().bad.run, c10)]


def _count_skips(mod, scaler, make):
    model, opt, batches, loss_fn, clip = make()
    mod.keep_in_fp32(model)
    skipped = 0
    for x, y in batches:
        before = scaler.get_scale()
        mod.train_step(model, opt, scaler, loss_fn, x, y, max_grad_norm=clip)
        skipped += scaler.get_scale() < before
    return skipped


@pytest.mark.parametrize("name,get_run,make", _setups(), ids=[s[0] for s in _setups()])
def test_exported_scaler_skips_no_more_than_pytorch_defaults(name, get_run, make):
    rec = mpscope.advise(get_run())
    if rec.dtype != "float16" or rec.grad_scaler is None:
        pytest.skip(f"{name}: no GradScaler recommended ({rec.dtype})")
    mod = _load_snippet(rec)
    ours = _count_skips(mod, mod.make_scaler("cpu"), make)
    default = _count_skips(mod, torch.amp.GradScaler("cpu"), make)
    print(name, "init_scale", rec.grad_scaler["init_scale"], "skipped", ours, "defaults", default)
    assert ours <= default
    assert math.log2(rec.grad_scaler["init_scale"]).is_integer()


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(32, 32)
        self.small = nn.Linear(32, 32)

    def forward(self, x):
        return self.big(x), self.small(x)


@pytest.mark.parametrize("factor", [1e-9, 1e-7])
def test_bf16_is_preferred_when_fp16_underflow_changes_a_gradient(factor):
    """Two heads whose gradients sit ``factor`` apart. At the largest safe loss scale 2^k_max the
    small head's output gradient is mostly subnormal in fp16 for both factors; bf16 is preferred
    on the CPU exactly when that rounding changes the gradient by over 1 % of its L1 norm (oracle:
    the fp32 gradient scaled and cast with .to(float16)): 3 % at 1e-9, 0.03 % at 1e-7."""
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(64, 32)
    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        with torch.autocast("cpu", dtype=torch.float16):
            big, small = model(x)
        loss = big.float().pow(2).mean() + factor * small.float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    cpu = mpscope.advise(rec.run)
    k = cpu.evidence["whatif"]["k_max"]
    s32 = model.small(x)
    (g,) = torch.autograd.grad(factor * s32.pow(2).mean(), s32)
    scaled = g * 2.0**k
    cast = scaled.to(torch.float16).float()
    assert float((cast.abs() < torch.finfo(torch.float16).tiny).float().mean()) > 0.5
    error = float((cast - scaled).abs().sum() / scaled.abs().sum())
    if error > 0.01:
        assert cpu.dtype == "bfloat16" and "'small'" in " ".join(cpu.reasons)
    else:
        assert cpu.dtype == "float16" and not any("tightly" in r for r in cpu.reasons)
    old_gpu = mpscope.advise(_with_meta(rec.run, device="cuda:0", autocast_device_type="cuda", cuda_capability=[7, 0]))
    assert old_gpu.dtype == "float16"  # no bf16 fast path: fp16 with a scaler still works
    # at 2^k_max the big head's weight gradient still fits fp16 with a binade to spare
    b32 = model.big(x)
    (gw,) = torch.autograd.grad(b32.pow(2).mean(), model.big.weight)
    assert float(gw.abs().max()) * 2.0**k < torch.finfo(torch.float16).max / 2


@pytest.mark.parametrize("spread", [2.0, 6.0, 12.0])
@pytest.mark.parametrize("k", [0, 8, 16, 24])
def test_underflow_error_bounds_the_error_of_a_cast_to_fp16(spread, k):
    """scaler.underflow_error from a tensor's exponent histogram is at least the relative L1 error
    that scaling by 2^k and casting to float16 makes (oracle: .to(torch.float16)), and within 4x
    of it when the tensor reaches below fp16's normal range."""
    from mpscope.advisor.scaler import underflow_error

    torch.manual_seed(k)
    x = torch.exp2(torch.randn(20_000, dtype=torch.float64) * spread - 24) * torch.randn(20_000, dtype=torch.float64).sign()
    e = torch.floor(torch.log2(x.abs())).long()
    exps, counts = torch.unique(e, return_counts=True)
    bound = underflow_error(exps.numpy(), counts.numpy(), k)
    scaled = x * 2.0**k
    lost = (scaled.to(torch.float16).double() - scaled).abs()
    lost = lost[scaled.abs() < torch.finfo(torch.float16).tiny]  # underflow's share, not normal rounding
    error = float(lost.sum() / scaled.abs().sum())
    assert error <= bound
    if error > 1e-6:
        assert bound <= 4 * error


@pytest.mark.parametrize("model_kind", ["demo_gpt", "gpt2"])
def test_a_healthy_fp16_run_is_told_so_and_keeps_its_settings(model_kind):
    """fp16 autocast + GradScaler on real text that trains well (falling loss, no step skipped by
    GradScaler itself): the advice keeps float16 and the run's own GradScaler settings, keeps no
    module in fp32, raises no warning or error, and its headline says so."""
    from mpscope.demo import GPT, CharDataset, GPTConfig
    from mpscope.summary import text_summary

    data = CharDataset.from_stdlib(64)
    torch.manual_seed(0)
    if model_kind == "gpt2":
        transformers = pytest.importorskip("transformers")
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=data.vocab_size, n_positions=64, n_embd=64, n_layer=2, n_head=4))

        def loss_of(x, y):
            return model(input_ids=x, labels=x).loss
    else:
        model = GPT(GPTConfig(vocab_size=data.vocab_size, d_model=64, n_layer=2, n_head=4, seq_len=64))

        def loss_of(x, y):
            return model(x, y)[1]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15)
    g, losses, scales = data.generator(0), [], []
    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        for _ in range(30):
            x, y = data.batch(8, g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(x, y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    assert scales == [2.0**15] * 30 and losses[-1] < 0.8 * losses[0]  # GradScaler's own account: no skip
    advice = mpscope.advise(rec.run)
    assert advice.dtype == "float16" and advice.fp32_modules == []
    assert advice.grad_scaler == dict(GRAD_SCALER_DEFAULTS, init_scale=2.0**15)
    assert not [f for f in advice.findings if f.severity != "info"]
    assert "no warning or error finding" in text_summary(rec.run, advice).splitlines()[-1]


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                      lambda p: torch.optim.Adam(p, lr=1e-3)], ids=["sgd_momentum", "adam"])
def test_optimizer_state_in_fp16_speaks_of_the_state_the_optimizer_keeps(make_opt):
    """An fp16 model stepped by SGD with momentum or by Adam: the optimizer_state_precision finding
    speaks of exp_avg_sq (and Adam's eps) only where the optimizer keeps one (oracle: its own
    state_dict's keys)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).half()
    opt = make_opt(model.parameters())
    x = torch.randn(16, 8, dtype=torch.float16)
    with mpscope.record(model, optimizer=opt) as rec:
        for _ in range(2):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
    keys = {k for st in opt.state_dict()["state"].values() for k in st}
    found = [f for f in mpscope.advise(rec.run).findings if f.code == "optimizer_state_precision"]
    assert found
    for f in found:
        assert ("exp_avg_sq" in f.message) == ("exp_avg_sq" in keys)
        assert ("eps" in f.message) == ("exp_avg_sq" in keys)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_fp16_is_kept_where_the_engine_verified_a_forward_repair_of_the_gradients_that_fit_no_scale(phase):
    """bfloat16 chosen for an fp16 run only because its gradients fit no loss scale, with the engine's
    verified float32 module repairing an error of the forward (the gradients are computed from it):
    float16 with that module in float32. A repair in the backward says nothing of that: bfloat16 stays."""
    import types

    import pandas as pd

    from mpscope.advisor.dtype import DtypeChoice
    from mpscope.advisor.recommendation import _engine_dtype
    from mpscope.recording.root_cause import COLUMNS

    row = dict.fromkeys(COLUMNS, "")
    row.update(step=0, spot="output", module="gn", op="aten.sub.Tensor", phase=phase, mechanism="cancellation",
               value=100.0, fix_modules="gn", fix_init_scale=float("nan"), verified=True)
    run = types.SimpleNamespace(tables={"forensics": pd.DataFrame([row], columns=COLUMNS)})
    d = DtypeChoice(dtype="bfloat16", reasons=["no loss scale fits the gradients into fp16"], fp32_modules=[],
                    fp16_fp32_modules=[], fp16_forward_ok=True, fp16_grad_ok=False, bf16_fast=True,
                    forward_absmax=711.0, forward_absmax_module="gn")
    out = _engine_dtype(d, run, types.SimpleNamespace(autocast="float16"))
    if phase == "forward":
        assert (out.dtype, out.fp32_modules) == ("float16", ["gn"]) and "float16 kept" in out.reasons[-1]
    else:
        assert out == d
