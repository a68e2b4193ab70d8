"""The stats kernel: one tensor (or a batch of tensors) -> the numbers of one ``Run.tensors`` row.

How it works, and why it is exact
---------------------------------
Every question mpscope asks of an element is "which side of a threshold is |x| on?": is it zero, is it
subnormal in its own dtype, would ``x.to(float16)`` round it to 0, to a subnormal or to inf, which
binade ``floor(log2|x|)`` holds it. All the thresholds are exact values of the tensor's *carrier*
format (float32 for float16 / bfloat16 / float32 tensors, whose upcast is exact; float64 for float64),
and for non-negative IEEE numbers the order of the values is the order of their bit patterns. So the
kernel

reads ``|x|`` as integer bits (``& 0x7fffffff``: NaN > inf > every finite value) and compares them
with the bit patterns of the thresholds. Three implementations give identical results:

* the fused CPU kernel (``mpscope/_kernel.cpp``, built once per environment in the background,
  see :mod:`mpscope.kernel`):
  one read of each tensor computes every count, min/max and the exponent histogram;
* on the CPU while the kernel is not built (or cannot be), for float16 / bfloat16 / float32: a code
  per element from a few shifts and masks of its bits (binade, and where in the binade the cast
  thresholds lie), one ``torch.bincount`` of (tensor, code) pairs per batch folded into the same
  buckets as below, and NumPy ``reduceat`` for min/max (see ``_cpu_stats``); several times
  cheaper than the next one on the CPU, several times dearer than the fused kernel;
* the torch-op path (CUDA, float64), :func:`batch_stats`: one
  ``torch.bucketize`` against a sorted table of thresholds (the cast thresholds below, plus every
  power of two from 2^-149 to 2^127 when a histogram is taken, inf and NaN), one scatter-add
  counting (tensor, bucket) pairs, one scatter-max of ordered integer keys for the extrema, and a
  small matrix product that sums buckets into counts (each bucket lies wholly inside one class).
  On CUDA it runs under ``torch.compile`` (a few fused kernels per batch instead of one per op).

The cast thresholds (round to nearest, ties to even, i.e. exactly what ``tensor.to(dtype)`` does)
are taken from :mod:`mpscope.formats`:

* underflow: ``0 < |x| <= min_subnormal / 2`` (float16: 2^-25; the tie rounds to 0),
* subnormal after the cast: ``min_subnormal / 2 < |x| < min_normal - min_subnormal / 2``,
* overflow: ``|x| >= max + ulp(max) / 2`` (float16: 65520; the tie rounds to inf).

min / max (over finite elements) and the smallest non-zero |x| come from the same pass. Nothing
here reads a device value on the host: the results stay on the tensor's device until the recorder
copies a whole step's worth in one transfer.

float64 tensors are classified exactly against the same thresholds (their float16 / bfloat16 fates
are those of the float32-rounded value, because that is how PyTorch casts float64 down); their
exponent histogram is clamped to the float32 range [-150, 128] (the end bins collect the rest).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from mpscope import kernel
from mpscope.formats import BF16, FORMATS, FP16, dtype_name
from mpscope.schema import COUNT_NAMES

#: Lowest and highest exponent bin of the histograms (float32's subnormal floor and max binade,
#: plus one clamp bin at each end for float64 tensors).
EXP_MIN, EXP_MAX = -150, 128


#: Floating dtypes the kernel accepts; everything else is skipped by :func:`is_recordable`.
RECORDABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def unmeasurable_reason(t: torch.Tensor) -> str | None:
    """Why the stats pass cannot read ``t`` although it is a floating tensor, or None if it can:
    ``"sparse"`` (a layout other than strided: sparse COO/CSR, mkldnn), ``"nested"``,
    ``"quantized"`` or ``"meta"`` (no data)."""
    if t.is_nested:
        return "nested"
    if t.layout != torch.strided:
        return "sparse"
    if t.is_quantized:
        return "quantized"
    if t.is_meta:
        return "meta"
    return None


_FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})  # the CPU kernel's
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter


def has_own_data(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values of its own in memory. Tensors without are: an efficient zero
    tensor (autograd's symbolic zeros), a meta tensor (PyTorch's ZeroTensor kernels compute shapes
    with them), and a ``__torch_dispatch__`` wrapper subclass (FakeTensor, a jagged nested tensor, a
    fake-quantized activation or quantized weight; often without storage): its values are what the
    plain ops its ``__torch_dispatch__`` runs compute with. Plain tensors and parameters take the
    fast path (two class checks)."""
    if t.is_meta or t._is_zerotensor():
        return False
    cls = t.__class__
    return cls is _Tensor or cls is _Parameter or not python_dispatch(t)


def _fusable(t: torch.Tensor) -> bool:
    """Whether the fused CPU kernels may read ``t``'s memory: a CPU float16/bfloat16/float32 tensor
    with data of its own (:func:`has_own_data`; the kernels would read a null or foreign pointer of
    any other, which the torch ops compute with or refuse)."""
    return t.is_cpu and t.dtype in _FUSED_DTYPES and has_own_data(t)


