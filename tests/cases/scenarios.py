"""Module-level failure cases of ../shared/CASES.md (C01, C05-C10) as real training code, seed 0.

Each builder trains the case's model under ``mpscope.record()`` and returns a small frozen dataclass
with the Run and the plain-PyTorch facts (the oracle) the tests compare it with. Builders are
cached: each scenario runs once per test session. ``train_*`` functions take an optional scaler config so that the
consistency tests can retrain the same seed with another GradScaler.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import mpscope

CPU = "cpu"


@dataclass(frozen=True)
class C01:
    run: mpscope.Run
    fp32_down0_absmax: float  # |x| of blocks.0.down's output in a plain fp32 forward
    bf16_finite: bool  # the bf16 autocast forward gives finite logits
    logits_nonfinite: int  # non-finite logits of the recorded fp16 forward


@dataclass(frozen=True)
class C05:
    run: mpscope.Run
    fp32_absmax: float  # |x| of the Linear's output in fp32
    running_mean_nan: int
    running_mean_dtype: torch.dtype


@dataclass(frozen=True)
class C06:
    run: mpscope.Run
    model: nn.Module


@dataclass(frozen=True)
class Trained:
    """One training of a case: the Run (None when trained unrecorded, as the oracle) and facts."""

    run: mpscope.Run | None
    norms: list[float] = field(default_factory=list)  # clip_grad_norm_'s return per step (C07)
    moved: float = float("nan")  # largest weight change (C07)
    final_loss: float = float("nan")
    nan_params: int = 0  # NaN parameters after training (C09)
    numel: int = 0
    changed: int = 0  # weights that ever changed (C10)
    skipped: int = 0  # steps the GradScaler skipped, as PyTorch saw them (C08)


@dataclass(frozen=True)
class Pair:
    """The failing setup and the fixed one, trained from the same seed."""

    bad: Trained
    good: Trained


def run_maybe_recorded(train, record: bool, model, **record_kw):
    """Run ``train()`` under ``mpscope.record(model, **record_kw)`` and return the Run, or run it
    plainly (the unrecorded oracle) and return None."""
    if not record:
        train()
        return None
    with mpscope.record(model, **record_kw) as rec:
        train()
    return rec.run


# ------------------------------------------------------------------------------------ C01
class RMSNorm(nn.Module):
    """RMSNorm with its variance in fp32 and a constant gain (24 in C01)."""

    def __init__(self, d: int, gain: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((d,), float(gain)))

    def forward(self, x):
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return (xf * torch.rsqrt(var + 1e-6)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, d=64, h=256):
        super().__init__()
        self.norm = RMSNorm(d, gain=24.0)
        self.up = nn.Linear(d, h, bias=False)
        self.act = nn.ReLU()
        self.down = nn.Linear(h, d, bias=False)
        nn.init.normal_(self.up.weight, 0.0, 1.0)
        nn.init.normal_(self.down.weight, 0.0, 8.0)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


class C01Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = RMSNorm(64)
        self.head = nn.Linear(64, 100)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


@functools.lru_cache(maxsize=None)
def c01():
    torch.manual_seed(0)
    model = C01Model()
    ids = torch.randint(0, 100, (8, 32))
    with torch.no_grad():  # oracle: the same forward in fp32 and in bf16
        acts = {}
        hooks = [model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: acts.__setitem__(n, o))
                 for n in ("blocks.0.down", "blocks.1.down", "head")]
        model(ids)
        fp32_down0 = acts["blocks.0.down"].abs().max().item()
        with torch.autocast(CPU, dtype=torch.bfloat16):
            bf16_logits = model(ids)
        for h in hooks:
            h.remove()
    with mpscope.record(model) as rec:
        with torch.autocast(CPU, dtype=torch.float16):
            logits = model(ids)
        rec.step()
    return C01(run=rec.run, fp32_down0_absmax=fp32_down0, bf16_finite=bool(torch.isfinite(bf16_logits).all()),
               logits_nonfinite=int((~torch.isfinite(logits)).sum()))


# ------------------------------------------------------------------------------------ C05
@functools.lru_cache(maxsize=None)
def c05():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10))
    x = torch.rand(2, 10) * 131070
    with torch.no_grad():
        fp32_absmax = model[0](x).abs().max().item()
    with mpscope.record(model) as rec:
        with torch.autocast(CPU, dtype=torch.float16):
            model(x)
        rec.step()
    return C05(run=rec.run, fp32_absmax=fp32_absmax, running_mean_nan=int(torch.isnan(model[1].running_mean).sum()),
               running_mean_dtype=model[1].running_mean.dtype)


# ------------------------------------------------------------------------------------ C06
def c06_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        lin = nn.Linear(128, 128)
        nn.init.normal_(lin.weight, 0.0, 0.05)
        layers += [lin, nn.Tanh()]
    layers.append(nn.Linear(128, 10))
    model = nn.Sequential(*layers)
    x = torch.randn(256, 128)
    y = torch.randn(256, 10)
    return model, x, y


def c06_loss(model, x, y):
    with torch.autocast(CPU, dtype=torch.float16):
        out = model(x)
    return 1e-4 * F.mse_loss(out.float(), y)


@functools.lru_cache(maxsize=None)
def c06(scale: float):
    """One backward at a fixed loss scale (1 or 2^16)."""
    model, x, y = c06_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step only marks the step boundary
    scaler = torch.amp.GradScaler(CPU, init_scale=scale)
    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        scaler.scale(c06_loss(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
    return C06(run=rec.run, model=model)


def train_c06(scaler_cfg: dict | None, steps: int = 20, record: bool = False):
    """SGD training of the C06 MLP with a GradScaler; returns (skipped steps, run or None)."""
    model, x, y = c06_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler(CPU, **(scaler_cfg or {}))
    return _train(model, opt, scaler, lambda: c06_loss(model, x, y), steps, record)


# ------------------------------------------------------------------------------------ C07
def c07_train(clip_first: bool, record: bool = True, steps: int = 20):
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    x = torch.randn(64, 16)
    y = x @ torch.randn(16, 1) * 0.5
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(CPU, init_scale=2.0**16)
    w0 = model.weight.detach().clone()
    norms, losses = [], []

    def loop():
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast(CPU, dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            scaler.scale(loss).backward()
            if clip_first:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
                scaler.unscale_(opt)
            else:
                scaler.unscale_(opt)
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))

    run = run_maybe_recorded(loop, record, model, optimizer=opt, scaler=scaler)
    with torch.no_grad():
        final = float(F.mse_loss(model(x), y))
    return Trained(run=run, norms=norms, moved=float((model.weight.detach() - w0).abs().max()), final_loss=final)


@functools.lru_cache(maxsize=None)
def c07():
    return Pair(bad=c07_train(True), good=c07_train(False, record=False))


# ------------------------------------------------------------------------------------ C08
C08_STEPS = 400


def c08_setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    x = torch.randn(128, 32)  # one fixed batch, trained on every step
    y = torch.randn(128, 1) * 100.0  # targets N(0, 100^2)
    return model, x, y


def train_c08(scaler_cfg: dict | None, record: bool = False, steps: int = C08_STEPS):
    model, x, y = c08_setup()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(CPU, **(scaler_cfg or {}))
    def loss_fn():
        with torch.autocast(CPU, dtype=torch.float16):
            out = model(x)
        return F.mse_loss(out.float(), y)

    return _train(model, opt, scaler, loss_fn, steps, record)


C08_SCALER = {"init_scale": 2.0**16, "growth_interval": 50}


@functools.lru_cache(maxsize=None)
def c08():
    skipped, run = train_c08(C08_SCALER, record=True)
    return Trained(run=run, skipped=skipped)


# ------------------------------------------------------------------------------------ C09
def c09_train(eps: float, record: bool = True):
    torch.manual_seed(0)
    model = nn.Embedding(10, 4).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    ids = torch.tensor([1, 2, 3])

    def step():
        opt.zero_grad()
        loss = model(ids).pow(2).sum()
        loss.backward()
        opt.step()

    run = run_maybe_recorded(step, record, model, optimizer=opt)
    return Trained(run=run, nan_params=int(torch.isnan(model.weight).sum()), numel=model.weight.numel())


@functools.lru_cache(maxsize=None)
def c09():
    return Pair(bad=c09_train(1e-8), good=c09_train(1e-4, record=False))


# ------------------------------------------------------------------------------------ C10
class C10Model(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.w = nn.Parameter(torch.ones(768, dtype=dtype))

    def forward(self):
        return (self.w.float() * torch.linspace(-1, 1, 768)).sum()


def c10_train(dtype, record: bool = True, steps: int = 100):
    torch.manual_seed(0)
    model = C10Model(dtype)
    w0 = model.w.detach().clone()
    opt = torch.optim.Adam(model.parameters(), lr=6e-4)
    changed = torch.zeros(768, dtype=torch.bool)

    def loop():
        nonlocal changed
        for _ in range(steps):
            opt.zero_grad()
            model().backward()
            opt.step()
            changed |= model.w.detach() != w0

    run = run_maybe_recorded(loop, record, model, optimizer=opt)
    return Trained(run=run, changed=int(changed.sum()))


@functools.lru_cache(maxsize=None)
def c10():
    return Pair(bad=c10_train(torch.bfloat16), good=c10_train(torch.float32, record=False))


# ------------------------------------------------------------------------------------ shared
#: Roles the scaler replay and the module-level findings of these cases need (weights and optimizer
#: state are left out where a case does not look at them: it halves the recording time).
GRAD_ROLES = ["activation", "activation_grad", "param_grad", "loss"]


def _train(model, opt, scaler, loss_fn, steps, record):
    """Standard GradScaler loop; returns (number of skipped steps as PyTorch saw them, run)."""
    skipped = 0

    def loop():
        nonlocal skipped
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn()
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before

    run = run_maybe_recorded(loop, record, model, optimizer=opt, scaler=scaler, roles=GRAD_ROLES)
    return skipped, run


def c06_layer_grads(scale: float) -> dict:
    """Plain-PyTorch oracle: per layer index, (zero fraction, subnormal fraction) of the fp16
    activation gradient after one backward of the C06 loss at ``scale`` (no mpscope)."""
    model, x, y = c06_model()
    grads = {}

    def keep(name):
        def hook(mod, inputs, output):
            output.register_hook(lambda g: grads.__setitem__(name, g))
        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in model.named_children()]
    try:
        (c06_loss(model, x, y) * scale).backward()
    finally:
        for h in hooks:
            h.remove()
    tiny = torch.finfo(torch.float16).tiny
    out = {}
    for n, g in grads.items():
        a = g.float().abs()
        out[n] = (float((a == 0).float().mean()), float(((a > 0) & (a < tiny)).float().mean()))
    return out
