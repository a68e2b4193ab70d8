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


@pytest.fixture(params=["extension", "core"])
def cpu_kernel(request):
    """Each fused CPU kernel: the PyTorch extension (built at run time) and mpscope._core (compiled
    when mpscope is installed); skips where one cannot be had."""
    from mpscope import kernel

    module = kernel.load() if request.param == "extension" else kernel.core()
    if module is None:
        pytest.skip(f"the fused kernel ({request.param}) cannot be built here")
    return module


def test_the_fused_cpu_kernels_take_an_empty_batch_and_check_their_tables(cpu_kernel):
    """No tensor: empty tables, rows left as they are. Rows outside the tables or tables of the
    wrong kind: a RuntimeError that says so, nothing written."""
    from mpscope import kernel

    counts, extrema = kernel.fused_stats(cpu_kernel, [], True)
    assert counts.shape == (0, len(COUNT_NAMES) + 279) and extrema.shape == (0, 3)
    counts = torch.full((4, len(COUNT_NAMES) + 279), -1, dtype=torch.int64)
    extrema = torch.zeros(4, 3, dtype=torch.float64)
    kernel.fused_stats_into(cpu_kernel, [], True, counts, extrema, 0)
    assert (counts == -1).all() and not extrema.any()
    t = _values(1000, torch.float16, seed=3)
    for _ in range(2):  # (mpscope._core checks a pair of tables once)
        kernel.fused_stats_into(cpu_kernel, [t], True, counts, extrema, 2)
        _check(t, counts[2], extrema[2])
    assert (counts[[0, 1, 3]] == -1).all()
    with pytest.raises(RuntimeError, match="outside the tables"):
        kernel.fused_stats_into(cpu_kernel, [t], True, counts, extrema, 4)
    with pytest.raises(RuntimeError, match="counts must be"):
        kernel.fused_stats_into(cpu_kernel, [t], True, counts.int(), extrema, 0)
    with pytest.raises(RuntimeError, match="extrema must be"):
        kernel.fused_stats_into(cpu_kernel, [t], True, counts, extrema.float(), 0)
    with pytest.raises(TypeError, match="not torch.float64"):
        kernel.fused_stats(cpu_kernel, [t, t.double()], True)


def test_tensors_without_data_of_their_own_never_reach_the_fused_cpu_kernels(cpu_kernel):
    """An efficient zero tensor and a ``__torch_dispatch__`` wrapper subclass (no storage of its
    own) go to the torch ops whichever kernel is asked, which refuse them with their own error (the
    recorder turns such tensors into plain ones before it measures them); the kernels would read a
    null or foreign pointer (and can crash the process)."""
    from torch.testing._internal.two_tensor import TwoTensor

    for t in (torch._efficientzerotensor(1000), TwoTensor(torch.randn(8), torch.randn(8))):
        with pytest.raises(RuntimeError) as kernel_error:
            device_stats([t], hist=True, fused=cpu_kernel)
        with pytest.raises(RuntimeError) as torch_error:
            device_stats([t], hist=True, fused=None)
        assert str(kernel_error.value) == str(torch_error.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=lambda d: str(d).replace("torch.", ""))
def test_the_fused_cpu_kernels_match_the_cast_oracle_at_every_size(cpu_kernel, dtype):
    """Sizes 0 … 2^20 (one chunk, a partial one, 32 chunks over the threads), alone and in one batch,
    with and without the histogram: every row is the cast oracle's."""
    ts = [_values(n, dtype, seed=n + 11) for n in SIZES]
    for hist in (True, False):
        ds = device_stats(ts, hist=hist, fused=cpu_kernel)
        for i, t in enumerate(ts):
            _check(t, ds.counts[i], ds.extrema[i])
    for t in ts[1:]:
        one = device_stats([t], hist=True, fused=cpu_kernel)
        _check(t, one.counts[0], one.extrema[0])


def test_the_fused_cpu_kernels_agree_on_the_same_batch(cpu_kernel):
    ts = [_values(n, d, seed=n + 1) for n in SIZES[1:5] for d in (torch.float16, torch.bfloat16, torch.float32)]
    a = device_stats(ts, hist=True, fused=None)
    b = device_stats(ts, hist=True, fused=cpu_kernel)
    assert torch.equal(a.counts, b.counts) and torch.equal(a.extrema, b.extrema)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=lambda d: str(d).replace("torch.", ""))