#: dtype -> its name, for the dtypes the stats take.
RECORDABLE_NAMES = {d: dtype_name(d) for d in RECORDABLE_DTYPES}
_STRIDED = torch.strided


def recordable_dtype(t: torch.Tensor) -> str | None:
    """The dtype name (``"float16"``, ...) of a tensor :func:`is_recordable` accepts, else None. The
    recorder's hooks call it on every tensor, so it is a few attribute reads (a quantized tensor's
    dtype is no recordable dtype, so only layout, nesting, meta and emptiness are checked)."""
    dtype = RECORDABLE_NAMES.get(t.dtype)
    if dtype is None or t.layout is not _STRIDED or t.is_nested or t.is_meta or not t.numel():
        return None
    return dtype


def tensor_facts(t: torch.Tensor, fallback=None) -> tuple | None:
    """What the recorder's per-tensor path needs to know of an observed tensor, read once.

    None when :func:`recordable_dtype` is None (the stats take no such tensor) and for an efficient
    zero tensor (``torch._efficientzerotensor``: no data; the recorder observes the zeros it stands
    for, see :func:`zeros_of`); else ``(dtype name,
    numel, ident, fused_cpu)``: ``ident`` is ``(id(t), t._version, t.data_ptr())``, what tells the
    same unchanged tensor seen again in a step, or None for an inference tensor (it has no version
    counter); ``fused_cpu``: a CPU float16/bfloat16/float32 tensor (the fused kernel's rows take it).
    Raises RuntimeError for a tensor without storage (``data_ptr``: vmap's batched tensors).

    The fused kernel's ``tensor_facts`` (mpscope/_kernel.cpp) gives the same answers in one C++ call
    for tensors of class Tensor or Parameter; it hands anything else to this function
    (``fallback`` is its argument for it, unused here).
    """
    dtype = RECORDABLE_NAMES.get(t.dtype)
    if dtype is None or t.layout is not _STRIDED or t.is_nested or t.is_meta or not (n := t.numel()) \
            or t._is_zerotensor():
        return None
    ident = None if t.is_inference() else (id(t), t._version, t.data_ptr())
    return dtype, n, ident, t.is_cpu and dtype != "float64"


def python_dispatch(t: torch.Tensor) -> bool:
    """Whether ``t``'s ops go to a ``__torch_dispatch__`` (its class is a wrapper subclass, such as
    torchao's float8 and NF4 tensors: often without storage of its own, its values are what the ops
    its ``__torch_dispatch__`` runs compute with)."""
    return torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)


def zeros_of(t: torch.Tensor) -> torch.Tensor | None:
    """The values of an efficient zero tensor (PyTorch's ``ZeroTensor``: ``torch._efficientzerotensor``,
    which some derivative formulas and autograd Functions return as a gradient; it has no data to
    read) as a plain tensor of zeros of its shape, dtype and device; None for any other tensor."""
    if not t._is_zerotensor():
        return None
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device)


def is_recordable(t: object) -> bool:
    """True for a non-empty float16/bfloat16/float32/float64 strided tensor (int, bool, complex,
    empty, sparse, nested, quantized, meta -> False; see :func:`unmeasurable_reason`)."""
    return isinstance(t, torch.Tensor) and recordable_dtype(t) is not None


def _nextup(x: float, dtype: torch.dtype) -> float:
    t = torch.tensor(x, dtype=dtype)
    return float(torch.nextafter(t, torch.tensor(math.inf, dtype=dtype)))


@dataclass(frozen=True)
class _Carrier:
    """The bucket table for one carrier format (float32 or float64)."""

    float_dtype: torch.dtype
    int_dtype: torch.dtype
    abs_mask: int
    inf_bits: int
    bounds: np.ndarray  # sorted lower bounds (as carrier bit patterns) of buckets 1..NB-1
    lower: np.ndarray  # float64 lower bound of every bucket (bucket 0 = exact zero -> 0.0)
    exponent: np.ndarray  # int exponent bin of every bucket (only meaningful for finite non-zero)
    masks: dict  # count name -> bool array over buckets (own-dtype "subnormal" handled separately)
    finite_nonzero: np.ndarray

    @property
    def nb(self) -> int:
        return len(self.bounds) + 1

    def subnormal_mask(self, dtype_name_: str) -> np.ndarray:
        min_normal = FORMATS[dtype_name_].min_normal
        return self.finite_nonzero & (self.lower < min_normal)


def _bits(values: list[float], float_dtype, int_dtype) -> list[int]:
    t = torch.tensor(values, dtype=torch.float64).to(float_dtype)
    if not torch.equal(t.double(), torch.tensor(values, dtype=torch.float64)):
        raise AssertionError("a threshold is not exact in the carrier format")  # pragma: no cover
    return t.view(int_dtype).tolist()


