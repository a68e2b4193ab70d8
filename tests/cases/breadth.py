"""Scenarios of the diagnosis-breadth cases (C13-C17) and of a second member of each kind.

Each builder is real training code (seed 0, CPU). ``train(..., record=True)`` runs it under
``mpscope.record`` and returns a small frozen dataclass with the Run and plain-PyTorch facts (the oracle); with
``apply=rec`` the same unchanged loop runs inside ``mpscope.apply(model, rec)``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import mpscope

CPU = "cpu"


@dataclass(frozen=True)
class C13Run:
    """C13: one training with clip_grad_norm_ (norms as returned, the fp32 norm and largest |g| before the clip)."""

    run: "mpscope.Run | None"
    norms: list[float]
    fp32_norm: list[float]
    grad_absmax: list[float]
    losses: list[float]
    moved: int  # weight elements that changed


@dataclass(frozen=True)
class C16Run:
    """C16: one training of an AMP misuse variant."""

    run: "mpscope.Run | None"
    optimizer_steps: int
    nan_weights: int


@dataclass(frozen=True)
class C17Run:
    """C17: one training of a stale-forward variant."""

    run: "mpscope.Run | None"
    losses: list[float]
    moved: int  # weight elements that changed


@dataclass(frozen=True)
class C14Run:
    """C14: timesteps cast to low precision (distinct values before/after, largest move, embedding error)."""

    run: "mpscope.Run | None"
    t: torch.Tensor
    distinct_in: int
    distinct_out: int
    max_move: float
    emb_err: float


@dataclass(frozen=True)
class RotaryRun:
    """C14, second member: rotary angles in bf16 (largest angle, cos error against fp32)."""

    run: "mpscope.Run | None"
    angle_max: float
    cos_err: float


@dataclass(frozen=True)
class C15Run:
    """C15: one training (losses, logit spread, the GradScaler's final scale)."""

    run: "mpscope.Run | None"
    losses: list[float]
    logit_std: float
    final_scale: float


@dataclass(frozen=True)
class ProbeRun:
    """a recorded run and nothing else."""

    run: "mpscope.Run | None"


def _maybe(model, record: bool, apply, **kw):
    """The recording (and applying) context for one scenario run."""
    stack = contextlib.ExitStack()
    if apply is not None:
        stack.enter_context(mpscope.apply(model, apply))
    rec = stack.enter_context(mpscope.record(model, **kw)) if record else None
    return stack, rec


# ------------------------------------------------------------------------------------ C13
def c13_model(kind: str = "mlp"):
    torch.manual_seed(0)
    if kind == "mlp":  # the case: Linear(256,256) -> ReLU -> Linear(256,16)
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))
        x, y = torch.randn(32, 256), torch.randn(32, 16) * 800
    else:  # second member: a small conv net, targets of size ~1000
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                              nn.Flatten(), nn.Linear(16 * 8 * 8, 8))
        x, y = torch.randn(64, 3, 8, 8), torch.randn(64, 8) * 1000
    return model, x, y


def c13_train(kind: str = "mlp", record: bool = True, apply=None, steps: int = 12):
    """fp16 parameters (.half(), no autocast, no scaler), summed MSE, SGD, clip_grad_norm_(1.0)."""
    model, x, y = c13_model(kind)
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    w0 = [p.detach().clone() for p in model.parameters()]
    norms, losses, fp32_norm, gmax = [], [], [], []
    stack, rec = _maybe(model, record, apply, optimizer=opt)
    with stack:
        for _ in range(steps):
            opt.zero_grad()
            out = model(x.half())
            loss = F.mse_loss(out.float(), y, reduction="sum")
            loss.backward()
            grads = [p.grad.double().reshape(-1) for p in model.parameters()]
            fp32_norm.append(float(torch.linalg.vector_norm(torch.cat(grads))))
            gmax.append(float(torch.cat(grads).abs().max()))
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            losses.append(float(loss.detach()))
    moved = sum(int((p.detach() != w).sum()) for p, w in zip(model.parameters(), w0))
    return C13Run(run=rec.run if rec else None, norms=norms, fp32_norm=fp32_norm, grad_absmax=gmax,
            losses=losses, moved=moved)


@functools.lru_cache(maxsize=None)
def c13(kind: str = "mlp"):
    return c13_train(kind)