def test_the_fused_cpu_kernel_reads_non_contiguous_tensors_in_place_or_copied(cpu_kernel, dtype):
    """Tensors whose elements fill one block of memory in another order (a transpose, a permutation,
    channels-last; larger than one chunk, so read by several threads) are read where they are (the
    extension; mpscope._core copies them); those with gaps or repeats (slices, expand) are copied
    first. Every row equals the cast oracle, with and without the histogram."""
    module = cpu_kernel
    base = _values(3 * 2**16, dtype, seed=21)
    dense = [base.view(3 * 2**8, 2**8).t(), base.view(2**4, 3 * 2**4, 2**8).permute(2, 0, 1),
             base.view(2**4, 3, 2**6, 2**6).to(memory_format=torch.channels_last),
             base[: 2**12].view(2**6, 2**6).t().unsqueeze(1)]
    gapped = [base.view(3 * 2**8, 2**8)[::3, 1::2], base.view(3 * 2**8, 2**8)[:, 5], base[:1].expand(4000)]
    ts = dense + gapped
    assert not any(t.is_contiguous() for t in ts)
    for hist in (True, False):
        ds = device_stats(ts, hist=hist, fused=module)
        for i, t in enumerate(ts):
            _check(t, ds.counts[i], ds.extrema[i])
    # (each tensor alone: the same rows)
    for i, t in enumerate(ts):
        one = device_stats([t], hist=True, fused=module)
        _check(t, one.counts[0], one.extrema[0])



@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_tensors_with_the_negative_bit_are_measured_as_their_values(dtype):
    """A real tensor with PyTorch's negative bit holds its values negated in memory (the imaginary
    part of a conjugate view; ``torch._neg_view``): alone (contiguous, one element or six 2^15-element
    chunks; a dense transpose, which the fused kernel reads in place; a strided one) and in a batch,
    through both fused kernels, the CPU torch-op path and the torch-op path a GPU takes: every row
    equals the cast oracle of the tensor's values. (Read as it lies in memory, such a tensor's
    values are negated, and the torch-op paths get no bit view of it until the negation is
    resolved.)"""
    from mpscope import kernel
    from mpscope.stats import _torch_stats

    base = _values(6 * 2**15, dtype, seed=5)
    x = torch._neg_view(base.view(6, 2**15))
    ts = [x, x.t(), x[:, ::3], torch._neg_view(base[:1])]
    if dtype in (torch.float32, torch.float64):
        ts.append(torch.complex(base, base.flip(0))[:1].conj().imag)
    assert all(t.is_neg() and t.dtype is dtype for t in ts)
    modules = [m for m in (kernel.load(), kernel.core()) if m is not None] if dtype is not torch.float64 else []
    paths = [lambda b: device_stats(b, True, fused=None), lambda b: _torch_stats(b, True)]
    paths += [lambda b, m=m: device_stats(b, True, fused=m) for m in modules]
    for stats_of in paths:
        for batch in [[t] for t in ts] + [ts]:
            ds = stats_of(batch)
            for i, t in enumerate(batch):
                _check(t.resolve_neg(), ds.counts[i], ds.extrema[i])

# ----------------------------------------------------------------------------- the CPU torch-op path
# (device_stats with fused=None on CPU float16 / bfloat16 / float32: per-binade codes of the bits,
# one bincount per batch; see mpscope.stats._cpu_stats)
CPU_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cpu_path_matches_the_cast_oracle_for_all_sizes(dtype):
    ts = [_values(n, dtype, seed=n + 11) for n in SIZES]
    batch = device_stats(ts, hist=True, fused=None)
    assert batch.counts.shape == (len(ts), len(COUNT_NAMES) + 279)
    for i, t in enumerate(ts):
        _check(t, batch.counts[i], batch.extrema[i])
        if t.numel():  # alone (no segments) the same
            one = device_stats([t], hist=True, fused=None)
            assert torch.equal(one.counts[0], batch.counts[i]) and torch.equal(one.extrema[0], batch.extrema[i])
    counts_only = device_stats(ts, hist=False, fused=None).counts
    assert torch.equal(counts_only, batch.counts[:, : len(COUNT_NAMES)])


def _element_oracle(x: torch.Tensor) -> torch.Tensor:
    """(n, 10 + 279) counts of n one-element tensors, straight from the casts: PyTorch's
    ``to(float16)`` / ``to(bfloat16)``, ``torch.finfo`` and NumPy's frexp."""
    d = x.double()
    finite, h, b = torch.isfinite(d), x.to(torch.float16).double(), x.to(torch.bfloat16).double()
    nonzero = finite & (d != 0)
    own_tiny = torch.finfo(x.dtype).tiny
    h16, b16 = torch.finfo(torch.float16).tiny, torch.finfo(torch.bfloat16).tiny
    own_sub = (nonzero & (h != 0) & (h.abs() < h16)) if x.dtype == torch.float16 else (nonzero & (d.abs() < own_tiny))
    cols = [d == 0, own_sub, nonzero & (h == 0), finite & (h != 0) & (h.abs() < h16), finite & torch.isinf(h),
            nonzero & (b == 0), finite & (b != 0) & (b.abs() < b16), finite & torch.isinf(b), torch.isnan(d),
            torch.isinf(d)]
    out = torch.zeros(len(x), len(COUNT_NAMES) + 279, dtype=torch.int64)
    out[:, : len(COUNT_NAMES)] = torch.stack(cols, 1).long()
    _, e = np.frexp(np.where(nonzero.numpy(), d.numpy(), 1.0))
    rows = np.nonzero(nonzero.numpy())[0]
    out[rows, len(COUNT_NAMES) + (e[rows] - 1) - EXP_MIN] = 1
    return out


