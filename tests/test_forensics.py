"""Precision forensics (record(ops=True, shadow=True)): each mechanism, in the phases where it occurs,
on members built here (not the ../shared/cases scripts), checked against float64 evaluation,
torch.finfo and the replayed fix; plus healthy controls with no finding."""

import copy
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mpscope
from mpscope.recording.root_cause import MECHANISMS
from mpscope.schema import GRAD_SCALER_DEFAULTS

FP16_MAX = torch.finfo(torch.float16).max


def _record(model, loop, optimizer=None, scaler=None):
    with mpscope.record(model, optimizer=optimizer, scaler=scaler, ops=True, shadow=True) as rec:
        loop(rec)
    run = rec.run
    return run, mpscope.advise(run)


def _amp_loop(m, opt, loss_of, dtype, steps=2, scaler=None):
    """The documented mixed-precision loop, ``loop(rec)`` for :func:`_record`: ``loss_of()`` under
    autocast(``dtype``), backward (through ``scaler`` when given), the optimizer step."""
    def loop(rec):
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_of()
            if scaler is None:
                loss.float().backward()
                opt.step()
            else:
                scaler.scale(loss.float()).backward()
                scaler.step(opt)
                scaler.update()
    return loop


def _engine(adv, code):
    return [f for f in adv.findings if f.code == code]


def _rows(run):
    return run.tables["forensics"]


# ----------------------------------------------------------------------------- cancellation -> domain, forward
class OnePassNorm(nn.Module):
    """Variance as E[x^2] - E[x]^2 (one pass), then sqrt: cancels for data with a large mean."""

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - m * m
        return (x - m) / var.sqrt()


class Feature(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 64)
        self.norm = OnePassNorm()
        self.out = nn.Linear(64, 1)

    def forward(self, x):
        return self.out(self.norm(self.proj(x) + 60.0))


def test_cancellation_in_a_one_pass_variance_is_named_and_its_module_in_fp32_verified():
    torch.manual_seed(0)
    m = Feature()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(32, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):  # the failure without mpscope
        h = (m.proj(x) + 60.0)
        var16 = (h * h).mean(-1) - h.mean(-1) ** 2
    h64 = (m.proj(x).double() + 60.0)
    var64 = h64.var(-1, unbiased=False)
    assert bool((var64 > 0).all()) and bool((var16 <= 0).any())  # oracle: float64 positive, fp16 not

    run, adv = _record(m, _amp_loop(m, opt, lambda: m(x).float().pow(2).mean(), torch.float16), opt)
    hits = [f for f in adv.findings if f.code in ("cancellation", "domain") and f.module == "norm"]
    assert hits, [(f.code, f.module) for f in adv.findings]
    rows = _rows(run)
    r = rows[rows.module == "norm"].iloc[0]
    assert r.mechanism in ("cancellation", "domain") and r.phase == "forward"
    assert bool(r.verified) and r.fix_modules == "norm"
    assert "norm" in adv.fp32_modules
    assert any(f["verified"] and f["fp32_modules"] == ["norm"] for f in adv.evidence["fixes"])


# ----------------------------------------------------------------------------- saturation, backward
class TanhHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, h):
        return torch.tanh(self.fc(h))


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 8)
        self.head = TanhHead()
        with torch.no_grad():
            self.head.fc.bias[:2] = 5.0  # two outputs start saturated

    def forward(self, x):
        return self.head(self.body(x))


def test_saturated_bf16_tanh_whose_backward_vanishes_is_named_at_the_tanh():
    torch.manual_seed(0)
    m = Regressor()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    x, y = torch.randn(64, 16), torch.zeros(64, 4)
    z = m.head.fc(m.body(x)).detach()
    # oracle: bf16 tanh rounds to exactly 1 there, float64's derivative 1 - tanh^2 is not 0
    assert bool((torch.tanh(z.bfloat16())[:, :2] == 1).any())
    assert float((1 - torch.tanh(z.double()[:, :2]) ** 2).min()) > 0

    run, adv = _record(m, _amp_loop(m, opt, lambda: F.mse_loss(m(x).float(), y), torch.bfloat16), opt)
    hits = _engine(adv, "saturation")
    assert hits and hits[0].module == "head", [(f.code, f.module) for f in adv.findings]
    assert "tanh" in hits[0].message and "exactly 1" in hits[0].message
    rows = _rows(run)
    assert set(rows[rows.mechanism == "saturation"].spot) == {"gradient"}
    assert bool(rows[rows.mechanism == "saturation"].verified.all())
    assert "head" in adv.fp32_modules


# ----------------------------------------------------------------------------- swamping, state (a buffer in the loop)
class WithRunningMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.stats = nn.Module()
        self.stats.register_buffer("mean", torch.full((8,), 4.0, dtype=torch.float16))

    def forward(self, x):
        return self.fc(x)


def test_fp16_running_mean_whose_increments_round_away_is_swamping_in_state():
    torch.manual_seed(0)
    m = WithRunningMean()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    x = torch.randn(32, 8)
    inc = 1e-4 * (x.mean(0).half() - m.stats.mean)
    # oracle: fp16 cannot hold 4 + inc (half an ulp at 4 is 2^-9 = 0.002); float64 can
    assert bool(((m.stats.mean + inc) == m.stats.mean).all())
    assert bool(((m.stats.mean.double() + inc.double()) != 4.0).all())

    def loop(rec):
        for _ in range(2):
            opt.zero_grad()
            out = m(x)
            out.pow(2).mean().backward()
            opt.step()
            with torch.no_grad():
                m.stats.mean.add_(1e-4 * (x.mean(0).half() - m.stats.mean))
    run, adv = _record(m, loop, opt)
    hits = _engine(adv, "swamping")
    assert hits and hits[0].module == "stats", [(f.code, f.module, f.message) for f in adv.findings]
    rows = _rows(run)
    r = rows[rows.mechanism == "swamping"].iloc[0]
    assert r.phase == "state" and bool(r.verified)


# ----------------------------------------------------------------------------- swamping, optimizer (bf16 weights)
def test_bf16_weights_whose_sgd_updates_round_away_is_swamping_in_the_optimizer():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)).to(torch.bfloat16)
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)
    x, y = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(64, 1, dtype=torch.bfloat16)

    def loop(rec):
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    w0 = m[0].weight.detach().clone()
    run, adv = _record(m, loop, opt)
    assert torch.equal(m[0].weight, w0) or float((m[0].weight != w0).float().mean()) < 0.5  # (the failure)
    rows = _rows(run)
    r = rows[(rows.mechanism == "swamping") & (rows.phase == "optimizer")]
    assert len(r), rows[["mechanism", "phase", "module"]]
    assert set(r.spot_name) & {"0.weight", "2.weight"}
    hits = [f for f in adv.findings if f.code == "swamping"]
    assert len(hits) == 1 and hits[0].role == "optimizer_update" and "master weights" in hits[0].fix
    assert adv.param_dtype == "float32" and not adv.fp32_modules


# ----------------------------------------------------------------------------- resolution, state (a bf16 counter)
class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("seen", torch.tensor(256.0, dtype=torch.bfloat16))

    def forward(self, x):
        self.seen.add_(1)
        return self.fc(x)


def test_bf16_counter_past_256_is_resolution():
    m = Counted()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    assert float(torch.tensor(256.0, dtype=torch.bfloat16) + 1) == 256.0  # oracle: 2^8 is bf16's last integer

    def loop(rec):
        for _ in range(2):
            opt.zero_grad()
            m(torch.randn(8, 4)).sum().backward()
            opt.step()
    run, adv = _record(m, loop, opt)
    hits = _engine(adv, "resolution")
    assert hits and "seen" in hits[0].message and "2^8" in hits[0].message


# ----------------------------------------------------------------------------- loss-scale bookkeeping, optimizer
def test_scaled_gradients_stepped_without_unscale_are_loss_scale_bookkeeping():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x, y = torch.randn(32, 8), torch.randn(32, 1)

    def loop(rec):
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(m(x).float(), y)
            sc.scale(loss).backward()
            opt.step()  # never scaler.step / unscale_
    run, adv = _record(m, loop, opt, sc)
    rows = _rows(run)
    r = rows[rows.mechanism == "loss_scale"]
    assert len(r) and float(r.value.iloc[0]) == sc.get_scale()  # oracle: the scaler's own scale
    assert "never removed" in r.message.iloc[0]
    assert [f.code for f in adv.findings if f.severity == "error"] == ["loss_scale"]  # (not also amp_misuse)


def test_gradients_divided_by_a_scale_never_applied_are_loss_scale_bookkeeping():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = torch.randn(32, 8), torch.randn(32, 1)

    def loop(rec):
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(m(x).float(), y)
            loss.backward()
            torch._foreach_div_([p.grad for p in m.parameters()], 1024.0)  # an unscale with no scale
            opt.step()
    run, adv = _record(m, loop, opt)
    hits = _engine(adv, "loss_scale")
    assert hits and "never" in hits[0].message and "1024" in hits[0].message
    assert hits[0].value == 1 / 1024


