"""Scenarios of the accumulation_precision kind: a running sum kept in float16/bfloat16 that loses
its increments (swamping: ``(acc + g) == acc`` while ``g != 0``).

* :func:`grad_accum_train` (the case): a character-level MLP language model on the standard library's
  own source text, parameters cast to bfloat16 (``model.to(torch.bfloat16)``), gradient accumulation
  over 16 micro-batches per optimizer step. The oracle is plain PyTorch on the actual tensors: a
  tensor hook on every parameter sees each micro-batch's gradient ``g`` before it is added to
  ``.grad`` and counts ``((acc + g) == acc) & (g != 0)``, and the same increments are summed in
  float32 next to it.
* :func:`ema_train` (the second member): an input normaliser whose running mean (an EMA buffer, as
  in RL observation normalisers) became bfloat16 with the model; recorded with ``ops=True``. The
  oracle: the buffer's own values before and after each update (elements that did not change
  although the batch mean differs from them), and the same EMA in float32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import mpscope
from mpscope.demo import CharDataset

from .breadth import _maybe

CONTEXT = 8


@dataclass(frozen=True)
class GradAccumRun:
    run: "mpscope.Run | None"
    losses: list  # per optimizer step, the sum of the micro-batch losses
    increments: list  # per step: non-zero increments added into an existing .grad (oracle)
    swamped: list  # per step: of those, the ones with (acc + g) == acc (oracle, torch on the tensors)
    differ_fp32: list  # per step: .grad elements that differ from the float32 sum of the same increments


@dataclass(frozen=True)
class EMARun:
    run: "mpscope.Run | None"
    losses: list
    increments: list  # per step: elements whose batch mean differs from the running mean
    swamped: list  # per step: of those, elements the update left unchanged (the buffer itself)
    ema: torch.Tensor  # the final running mean (as trained)
    ema_fp32: torch.Tensor  # the same EMA of the same batch means in float32
    target: float  # the data's mean at the last step


@functools.lru_cache(maxsize=1)
def _text_data() -> CharDataset:
    return CharDataset.from_stdlib(CONTEXT)


class CharMLP(nn.Module):
    """Next character from the previous CONTEXT characters (Bengio-style MLP language model)."""

    def __init__(self, vocab: int, d: int = 16, hidden: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(CONTEXT * d, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(F.gelu(self.fc(self.emb(x).flatten(1))))


def _oracle_hooks(params, stats):
    """Plain-PyTorch tensor hooks: count swamped increments and keep the float32 sum."""
    handles = []
    for p in params:
        def hook(g, p=p):
            with torch.no_grad():
                if p.grad is None:
                    stats["acc32"][p] = g.float()
                    return
                stats["acc32"][p] += g.float()
                nz = g != 0
                stats["inc"] += int(nz.sum())
                stats["sw"] += int((((p.grad + g) == p.grad) & nz).sum())
        handles.append(p.register_hook(hook))
    return handles


def grad_accum_train(dtype=torch.bfloat16, micro: int = 16, steps: int = 2, record: bool = True, apply=None,
                     batch: int = 8) -> GradAccumRun:
    torch.manual_seed(0)
    ds = _text_data()
    model = CharMLP(ds.vocab_size).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = ds.generator(0)
    params = list(model.parameters())
    losses, increments, swamped, differ = [], [], [], []
    stats: dict = {}
    handles = _oracle_hooks(params, stats)
    stack, rec = _maybe(model, record, apply, optimizer=opt)
    try:
        with stack:
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                stats.update(inc=0, sw=0, acc32={})
                total = 0.0
                for _ in range(micro):
                    x, y = ds.batch(batch, gen)
                    loss = F.cross_entropy(model(x).float(), y[:, -1]) / micro
                    loss.backward()
                    total += float(loss.detach())
                increments.append(stats["inc"])
                swamped.append(stats["sw"])
                differ.append(sum(int((p.grad != stats["acc32"][p].to(p.grad.dtype)).sum()) for p in params))
                opt.step()
                losses.append(total)
    finally:
        for h in handles:
            h.remove()
    return GradAccumRun(run=rec.run if rec else None, losses=losses, increments=increments, swamped=swamped,
                        differ_fp32=differ)


@functools.lru_cache(maxsize=None)
def grad_accum(dtype=torch.bfloat16):
    return grad_accum_train(dtype)


class RunningMeanNorm(nn.Module):
    """Subtracts a running mean of its inputs: set to the first batch's mean, then an EMA with
    ``momentum`` updated in training mode (as in observation normalisers and feature centering)."""

    def __init__(self, d: int, momentum: float = 0.99):
        super().__init__()
        self.momentum = momentum
        self.started = False
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                if self.started:
                    self.mean.lerp_(x.mean(0), 1.0 - self.momentum)
                else:
                    self.mean.copy_(x.mean(0))
                    self.started = True
        return x - self.mean


EMA_OFFSET, EMA_DRIFT = 8.0, 0.04  # the data's mean starts at 8 and drifts by 0.04 per step


def ema_train(dtype=torch.bfloat16, steps: int = 40, record: bool = True, apply=None) -> EMARun:
    torch.manual_seed(0)
    model = nn.Sequential(RunningMeanNorm(16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    noise = torch.randn(steps, 64, 16)
    w = torch.randn(16, 1)
    ema32 = None
    losses, increments, swamped = [], [], []
    stack, rec = _maybe(model, record, apply, optimizer=opt, ops=True)
    with stack:
        for i in range(steps):
            x = (noise[i] + EMA_OFFSET + EMA_DRIFT * i).to(model[1].weight.dtype)
            old = model[0].mean.detach().clone()
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), noise[i] @ w)
            loss.backward()
            opt.step()
            batch_mean = x.mean(0)
            if i:  # the first step sets the mean; every later one is an EMA update
                new = model[0].mean.detach()
                moves = batch_mean.to(old.dtype) != old
                increments.append(int(moves.sum()))
                swamped.append(int((moves & (new == old)).sum()))
                ema32.lerp_(batch_mean.float(), 1.0 - model[0].momentum)
            else:
                ema32 = batch_mean.float().clone()
            losses.append(float(loss.detach()))
    return EMARun(run=rec.run if rec else None, losses=losses, increments=increments, swamped=swamped,
                  ema=model[0].mean.detach().float().clone(), ema_fp32=ema32,
                  target=EMA_OFFSET + EMA_DRIFT * (steps - 1))


@functools.lru_cache(maxsize=None)
def ema(dtype=torch.bfloat16):
    return ema_train(dtype)