def _every_code_edge() -> torch.Tensor:
    """float32 values at both ends of every code of the CPU path and one pattern either side, both
    signs, plus every cast threshold's neighbours: every bit pattern where a count could change."""
    from mpscope.stats import _code_bounds

    lo, hi = _code_bounds()
    pats = np.unique(np.concatenate([lo, hi, lo - 1, hi + 1, [0, 1, 0x8000, 0x8001, 0x7F8000, 0x7F7FFF]]))
    pats = pats[(pats >= 0) & (pats < 2**31)]
    pos = torch.from_numpy(pats.astype(np.int32)).view(torch.float32)
    edges = torch.tensor(FP16_BOUNDARIES + BF16_BOUNDARIES, dtype=torch.float32)
    return torch.cat([pos, -pos, edges, torch.nextafter(edges, torch.full_like(edges, math.inf))])


def test_cpu_path_classifies_every_code_edge_like_the_casts():
    """Each value as its own tensor (several thousand: also past the per-bincount tensor limit)."""
    x = _every_code_edge()
    assert len(x) > 5_000
    ds = device_stats(list(x.view(-1, 1)), hist=True, fused=None)
    want = _element_oracle(x)
    bad = (ds.counts != want).any(1).nonzero().view(-1)
    assert not len(bad), [(float(x[i]), hex(int(x[i : i + 1].view(torch.int32))),
                           (ds.counts[i] != want[i]).nonzero().view(-1).tolist()) for i in bad[:5]]
    # extrema of a one-element tensor: the element itself where finite
    f = torch.isfinite(x).double()
    xd = x.double()
    assert torch.equal(ds.extrema[:, 0], torch.where(f.bool(), xd, -math.inf))
    assert torch.equal(ds.extrema[:, 1], torch.where(f.bool(), xd, math.inf))
    assert torch.equal(ds.extrema[:, 2], torch.where(f.bool() & (xd != 0), xd.abs(), math.inf))
    # and the same values in other dtypes (their own roundings of them)
    for dtype in (torch.float16, torch.bfloat16):
        y = torch.from_numpy(np.unique(x.to(dtype).view(torch.int16).numpy())).view(dtype)
        assert torch.equal(device_stats(list(y.view(-1, 1)), hist=True, fused=None).counts, _element_oracle(y))


def test_cpu_path_float32_subnormals_in_a_batch_land_in_their_own_tensors():
    """Tensors with subnormals between tensors without (the subnormals are bucketed on their own and
    must be counted for the tensor that holds them), every subnormal binade, both ties."""
    g = torch.Generator().manual_seed(3)
    sub = torch.tensor([2.0**-149, 2.0**-140, 2.0**-134, float(np.nextafter(np.float32(2**-134), np.float32(1))),
                        2.0**-127 * 1.99, float(np.nextafter(np.float32(2**-126 - 2**-134), np.float32(0))),
                        2**-126 - 2**-134, -(2.0**-130), 0.0] + [2.0**-k for k in range(127, 150)])
    ts = [torch.randn(50, generator=g), sub, torch.randn(3, 7, generator=g).t(), sub.flip(0) * 3,
          torch.randn(1000, generator=g) * 1e-38, torch.tensor([math.nan, 2.0**-140]), torch.ones(2)]
    ds = device_stats(ts, hist=True, fused=None)
    for i, t in enumerate(ts):
        _check(t, ds.counts[i], ds.extrema[i])


def test_cpu_path_equals_the_bucketize_path_on_a_training_like_batch():
    """The two torch-op implementations (CPU codes, and batch_stats which CUDA compiles) agree exactly."""
    from mpscope.stats import _cpu_stats, _torch_stats

    g = torch.Generator().manual_seed(9)
    ts = [torch.randn(64, 64, generator=g) * 0.02, torch.randn(4096, generator=g).half() * 1e-5,
          (torch.randn(333, generator=g) * 1e4).bfloat16(), torch.tensor([math.inf, -1.0, math.nan]),
          torch.rand(17, generator=g) ** 40, torch.zeros(5), torch.randn(8, 64, 256, generator=g).half()[:, ::2]]
    for hist in (True, False):
        a, b = _cpu_stats(ts, hist), _torch_stats(ts, hist)
        assert torch.equal(a.counts, b.counts) and torch.equal(a.extrema, b.extrema)