def test_gradscaler_used_as_documented_has_no_loss_scale_finding():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    x, y = torch.randn(32, 8), torch.randn(32, 1)

    def loop(rec):
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(m(x).float(), y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            sc.step(opt)
            sc.update()
    run, adv = _record(m, loop, opt, sc)
    assert not _engine(adv, "loss_scale")


# ----------------------------------------------------------------------------- overflow, forward (inference only)
def test_fp16_overflow_in_an_inference_run_is_found_and_gets_no_gradscaler_advice():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).half()
    with torch.no_grad():
        m[2].weight.fill_(3000.0)
    x = torch.randn(16, 64, dtype=torch.float16)
    with torch.no_grad():
        ref = m.float()(x.float()).double()
        m.half()
    assert float(ref.abs().max()) > FP16_MAX  # oracle: finfo(fp16).max

    def loop(rec):
        with torch.no_grad():
            for _ in range(2):
                m(x)
                rec.step()
    run, adv = _record(m, loop)
    hits = _engine(adv, "overflow")
    assert hits and hits[0].module == "2", [(f.code, f.module) for f in adv.findings]
    assert _rows(run).phase.iloc[0] == "eval"
    assert adv.grad_scaler is None
    assert not any("loss scale" in f.message for f in adv.findings if f.code == "missing_evidence")


# ----------------------------------------------------------------------------- underflow in the loss (outside the model)
def test_fp16_probabilities_underflowing_before_a_log_in_the_loss_are_found():
    torch.manual_seed(0)
    m = nn.Linear(32, 100)
    with torch.no_grad():
        m.weight.mul_(8.0)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x, t = torch.randn(16, 32), torch.randint(0, 100, (16,))

    def loss():  # written by hand outside the model
        return -torch.log(m(x).softmax(-1).gather(1, t[:, None])).mean()
    run, adv = _record(m, _amp_loop(m, opt, loss, torch.float16), opt)
    rows = _rows(run)
    assert len(rows) and set(rows.mechanism) & {"underflow", "domain", "saturation"}, rows[["mechanism", "phase", "op"]]
    assert (rows.phase == "loss").any()


# ----------------------------------------------------------------------------- lost constant, loss
def test_clamp_bound_that_rounds_to_one_before_log1p_is_a_lost_constant():
    torch.manual_seed(0)
    m = nn.Linear(8, 1)
    with torch.no_grad():
        m.bias.fill_(12.0)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(16, 8)
    assert float(torch.tensor(1 - 1e-6, dtype=torch.float16)) == 1.0  # oracle

    def loss():
        return -torch.log1p(-torch.sigmoid(m(x)).clamp(max=1 - 1e-6)).mean()
    run, adv = _record(m, _amp_loop(m, opt, loss, torch.float16), opt)
    hits = _engine(adv, "lost_constant")
    assert hits and "1e-06" in hits[0].message or "0.999999" in hits[0].message, [(f.code, f.message) for f in adv.findings]


# ----------------------------------------------------------------------------- decision flip
class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.gate(x).argmax(-1)


def test_bf16_routing_decisions_that_flip_against_float64_are_found():
    torch.manual_seed(0)
    m = Router()
    x = torch.randn(256, 16)
    with torch.no_grad():
        m.gate.weight.copy_(m.gate.weight[:1].expand(8, 16) + 1e-3 * torch.randn(8, 16))  # nearly tied experts
        ref = (x.double() @ m.gate.weight.double().t()).argmax(-1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = m(x)
    assert bool((ref != low).any())  # oracle: float64's choice

    def loop(rec):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            m(x)
            rec.step()
    run, adv = _record(m, loop)
    hits = _engine(adv, "decision_flip")
    assert hits and hits[0].module == "" and "argmax" in hits[0].name, [(f.code, f.module) for f in adv.findings]
    assert "gate" in adv.fp32_modules  # the module the scores come through: replayed in float32, the flips go
    assert 0 < hits[0].value <= float((ref != low).float().mean()) + 0.05


# ----------------------------------------------------------------------------- healthy controls
def test_healthy_fp16_mlp_with_gradscaler_has_no_engine_finding():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)
    sc = torch.amp.GradScaler("cpu", growth_interval=50)
    x, y = torch.randn(64, 32), 100 * torch.randn(64, 1)

    run, adv = _record(m, _amp_loop(m, opt, lambda: F.mse_loss(m(x).float(), y), torch.float16, 4, sc), opt, sc)
    assert not [f for f in adv.findings if f.code in MECHANISMS], [(f.code, f.message) for f in adv.findings]


def test_bf16_gpt2_from_a_config_has_no_engine_finding():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64)
    m = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (4, 32))

    run, adv = _record(m, _amp_loop(m, opt, lambda: m(input_ids=ids, labels=ids).loss, torch.bfloat16), opt)
    assert not [f for f in adv.findings if f.code in MECHANISMS and f.severity == "error"], \
        [(f.code, f.module, f.message[:200]) for f in adv.findings if f.code in MECHANISMS]


def test_without_the_engine_the_table_is_absent_and_advice_works():
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with mpscope.record(m, optimizer=opt, ops=True) as rec:
        opt.zero_grad()
        m(torch.randn(8, 4)).sum().backward()
        opt.step()
    assert "forensics" not in rec.run.tables
    assert mpscope.advise(rec.run).evidence["fixes"] == []


def test_mechanisms_are_a_closed_vocabulary_of_finding_codes():
    from mpscope.advisor.coherence import REMEDIES
    from mpscope.advisor.finding import SEVERITY
    assert all(m in SEVERITY and m in REMEDIES for m in MECHANISMS)


def test_demo_gpt_in_bf16_and_fp16_has_no_engine_finding():
    from mpscope.demo.data import CharDataset
    from mpscope.demo.model import GPT, GPTConfig
    data = CharDataset.from_stdlib(32)
    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        m = GPT(GPTConfig(vocab_size=data.vocab_size, d_model=64, n_layer=2, n_head=4, seq_len=32))
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
        sc = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
        g = torch.Generator().manual_seed(1)

        def loop(rec):
            for _ in range(2):
                x, y = data.batch(4, g)
                with torch.autocast("cpu", dtype=dtype):
                    loss = m(x, y)[1]
                opt.zero_grad()
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
        run, adv = _record(m, loop, opt, sc if dtype == torch.float16 else None)
        assert "forensics" in run.tables
        assert not [f for f in adv.findings if f.code in MECHANISMS], \
            (dtype, [(f.code, f.module, f.message[:200]) for f in adv.findings if f.code in MECHANISMS])


def test_first_nonfinite_points_to_the_engine_finding_or_to_the_options_that_find_it():
    from mpscope.advisor.forensic_findings import ENGINE_HINT

    class Dist(nn.Module):
        def forward(self, z, p):
            return (z.float().pow(2).sum(-1, keepdim=True) + p.float().pow(2).sum(-1) - 2 * (z @ p.t())).sqrt()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(8, 16)
            self.dist = Dist()
            self.protos = nn.Parameter(torch.zeros(4, 16))

        def forward(self, x):
            return self.dist(self.enc(x), self.protos)
    torch.manual_seed(0)
    m = Net()
    a = torch.randn(4, 8) * 3
    x = a.repeat(8, 1) + 1e-4 * torch.randn(32, 8)  # near-duplicates of the anchors
    with torch.no_grad():
        m.protos.copy_(m.enc(a) + 1e-3)
    start = copy.deepcopy(m.state_dict())
    for engine in (False, True):
        m.load_state_dict(start)  # (the first run's step made the weights NaN)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        with mpscope.record(m, optimizer=opt, ops=True, shadow=engine) as rec:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(x)
            out.float().nan_to_num().sum().backward()
            opt.step()
        adv = mpscope.advise(rec.run)
        first = [f for f in adv.findings if f.code == "first_nonfinite" and f.module == "dist"]
        assert first, [(f.code, f.module) for f in adv.findings]
        if engine:
            assert first[0].fix.startswith("The cause is the ") and "'dist'" in first[0].fix
        else:
            assert first[0].fix == ENGINE_HINT


def test_bf16_weight_average_kept_outside_the_model_is_swamping_with_no_module_to_put_in_fp32():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    avg = [p.detach().to(torch.bfloat16) for p in m.parameters()]  # a weight average, in no module
    x, y = torch.randn(64, 16), torch.randn(64, 4)

    def loop(rec):
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(m(x).float(), y)
            loss.backward()
            opt.step()
            with torch.no_grad():
                torch._foreach_lerp_(avg, [p.to(torch.bfloat16) for p in m.parameters()], 1e-3)
    before = [a.clone() for a in avg]
    run, adv = _record(m, loop, opt)
    assert sum(int((a != b).sum()) for a, b in zip(avg, before)) < 0.2 * sum(a.numel() for a in avg)  # (the failure)
    hits = _engine(adv, "swamping")
    assert hits and all(f.module in ("", None) for f in hits), [(f.code, f.module) for f in adv.findings]
    assert "running copy" in hits[0].fix and "" not in adv.fp32_modules
    assert set(_rows(run).phase) == {"state"}


