"""The fused torch-op statistics (``mpscope.stats.batch_stats``, the function CUDA compiles) against
the cast oracle on the CPU: every dtype, sizes 0 … 2^20, non-contiguous inputs, inf/NaN/subnormals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpscope.stats import COUNT_NAMES, EXP_MIN, batch_stats, device_stats, histogram_rows
from test_stats import BF16_BOUNDARIES, FP16_BOUNDARIES, frexp_histogram, oracle

SIZES = [0, 1, 5, 1000, 2**15 + 3, 2**20]


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Log-uniform magnitudes over the dtype's whole range (subnormals included), random signs,
    zeros, inf and NaN, and the fp16/bf16 rounding boundaries."""
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    lo, hi = math.log2(fi.tiny * fi.eps), math.log2(fi.max)
    e = torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo
    x = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double() * torch.exp2(e)
    if n >= 50:
        x[::17] = 0.0
        x[3::41] = math.inf
        x[5::43] = -math.inf
        x[7::47] = math.nan
        edge = torch.tensor(FP16_BOUNDARIES + BF16_BOUNDARIES, dtype=torch.float64)
        x[10 : 10 + len(edge)] = edge
    with np.errstate(over="ignore"):
        return x.to(dtype)


def _check(t: torch.Tensor, counts: torch.Tensor, extrema: torch.Tensor) -> None:
    if t.numel() == 0:  # no element: all counts 0, extrema the reductions' identities
        assert not counts.any()
        assert extrema.tolist() == [-math.inf, math.inf, math.inf]
        return
    want = oracle(t)
    n = t.numel()
    for j, name in enumerate(COUNT_NAMES):
        key = f"{name}_count" if name in ("nan", "inf") else f"{name}_frac"
        if key in want:
            got = int(counts[j]) if name in ("nan", "inf") else int(counts[j]) / n
            assert got == want[key], f"{t.dtype} n={n} {name}: {got} vs oracle {want[key]}"
    hi, lo, nz = extrema.tolist()
    for got, k in ((hi, "max"), (lo, "min"), (nz, "absmin_nonzero")):
        w = want[k]
        assert (math.isnan(w) and math.isinf(got)) or got == w, f"{t.dtype} n={n} {k}: {got} vs {w}"
    if counts.numel() > len(COUNT_NAMES):
        hist = histogram_rows(counts.view(1, -1).numpy())[0]
        want_hist: dict = {}
        for e, c in frexp_histogram(t).items():  # float64's binades clamp to the float32 range's ends
            e = min(max(e, EXP_MIN), EXP_MIN + len(hist) - 1)
            want_hist[e] = want_hist.get(e, 0) + c
        assert {int(e) + EXP_MIN: int(c) for e, c in enumerate(hist) if c} == want_hist


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_batch_of_all_sizes_matches_the_cast_oracle(dtype):
    ts = [_values(n, dtype, seed=n) for n in SIZES]
    carrier = torch.float64 if dtype == torch.float64 else torch.float32
    flat = torch.cat([t.reshape(-1).to(carrier) for t in ts])
    seg = torch.repeat_interleave(torch.arange(len(ts)), torch.tensor([t.numel() for t in ts]))
    rows = torch.tensor([dtype == torch.float16] * len(ts))
    for hist in (False, True):
        counts, extrema = batch_stats(flat, seg, len(ts), hist, rows if dtype == torch.float16 else None)
        assert counts.shape == (len(ts), len(COUNT_NAMES) + (279 if hist else 0)) and extrema.shape == (len(ts), 3)
        for i, t in enumerate(ts):
            if dtype == torch.float64 and t.numel():
                continue  # float64's cast columns come from the float32 detour: checked below
            _check(t, counts[i], extrema[i])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_non_contiguous_inputs_through_the_torch_path(dtype):
    base = _values(3 * 2**12, dtype, seed=7).view(3 * 2**6, 2**6)
    ts = [base.t(), base[::3, 1::2], base[:, 5], _values(1, dtype, 8).expand(40), base[:0]]
    assert not any(t.is_contiguous() for t in ts[:3])
    ds = device_stats([t for t in ts if t.numel()], hist=True, fused=None)  # the torch-op path
    for i, t in enumerate(t for t in ts if t.numel()):
        _check(t, ds.counts[i], ds.extrema[i])


def test_the_fused_cpu_kernel_agrees_on_the_same_batch():
    from mpscope import kernel

    module = kernel.load()
    if module is None:
        pytest.skip("the fused kernel cannot be built here")
    ts = [_values(n, d, seed=n + 1) for n in SIZES[1:5] for d in (torch.float16, torch.bfloat16, torch.float32)]
    a = device_stats(ts, hist=True, fused=None)
    b = device_stats(ts, hist=True, fused=module)
    assert torch.equal(a.counts, b.counts) and torch.equal(a.extrema, b.extrema)