@lru_cache(maxsize=None)
def _carrier(float_dtype: torch.dtype, hist: bool = True) -> _Carrier:
    """The bucket table; with ``hist=False`` only the class thresholds (a shallower search)."""
    int_dtype = torch.int32 if float_dtype == torch.float32 else torch.int64
    nbits = 32 if float_dtype == torch.float32 else 64
    abs_mask = (1 << (nbits - 1)) - 1
    fi = torch.finfo(float_dtype)
    smallest = float(fi.tiny) * float(fi.eps)

    values = {smallest}
    if hist:
        values.update(math.ldexp(1.0, k) for k in range(EXP_MIN + 1, EXP_MAX))  # 2^-149 .. 2^127
        if float_dtype == torch.float64:  # float64's binades >= 128 go to the top (clamp) bin
            values.add(math.ldexp(1.0, EXP_MAX))
    for fmt in (FP16, BF16):
        values.add(_nextup(fmt.underflow_threshold, float_dtype))
        values.add(fmt.normal_threshold)
        values.add(fmt.overflow_threshold)
    for fmt in FORMATS.values():  # own-dtype subnormal boundaries
        values.add(fmt.min_normal)
    values = sorted(v for v in values if smallest <= v < math.inf)
    finite_bits = _bits(values, float_dtype, int_dtype)
    inf_bits = _bits([math.inf], float_dtype, int_dtype)[0]
    bounds = np.array(finite_bits + [inf_bits, inf_bits + 1], dtype=np.int64)
    assert np.all(np.diff(bounds) > 0)

    lower = np.array([0.0] + values + [math.inf, math.nan])
    nb = len(lower)
    is_inf = np.zeros(nb, bool)
    is_inf[-2] = True
    is_nan = np.zeros(nb, bool)
    is_nan[-1] = True
    is_zero = np.zeros(nb, bool)
    is_zero[0] = True
    finite_nonzero = ~(is_inf | is_nan | is_zero)
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = np.where(finite_nonzero, np.floor(np.log2(np.where(finite_nonzero, lower, 1.0))), 0)
    exponent = np.clip(exponent, EXP_MIN, EXP_MAX).astype(np.int64)

    masks = {"zero": is_zero, "nan": is_nan, "inf": is_inf}
    for fmt, prefix in ((FP16, "fp16"), (BF16, "bf16")):
        up = _nextup(fmt.underflow_threshold, float_dtype)
        masks[f"{prefix}_underflow"] = finite_nonzero & (lower < up)
        masks[f"{prefix}_subnormal"] = finite_nonzero & (lower >= up) & (lower < fmt.normal_threshold)
        masks[f"{prefix}_overflow"] = finite_nonzero & (lower >= fmt.overflow_threshold)
    return _Carrier(
        float_dtype, int_dtype, abs_mask, inf_bits, bounds, lower, exponent, masks, finite_nonzero
    )


def _carrier_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# host sources of recent non-blocking copies, kept alive a while longer. (PyTorch's caching host
# allocator already records the copy's stream on a pinned block and reuses it only after the copy:
# this is a second guard, bounded, as the staged rows copy their segment sizes at every pass.)
_PINNED: deque[torch.Tensor] = deque(maxlen=256)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a small host constant to ``device`` without a host synchronisation (pinned, non-blocking)."""
    if device.type != "cuda":
        return t.to(device)
    pinned = t.pin_memory()
    _PINNED.append(pinned)
    return pinned.to(device, non_blocking=True)


@lru_cache(maxsize=None)
def _device_bounds(float_dtype: torch.dtype, hist: bool, device: torch.device) -> torch.Tensor:
    c = _carrier(float_dtype, hist)
    return _to_device(torch.tensor(c.bounds, dtype=c.int_dtype), device)


def segment_ids(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int64 tensor on ``device``: ``i`` repeated ``sizes[i]`` times (the tensor each element of a
    concatenation belongs to), without a host synchronisation."""
    counts = _to_device(torch.tensor(sizes), device)
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), counts, output_size=sum(sizes))


# the parameter batches repeat their sizes every step (the staged rows' do not: uncached there)
_segment_ids = lru_cache(maxsize=64)(segment_ids)


#: Columns of a stats block on the device: the counts of :data:`COUNT_NAMES`, then (when a
#: histogram is taken) NHIST exponent bins for floor(log2|x|) = EXP_MIN .. EXP_MAX.
NHIST = EXP_MAX - EXP_MIN + 1
_SUB, _FP16_SUB = COUNT_NAMES.index("subnormal"), COUNT_NAMES.index("fp16_subnormal")
_CAST_COLUMNS = slice(COUNT_NAMES.index("fp16_underflow"), COUNT_NAMES.index("bf16_overflow") + 1)
_ZERO, _INF = COUNT_NAMES.index("zero"), COUNT_NAMES.index("inf")
_UNDER_COLUMNS = (COUNT_NAMES.index("fp16_underflow"), COUNT_NAMES.index("bf16_underflow"))
_OVER_COLUMNS = (COUNT_NAMES.index("fp16_overflow"), COUNT_NAMES.index("bf16_overflow"))