def test_bf16_average_registered_on_the_root_never_puts_the_whole_model_in_fp32():
    class WithAverage(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.register_buffer("avg_weight", self.fc.weight.detach().to(torch.bfloat16).clone())

        def forward(self, x):
            return self.fc(x)
    torch.manual_seed(0)
    m = WithAverage()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    x = torch.randn(32, 16)

    def loop(rec):
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                m(x).float().pow(2).mean().backward()
            opt.step()
            with torch.no_grad():
                m.avg_weight.lerp_(m.fc.weight.to(torch.bfloat16), 1e-3)
    run, adv = _record(m, loop, opt)
    hits = _engine(adv, "swamping")
    assert hits and hits[0].module == "" and "avg_weight" in hits[0].message
    assert "" not in adv.fp32_modules


def test_log_of_one_minus_a_saturated_softmax_in_the_loss_is_saturation():
    torch.manual_seed(0)
    m = nn.Linear(8, 4)
    with torch.no_grad():
        m.bias.copy_(torch.tensor([14.0, 0.0, 0.0, 0.0]))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(16, 8) * 0.1
    with torch.autocast("cpu", dtype=torch.float16):
        assert bool((torch.softmax(m(x), -1)[:, 0] == 1).any())  # oracle: fp16 rounds it onto 1
    assert float(torch.softmax(m(x).double(), -1)[:, 0].max()) < 1

    def loss():  # "probability of not class 0", written by hand
        return -torch.log(1 - torch.softmax(m(x), -1)[:, 0]).mean()
    run, adv = _record(m, _amp_loop(m, opt, loss, torch.float16), opt)
    hits = _engine(adv, "saturation")
    assert hits and "softmax" in hits[0].message and "1 - y is exactly 0" in hits[0].message, \
        [(f.code, f.message[:200]) for f in adv.findings]
    assert "" not in adv.fp32_modules
    # one story: the non-finite gradients that follow are no spot of their own (no cancellation told of
    # them), and the op-level log_of_zero on the same log is the engine's finding
    assert set(_rows(run).mechanism) == {"saturation"}
    assert not [f for f in adv.findings if f.code == "log_of_zero"]


class SafeNorm(nn.Module):
    """Normalise rows by their standard deviation plus a tiny epsilon (float16 loses it)."""

    def forward(self, h):
        var = (h - h.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True)
        return h / torch.sqrt(var + 1e-10)


def test_epsilon_below_fp16_subnormals_is_a_lost_constant_and_its_module_in_fp32_verified():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), SafeNorm())
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(16, 8)
    x[:4] = 0.0  # padded rows: constant activations
    with torch.no_grad():
        m[0].weight[:] = 0.0
    assert float(torch.tensor(1e-10, dtype=torch.float16)) == 0.0  # oracle

    def loop(rec):
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(x)
            out.float().nan_to_num().sum().backward()
            opt.step()
    run, adv = _record(m, loop, opt)
    hits = _engine(adv, "lost_constant")
    assert hits and hits[0].module == "1" and hits[0].value == 1e-10, [(f.code, f.module) for f in adv.findings]
    assert "1" in adv.fp32_modules


def test_gradscaler_probe_skips_a_bias_before_batchnorm_and_its_counter_are_no_finding():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)  # too high: the first steps overflow and are skipped
    x, y = torch.randn(64, 16), 50 * torch.randn(64, 1)

    run, adv = _record(m, _amp_loop(m, opt, lambda: F.mse_loss(m(x).float(), y), torch.float16, 4, sc), opt, sc)
    assert sc.get_scale() < 2.0 ** 24  # oracle: GradScaler itself backed off (it skipped steps)
    assert not [f for f in adv.findings if f.code in MECHANISMS], \
        [(f.code, f.module, f.message[:160]) for f in adv.findings if f.code in MECHANISMS]


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mu = nn.Linear(16, 8)
        self.logvar = nn.Linear(16, 8)

    def forward(self, x):
        return self.mu(x), self.logvar(x)


def test_exp_overflow_in_a_kl_term_outside_the_model_is_fixed_by_the_module_that_feeds_it_verified():
    """exp(logvar) in a KL written in the loop overflows float16. Nothing outside the model can go to
    float32 by config, so the modules upstream are tried: 'logvar' in float32 makes its output, and
    so the exp, float32 (oracle: torch's exp of 12 in float16 and bfloat16)."""
    torch.manual_seed(0)
    m = Encoder()
    with torch.no_grad():
        m.logvar.bias.fill_(12.0)  # a posterior variance that grew: exp(12) = 1.6e5
    opt = torch.optim.Adam(m.parameters(), lr=1e-4)
    sc = torch.amp.GradScaler("cpu")
    x = torch.randn(32, 16) * 0.1
    assert torch.isinf(torch.exp(torch.tensor(12.0, dtype=torch.float16)))  # oracle: finfo(fp16).max < e^12
    assert torch.isfinite(torch.exp(torch.tensor(12.0, dtype=torch.bfloat16)))

    def kl():  # the loss, by hand
        mu, logvar = m(x)
        return 0.5 * (torch.exp(logvar) + mu * mu - 1 - logvar).sum(-1).mean()
    run, adv = _record(m, _amp_loop(m, opt, kl, torch.float16, scaler=sc), opt, sc)
    hits = _engine(adv, "overflow")
    assert hits and hits[0].module == "" and "exp" in hits[0].name, [(f.code, f.module) for f in adv.findings]
    assert "verified" in hits[0].fix and "'logvar'" in hits[0].fix and "" not in adv.fp32_modules
    assert adv.dtype == "float16" and "logvar" in adv.fp32_modules


def test_a_discarded_scaler_scale_call_is_no_applied_scale():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu")
    x, y = torch.randn(32, 8), torch.randn(32, 1)

    def loop(rec):
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(m(x).float(), y)
            sc.scale(loss)  # the result is dropped ...
            loss.backward()  # ... and the unscaled loss backpropagated
            sc.step(opt)  # which still divides the gradients by the scale
            sc.update()
    run, adv = _record(m, loop, opt, sc)
    hits = _engine(adv, "loss_scale")
    assert hits and hits[0].value == 1 / sc.get_scale(), [(f.code, f.value) for f in adv.findings]
    assert "not scaled" in hits[0].message


class GridLookup(nn.Module):
    """Features of a 64 x 64 grid looked up at coordinates a small network predicts (flat index iy * 64 + ix)."""

    def __init__(self):
        super().__init__()
        self.coords = nn.Linear(4, 2)
        self.grid = nn.Embedding(64 * 64, 8)

    def forward(self, x):
        c = torch.sigmoid(self.coords(x)) * 63.0
        idx = (c[:, 1].round() * 64 + c[:, 0].round()).long()  # computed in the activation dtype
        return self.grid(idx)


def test_an_index_computed_past_fp16_integers_is_resolution_and_its_module_in_fp32_verified():
    torch.manual_seed(0)
    m = GridLookup()
    x = torch.randn(256, 4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        c = torch.sigmoid(m.coords(x)) * 63.0
        idx16 = (c[:, 1].round() * 64 + c[:, 0].round()).long()
    c32 = torch.sigmoid(m.coords(x).float()) * 63.0
    idx32 = (c32[:, 1].round() * 64 + c32[:, 0].round()).long()
    assert float(torch.tensor(2049.0, dtype=torch.float16)) == 2048.0 and bool((idx16 != idx32).any())  # oracle

    def loop(rec):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            m(x)
            rec.step()
    run, adv = _record(m, loop)
    hits = _engine(adv, "resolution")
    assert hits and "2048" in hits[0].message, [(f.code, f.module, f.message[:120]) for f in adv.findings]
    # the coordinates in float32 keep the index exact: the replay verifies it, the recommendation takes it
    assert "'coords' in float32 (fp32_modules): verified" in hits[0].fix and adv.fp32_modules == ["coords"]


def test_a_comm_hook_that_sums_in_fp16_overflows_in_the_communication_phase(tmp_path):
    """Two gloo ranks of DDP (tests/scripts/ddp_comm_hook.py). A hook that sums float16 gradients
    and divides after: the all-reduce is the root, in the communication phase, with as many
    non-finite values as the float16 sum of both ranks' float32 gradients cast to float16 has
    (oracle: .half() of each rank's gradient, added in float64, cast with .half()); no replay runs
    the collective again. PyTorch's fp16_compress_hook divides first: no finding."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(repo / "tests" / "scripts" / "ddp_comm_hook.py"), str(tmp_path),
                           "sum_then_divide,fp16_compress", "800"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    control = json.loads((tmp_path / "result_fp16_compress.json").read_text())
    assert control["finite"] and control["rows"] == []
    assert not [f for f in control["findings"] if f["code"] == "overflow"]
    r = json.loads((tmp_path / "result_sum_then_divide.json").read_text())
    g = [torch.tensor(t) for t in r["grads"]]
    lost = int((~torch.isfinite((g[0].half().double() + g[1].half().double()).half())).sum())
    casts = [int((~torch.isfinite(t.half())).sum()) for t in g]
    assert lost > 0 and casts == [0, 0] and not r["finite"]  # the sum overflows, not the casts
    (row,) = r["rows"]
    assert (row["phase"], row["mechanism"], row["op"]) == ("communication", "overflow", "c10d.allreduce_.default")
    assert f"{lost} of 1348 values" in row["message"] and row["verified"] == "False"
    assert "divide them by the group size before" in row["fix"]


# ----------------------------------------------------------------------------- underflow onto a pole, backward
class L4Pool(nn.Module):
    """The L4 norm of each row (a generalised-mean pooling with p = 4): x.pow(4) of small values
    underflows to 0 in fp16, and pow(0.25)'s derivative at 0 is infinite."""

    def forward(self, h):
        return h.clamp(min=1e-6).pow(4).mean(-1, keepdim=True).pow(0.25)


class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 32)
        self.pool = L4Pool()
        self.head = nn.Linear(1, 1)

    def forward(self, x):
        return self.head(self.pool(self.proj(x)))