# ------------------------------------------------------------------------------------ C16
def c16_train(variant: str = "no_scaler_step", record: bool = True, steps: int = 12):
    """MLP 3->64->64->4, Adam, default GradScaler, summed MSE, fp16 autocast.

    ``no_scaler_step`` (the case): scaler.scale(loss).backward(); optimizer.step() — never
    scaler.step / unscale_ / update. ``unscale_then_step`` (second member): scaler.unscale_(opt);
    optimizer.step(); scaler.update() — the scaler's inf check is ignored.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(CPU, init_scale=2.0**16 if variant == "no_scaler_step" else 2.0**24)
    x, y = torch.randn(64, 3), torch.randn(64, 4) * 10
    n_opt_steps = 0
    stack, rec = _maybe(model, record, None, optimizer=opt, scaler=scaler)
    with stack:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast(CPU, dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y, reduction="sum")
            scaler.scale(loss).backward()
            if variant == "unscale_then_step":
                scaler.unscale_(opt)
                opt.step()
                scaler.update()
            else:
                opt.step()
            n_opt_steps += 1
    nan_w = sum(int(torch.isnan(p).sum()) for p in model.parameters())
    return C16Run(run=rec.run if rec else None, optimizer_steps=n_opt_steps, nan_weights=nan_w)


@functools.lru_cache(maxsize=None)
def c16(variant: str = "no_scaler_step"):
    return c16_train(variant)


# ------------------------------------------------------------------------------------ C17
def c17_train(variant: str = "bf16_mlp", record: bool = True, steps: int = 12):
    """One autocast region around the whole loop (forward, backward and optimizer.step inside).

    ``bf16_mlp`` (the case): fp32 MLP 16->64->64->1, AdamW, bf16. ``fp16_conv`` (second member): a
    small fp32 conv net, SGD with momentum, float16.
    """
    torch.manual_seed(0)
    if variant == "bf16_mlp":
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y, dtype = torch.randn(32, 16), torch.randn(32, 1), torch.bfloat16
    else:
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        x, y, dtype = torch.randn(16, 3, 8, 8), torch.randn(16, 4), torch.float16
    w0 = copy.deepcopy(model.state_dict())
    losses = []
    stack, rec = _maybe(model, record, None, optimizer=opt)
    with stack, torch.autocast(CPU, dtype=dtype):
        for _ in range(steps):
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
    moved = sum(int((v != w0[k]).sum()) for k, v in model.state_dict().items() if k in w0)
    return C17Run(run=rec.run if rec else None, losses=losses, moved=moved)


@functools.lru_cache(maxsize=None)
def c17(variant: str = "bf16_mlp"):
    return c17_train(variant)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and bool(torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                                                   b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)))


def finite_and_decreasing(losses) -> bool:
    return all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


# ------------------------------------------------------------------------------------ C14
class TimeEmbedding(nn.Module):
    """Sinusoidal timestep embedding (as in diffusion models): fp32 frequencies, sin/cos."""

    def __init__(self, dim: int = 64):
        super().__init__()
        half = dim // 2
        self.register_buffer("freqs", torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half))

    def forward(self, t):
        args = t[:, None].float() * self.freqs[None]
        return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.temb = TimeEmbedding(64)
        self.mlp = nn.Sequential(nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 16))

    def forward(self, x, t):
        h = self.inp(x)
        t = t.to(h.dtype)  # the timesteps are cast to the activation dtype: bf16 under autocast
        return self.mlp(h + self.temb(t))


def c14_data():
    torch.manual_seed(0)
    model = Denoiser()
    x, t = torch.randn(256, 16), torch.rand(256) * 1000
    return model, x, t


@functools.lru_cache(maxsize=None)
def c14(dtype=torch.bfloat16):
    """One recorded training step of the denoiser under CPU autocast; the oracle compares the
    embedding of the rounded timesteps with the fp32 one."""
    model, x, t = c14_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with mpscope.record(model, optimizer=opt, ops=True) as rec:
        opt.zero_grad()
        with torch.autocast(CPU, dtype=dtype):
            out = model(x, t)
        F.mse_loss(out.float(), torch.zeros_like(x)).backward()
        opt.step()
    with torch.no_grad():
        rounded = t.to(dtype)
        emb_err = float((model.temb(rounded) - model.temb(t)).abs().max())
    return C14Run(run=rec.run, t=t, distinct_in=int(t.unique().numel()), distinct_out=int(rounded.unique().numel()),
            max_move=float((rounded.float() - t).abs().max()), emb_err=emb_err)


class RotaryAttention(nn.Module):
    """Second member of the kind: rotary angles computed by a matmul that runs under autocast, so
    positions · inv_freq are bfloat16 before cos/sin (what HF avoids with autocast disabled)."""

    def __init__(self, d: int = 32, base: float = 10000.0):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=torch.float32)[:, None]
        angles = pos @ self.inv_freq[None]  # (T, d/2): a matmul, so bfloat16 under autocast
        cos, sin = angles.cos(), angles.sin()
        q = self.q(x)
        q1, q2 = q[..., 0::2], q[..., 1::2]
        return torch.cat([q1 * cos - q2 * sin, q1 * sin + q2 * cos], dim=-1)


@functools.lru_cache(maxsize=None)
def c14_rotary():
    torch.manual_seed(0)
    model = RotaryAttention()
    x = torch.randn(2, 2048, 32)
    with mpscope.record(model, ops=True) as rec:
        with torch.autocast(CPU, dtype=torch.bfloat16):
            model(x)
        rec.step()
    angles = torch.arange(2048, dtype=torch.float32)[:, None] @ model.inv_freq[None]
    return RotaryRun(run=rec.run, angle_max=float(angles.abs().max()),
            cos_err=float((angles.to(torch.bfloat16).float().cos() - angles.cos()).abs().max()))


# ------------------------------------------------------------------------------------ C15
class NegLogLik(nn.Module):
    """log(1 - p) with p = sigmoid(logits) clamped below 1 by a constant (1 - 1e-6)."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, logits):
        p = torch.sigmoid(logits).clamp(max=1 - self.eps)
        return torch.log1p(-p)