class DeviceStats:
    """Stats of ``n`` tensors, still on their device (nothing has been read back).

    Attributes:
        counts: int64 (n, 10) or, with ``hist``, (n, 10 + NHIST): the :data:`COUNT_NAMES` counts,
            then the exponent histogram.
        extrema: float64 (n, 3): largest finite element, smallest finite element, smallest non-zero
            finite |x| (-inf, +inf, +inf when there is none).
        hist: whether the histogram columns are present.
    """

    __slots__ = ("counts", "extrema", "hist")

    def __init__(self, counts: torch.Tensor, extrema: torch.Tensor, hist: bool):
        self.counts, self.extrema, self.hist = counts, extrema, hist


def device_stats(tensors: list[torch.Tensor], hist: bool = True, fused=True) -> DeviceStats:
    """Stats of several tensors on one device, in one batched pass, without host synchronisation.

    Args:
        tensors: non-empty float16/bfloat16/float32/float64 tensors on one device, any shapes.
            They are read, never modified.
        hist: also take the exponent histogram.
        fused: which implementation takes CPU float16/bfloat16/float32 tensors: True (default) the
            fused kernel if one is ready now (:func:`mpscope.kernel.stats_module`; never waits for
            a build), a kernel module (from :mod:`mpscope.kernel`) to use that one, None / False the
            torch-op path. All give identical results.

    Returns:
        :class:`DeviceStats` on the tensors' device.
    """
    if fused:
        module = kernel.stats_module() if fused is True else fused
        if module is not None and (_fusable(tensors[0]) if len(tensors) == 1 else all(map(_fusable, tensors))):
            return DeviceStats(*kernel.fused_stats(module, tensors, hist), hist)
    if all(t.is_cpu and t.dtype in _FUSED_DTYPES for t in tensors):
        return _cpu_stats(tensors, hist)
    device = tensors[0].device
    groups: dict[bool, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype == torch.float64, []).append(i)
    if len(groups) == 1:
        return _torch_stats(tensors, hist)
    parts = {k: _torch_stats([tensors[i] for i in idx], hist) for k, idx in groups.items()}
    order = _to_device(torch.tensor([i for idx in groups.values() for i in idx]).argsort(), device)
    counts = torch.cat([parts[k].counts for k in groups])[order]
    extrema = torch.cat([parts[k].extrema for k in groups])[order]
    return DeviceStats(counts, extrema, hist)


@lru_cache(maxsize=None)
def _class_matrix(float_dtype: torch.dtype, hist: bool, device: torch.device) -> torch.Tensor:
    """(NB, 10 [+ NHIST]) float64 0/1 matrix: bucket -> count column (own subnormal = float32's)."""
    c = _carrier(float_dtype, hist)
    own = "float64" if float_dtype == torch.float64 else "float32"
    cols = []
    for name in COUNT_NAMES:
        cols.append(c.subnormal_mask(own) if name == "subnormal" else c.masks[name])
    m = np.stack(cols, axis=1).astype(np.float64)
    if hist:
        onehot = np.zeros((c.nb, NHIST))
        rows = np.nonzero(c.finite_nonzero)[0]
        onehot[rows, c.exponent[rows] - EXP_MIN] = 1
        m = np.concatenate([m, onehot], axis=1)
    return _to_device(torch.tensor(m, dtype=torch.float64), device)


@lru_cache(maxsize=256)
def _fp16_rows(flags: tuple[bool, ...], device: torch.device) -> torch.Tensor:
    return _to_device(torch.tensor(flags, dtype=torch.bool), device).view(-1, 1)


def prepare(device: torch.device) -> None:
    """Create the torch-op path's constant tables on ``device`` ahead of time (the recorder calls
    this when it attaches), so that no hook has to copy a table to the device, and on the CPU
    the code table of the path that records until the fused kernel is ready (so that the first
    recorded step does not build it)."""
    if device.type == "cpu":
        _code_table()
        return
    for float_dtype in (torch.float32, torch.float64):
        for hist in (False, True):
            _device_bounds(float_dtype, hist, device)
            _class_matrix(float_dtype, hist, device)


_I64_MIN = -(2**63)


def _order_key(bits: torch.Tensor, nbits: int) -> torch.Tensor:
    """Ordered integer key of float bit patterns (a < b as floats <=> key(a) < key(b)); an involution."""
    return bits ^ ((bits >> (nbits - 1)) & ((1 << (nbits - 1)) - 1))


