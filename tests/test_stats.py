"""The stats kernel against the cast oracle: what ``tensor.to(float16/bfloat16)`` and NumPy do."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpscope import kernel
from mpscope.formats import BF16, FP16, FP32, FORMATS
from mpscope.stats import device_stats, is_recordable, tensor_stats


@pytest.fixture(autouse=True, params=["fused", "core", "torch"])
def backend(request, monkeypatch):
    """Run every test on every implementation: the fused C++ kernel (the PyTorch extension),
    mpscope._core (the same statistics compiled at install, ``MPSCOPE_KERNEL=core``) and the
    torch-op path."""
    if request.param != "fused":
        monkeypatch.setenv("MPSCOPE_KERNEL", request.param)
    kernel.load.cache_clear()
    if request.param == "fused" and kernel.load() is None:
        pytest.skip("the fused kernel cannot be built here (no C++ compiler / ninja)")
    if request.param == "core" and kernel.core() is None:
        pytest.skip("mpscope._core was not compiled when mpscope was installed (no C++ compiler)")
    yield request.param
    kernel.load.cache_clear()

FP16_BOUNDARIES = [
    0.0,
    2**-25,  # ties to 0
    float(np.nextafter(np.float32(2**-25), np.float32(1))),  # just above: rounds to 2^-24
    2**-24,
    2**-14 - 2**-25,  # ties to 2^-14 (normal)
    float(np.nextafter(np.float32(2**-14 - 2**-25), np.float32(0))),  # stays subnormal
    2**-14,
    65504.0,
    65519.99,
    65520.0,  # ties to inf
    1e5,
    1.0,
    -3.5,
]
BF16_BOUNDARIES = [
    2**-134,  # ties to 0 in bf16
    float(np.nextafter(np.float32(2**-134), np.float32(1))),
    2**-133,
    2**-126 - 2**-134,
    float(np.nextafter(np.float32(2**-126 - 2**-134), np.float32(0))),
    2**-126,
    float(BF16.max),
    float(np.nextafter(np.float32(BF16.overflow_threshold), np.float32(0))),
    float(BF16.overflow_threshold),
    1e-45,  # float32's smallest subnormal
]
SPECIAL = [math.inf, -math.inf, math.nan]


def oracle(t: torch.Tensor) -> dict:
    """Every column from casts done by PyTorch (and NumPy for float16)."""
    x = t.double()
    n = t.numel()
    finite = torch.isfinite(x)
    nonzero = finite & (x != 0)
    h = t.to(torch.float16)
    b = t.to(torch.bfloat16)
    with np.errstate(over="ignore"):
        h_np = t.float().numpy().astype(np.float16) if t.dtype != torch.float64 else t.numpy().astype(np.float32).astype(np.float16)
    fi = torch.finfo(t.dtype)
    h16, b16 = torch.finfo(torch.float16), torch.finfo(torch.bfloat16)
    out = {
        "zero_frac": int((x == 0).sum()) / n,
        "subnormal_frac": int((nonzero & (x.abs() < fi.tiny)).sum()) / n,
        "fp16_underflow_frac": int((nonzero & (h == 0)).sum()) / n,
        "fp16_subnormal_frac": int((finite & (h != 0) & (h.double().abs() < h16.tiny)).sum()) / n,
        "fp16_overflow_frac": int((finite & torch.isinf(h)).sum()) / n,
        "bf16_underflow_frac": int((nonzero & (b == 0)).sum()) / n,
        "bf16_subnormal_frac": int((finite & (b != 0) & (b.double().abs() < b16.tiny)).sum()) / n,
        "bf16_overflow_frac": int((finite & torch.isinf(b)).sum()) / n,
        "nan_count": int(torch.isnan(x).sum()),
        "inf_count": int(torch.isinf(x).sum()),
        "max": float(x[finite].max()) if finite.any() else math.nan,
        "min": float(x[finite].min()) if finite.any() else math.nan,
        "absmax": float(x[finite].abs().max()) if finite.any() else math.nan,
        "absmin_nonzero": float(x[nonzero].abs().min()) if nonzero.any() else math.nan,
    }
    # NumPy agrees with PyTorch on float16 rounding (an independent implementation)
    np_under = int((nonzero.numpy() & (h_np == 0)).sum())
    assert np_under / n == out["fp16_underflow_frac"]
    return out


def assert_matches(t: torch.Tensor) -> None:
    got = tensor_stats(t)
    want = oracle(t)
    for k, v in want.items():
        g = got[k]
        assert (math.isnan(v) and math.isnan(g)) or g == v, f"{t.dtype} {k}: got {g}, cast oracle {v}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_boundary_values_match_cast(dtype):
    vals = FP16_BOUNDARIES + [-v for v in FP16_BOUNDARIES] + BF16_BOUNDARIES + SPECIAL
    t = torch.tensor(vals, dtype=torch.float64).to(dtype)
    assert_matches(t)


def test_each_boundary_alone():
    """One element at a time: a wrong threshold cannot hide behind a neighbour."""
    for v in FP16_BOUNDARIES + BF16_BOUNDARIES:
        assert_matches(torch.tensor([v], dtype=torch.float32))


def test_known_fates_at_fp16_thresholds():
    s = tensor_stats(torch.tensor([2**-25], dtype=torch.float32))
    assert s["fp16_underflow_frac"] == 1.0 and s["fp16_subnormal_frac"] == 0.0
    s = tensor_stats(torch.tensor([65520.0, 65519.99], dtype=torch.float32))
    assert s["fp16_overflow_frac"] == 0.5
    assert torch.isinf(torch.tensor(65520.0).half()) and not torch.isinf(torch.tensor(65519.99).half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_log_uniform_random_tensors(dtype):
    g = torch.Generator().manual_seed(0)
    exps = torch.randint(-150, 129, (20000,), generator=g).double()
    mant = 1 + torch.rand(20000, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(20000, generator=g) < 0.5, -1.0, 1.0).double()
    t = (sign * mant * torch.pow(2.0, exps)).to(dtype)
    t[::97] = 0
    t[::301] = math.nan
    assert_matches(t)
    assert tensor_stats(t)["histogram"] == frexp_histogram(t)


def frexp_histogram(t: torch.Tensor) -> dict:
    """NumPy's frexp as the oracle of floor(log2|x|) (x = m * 2^e, 0.5 <= |m| < 1)."""
    x = t.double()
    x = x[(x != 0) & torch.isfinite(x)]
    _, e = np.frexp(x.numpy())
    return {int(k): int(c) for k, c in zip(*np.unique(e - 1, return_counts=True))}