def test_an_underflow_onto_pow_s_pole_in_backward_is_no_gradscaler_probe():
    """fp16 autocast + GradScaler: every gradient of 'proj' is non-finite (GradScaler skips both steps:
    its scale halves), though float64 gives finite ones. The engine names the overflow of pow's
    backward at 'pool', its input exactly 0 where float64 is not (no loss scale helps), and verifies
    'pool' in float32; mpscope.apply with that advice gives finite gradients."""
    torch.manual_seed(0)
    m = Pooled()
    with torch.no_grad():
        m.proj.weight.mul_(1e-3)
        m.proj.bias.mul_(1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    ref = copy.deepcopy(m).double()
    F.mse_loss(ref(x.double()), y.double()).backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in ref.parameters())  # oracle: float64 trains
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    run, adv = _record(m, _amp_loop(m, opt, lambda: F.mse_loss(m(x).float(), y), torch.float16, scaler=scaler),
                       optimizer=opt, scaler=scaler)
    assert scaler.get_scale() == 2.0**14  # GradScaler's own account: both steps found inf and backed off
    hits = [f for f in _engine(adv, "overflow") if f.module == "pool"]
    assert hits and "pole" in hits[0].message and "no loss scale" in hits[0].message
    row = _rows(run)[_rows(run).module == "pool"].iloc[0]
    assert row.phase == "backward" and row.fix_modules == "pool" and bool(row.verified)
    assert "pool" in adv.fp32_modules
    opt.zero_grad()
    with mpscope.apply(m, adv):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(m(x).float(), y)
        loss.backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())


# ----------------------------------------------------------------------------- verified means every overflow after it too
def test_a_fix_of_the_first_overflow_that_leaves_the_next_is_not_verified():
    """Two Linear layers under fp16 autocast inference, each overflowing on its own: keeping the first
    in float32 leaves the second's overflow (oracle: torch with autocast off in layer 0 alone), so
    that is not a verified fix; bfloat16 is (oracle: autocast bfloat16 gives finite outputs), and the
    advice takes it. The argmax over the NaN softmax of the inf logits is no decision flip."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))
    with torch.no_grad():
        m[0].weight.normal_(0, 4000.0)
        m[1].weight.normal_(0, 60.0)
    x = torch.randn(8, 32)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.float16):
            assert not bool(torch.isfinite(m(x)).all())
            with torch.autocast("cpu", enabled=False):
                h = m[0](x)  # layer 0 in float32 alone: no fix
            assert bool(torch.isfinite(h).all()) and not bool(torch.isfinite(m[1](h)).all())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert bool(torch.isfinite(m(x)).all())

    def loop(rec):
        with torch.no_grad():
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.float16):
                    torch.softmax(m(x).float(), -1).argmax(-1)
                rec.step()
    run, adv = _record(m, loop)
    rows = _rows(run)
    first = rows[rows.mechanism == "overflow"].iloc[0]
    assert first.module == "0" and first.fix_dtype == "bfloat16" and bool(first.verified)
    assert not (rows.fix_modules == "0").any() or not rows[rows.fix_modules == "0"].verified.any()
    assert adv.dtype == "bfloat16"
    assert not _engine(adv, "decision_flip")


# ----------------------------------------------------------------------------- ties from the scores' own rounding
class DotScorer(nn.Module):
    def forward(self, q, d):
        return q @ d.T


class Retriever(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.tower = nn.Linear(dim, dim, bias=False)
        nn.init.orthogonal_(self.tower.weight)  # (lengths and angles kept: the scores are the cosines)
        self.scorer = DotScorer()

    def forward(self, q, d):
        return self.scorer(self.tower(q), self.tower(d))


def test_bf16_score_ties_that_flip_a_top1_are_fixed_by_the_scorer_alone():
    """bf16 autocast retrieval: each query's relevant document scores 0.9500 and a hard negative,
    stored before it, 0.9478 - 0.0022 apart, below bf16's spacing 2^-8 there, so they tie and argmax
    takes the negative. The fix is the scorer alone in float32 (oracle: torch with autocast off in
    the scorer finds every relevant document; float64 does too), nearest the decision, verified."""
    torch.manual_seed(0)
    dim, nq = 64, 32
    q = F.normalize(torch.randn(nq, dim), dim=-1)
    side = [torch.randn(nq, dim) for _ in range(2)]
    side = [F.normalize(e - (e * q).sum(-1, keepdim=True) * q, dim=-1) for e in side]  # unit, orthogonal to q
    rel = 0.9500 * q + (1 - 0.9500**2) ** 0.5 * side[0]
    neg = 0.9478 * q + (1 - 0.9478**2) ** 0.5 * side[1]
    docs = torch.stack([neg, rel], 1).reshape(2 * nq, dim)  # negative i at 2i, relevant at 2i + 1
    want = torch.arange(nq) * 2 + 1
    m = Retriever(dim)
    with torch.no_grad():
        assert torch.equal((m.tower(q).double() @ m.tower(docs).double().T).argmax(-1), want)  # oracle: float64
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lowp = m(q, docs).argmax(-1)
            tq, td = m.tower(q), m.tower(docs)
            with torch.autocast("cpu", enabled=False):
                fixed = m.scorer(tq.float(), td.float()).argmax(-1)
    assert float((lowp != want).float().mean()) > 0.5 and torch.equal(fixed, want)

    def loop(rec):
        with torch.no_grad():
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    m(q, docs).argmax(-1)
                rec.step()
    run, adv = _record(m, loop)
    rows = _rows(run)
    row = rows[rows.mechanism == "decision_flip"].iloc[0]
    assert row.fix_modules == "scorer" and bool(row.verified) and row.source_module == "scorer"
    assert adv.fp32_modules == ["scorer"]


# ----------------------------------------------------------------------------- a scaled gradient used as data
@pytest.mark.parametrize("unscaled", [False, True])
def test_an_input_gradient_penalty_from_a_scaled_loss_is_loss_scale_bookkeeping(unscaled):
    """Double backprop under fp16 autocast + GradScaler: penalty = ||d loss / d x||^2 from
    torch.autograd.grad(scaler.scale(loss), x, create_graph=True). Used as it comes, the gradient
    carries the scale S (oracle: the same gradient without scaling, times GradScaler's own
    get_scale()), the penalty S^2 too large: a loss_scale finding in the loss phase with S as its
    value. Multiplied by 1 / scaler.get_scale() first, as PyTorch's AMP examples do: no finding."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    xr = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.float16):
        ce = F.cross_entropy(m(xr).float(), y)
    (g,) = torch.autograd.grad(scaler.scale(ce), xr, retain_graph=True)
    (plain,) = torch.autograd.grad(ce, xr)
    assert float((g / plain).median()) == pytest.approx(2.0**10, rel=1e-2)  # oracle: it carries GradScaler's scale

    def loop(rec):
        for _ in range(2):
            xr = x.clone().requires_grad_(True)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                ce = F.cross_entropy(m(xr).float(), y)
            (g,) = torch.autograd.grad(scaler.scale(ce), xr, create_graph=True)
            if unscaled:
                g = g * (1.0 / scaler.get_scale())
            loss = ce + 0.1 * g.pow(2).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    run, adv = _record(m, loop, optimizer=opt, scaler=scaler)
    rows = _rows(run)
    hits = rows[(rows.mechanism == "loss_scale") & (rows.phase == "loss")]
    if unscaled:
        assert hits.empty and not _engine(adv, "loss_scale")
        return
    assert len(hits) and hits.value.iloc[0] == 2.0**10
    f = _engine(adv, "loss_scale")
    assert f and "still carries the loss scale" in f[0].message and "1.0 / scaler.get_scale()" in f[0].fix
    # gradients wrong by the scale advise no GradScaler setting: the run's own stays
    assert adv.grad_scaler == dict(GRAD_SCALER_DEFAULTS, init_scale=2.0**10) and not adv.predictions
    assert all("loss_scale" in g.fix for g in adv.findings if g.code in ("init_scale_too_high", "scale_collapse"))