def batch_stats(flat: torch.Tensor, seg: torch.Tensor, n: int, hist: bool,
                fp16_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch-op statistics of ``n`` tensors laid end to end, as one fused computation.

    One classification of every element (a ``bucketize`` of its ``|x|`` bits against the threshold
    table), one scatter-add that counts (tensor, bucket) pairs, one scatter-max of three ordered
    integer keys per element (largest and smallest finite element, smallest non-zero finite |x|),
    and a small matrix product that sums buckets into the count columns. Everything is elementwise
    work feeding two scatters, so ``torch.compile`` turns it into a few kernels (the CUDA path
    compiles it; on the CPU it runs as is, and both are tested against the cast oracle). No host
    synchronisation: no ``bincount``, no boolean indexing, no data-dependent shape.

    Args:
        flat: 1-D float32 (for float16/bfloat16/float32 tensors) or float64 tensor: the tensors'
            elements, concatenated.
        seg: int64 tensor like ``flat``: the index (0..n-1) of the tensor each element belongs to.
        n: number of tensors (a tensor may have no element).
        hist: also count the exponent histogram.
        fp16_rows: bool (n,) tensor or None: which tensors are float16 (their own subnormals are
            their fp16-subnormal elements).

    Returns:
        ``(counts, extrema)`` as in :class:`DeviceStats`.
    """
    float_dtype = flat.dtype
    c = _carrier(float_dtype, hist)
    device = flat.device
    nbits = 32 if float_dtype == torch.float32 else 64
    nb = c.nb
    bits = flat.view(c.int_dtype)
    abits = bits & c.abs_mask
    bucket = torch.bucketize(abits, _device_bounds(float_dtype, hist, device), right=True) + seg * nb
    bcounts = torch.zeros(n * nb, dtype=torch.int64, device=device)
    bcounts.index_add_(0, bucket, torch.ones((), dtype=torch.int64, device=device).expand_as(bucket))
    counts = (bcounts.view(n, nb).to(torch.float64) @ _class_matrix(float_dtype, hist, device)).round().to(torch.int64)
    if fp16_rows is not None:  # a float16 tensor's own subnormals are its fp16-subnormal elements
        counts[:, _SUB] = torch.where(fp16_rows, counts[:, _FP16_SUB], counts[:, _SUB])
    # extrema as one scatter-max over ordered integer keys (int64 for both carriers)
    finite = abits < c.inf_bits
    key = _order_key(bits, nbits).to(torch.int64)
    none = torch.full_like(key, _I64_MIN)
    keys = torch.stack([torch.where(finite, key, none), torch.where(finite, -key, none),
                        torch.where(finite & (abits != 0), -abits.to(torch.int64), none)], dim=1)
    ext = torch.full((n, 3), _I64_MIN, dtype=torch.int64, device=device)
    ext.scatter_reduce_(0, seg.view(-1, 1).expand(-1, 3), keys, "amax")
    empty = ext == _I64_MIN
    hi = _order_key(ext[:, 0].to(c.int_dtype), nbits).view(float_dtype).to(torch.float64)
    lo = _order_key((-ext[:, 1]).to(c.int_dtype), nbits).view(float_dtype).to(torch.float64)
    nz = (-ext[:, 2]).to(c.int_dtype).view(float_dtype).to(torch.float64)
    inf = torch.full_like(hi, math.inf)
    extrema = torch.stack([torch.where(empty[:, 0], -inf, hi), torch.where(empty[:, 1], inf, lo),
                           torch.where(empty[:, 2], inf, nz)], dim=1)
    return counts, extrema


@lru_cache(maxsize=8)
def _compiled_batch_stats(device_type: str):
    """``batch_stats`` under ``torch.compile`` for CUDA (dynamic shapes: one compile per carrier and
    histogram setting, not per size), or plain ``batch_stats`` when compiling is unavailable."""
    if device_type != "cuda":
        return batch_stats
    try:
        return torch.compile(batch_stats, dynamic=True)
    except Exception:  # pragma: no cover - no triton / inductor: the same ops, one kernel each
        return batch_stats


def _flat_stats(flat: torch.Tensor, seg: torch.Tensor, fp16: tuple[bool, ...], hist: bool):
    """:func:`batch_stats` of ``len(fp16)`` tensors laid end to end in ``flat`` (``fp16[i]``: the
    i-th was float16), compiled on CUDA; returns ``(counts, extrema)``."""
    rows = _fp16_rows(fp16, flat.device).view(-1) if any(fp16) else None
    return _compiled_batch_stats(flat.device.type)(flat, seg, len(fp16), hist, rows)


def staged_stats(flat: torch.Tensor, sizes: tuple[int, ...], fp16: tuple[bool, ...], hist: bool) -> DeviceStats:
    """Stats of tensors already copied end to end into one float32 buffer, in one batched pass
    without host synchronisation (the staged rows of a recorded step on an accelerator,
    :class:`mpscope.recording.step_buffer.StagedRows`).

    Args:
        flat: 1-D float32 tensor of ``sum(sizes)`` elements: the tensors' values converted to
            float32 (exact for float16 and bfloat16), one after the other. Read, never modified.
        sizes: each tensor's number of elements (a tensor may have none).
        fp16: per tensor, whether it was float16 (its own subnormals are its fp16-subnormal elements).
        hist: also take the exponent histogram.

    Returns:
        :class:`DeviceStats` of ``len(sizes)`` rows on ``flat``'s device, equal to
        :func:`device_stats` of the original tensors.
    """
    with torch.no_grad():
        return DeviceStats(*_flat_stats(flat, segment_ids(sizes, flat.device), fp16, hist), hist)


def _torch_stats(tensors: list[torch.Tensor], hist: bool) -> DeviceStats:
    """The torch-op implementation (see :func:`batch_stats`); one carrier format per call."""
    first = tensors[0]
    float_dtype = _carrier_dtype(first.dtype)
    device = first.device
    n = len(tensors)
    with torch.no_grad():
        # one view per tensor and one concatenation (mixed 16-bit formats promote to float32,
        # exactly), then one conversion: no detach (no graph under no_grad), no cast per tensor
        flat = (torch.cat([t.reshape(-1) for t in tensors]) if n > 1 else first.reshape(-1).resolve_neg()).to(float_dtype)
        seg = _segment_ids(tuple(t.numel() for t in tensors), device)
        counts, extrema = _flat_stats(flat, seg, tuple(t.dtype == torch.float16 for t in tensors), hist)
        if float_dtype == torch.float64:  # PyTorch casts float64 -> float16/bfloat16 via float32
            cast = _torch_stats([t.to(torch.float32) for t in tensors], False).counts
            counts[:, _CAST_COLUMNS] = cast[:, _CAST_COLUMNS]
            # what float32 already flushed to 0 or rounded to inf underflows / overflows as well
            lost = cast[:, _ZERO] - counts[:, _ZERO]
            big = cast[:, _INF] - counts[:, _INF]
            for j in _UNDER_COLUMNS:
                counts[:, j] += lost
            for j in _OVER_COLUMNS:
                counts[:, j] += big
    return DeviceStats(counts, extrema, hist)


# ----------------------------------------------------------------------------- CPU torch-op path
# On the CPU (while the fused kernel is building, or when it cannot be built) float16 / bfloat16 /
# float32 tensors take a cheaper path than ``batch_stats``: no binary search per element, no
# scatter. Each element's float32 bits ``a = |x|`` get a *code*, a few shifts, masks and clamps:
#
#     code = 10 * e + min(f, 1) + max((f >> 12) - 0x7F7, 0)      (e = a >> 23, f = a & 0x7FFFFF)
#
# i.e. per binade (biased exponent e): 0 for a power of two (f == 0), 1 for most of the binade, and
# 2 .. 9 for its top 8/2048 (f >= 0x7F8000) in steps of 2^12 ulps. The code is monotone in |x|, and
# every cast threshold, binade boundary, inf and NaN of the bucket table (``_carrier``) falls on a
# code boundary, except within float32's subnormals (code 1: thresholds at bit patterns below
# 2^12, e.g. bfloat16's underflow tie 2^-134 = pattern 0x8000): elements there, if any, are
# bucketed exactly with ``bucketize`` on their own. One ``bincount`` per batch counts (tensor, code)
# pairs; a fixed code -> bucket table folds them into the same bucket counts as ``batch_stats``.
# min / max and the smallest non-zero |x| are plain reductions per tensor (the bucket counts say
# which tensors hold inf / NaN; only those are filtered first).
_CODES_PER_BINADE = 10
_NCODE = 256 * _CODES_PER_BINADE
_WINDOW = 0x7F7  # (f >> 12) at and below which a non-power-of-two element has sub-code 1
#: Most tensors per ``bincount`` (its length is this many times _NCODE).
_CODE_BATCH = 256


def _code_bounds() -> tuple[np.ndarray, np.ndarray]:
    """Smallest and largest float32 |x| bit pattern of every code (int64 arrays of length _NCODE)."""
    e = np.repeat(np.arange(256, dtype=np.int64), _CODES_PER_BINADE) << 23
    s = np.tile(np.arange(_CODES_PER_BINADE, dtype=np.int64), 256)
    top = (_WINDOW + s - 1) << 12  # sub-codes 2..9: f >> 12 == _WINDOW + s - 1
    lo = e + np.where(s == 0, 0, np.where(s == 1, 1, top))
    hi = e + np.where(s == 0, 0, np.where(s == 1, (_WINDOW + 1 << 12) - 1, top + 0xFFF))
    return lo, hi


def _codes(ab: torch.Tensor) -> torch.Tensor:
    """The code (int32) of every |x| bit pattern in ``ab`` (int32); see the comment above."""
    code = ab >> 23
    code.mul_(_CODES_PER_BINADE)
    code.add_(((ab >> 12).bitwise_and_(0x7FF)).clamp_(min=_WINDOW))
    code.add_((ab & 0x7FFFFF).clamp_(max=1))
    return code.sub_(_WINDOW)


@dataclass(frozen=True)
class _CodeTable:
    """How codes fold into the float32 carrier's buckets (hist=True table of ``_carrier``)."""

    bucket: torch.Tensor  # int64 (_NCODE,): the bucket of every code; nb (a spare column) for `ambiguous`
    ambiguous: int  # the one code whose elements span several buckets (float32 subnormals)
    amb_bits: tuple[int, int]  # its smallest and largest |x| bit pattern
    bounds: torch.Tensor  # the carrier's bucket bounds (int32), for the ambiguous elements
    count_matrix: torch.Tensor  # float64 (nb, 10): bucket -> COUNT_NAMES columns (own subnormal: float32's)
    exp_col: torch.Tensor  # int64 (nb + 1,): bucket -> histogram column; NHIST (a spare) for none
    nb: int


@lru_cache(maxsize=1)
def _code_table() -> _CodeTable:
    c = _carrier(torch.float32, True)
    lo, hi = _code_bounds()
    b_lo = np.searchsorted(c.bounds, lo, side="right")
    b_hi = np.searchsorted(c.bounds, hi, side="right")
    ambiguous = np.nonzero(b_lo != b_hi)[0]
    # only float32's subnormals (code 1) hold thresholds off the code grid
    assert ambiguous.tolist() == [1], ambiguous  # pragma: no cover - a table that does not hold
    bucket = np.where(b_lo == b_hi, b_lo, c.nb)
    exp_col = np.full(c.nb + 1, NHIST, dtype=np.int64)
    rows = np.nonzero(c.finite_nonzero)[0]
    exp_col[rows] = c.exponent[rows] - EXP_MIN
    full = _class_matrix(torch.float32, True, torch.device("cpu"))
    return _CodeTable(torch.from_numpy(bucket), 1, (int(lo[1]), int(hi[1])),
                      torch.tensor(c.bounds, dtype=torch.int32), full[:, : len(COUNT_NAMES)].contiguous(),
                      torch.from_numpy(exp_col), c.nb)


@lru_cache(maxsize=64)
def _code_offsets(sizes: tuple[int, ...]) -> torch.Tensor:
    """int32, one per element: _NCODE times the index of the tensor it belongs to."""
    return torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32) * _NCODE,
                                   torch.tensor(sizes), output_size=sum(sizes))