class C15Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)
        self.nll = NegLogLik()

    def forward(self, x):
        return self.nll(self.head(self.mlp(x))).squeeze(-1)


def c15_setup():
    torch.manual_seed(0)
    model = C15Model()
    with torch.no_grad():
        model.head.weight.mul_(90.0)  # logits of std about 5
    x = torch.randn(128, 16)
    with torch.no_grad():
        negative = model.head(model.mlp(x)).squeeze(-1) < 0  # saturated logits are all positives
    return model, x, negative


def c15_train(record: bool = True, apply=None, steps: int = 12):
    """fp16 autocast + GradScaler; loss = -(sum of log(1 - p) over the negatives) (a masked sum)."""
    model, x, negative = c15_setup()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses, logit_std = [], None
    rec = None
    scaler_box = []
    with contextlib.ExitStack() as outer:
        if apply is not None:
            outer.enter_context(mpscope.apply(model, apply))
        scaler = torch.amp.GradScaler(CPU)
        scaler_box.append(scaler)
        if record:
            rec = outer.enter_context(mpscope.record(model, optimizer=opt, scaler=scaler, ops=True))
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast(CPU, dtype=torch.float16):
                ll = model(x)
                if logit_std is None:
                    with torch.no_grad():
                        logit_std = float(model.head(model.mlp(x)).float().std())
            loss = -torch.where(negative, ll.float(), 0.0).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))
    return C15Run(run=rec.run if rec else None, losses=losses, logit_std=logit_std,
            final_scale=scaler_box[0].get_scale())


@functools.lru_cache(maxsize=None)
def c15():
    return c15_train()


class PoincareDistance(nn.Module):
    """Distance from the origin of the Poincare ball: 2 atanh(|z|), |z| clamped below 1 by 1 - 1e-5
    (a common guard)."""

    def forward(self, z):
        r = z.abs().amax(-1).clamp(max=1 - 1e-5)
        return 2 * torch.atanh(r)


class Hyperbolic(nn.Module):
    """Second member: a hyperbolic embedding (tanh into the unit ball), bfloat16 autocast."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        self.dist = PoincareDistance()

    def forward(self, x):
        return self.dist(torch.tanh(self.enc(x)))


@functools.lru_cache(maxsize=None)
def c15_hyperbolic():
    torch.manual_seed(0)
    model = Hyperbolic()
    with torch.no_grad():
        model.enc[2].weight.mul_(20.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 8)
    with mpscope.record(model, optimizer=opt, ops=True) as rec:
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast(CPU, dtype=torch.bfloat16):
                d = model(x)
            d.float().mean().backward()
            opt.step()
    return ProbeRun(run=rec.run)