# ----------------------------------------------------------------------------- a running statistic, state
def test_a_batchnorm_running_variance_past_fp16_s_max_is_named_at_its_buffer():
    """A .half() MLP whose BatchNorm1d sees activations with variance ~1e6: native_batch_norm updates
    running_var in place (its schema does not say so) and it overflows to inf, while the batch's
    own output stays finite (oracle: the same step in float32 gives a finite running_var above
    finfo(float16).max). The engine names 1.running_var, overflow, with '1' in float32 verified."""
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16, momentum=0.5), nn.ReLU(), nn.Linear(16, 2))

    x = torch.randn(64, 32) * 2000.0
    ref = net()
    ref(x)
    assert torch.isfinite(ref[1].running_var).all() and float(ref[1].running_var.max()) > FP16_MAX
    m = net().half()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    outs = []

    def loop(rec):
        for _ in range(2):
            opt.zero_grad()
            out = m(x.half())
            outs.append(bool(torch.isfinite(out).all()))
            out.float().pow(2).mean().backward()
            opt.step()
    run, adv = _record(m, loop, optimizer=opt)
    assert outs == [True, True] and not bool(torch.isfinite(m[1].running_var).all())  # only the buffer is inf
    rows = _rows(run)
    hit = rows[(rows.mechanism == "overflow") & (rows.spot_name == "1.running_var")]
    assert len(hit) and hit.module.iloc[0] == "1" and hit.fix_modules.iloc[0] == "1" and bool(hit.verified.iloc[0])
    assert "running_var" in hit.message.iloc[0]


# ----------------------------------------------------------------------------- a few flips among many decisions
def test_a_bf16_nucleus_mask_that_keeps_the_wrong_tokens_is_a_decision_flip_at_its_cumsum():
    """A top-p (0.9) mask over 8000 bf16 probabilities per row, computed by the loop from sorted
    probabilities' cumsum: the bf16 cumsum moves the boundary, so tens of the 128,000 decisions flip
    (under 1 in 1000, oracle: the float64 mask of the same probabilities). They count (at least 16),
    and the rounding that decides is traced to the cumsum."""
    torch.manual_seed(0)
    head = nn.Linear(64, 8000)
    h = torch.randn(16, 64)
    with torch.no_grad():
        p64 = torch.softmax(head(h).double(), -1)
        ref = p64.sort(-1, descending=True).values.cumsum(-1) > 0.9
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = torch.softmax(head(h), -1).sort(-1, descending=True).values.cumsum(-1) > 0.9
    flips = int((ref != low).sum())
    assert 16 <= flips < 1e-3 * ref.numel()

    def loop(rec):
        with torch.no_grad():
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    torch.softmax(head(h), -1).sort(-1, descending=True).values.cumsum(-1) > 0.9
                rec.step()
    run, adv = _record(head, loop)
    rows = _rows(run)
    hit = rows[(rows.mechanism == "decision_flip") & (rows.op == "aten.gt.Scalar")]
    assert len(hit) and hit.source_op.iloc[0] == "aten.cumsum.default"


# ----------------------------------------------------------------------------- ties in exact arithmetic
def test_an_index_decision_that_breaks_exact_ties_another_way_is_no_flip():
    """Two sorts that order equal elements differently (as a GPU's unstable sort may, against the
    shadow's) pick elements of the same value: no flip. Oracle: torch's own stable sort of the input
    and of its reverse; where the values really differ (a tie made by bf16 rounding), the flips remain."""
    from mpscope.recording.forensics import _flips, _ties_resolved
    from mpscope.recording.root_cause import flatten

    def resolved(func, args, kwargs, x, real, shadow):
        flat, spec = flatten((args, kwargs))
        return _ties_resolved(func, spec, flat, x, real, shadow)

    x = (torch.randint(-8, 9, (4, 300), generator=torch.Generator().manual_seed(0)).double() / 4).relu()
    first = torch.sort(x, dim=-1, descending=True, stable=True).indices  # ties: lower index first
    last = x.shape[-1] - 1 - torch.sort(x.flip(-1), dim=-1, descending=True, stable=True).indices  # higher first
    assert _flips(last, first) > 0.5 and torch.equal(x.gather(-1, last), x.gather(-1, first))
    kw = {"stable": True, "dim": -1, "descending": True}
    assert _flips(last, resolved(torch.ops.aten.sort.stable, (x,), kw, x, last, first)) == 0.0
    assert _flips(last[:, 0], resolved(torch.ops.aten.max.dim, (x, -1), {}, x, last[:, 0], first[:, 0])) == 0.0
    y = x.clone()
    y[:, 0], y[:, 1] = 2.0, 2.0 + 2.0**-10  # distinct in float64, both 2.0 in bfloat16
    real, exact = y.to(torch.bfloat16).argmax(-1), y.argmax(-1)
    assert _flips(real, exact) == 1.0  # bf16 takes index 0, float64 index 1
    assert _flips(real, resolved(torch.ops.aten.argmax.default, (y,), {"dim": -1}, y, real, exact)) == 1.0


# ----------------------------------------------------------------------------- underflow in the backward
def test_fp16_conv_gradients_flushed_to_zero_are_fixed_by_a_loss_scale_verified_by_gradscaler_itself():
    """An fp16 conv net with a GradScaler at scale 1 and a loss of order 1e-6: its first conv's weight
    gradient is exactly 0 (oracle: the same step in float64 is not). The engine names underflow in the
    backward and verifies a higher init_scale by replay; GradScaler itself, at that init_scale, gives
    the first conv nonzero gradients and skips no step (the oracle nobody here wrote)."""
    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Tanh(), nn.Conv2d(16, 16, 3, padding=1), nn.Tanh(),
                          nn.Flatten(), nn.Linear(16 * 8 * 8, 4))
        return m, torch.optim.SGD(m.parameters(), lr=0.0)

    x, y = torch.randn(8, 3, 8, 8), torch.randn(8, 4)

    def loss_of(m):
        return 1e-6 * F.mse_loss(m(x).float(), y)

    ref, _ = build()
    ref.double()
    (1e-6 * F.mse_loss(ref(x.double()), y.double())).backward()
    assert bool((ref[0].weight.grad != 0).all())  # float64: every first-layer gradient is nonzero
    m, opt = build()
    run, adv = _record(m, _amp_loop(m, opt, lambda: loss_of(m), torch.float16, steps=1,
                                    scaler=torch.amp.GradScaler("cpu", init_scale=1.0)), opt)
    assert float((m[0].weight.grad == 0).float().mean()) > 0.9  # the recorded step flushed them
    rows = _rows(run)
    row = rows[(rows.mechanism == "underflow") & (rows.spot == "gradient")].iloc[0]
    assert row.phase == "backward" and bool(row.verified) and row.fix_init_scale > 1.0
    assert adv.dtype == "float16" and adv.grad_scaler["init_scale"] >= row.fix_init_scale
    assert "init_scale" in _engine(adv, "underflow")[0].fix
    m2, opt2 = build()
    scaler = torch.amp.GradScaler("cpu", init_scale=float(row.fix_init_scale))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_of(m2)
    scaler.scale(loss).backward()
    scaler.unscale_(opt2)
    assert float((m2[0].weight.grad == 0).float().mean()) < 0.01
    scaler.step(opt2)
    scaler.update()
    assert scaler.get_scale() == row.fix_init_scale  # (no inf found: the step was not skipped)


# ----------------------------------------------------------------------------- resolution before a periodic function
class FourierFeatures(nn.Module):
    """Random Fourier features (Tancik et al., NeurIPS 2020): sin/cos of coordinates projected by a
    Gaussian matrix of scale 100; the projection is a matmul, so autocast runs it in 16 bits."""

    def __init__(self, d_in=2, n=64, scale=100.0):
        super().__init__()
        self.proj = nn.Linear(d_in, n, bias=False)
        with torch.no_grad():
            self.proj.weight.normal_(0.0, scale)

    def forward(self, x):
        z = self.proj(x)
        return torch.cat([torch.sin(z), torch.cos(z)], -1)


class FourierMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = FourierFeatures()
        self.mlp = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 3))

    def forward(self, x):
        return self.mlp(self.enc(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fourier_features_of_a_16_bit_projection_are_resolution_and_the_encoder_in_fp32_verified(dtype):
    """Projected coordinates reach |z| ~ 300, where bf16's spacing is 2 (fp16's 0.25): sin/cos of them
    are wrong though z is only rounded. The fix is the projection alone in float32. Oracle: the model's
    output in float64 against autocast's, and against autocast with the projection in float32 (unit
    roundoff from torch.finfo)."""
    torch.manual_seed(0)
    m = FourierMLP()
    x, y = torch.rand(512, 2), torch.rand(512, 3)
    u = torch.finfo(dtype).eps / 2
    with torch.no_grad():
        exact = copy.deepcopy(m).double()(x.double())

    def rel(out):
        return float((out.double() - exact).norm() / exact.norm())

    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        low = m(x)
        with torch.autocast("cpu", enabled=False):
            z = m.enc.proj(x)  # the projection alone in float32
        fixed = m.mlp(torch.cat([torch.sin(z), torch.cos(z)], -1))
    assert rel(low) > 16 * u and rel(fixed) < 16 * u
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    run, adv = _record(m, _amp_loop(m, opt, lambda: F.mse_loss(m(x).float(), y), dtype, steps=1), opt)
    rows = _rows(run)
    row = rows[rows.spot == "output"].iloc[0]
    assert row.mechanism == "resolution" and row.op in ("aten.sin.default", "aten.cos.default")
    assert row.fix_modules == "enc.proj" and bool(row.verified) and row.source_module == "enc.proj"
    assert "enc.proj" in adv.fp32_modules


# ----------------------------------------------------------------------------- the loop's own decisions
@pytest.mark.parametrize("use", ["metric", "mask"])
def test_a_flipped_decision_counts_only_where_it_reaches_the_model_or_its_training(use):
    """A bf16 classifier with nearly tied logits: its argmax differs from float64's on many rows (the
    oracle). As an accuracy the loop computes, it changes nothing trained: no finding. As a mask on
    the loss (training on the misclassified rows), it changes the gradients: a decision_flip."""
    torch.manual_seed(0)
    m = nn.Linear(16, 8, bias=False)
    with torch.no_grad():
        m.weight.copy_(m.weight[:1].expand(8, 16) + 1e-3 * torch.randn(8, 16))
    x, y = torch.randn(256, 16), torch.randint(0, 8, (256,))
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with torch.no_grad():
        exact = copy.deepcopy(m).double()(x.double()).argmax(-1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert int((m(x).argmax(-1) != exact).sum()) >= 16

    def loop(rec):
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = m(x)
            ce = F.cross_entropy(logits.float(), y, reduction="none")
            pred = logits.argmax(-1)
            loss = ce[pred != y].mean() if use == "mask" else ce.mean()
            loss.backward()
            opt.step()
            float((pred == y).float().mean())  # the accuracy the loop prints
    run, adv = _record(m, loop, opt)
    rows = _rows(run)
    found = rows[rows.mechanism == "decision_flip"]
    assert (len(found) > 0) == (use == "mask"), found[["op", "phase", "module"]]


# ----------------------------------------------------------------------------- top-k routing, parameters updated later
class TopKGate(nn.Module):
    """Sparse gating (Shazeer et al., 2017): the top-2 of 32 experts' scores per token."""

    def __init__(self, d=32, n=32):
        super().__init__()
        self.scores = nn.Linear(d, n, bias=False)

    def forward(self, h):
        return self.scores(h).topk(2).indices  # (the default dim)


class Routed(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.gate = TopKGate(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        picks = self.gate(h)
        return self.out(h * (1 + picks.float().mean(-1, keepdim=True) / 32))


def test_topk_picks_flipped_in_an_evaluation_before_the_step_are_found_and_fixed_on_the_weights_they_saw():
    """A routing check under no_grad, then a training step with AdamW that moves every weight, in one
    recorded step. The top-2 sets differ from float64's (the oracle: sets, not order); the engine names
    the flip at the top-k, and its replay, on the weights as the evaluation saw them (not as the
    optimizer left them), verifies the gate in float32."""
    torch.manual_seed(0)
    m = Routed()
    with torch.no_grad():
        m.gate.scores.weight.copy_(m.gate.scores.weight[:1].expand(32, 32) + 2e-3 * torch.randn(32, 32))
    x, y = torch.randn(512, 32), torch.randn(512, 1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

    def sets(idx):
        return idx.sort(-1).values

    with torch.no_grad():
        d = copy.deepcopy(m).double()
        exact = sets(d.gate(d.inp(x.double())))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert float((sets(m.gate(m.inp(x))) != exact).any(-1).float().mean()) > 0.02

    def loop(rec):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            m(x)  # the evaluation: its top-k is the spot
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(m(x).float(), y)
        loss.backward()
        opt.step()
    run, adv = _record(m, loop, opt)
    assert "forensics" in run.tables
    rows = _rows(run)
    row = rows[(rows.mechanism == "decision_flip") & (rows.op == "aten.topk.default")].iloc[0]
    assert row.phase == "eval" and bool(row.verified) and row.fix_modules in ("gate", "gate.scores")
    assert row.fix_modules in adv.fp32_modules


# ----------------------------------------------------------------------------- a cast on the way out
class OnePassStd(nn.Module):
    """Features scaled by a one-pass standard deviation, sqrt(E[x^2] - E[x]^2) (cancels on large means)."""

    def forward(self, h):
        var = (h * h).mean(-1, keepdim=True) - h.mean(-1, keepdim=True) ** 2
        return (h - h.mean(-1, keepdim=True)) / torch.sqrt(var.clamp_min(0) + 1e-3)


def test_cancellation_seen_through_a_cast_that_flushes_some_of_its_wrong_values_is_named_at_the_subtraction():
    """fp16 autocast: activations of mean ~100 and spread ~1 make E[x^2] - E[x]^2 cancel; the next
    Linear's autocast cast then flushes a few of the (already wrong) normalised values. The walk passes
    the cast to the subtraction, and the module in float32 is verified (oracle: float64 output of the
    model against fp16's, unit roundoff from torch.finfo)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), OnePassStd(), nn.Tanh(), nn.Linear(64, 2))
    with torch.no_grad():
        m[0].bias.fill_(100.0)  # (weights as initialised: a spread of about 4, wider than fp16's 1/16 at 100)
    x = torch.randn(256, 16)
    u = torch.finfo(torch.float16).eps / 2
    with torch.no_grad():
        exact = copy.deepcopy(m).double()(x.double())
        with torch.autocast("cpu", dtype=torch.float16):
            low = m(x)
        assert float((low.double() - exact).norm() / exact.norm()) > 16 * u
    run, adv = _record(m, lambda rec: _eval(m, x, rec))
    rows = _rows(run)
    row = rows[rows.spot == "output"].iloc[0]
    assert row.mechanism == "cancellation" and row.op == "aten.sub.Tensor" and row.module == "1"
    assert bool(row.verified) and row.fix_modules == "1"


def _eval(m, x, rec):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        m(x)
    rec.step()


# ----------------------------------------------------------------------------- optimizer state that underflows
def test_fp16_rmsprop_square_average_whose_increments_are_below_subnormals_is_underflow_not_swamping():
    """A .half() model under RMSprop: square_avg += (1 - alpha) * g^2 with |g| ~ 1e-4 adds ~1e-10,
    below float16's least subnormal (torch.finfo: tiny * eps = 5.96e-8), so the state stays 0 (oracle:
    the optimizer's own state after the step). Underflow in the optimizer, fixed by float32 master
    weights; RMSprop's in-place denominator (sqrt(v) + eps, a temporary) is no spot."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).half()
    opt = torch.optim.RMSprop(m.parameters(), lr=1e-3, alpha=0.99, eps=1e-4)
    x, y = torch.randn(64, 16).half(), torch.randn(64, 1).half()

    def loop(rec):
        for _ in range(2):
            opt.zero_grad()
            (1e-3 * F.mse_loss(m(x).float(), y.float())).backward()
            opt.step()
    run, adv = _record(m, loop, opt)
    v = opt.state[m[0].weight]["square_avg"]
    g = m[0].weight.grad.float()
    least = torch.finfo(torch.float16).tiny * torch.finfo(torch.float16).eps
    assert float(((0.01 * g * g < least / 2) & (g != 0)).float().mean()) > 0.5 and float((v == 0).float().mean()) > 0.5
    rows = _rows(run)
    opt_rows = rows[(rows.phase == "optimizer") & (rows.spot == "update")]
    assert "underflow" in set(opt_rows.mechanism), opt_rows[["mechanism", "op", "spot_name"]]
    assert all(n.split(".")[-1] in ("weight", "bias", "square_avg") or "square_avg" in n for n in opt_rows.spot_name)
    hit = _engine(adv, "underflow")[0]
    assert "least subnormal" in hit.message and "float32" in hit.fix


# ----------------------------------------------------------------------------- a backward overflow no loss scale makes
class InverseDistance(nn.Module):
    """Weights 1/d of distances d ~ 3e-3: reciprocal's backward is -grad * (1/d)^2, and (1/d)^2 ~ 1e5
    overflows float16 whatever the loss scale."""

    def forward(self, d):
        return torch.reciprocal(d)


def test_an_fp16_backward_overflow_that_carries_no_loss_scale_is_found_at_every_scale():
    """With GradScaler at 2^16 each step is skipped, and it would be at scale 1 too (oracle: fp16
    reciprocal backward at grad 1 is inf; float32's is finite): the overflow is named in the backward,
    not taken for GradScaler's probe of its scale."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid(), InverseDistance(), nn.Linear(8, 1))
    with torch.no_grad():
        m[0].bias.fill_(-5.8)  # sigmoid ~ 3e-3
        m[0].weight.mul_(0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    d = torch.full((4,), 3e-3, dtype=torch.float16, requires_grad=True)
    torch.reciprocal(d).sum().backward()
    assert not bool(torch.isfinite(d.grad).all())
    d32 = d.detach().float().requires_grad_()
    torch.reciprocal(d32).sum().backward()
    assert bool(torch.isfinite(d32.grad).all())
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    run, adv = _record(m, _amp_loop(m, opt, lambda: 1e-6 * F.mse_loss(m(x).float(), y), torch.float16, steps=2,
                                    scaler=scaler), opt, scaler)
    assert bool(run.steps.skipped.all())
    rows = _rows(run)
    row = rows[(rows.mechanism == "overflow") & (rows.phase == "backward")].iloc[0]
    assert row.module in ("2", "1") and bool(row.verified), rows[["mechanism", "module", "op", "phase"]]


def test_an_optimizer_step_counter_loaded_in_bf16_is_resolution_fixed_by_its_own_dtype():
    """Adam state loaded with its 0-dim step counter in bfloat16 (state cast with the model): at 300
    bf16's spacing is 2, so step += 1 changes nothing (oracle: torch's own bf16 add). The parameters
    are float32: the fix named is the counter's dtype, a code change, not master weights."""
    torch.manual_seed(0)
    m = nn.Linear(8, 1)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    F.mse_loss(m(x), y).backward()
    opt.step()
    for st in opt.state.values():
        st["step"] = torch.tensor(300.0, dtype=torch.bfloat16)
    assert float(torch.tensor(300.0, dtype=torch.bfloat16) + 1) == 300.0

    def loop(rec):
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    run, adv = _record(m, loop, opt)
    hit = _engine(adv, "resolution")
    assert hit and hit[0].module is None and "weight.step" in hit[0].message + hit[0].fix  # (the root's own)
    assert "No config fixes this" in hit[0].fix and "master" not in hit[0].fix



class LogBuckets(nn.Module):
    """Relative-position buckets as T5 computes them: log of integer distances, whose 0 on the diagonal
    gives -inf in any precision and is discarded by torch.where; then a projection that overflows fp16."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        pos = torch.arange(x.shape[0])
        d = (pos[:, None] - pos[None, :]).abs()
        bucket = torch.where(d > 0, torch.log(d.float()), torch.zeros(()))
        return self.proj(x) + bucket.sum(-1, keepdim=True)


def test_a_pole_that_float64_meets_too_from_exact_inputs_is_no_spot_and_the_real_overflow_is_named():
    """log(0) of an integer distance is -inf in float64 as well (the oracle) and masked: no finding; the
    fp16 projection whose outputs pass 65504 (oracle: torch.finfo) is the one named."""
    assert float(torch.log(torch.tensor(0.0, dtype=torch.float64))) == float("-inf")
    torch.manual_seed(0)
    m = LogBuckets()
    with torch.no_grad():
        m.proj.weight.mul_(1e5)
    x = torch.randn(8, 16)
    assert float(m.proj(x).abs().max()) > torch.finfo(torch.float16).max

    def loop(rec):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            m(x)
        rec.step()
    run, adv = _record(m, loop)
    rows = _rows(run)
    assert not len(rows[rows.op == "aten.log.default"]), rows[["mechanism", "op"]]
    assert (rows.mechanism == "overflow").any() and set(rows[rows.mechanism == "overflow"].module) == {"proj"}


def test_a_gaussian_nll_whose_fp16_variance_underflows_is_named_at_the_square_not_the_division():
    """sigma ~ 1e-4 from exp(log_sigma) in the loss: sigma**2 ~ 1e-8 is 0 in float16 (oracle: torch's
    own square; float32's is not), so (x - mu)^2 / (2 var) is inf. The division by 0 is inf in
    float64 too, on its own inputs: it adds no error; the walk goes on to the square, an underflow."""
    s16 = torch.tensor(1e-4, dtype=torch.float16)
    assert float(s16 ** 2) == 0.0 and float(s16.float() ** 2) > 0
    torch.manual_seed(0)
    m = nn.Linear(8, 2)
    with torch.no_grad():
        m.bias.copy_(torch.tensor([0.0, math.log(1e-4)]))
        m.weight.mul_(1e-3)
    x, y = torch.randn(32, 8), torch.randn(32)

    def loop(rec):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            mu, log_sigma = m(x).unbind(-1)
            var = torch.exp(log_sigma) ** 2
            ((y - mu) ** 2 / (2 * var) + 0.5 * torch.log(var)).mean()
        rec.step()
    run, adv = _record(m, loop)
    rows = _rows(run)
    row = rows[rows.spot == "nonfinite"].iloc[0]
    assert row.mechanism == "underflow" and row.op == "aten.pow.Tensor_Scalar", rows[["mechanism", "op"]]


# ----------------------------------------------------------------------------- shadows through in-place writes
class _TripleInPlace(nn.Module):
    def forward(self, h):
        return h.mul_(3.0)


def test_shadows_follow_values_written_in_place():
    # h.mul_ and ReLU(inplace=True) write fp16 activations in place; the engine's shadow of every
    # module output (the precision rows' reference) must still be the model evaluated in float64 from
    # its float32 weights: each row's SQNR equals the one against a float64 copy of the model
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), _TripleInPlace(), nn.ReLU(inplace=True), nn.Linear(64, 8))
    wide = copy.deepcopy(model).double()  # (before SGD's step changes the model)
    x = torch.randn(32, 16)
    got = {}
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: got.__setitem__(n, o.detach().double().clone()))
             for n, m in model.named_children()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run, _ = _record(model, _amp_loop(model, opt, lambda: model(x).float().square().mean(), torch.float16,
                                      steps=1), opt)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        exact = {}
        h = x.double()
        for n, m in wide.named_children():
            h = m(h)
            exact[n] = h.clone()
    p = run.precision
    p = p[p.role == "activation"].set_index("module")
    for n in ("1", "2", "3"):
        noise = float(((got[n] - exact[n]) ** 2).sum())
        oracle = 10 * math.log10(float((exact[n] ** 2).sum()) / noise)
        assert p.loc[n, "sqnr_db"] == pytest.approx(oracle, abs=0.05), n


# ----------------------------------------------------------------------------- lost constant, optimizer
def test_a_constant_the_optimizers_16bit_state_loses_is_fixed_by_float32_master_weights():
    # Adagrad on a .half() Linear: std = sqrt(state_sum) + eps, eps = 1e-10 is 0 in float16, so the
    # weights of an input column that is always 0 (zero gradient, zero state) become 0/0
    torch.manual_seed(0)
    model = nn.Linear(8, 4).half()
    wide = copy.deepcopy(model).float()
    x = torch.randn(16, 8).half()
    x[:, 3] = 0

    def step(m, opt):
        opt.zero_grad()
        m(x.to(m.weight.dtype)).float().square().mean().backward()
        opt.step()

    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, eps=1e-10)
    with mpscope.record(model, optimizer=opt, ops=True, shadow=True) as rec:
        step(model, opt)
    step(wide, torch.optim.Adagrad(wide.parameters(), lr=0.1, eps=1e-10))
    # the oracle: torch's own step, NaN in float16 state, finite with float32 parameters and state
    assert torch.isnan(model.weight[:, 3]).all() and torch.isfinite(wide.weight).all()
    t = _rows(rec.run)
    r = t[(t.phase == "optimizer") & t.verified]
    assert len(r) and (r.fix_dtype == "float32").all() and (r.mechanism == "lost_constant").all(), t.T
    adv = mpscope.advise(rec.run)
    f = _engine(adv, "lost_constant")
    assert f and f[0].role == "optimizer_update" and "master weights" in f[0].fix
    assert adv.param_dtype == "float32"


# ----------------------------------------------------------------------------- the rebuild
def test_a_rebuilt_step_holds_the_values_its_ops_made():
    # The engine lets go of values the program frees and, for a step with a bad spot, runs the graph
    # again from its leaves. Every rebuilt output must equal what the op returned during the step
    # (oracle: the op's own output, copied as it ran): dropout's draws, ReLU(inplace=True), a .t() view
    # of fp16 weights that the SGD step then writes in place, and an overflow past float16's range
    from mpscope.recording import forensics as fmod
    made, checked = {}, []
    let_go, rebuild = fmod.Forensics._let_go, fmod.Forensics.rebuild

    def copy_then_let_go(self, node):
        made[node.seq] = [o.detach().clone() for o in node.outs]
        let_go(self, node)

    def rebuild_then_compare(self):
        rebuild(self)
        for n in self.nodes:
            if n.seq in made:
                assert len(n.outs) == len(made[n.seq]), n.name
                for a, b in zip(made[n.seq], n.outs):
                    assert a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num()), n.name
                checked.append(n.seq)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.3), nn.ReLU(inplace=True), nn.Linear(64, 8)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 16).half() * 3000  # (the first Linear's output passes 65504)
    try:
        fmod.Forensics._let_go, fmod.Forensics.rebuild = copy_then_let_go, rebuild_then_compare
        run, _ = _record(model, lambda rec: [opt.zero_grad(), model(x).float().square().mean().backward(),
                                             opt.step()], opt)
    finally:
        fmod.Forensics._let_go, fmod.Forensics.rebuild = let_go, rebuild
    assert len(_rows(run)) and len(checked) == len(made) > 20


def test_op_arguments_flatten_as_pytorchs_pytree_does_and_build_again():
    from torch.utils._pytree import tree_flatten

    from mpscope.recording.root_cause import flatten, tensors_of, unflatten
    t = torch.ones(2)
    trees = [((t, 2.0, [t, t], None), {"dtype": torch.float16, "dim": (0, 1)}),
             (([t], t, torch.Size([2, 3])), {}), ((t,), {"out": [t, {"k": t}]})]
    for tree in trees:
        leaves, spec = flatten(tree)
        ref = tree_flatten(tree)[0]  # (torch.Size: a leaf here, opened by PyTorch's pytree)
        assert [type(a) for a in leaves if isinstance(a, torch.Tensor)] == [type(a) for a in ref
                                                                            if isinstance(a, torch.Tensor)]
        assert unflatten(leaves, spec) == tree
    out = torch.max(torch.randn(3, 4), 1)  # (a named tuple of tensors)
    assert [a is b for a, b in zip(tensors_of(out), tree_flatten(out)[0])] == [True, True]


# ----------------------------------------------------------------------------- a forward fix the backward refutes
class _Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.mu = nn.Linear(8, 1)
        self.log_std = nn.Linear(8, 1)
        with torch.no_grad():
            self.log_std.weight.zero_()
            self.log_std.bias.fill_(math.log(4.5e-5))  # (a posterior that grew sharp: var ~ 2e-9)

    def forward(self, x):
        return self.mu(x).squeeze(-1), self.log_std(x).squeeze(-1)


def test_a_forward_fix_whose_backward_still_overflows_is_not_verified():
    # A Gaussian NLL in the loop: var = exp(log_std)**2 is 0 in float16, so the loss is inf. 'log_std' in
    # float32 makes the loss finite, but d loss / d mu = (mu - y) / var ~ 1e9 still overflows the fp16
    # mean head's backward at any loss scale >= 1: oracle, GradScaler itself skips every step under that
    # config (its scale halves each time). bfloat16 (wider range) is the fix the replay must verify.
    def nll(m, x, y):
        mu, log_std = m(x)
        var = torch.exp(log_std) ** 2
        return ((y - mu) ** 2 / (2 * var) + log_std).mean()

    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64) * 1e-3
    m = _Heads()
    trial = copy.deepcopy(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    sc = torch.amp.GradScaler("cpu")
    run, adv = _record(m, _amp_loop(m, opt, lambda: nll(m, x, y), torch.float16, scaler=sc), opt, sc)
    rows = _rows(run)
    row = rows[rows.spot == "nonfinite"].iloc[0]
    assert "log_std" not in str(row.fix_modules) and (row.fix_dtype == "bfloat16") and bool(row.verified), \
        rows[["spot", "mechanism", "op", "fix_modules", "fix_dtype", "verified"]]
    # the oracle: 'log_std' in float32 under GradScaler, four steps, every one skipped
    fwd = trial.log_std.forward
    trial.log_std.forward = lambda h: torch.autocast("cpu", enabled=False)(fwd)(h.float())
    opt2, sc2 = torch.optim.SGD(trial.parameters(), lr=0.0), torch.amp.GradScaler("cpu")
    for _ in range(4):
        opt2.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nll(trial, x, y)
        assert torch.isfinite(loss)  # (the forward is fixed)
        sc2.scale(loss).backward()
        sc2.step(opt2)
        sc2.update()
    assert sc2.get_scale() == 2.0 ** 16 / 2 ** 4


# ----------------------------------------------------------------------------- an output after a step function
def test_an_output_after_a_sign_is_judged_at_the_sign_and_bf16_verified():
    # FGSM in fp16: the input gradient of a confident classifier's mean cross-entropy (logit margin 20,
    # dCE/dlogit ~ 2e-9 / 128) is exactly 0 in fp16, so sign() gives 0 and x_adv is x. The adversarial
    # output stays far off float64 under any fix (elements near 0 may take either sign), so the fix is
    # judged at the sign: bfloat16 puts it on float64's side. Oracle: torch's own autograd.grad under
    # fp16 autocast (every element 0) and under bf16 (none).
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 10))
    with torch.no_grad():
        m[2].bias.zero_()
        m[2].bias[3] = 20.0
    x, y = torch.rand(128, 64), torch.full((128,), 3)

    def input_grad(dtype):
        x_ = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            return torch.autograd.grad(F.cross_entropy(m(x_).float(), y), x_)[0]

    assert bool((input_grad(torch.float16) == 0).all()) and bool((input_grad(torch.bfloat16) != 0).all())
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    run, _ = _record(m, _amp_loop(m, opt, lambda: F.cross_entropy(m(x + 0.1 * input_grad(torch.float16).sign())
                                                                  .float(), y), torch.float16,
                                  scaler=torch.amp.GradScaler("cpu")), opt)
    rows = _rows(run)
    row = rows[rows.spot == "output"].iloc[0]
    assert row.mechanism == "underflow" and row.fix_dtype == "bfloat16" and bool(row.verified), rows.T


# ----------------------------------------------------------------------------- gradient bookkeeping with grad on
def test_a_clip_norm_summed_in_fp16_is_in_the_optimizer_phase_whatever_the_grad_mode():
    # A .half() conv net whose gradients reach ~300: the loop clips them by hand, with autograd on, as
    # sqrt(sum(g * g)) in float16; 300 * 300 = 90000 > 65504 (oracle: torch's own float16 product; float32's
    # is finite), the norm is inf and the clip coefficient 0. Reading parameters' gradients is gradient
    # bookkeeping before optimizer.step(): the overflow is named in that phase, not the loss's.
    g16 = torch.tensor(300.0, dtype=torch.float16)
    assert torch.isinf(g16 * g16) and torch.isfinite(g16.float() * g16.float())
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 1)).half()
    opt = torch.optim.SGD(m.parameters(), lr=1e-6)
    x, y = torch.randn(16, 3, 8, 8).half(), torch.full((16, 1), 2000.0)

    def loop(rec):
        opt.zero_grad()
        F.mse_loss(m(x).float(), y).backward()
        norm = torch.sqrt(sum((p.grad * p.grad).sum() for p in m.parameters()))
        for p in m.parameters():
            p.grad.mul_(1.0 / (norm + 1e-6))
        opt.step()
    run, _ = _record(m, loop, opt)
    assert max(float(p.grad.abs().max()) for p in m.parameters()) == 0  # (the clip zeroed every gradient)
    rows = _rows(run)
    hit = rows[(rows.mechanism == "overflow") & (rows.op == "aten.mul.Tensor")]
    assert len(hit) and (hit.phase == "optimizer").all(), rows[["spot", "mechanism", "op", "phase"]]


def test_an_infinity_an_op_only_carries_is_no_error_of_its_own():
    # inf + 1e-6 (a clip norm's guard after the norm overflowed) is the same infinity in float64 (oracle:
    # torch's own float64 sum of a float16 inf): the add adds no error; the op that made the inf did
    from mpscope.recording.root_cause import bad_fraction
    inf16 = torch.tensor([math.inf, 1.0, math.nan], dtype=torch.float16)
    local = inf16.double() + 1e-6  # the op on its own inputs, cast up
    assert local[0] == math.inf and bool(torch.isnan(local[2]))
    ref = torch.tensor([math.inf, 1.0, 2.0], dtype=torch.float64)  # (the NaN is wrong against a finite 2)
    assert bad_fraction(inf16 + 1e-6, ref) == pytest.approx(2 / 3)  # (made here: a pole's inf is the op's)
    assert bad_fraction(inf16 + 1e-6, ref, same_inf_right=True) == pytest.approx(1 / 3)
