"""Floating-point formats that mixed-precision training moves numbers between.

Every limit is read from :func:`torch.finfo`, the single source of truth; nothing is typed in by hand.

=========  =============  ====================  ======================  =======
format     max            min normal (tiny)     min subnormal           eps
=========  =============  ====================  ======================  =======
float16    65504          2^-14 ≈ 6.10e-5       2^-24 ≈ 5.96e-8         2^-10
bfloat16   ≈ 3.39e38      2^-126 ≈ 1.18e-38     2^-133 ≈ 9.18e-41       2^-7
float32    ≈ 3.40e38      2^-126                2^-149                  2^-23
=========  =============  ====================  ======================  =======
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    """Limits of one IEEE-style binary floating-point format.

    Attributes:
        name: PyTorch's name without ``torch.`` ("float16", "bfloat16", "float32", "float64").
        dtype: the ``torch.dtype``.
        max: largest finite value (float16: 65504).
        min_normal: smallest positive normal value, ``finfo.tiny`` (float16: 2^-14).
        min_subnormal: smallest positive subnormal value, ``finfo.tiny * finfo.eps`` (float16: 2^-24).
        eps: spacing of values just above 1.0 (float16: 2^-10).
        mantissa_bits: explicitly stored fraction bits (float16: 10, bfloat16: 7).
        exponent_bits: width of the exponent field (float16: 5, bfloat16: 8).
    """

    name: str
    dtype: torch.dtype
    max: float
    min_normal: float
    min_subnormal: float
    eps: float
    mantissa_bits: int
    exponent_bits: int

    @property
    def max_exponent(self) -> int:
        """floor(log2(max)): the highest binade (float16: 15)."""
        return math.frexp(self.max)[1] - 1

    @property
    def min_normal_exponent(self) -> int:
        """log2(min_normal) (float16: -14)."""
        return math.frexp(self.min_normal)[1] - 1

    @property
    def min_subnormal_exponent(self) -> int:
        """log2(min_subnormal) (float16: -24)."""
        return math.frexp(self.min_subnormal)[1] - 1

    @property
    def ideal_sqnr_db(self) -> float:
        """The format's ideal signal-to-quantization-noise ratio in dB: 20·log10(2) ≈ 6.02 dB per
        significand bit, stored bits plus the implicit one (float16: 66.2 dB, bfloat16: 48.2 dB) —
        the usual rule of thumb for p-bit quantization. One round-to-nearest of Gaussian data
        measures about 7.4 dB above it (float16: 73.6 dB, bfloat16: 55.6 dB)."""
        return 20.0 * math.log10(2.0) * (self.mantissa_bits + 1)

    @property
    def overflow_threshold(self) -> float:
        """Smallest magnitude that rounds to inf when cast (round to nearest even): max + ulp(max)/2.

        float16: 65520. A value exactly halfway rounds to inf because max has an odd mantissa.
        """
        return self.max + math.ldexp(1.0, self.max_exponent - self.mantissa_bits - 1)

    @property
    def underflow_threshold(self) -> float:
        """Largest magnitude that rounds to 0 when cast: min_subnormal / 2 (float16: 2^-25).

        The halfway value rounds to 0 (even); anything above it rounds to min_subnormal.
        """
        return self.min_subnormal / 2

    @property
    def normal_threshold(self) -> float:
        """Smallest magnitude that rounds to a normal number: min_normal - min_subnormal / 2.

        float16: 2^-14 - 2^-25. At the halfway value the tie goes to min_normal (even mantissa).
        """
        return self.min_normal - self.min_subnormal / 2


def _from_finfo(dtype: torch.dtype) -> Format:
    fi = torch.finfo(dtype)
    mantissa_bits = -int(math.log2(fi.eps))
    exponent_bits = fi.bits - 1 - mantissa_bits
    return Format(
        name=str(dtype).removeprefix("torch."),
        dtype=dtype,
        max=float(fi.max),
        min_normal=float(fi.tiny),
        # torch.finfo has no smallest_subnormal: it is tiny * eps (one ulp of the lowest binade)
        min_subnormal=float(fi.tiny) * float(fi.eps),
        eps=float(fi.eps),
        mantissa_bits=mantissa_bits,
        exponent_bits=exponent_bits,
    )


FP16 = _from_finfo(torch.float16)
BF16 = _from_finfo(torch.bfloat16)
FP32 = _from_finfo(torch.float32)
FP64 = _from_finfo(torch.float64)

FORMATS: dict[str, Format] = {f.name: f for f in (FP16, BF16, FP32, FP64)}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"`` (PyTorch's name without ``torch.``)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DTYPE_NAMES: dict[torch.dtype, str] = {}  # called per observed tensor by the recorder's hooks


def format_of(dtype: torch.dtype | str) -> Format:
    """The :class:`Format` of a floating dtype.

    Raises:
        ValueError: for a dtype that is not float16, bfloat16, float32 or float64.
    """
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"mpscope knows the formats {sorted(FORMATS)}; got {name!r}"
        ) from None