_F32_INF_BITS = 0x7F800000


def _cpu_stats(tensors: list[torch.Tensor], hist: bool) -> DeviceStats:
    """The CPU torch-op path for float16 / bfloat16 / float32 tensors (see the comment above);
    the same numbers as :func:`batch_stats`, in :class:`DeviceStats` layout."""
    if len(tensors) > _CODE_BATCH:
        parts = [_cpu_stats(tensors[i : i + _CODE_BATCH], hist) for i in range(0, len(tensors), _CODE_BATCH)]
        return DeviceStats(torch.cat([p.counts for p in parts]), torch.cat([p.extrema for p in parts]), hist)
    tab = _code_table()
    n, nb = len(tensors), tab.nb
    sizes = tuple(t.numel() for t in tensors)
    with torch.no_grad():
        # (one float32 tensor stays itself: one with the negative bit, the imaginary part of a
        # conjugate view, holds its values negated in memory and has no bit view until resolved)
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]) if n > 1 else \
            tensors[0].detach().reshape(-1).float().resolve_neg()
        ab = flat.view(torch.int32) & 0x7FFFFFFF
        code = _codes(ab)
        if n > 1:
            code.add_(_code_offsets(sizes))
        per_code = torch.bincount(code, minlength=n * _NCODE).view(n, _NCODE)
        buckets = torch.zeros(n, nb + 1, dtype=torch.int64).index_add_(1, tab.bucket, per_code)
        if per_code[:, tab.ambiguous].any():  # float32 subnormals: bucketed exactly
            lo, hi = tab.amb_bits
            idx = ((ab >= lo) & (ab <= hi)).nonzero().view(-1)
            b = torch.bucketize(ab[idx], tab.bounds, right=True)
            if n > 1:
                starts = torch.tensor(np.cumsum((0,) + sizes[:-1]))
                b += (torch.searchsorted(starts, idx, right=True) - 1) * (nb + 1)
            buckets.view(-1).index_add_(0, b, torch.ones_like(b))
        counts = (buckets[:, :nb].double() @ tab.count_matrix).round_().long()
        fp16 = [t.dtype == torch.float16 for t in tensors]
        if any(fp16):  # a float16 tensor's own subnormals are its fp16-subnormal elements
            rows = torch.tensor(fp16)
            counts[rows, _SUB] = counts[rows, _FP16_SUB]
        if hist:
            h = torch.zeros(n, NHIST + 1, dtype=torch.int64).index_add_(1, tab.exp_col, buckets)
            counts = torch.cat([counts, h[:, :NHIST]], dim=1)
        # extrema: min / max over the finite elements, smallest non-zero |x| over the bit patterns
        # ((|x| bits - 1) & 0x7FFFFFFF puts 0 last; inf and NaN patterns sit above every finite one),
        # one NumPy reduceat per column over the tensors' segments of the flat (shared) memory
        extrema = np.array([[-math.inf, math.inf, math.inf]] * n)
        full = [i for i, size in enumerate(sizes) if size]
        if full:
            starts = np.cumsum((0,) + sizes[:-1])
            x = flat.numpy()
            with np.errstate(invalid="ignore"):  # signalling NaNs (their tensors are redone below)
                extrema[full, 0] = np.maximum.reduceat(x, starts[full])
                extrema[full, 1] = np.minimum.reduceat(x, starts[full])
            m = np.minimum.reduceat((ab - 1).bitwise_and_(0x7FFFFFFF).numpy(), starts[full]).astype(np.int64) + 1
            extrema[full, 2] = np.where(m < _F32_INF_BITS, np.minimum(m, _F32_INF_BITS).astype(np.int32).view(np.float32),
                                        math.inf)
            nonfinite = (buckets[:, nb - 2] + buckets[:, nb - 1]).numpy()
            for i in np.nonzero(nonfinite)[0].tolist():  # filter inf / NaN out of these tensors only
                seg = flat[starts[i] : starts[i] + sizes[i]]
                seg = seg[torch.isfinite(seg)]
                extrema[i, :2] = (float(seg.max()), float(seg.min())) if seg.numel() else (-math.inf, math.inf)
        extrema = torch.from_numpy(extrema)
    return DeviceStats(counts, extrema, hist)