def test_histogram_matches_frexp():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(5000, generator=g) * torch.exp(torch.randn(5000, generator=g) * 8)
    t[:10] = 0
    assert tensor_stats(t)["histogram"] == frexp_histogram(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_histogram_over_many_chunks_with_rare_and_common_outliers(dtype):
    """Chunks (2^15 elements) whose exponents sit within 16 binades of their largest |x| but for a few
    far-off values, then chunks spread over every binade (the fused kernel counts those two kinds
    differently), a tail shorter than a vector, zeros, subnormals, inf and NaN: frexp decides."""
    g = torch.Generator().manual_seed(5)
    tiny = 2.0**-20 if dtype == torch.float16 else 2.0**-60
    narrow = torch.randn(3 * 2**15, generator=g)
    narrow[::997] *= tiny  # rare: below the 16-binade window, many subnormal in float16
    narrow[5::1499] = 0.0
    wide = torch.randn(2**15 + 77, generator=g) * torch.exp2(torch.randint(-30, 12, (2**15 + 77,), generator=g).float())
    t = torch.cat([narrow, wide, narrow[:1000]]).to(dtype)
    t[123] = math.inf
    t[-5] = math.nan
    assert tensor_stats(t)["histogram"] == frexp_histogram(t)
    assert_matches(t)


def test_batched_equals_single():
    g = torch.Generator().manual_seed(2)
    ts = [torch.randn(100, generator=g) * 1e-6, (torch.randn(7, 3, generator=g) * 1e5).half().float(),
          torch.tensor([math.nan, 1.0, -math.inf]), torch.randn(1, generator=g)]
    ts.append(torch.randn(5, generator=g).half())
    batch = device_stats(ts)
    for i, t in enumerate(ts):
        one = device_stats([t])
        assert torch.equal(batch.counts[i], one.counts[0])
        assert torch.equal(batch.extrema[i], one.extrema[0])


def test_backends_agree_on_a_mixed_batch(monkeypatch):
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(1000, generator=g) * 1e-4, torch.randn(300, generator=g).bfloat16() * 1e30,
          torch.randn(64, generator=g).half() * 1e-3, torch.tensor([0.0, -0.0, math.inf, math.nan, 2**-140])]
    a = device_stats(ts)
    monkeypatch.setenv("MPSCOPE_KERNEL", "torch")
    kernel.load.cache_clear()
    b = device_stats(ts)
    assert torch.equal(a.counts, b.counts)
    assert torch.equal(a.extrema, b.extrema)


def test_all_nonfinite_and_all_zero():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        s = tensor_stats(torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype))
        assert math.isnan(s["max"]) and math.isnan(s["min"]) and math.isnan(s["absmin_nonzero"])
        assert math.isnan(s["absmax"]) and s["nan_count"] == 1 and s["inf_count"] == 2
    s = tensor_stats(torch.zeros(4, dtype=torch.float16))
    assert s["zero_frac"] == 1.0 and s["max"] == 0.0 and math.isnan(s["absmin_nonzero"])


@pytest.mark.parametrize(
    "t",
    [torch.arange(4), torch.tensor([True]), torch.zeros(2, dtype=torch.complex64), torch.empty(0), "x", None],
)
def test_skipped_kinds(t):
    assert not is_recordable(t)
    with pytest.raises(TypeError, match="non-empty float16/bfloat16/float32/float64"):
        tensor_stats(t)


def test_formats_come_from_finfo():
    for f in (FP16, BF16, FP32):
        fi = torch.finfo(f.dtype)
        assert f.max == fi.max and f.min_normal == fi.tiny and f.eps == fi.eps
        # the smallest subnormal really is the smallest positive value the dtype holds
        sub = torch.tensor(f.min_subnormal, dtype=torch.float64).to(f.dtype)
        assert float(sub) == f.min_subnormal
        assert float(torch.tensor(f.min_subnormal / 2, dtype=torch.float64).to(torch.float32).to(f.dtype)) == 0.0
    assert FP16.max == 65504 and FP16.overflow_threshold == 65520 and FP16.min_subnormal == 2**-24
    assert set(FORMATS) >= {"float16", "bfloat16", "float32"}


def test_large_tensor_on_several_threads_matches_torch_path(backend, monkeypatch):
    """Tensors above the kernel's per-task size are split over threads; the sums must not change."""
    g = torch.Generator().manual_seed(4)
    t = torch.randn(1_500_001, generator=g) * torch.exp(torch.randn(1_500_001, generator=g) * 6)
    t[7] = math.nan
    t[-1] = -math.inf
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = device_stats([t, t.bfloat16(), t.half()])
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("MPSCOPE_KERNEL", "torch")
    kernel.load.cache_clear()
    b = device_stats([t, t.bfloat16(), t.half()])
    assert torch.equal(a.counts, b.counts) and torch.equal(a.extrema, b.extrema)
