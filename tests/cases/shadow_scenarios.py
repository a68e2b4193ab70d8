"""Precision-loss scenarios for the fp32 shadow: nothing overflows, nothing is NaN, the numbers are
just wrong. Each model has a ``fixed`` variant (the healthy control) doing the rounding-sensitive
part in float32. All follow the activation dtype: under autocast they compute in its dtype, without
it in float32, so a float32 forward is the true reference.

* C11 kind, positions: rotary embedding whose positions are built in the activation dtype
  (``arange(T).to(x.dtype)``): bf16 holds every integer only up to 256.
* C14 kind, timesteps: diffusion timesteps in [0, 1000) cast to the activation dtype before a
  sinusoidal embedding: bf16's spacing between 512 and 1024 is 4.
* A running sum: an exponential moving average (a leaky integrator over time) whose state is kept
  in the activation dtype: each step moves the state (about 4) by 0.5 % of the input's difference from
  it, near or below half a bf16 ulp (2^-6 between 4 and 8), so increments are lost or rounded.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def act_dtype() -> torch.dtype:
    """The activation dtype: autocast's while it is on (CPU), else float32."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32


# ----------------------------------------------------------------------------- C11 kind: positions
class Rotary(nn.Module):
    def __init__(self, dim: int, fixed: bool):
        super().__init__()
        self.fixed = fixed
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, x):  # x (B, T, dim)
        pos = torch.arange(x.shape[1], device=x.device)
        if self.fixed:
            angles = torch.outer(pos.float(), self.inv_freq)
        else:  # the bug: positions and angles in the activation dtype
            angles = torch.outer(pos.to(x.dtype), self.inv_freq.to(x.dtype))
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class RotaryModel(nn.Module):
    def __init__(self, fixed: bool = False, d: int = 32):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.rotary = Rotary(d, fixed)
        self.mix = nn.Linear(d, d)
        self.act = nn.GELU()
        self.out = nn.Linear(d, 8)

    def forward(self, x):
        return self.out(self.act(self.mix(self.rotary(self.q(x)))))


def rotary_batch():
    return (torch.randn(2, 1024, 32),)


# ----------------------------------------------------------------------------- C14 kind: timesteps
class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, fixed: bool):
        super().__init__()
        self.fixed = fixed
        half = dim // 2
        self.register_buffer("freqs", torch.exp(-math.log(10000.0) * torch.arange(half).float() / half))

    def forward(self, t):  # t (B,) float timesteps in [0, 1000)
        t = t.float() if self.fixed else t.to(act_dtype())  # the bug: timesteps in the activation dtype
        args = t[:, None].float() * self.freqs
        return torch.cat([args.cos(), args.sin()], -1)


class DenoiserModel(nn.Module):
    def __init__(self, fixed: bool = False, d: int = 64):
        super().__init__()
        self.temb = TimestepEmbedding(d, fixed)
        self.tproj = nn.Linear(d, d)
        self.xproj = nn.Linear(16, d)
        self.act = nn.SiLU()
        self.out = nn.Linear(d, 16)

    def forward(self, x, t):
        return self.out(self.act(self.xproj(x) + self.tproj(self.temb(t))))


def denoiser_batch():
    return torch.randn(256, 16), torch.rand(256) * 1000


# ----------------------------------------------------------------------------- a running sum
class LeakyIntegrator(nn.Module):
    """h_t = (1 - a) h_{t-1} + a x_t over the time axis (an EMA), state in the activation dtype."""

    def __init__(self, a: float, fixed: bool):
        super().__init__()
        self.a, self.fixed = a, fixed

    def forward(self, x):  # x (B, T, D)
        h = torch.zeros_like(x[:, 0], dtype=torch.float32 if self.fixed else x.dtype)
        out = []
        for i in range(x.shape[1]):
            h = (1 - self.a) * h + self.a * x[:, i]
            out.append(h)
        return torch.stack(out, 1).to(x.dtype)


class SmootherModel(nn.Module):
    def __init__(self, fixed: bool = False, d: int = 16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.ema = LeakyIntegrator(0.005, fixed)
        self.out = nn.Linear(d, 4)
        with torch.no_grad():
            self.inp.bias.fill_(4.0)  # a level the average sits on, small changes around it

    def forward(self, x):
        return self.out(self.ema(self.inp(x)))


def smoother_batch():
    return (torch.randn(4, 256, 16),)


SCENARIOS = {
    # name: (model class, batch builder, culprit module)
    "positions": (RotaryModel, rotary_batch, "rotary"),
    "timesteps": (DenoiserModel, denoiser_batch, "temb"),
    "running_sum": (SmootherModel, smoother_batch, "ema"),
}