def host_rows(counts: np.ndarray, extrema: np.ndarray) -> dict[str, np.ndarray]:
    """Turn host copies of :class:`DeviceStats` into row columns (counts, not fractions).

    Returns a dict of arrays of length n: ``max, min, absmax, absmin_nonzero`` (float64, NaN where
    a tensor has no finite / non-zero finite element) and one ``<name>_count`` int64 array per
    :data:`COUNT_NAMES`.
    """
    mx, mn, az = ext = np.array(extrema[:, :3].T, dtype=np.float64, order="C")  # one copy: rows = columns
    ext[:2, ~np.isfinite(mx)] = np.nan
    az[~np.isfinite(az)] = np.nan
    out = {"max": mx, "min": mn, "absmax": np.fmax(np.abs(mx), np.abs(mn)), "absmin_nonzero": az}
    cols = np.array(counts[:, : len(COUNT_NAMES)].T, dtype=np.int64, order="C")
    for j, name in enumerate(COUNT_NAMES):
        out[f"{name}_count"] = cols[j]
    return out


def histogram_rows(counts: np.ndarray) -> np.ndarray:
    """The (n, NHIST) exponent histogram part of host counts (column j: exponent EXP_MIN + j)."""
    return counts[:, len(COUNT_NAMES) :]


def tensor_stats(t: torch.Tensor) -> dict:
    """Exact stats of one tensor as a dict of Python numbers (a host-side convenience; it syncs).

    Keys are the ``Run.tensors`` columns that depend only on the tensor: ``dtype, numel, min, max,
    absmax, absmin_nonzero, zero_frac, subnormal_frac, fp16_underflow_frac, fp16_subnormal_frac,
    fp16_overflow_frac, bf16_underflow_frac, bf16_subnormal_frac, bf16_overflow_frac, nan_count,
    inf_count``, plus ``histogram`` ({exponent: count}). Fractions are over ``numel``.

    Raises:
        TypeError: if ``t`` is not a non-empty floating tensor (see :func:`is_recordable`).
    """
    if not is_recordable(t):
        raise TypeError(
            "tensor_stats needs a non-empty float16/bfloat16/float32/float64 tensor; got "
            f"{type(t).__name__} {getattr(t, 'dtype', '')} with {getattr(t, 'numel', lambda: '?')()} elements"
        )
    ds = device_stats([t])
    counts = ds.counts.cpu().numpy()
    cols = host_rows(counts, ds.extrema.cpu().numpy())
    numel = t.numel()
    out: dict = {"dtype": dtype_name(t.dtype), "numel": numel}
    for k in ("min", "max", "absmax", "absmin_nonzero"):
        out[k] = float(cols[k][0])
    for name in COUNT_NAMES:
        v = int(cols[f"{name}_count"][0])
        if name in ("nan", "inf"):
            out[f"{name}_count"] = v
        else:
            out[f"{name}_frac"] = v / numel
    hist = histogram_rows(counts)[0]
    out["histogram"] = {int(e) + EXP_MIN: int(c) for e, c in enumerate(hist) if c}
    return out


def to_host_async(t: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """``t`` on the host without waiting for the device.

    A CUDA tensor is copied non-blocking into pinned host memory and a CUDA event is recorded after
    the copy: read the host tensor only once ``event.query()`` is True (or after
    ``event.synchronize()``). A CPU tensor is returned as it is, with no event.
    """
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
