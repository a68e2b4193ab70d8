"""Autocast policy tables and static facts about ATen ops, shared by the op recorder and the advisor.

* Which ops reduce (:data:`REDUCTIONS`, :data:`MATMULS`, :data:`SUMMING`), cast, take a log, mask,
  preserve values (:data:`PRESERVING`) or have a pole (:data:`POLES`).
* Which ops autocast runs in float32 on CUDA (:data:`CUDA_FP32_OPS`) and on the CPU
  (:data:`CPU_FP32_OPS`), and which it runs in the lower precision (:data:`AUTOCAST_LOWP_OPS`): the
  lists of PyTorch's AMP documentation (``docs/source/amp.rst``, "Autocast Op Reference", torch 2.x).
* :func:`op_info` (cached per overload), :func:`check_op_filter` for ``record(ops=[...])``, and the
  frame-level rules on op facts that both recording and advice use (:func:`may_overflow`,
  :func:`periodic_coarse`).

Nothing here records or judges a run; it only describes ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from mpscope.formats import FORMATS

#: Largest tensor whose distinct values are counted (a sort) when a floating tensor that does not
#: require grad (positions, not weights or activations) is cast to float16/bfloat16; integer-dtype
#: inputs (positions, ids) are counted up to ``DISTINCT_MAX_INT`` elements.
DISTINCT_MAX_FLOAT = 1 << 16
DISTINCT_MAX_INT = 1 << 22

# --------------------------------------------------------------------------- op classification
#: Reductions (ATen overload packet -> the op name used by the autocast op lists). The matmul family
#: reduces over its inner dimension K.
REDUCTIONS = {
    "sum": "sum", "mean": "mean", "var": "var", "std": "std", "var_mean": "var", "std_mean": "std",
    "nansum": "sum", "nanmean": "mean", "prod": "prod", "cumsum": "cumsum", "cumprod": "cumprod",
    "logsumexp": "logsumexp", "logcumsumexp": "logcumsumexp",
    "_softmax": "softmax", "softmax": "softmax", "_log_softmax": "log_softmax",
    "log_softmax": "log_softmax", "_softmax_backward_data": "softmax",
    "_log_softmax_backward_data": "log_softmax",
    "norm": "norm", "linalg_vector_norm": "norm", "frobenius_norm": "norm",
    "native_layer_norm": "layer_norm", "native_layer_norm_backward": "layer_norm",
    "native_group_norm": "group_norm", "native_group_norm_backward": "group_norm",
    "native_batch_norm": "batch_norm", "_native_batch_norm_legit": "batch_norm",
    "_native_batch_norm_legit_functional": "batch_norm", "_native_batch_norm_legit_no_training": "batch_norm",
    "mm": "mm", "bmm": "bmm", "addmm": "addmm", "baddbmm": "baddbmm", "addbmm": "addbmm",
    "matmul": "matmul", "dot": "dot", "vdot": "dot", "mv": "mv", "addmv": "addmv",
    "_scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention": "scaled_dot_product_attention",
}
MATMULS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "dot", "vdot", "mv", "addmv"}
#: Reductions whose output can exceed the inputs' range (a long sum); mean/var/softmax/norm cannot
#: overflow through the length of the reduction alone (PyTorch accumulates them in float32).
SUMMING = MATMULS | {"sum", "nansum", "cumsum"}
_DIM_ARG = {"_softmax", "_log_softmax", "cumsum", "cumprod", "logcumsumexp", "softmax", "log_softmax"}

#: Ops that CUDA autocast runs in float32 ("CUDA Ops that can autocast to float32", PyTorch AMP docs,
#: ``docs/source/amp.rst``, torch 2.x). CPU autocast has no softmax/sum/pow/layer_norm entry: they
#: run in their input's dtype, so float16 in, float16 out (PyTorch AMP docs, "CPU Ops that can autocast to float32").
CUDA_FP32_OPS = frozenset({
    "pow", "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "softplus", "softmax", "softmin", "log_softmax",
    "cumprod", "cumsum", "dist", "pdist", "cdist", "renorm", "prod", "sum", "norm", "normalize",
    "layer_norm", "group_norm", "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "kl_div",
    "smooth_l1_loss", "binary_cross_entropy_with_logits", "cosine_similarity", "poisson_nll_loss",
})
#: Ops that CPU autocast runs in float32 ("CPU Ops that can autocast to float32", same document).
CPU_FP32_OPS = frozenset({
    "prod", "cdist", "trace", "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "kl_div",
    "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "poisson_nll_loss", "margin_ranking_loss", "soft_margin_loss", "multi_margin_loss",
    "quantile", "nanquantile", "stft", "polar",
})
#: Ops that autocast (CPU and CUDA) runs in the lower precision: an in-place / ``out=`` call of these
#: bypasses the cast (autocast does not apply to them).
AUTOCAST_LOWP_OPS = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "conv1d", "conv2d", "conv3d",
    "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "prelu", "addmv", "addr", "mv", "dot",
})
CASTS = {"_to_copy", "copy_", "to", "_to_copy_"}
NOT_RECORDED = frozenset({"detach", "lift_fresh", "alias", "empty", "empty_like", "empty_strided", "new_empty",
                           "new_empty_strided", "empty_permuted"})
#: Ops whose output holds only elements of their floating inputs, unchanged (copies, concatenations,
#: gathers, rearrangements). When the output has the inputs' dtype and every floating input already
#: has an ``op_output`` row this step, the output can hold no value (non-finite, subnormal, out of
#: range, integer collision) that those rows do not show first, so its row is skipped (see
#: :meth:`OpRecorder._skippable`); its stats are still taken if a later op needs them.
PRESERVING = frozenset({
    "clone", "contiguous", "_to_copy", "copy_", "cat", "stack", "hstack", "vstack", "index_select",
    "gather", "repeat", "flip", "roll", "narrow_copy", "expand_copy", "permute_copy", "t_copy",
    "transpose_copy", "unsqueeze_copy", "squeeze_copy", "view_copy", "alias_copy", "slice_copy",
    "select_copy", "unfold_copy", "_unsafe_view", "unbind_copy", "split_copy", "split_with_sizes_copy",
})
LOGS = {"log", "log2", "log10", "log_", "log2_", "log10_"}
MASKING = {"add", "add_", "sub", "sub_", "rsub", "masked_fill", "masked_fill_", "where", "addcmul"}
NORM_TAIL = {"rsqrt", "sqrt", "reciprocal", "div", "native_layer_norm", "native_group_norm"}
#: Ops with a pole: the input value at which each returns -inf/inf/NaN from a finite input
#: (log(0), log1p(-1), x / 0, 1 / 0, rsqrt(0), atanh(+-1)); ``in_pole`` counts such inputs.
POLES = {"log": 0.0, "log_": 0.0, "log2": 0.0, "log2_": 0.0, "log10": 0.0, "log10_": 0.0,
         "log1p": -1.0, "log1p_": -1.0, "reciprocal": 0.0, "reciprocal_": 0.0, "rsqrt": 0.0, "rsqrt_": 0.0,
         "div": 0.0, "div_": 0.0, "atanh": 1.0, "atanh_": 1.0}
#: In-place updates of a running value (sum, average, EMA): ``acc.add_(x)``, ``acc.sub_(x)``,
#: ``acc.lerp_(x, w)``; the op recorder counts the increments they lose (``acc_swamped``).
ACCUMULATING = frozenset({"add_", "sub_", "lerp_"})
#: Periodic functions: an argument rounded by a low-precision cast shifts their phase.
PERIODIC = {"sin", "cos", "tan", "sin_", "cos_", "tan_"}
#: Boundary values a constant may round onto (besides 0, see ``scalar_lost``): 1 - eps -> 1.
BOUNDARIES = (1.0, -1.0)


@dataclass(frozen=True)
class OpInfo:
    """Static facts about one ATen overload (cached per OpOverload)."""

    name: str  # "aten.add.Tensor"
    packet: str  # "add"
    view: bool
    inplace: bool
    out_variant: bool
    reduction: str | None  # policy name, or None
    cast: bool
    log: bool
    masking: bool
    preserving: bool
    short: str  # packet without leading / trailing underscores ("softmax" for "_softmax", "add" for "add_")
    accumulating: bool = False  # an in-place update of a running value (ACCUMULATING)
    pole: float | None = None  # the input value at the op's pole (POLES), None without one
    periodic: bool = False  # sin/cos/tan (PERIODIC)


_INFO: dict = {}


def op_info(func) -> OpInfo:
    info = _INFO.get(func)
    if info is None:
        schema = func._schema
        packet = func.overloadpacket.__name__
        rets = schema.returns
        alias = [r.alias_info for r in rets]
        view = bool(rets) and all(a is not None and not a.is_write for a in alias)
        out_variant = any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
                          for a in schema.arguments)
        inplace = not out_variant and packet.endswith("_") and any(a is not None and a.is_write for a in alias)
        info = OpInfo(
            # views share an input's memory; empty* outputs are uninitialised memory: neither is recorded
            name=str(func), packet=packet, view=view or packet in NOT_RECORDED,
            inplace=inplace, out_variant=out_variant, reduction=REDUCTIONS.get(packet),
            cast=packet in CASTS, log=packet in LOGS, masking=packet in MASKING,
            preserving=packet in PRESERVING, short=op_short_name(packet),
            accumulating=packet in ACCUMULATING, pole=POLES.get(packet), periodic=packet in PERIODIC,
        )
        _INFO[func] = info
    return info


def op_short_name(name: str) -> str:
    """``"softmax"`` for ``"_softmax"``, ``"add"`` for ``"add_"`` or ``"aten.add.Tensor"``: the name an
    op filter (``record(ops=[...])``) matches."""
    if name.startswith("aten."):
        name = name.split(".")[1]
    return name.strip("_")


def check_op_filter(ops) -> frozenset | None:
    """The op filter of ``record(ops=...)``: None (every op) for ``True``, else the set of short names.

    Raises:
        ValueError: a name that is no ATen operator, an empty list, or neither True nor names.
    """
    if ops is True:
        return None
    if not isinstance(ops, (str, list, tuple, set, frozenset)):
        raise ValueError(f"ops= takes True (every op) or op names such as ['add', 'softmax']; got {ops!r}.")
    names = [ops] if isinstance(ops, str) else list(ops)
    if not names:
        raise ValueError("ops= got an empty list; pass True for every op or names such as ops=['add', 'softmax'].")
    out = set()
    for n in names:
        if not isinstance(n, str):
            raise ValueError(f"ops= takes op names (str); got {n!r}.")
        short = op_short_name(n)
        if not any(hasattr(torch.ops.aten, c) for c in (short, "_" + short, short + "_")):
            raise ValueError(f"ops=: {n!r} is not an ATen operator; use names such as 'add', 'matmul', "
                             "'softmax', 'layer_norm' (as in torch.ops.aten, leading underscores optional).")
        out.add(short)
    return frozenset(out)


def reduction_len(info: OpInfo, args, out: torch.Tensor) -> int:
    """Number of values each output element reduces over (K for matmuls)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return 0
    p = info.packet
    if p in MATMULS:
        a = tensors[1] if p in ("addmm", "baddbmm", "addbmm", "addmv") and len(tensors) > 1 else tensors[0]
        return int(a.shape[-1]) if a.dim() else 1
    if p in _DIM_ARG and len(args) > 1 and isinstance(args[1], int) and tensors[0].dim():
        return int(tensors[0].shape[args[1]])
    if p.startswith("native_layer_norm") and len(args) > 1:
        return int(math.prod(args[1])) if p == "native_layer_norm" else int(math.prod(args[2]))
    return int(tensors[0].numel() // max(out.numel(), 1))


def may_overflow(frame: pd.DataFrame) -> pd.Series:
    """A forward summing reduction in float16/bfloat16 whose bound K * max|a| * max|b| reaches the
    format's max."""
    return pd.Series(may_overflow_values(frame.phase.eq("forward").to_numpy(), frame.reduction.ne("").to_numpy(),
                                         frame.out_dtype.tolist(), frame.reduction_len.to_numpy(),
                                         frame.in_absmax0.to_numpy(), frame.in_absmax1.to_numpy()),
                     index=frame.index)


def may_overflow_values(forward, reducing, out_dtype, reduction_len, absmax0, absmax1) -> np.ndarray:
    """:func:`may_overflow` on arrays, one element per op call: ``forward`` and ``reducing`` (a
    reduction) bool, ``out_dtype`` format names, ``reduction_len`` K, ``absmax0`` / ``absmax1`` the
    inputs' largest |x| (float, NaN: not measured; a missing second factor counts as 1)."""
    fmax = np.array([FORMATS[d].max if d in FORMATS else math.inf for d in out_dtype], dtype=np.float64)
    low = np.array([d in ("float16", "bfloat16") for d in out_dtype], dtype=bool)
    absmax1 = np.asarray(absmax1, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # 0 * inf is NaN, and NaN >= max is False (as in pandas)
        bound = np.asarray(reduction_len) * np.asarray(absmax0, dtype=np.float64) * np.where(np.isnan(absmax1), 1.0, absmax1)
        # forward only: an overflowing (scaled) gradient in backward is the GradScaler's to catch and skip
        return np.asarray(forward, dtype=bool) & np.asarray(reducing, dtype=bool) & (bound >= fmax) & low


#: float_precision: a sin/cos/tan argument held in float16/bfloat16 whose spacing (ulp) at its
#: largest magnitude reaches 2^-3 rad: neighbouring arguments then differ by up to 1/16 rad in phase.
PERIODIC_ULP = 2.0**-3


def ulp(absmax: pd.Series, dtype: pd.Series) -> pd.Series:
    """Spacing of each row's format at |x| = absmax: 2^(floor(log2 absmax) - mantissa bits)."""
    return pd.Series(ulp_values(absmax.to_numpy(), dtype.tolist()), index=absmax.index)


def ulp_values(absmax, dtype) -> np.ndarray:
    """:func:`ulp` on arrays: ``absmax`` float, ``dtype`` format names; NaN where ``absmax`` is not
    positive or the format is unknown."""
    mant = np.array([FORMATS[d].mantissa_bits if d in FORMATS else np.nan for d in dtype], dtype=np.float64)
    absmax = np.asarray(absmax, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.exp2(np.floor(np.log2(np.where(absmax > 0, absmax, np.nan))) - mant)


def periodic_coarse(frame: pd.DataFrame) -> pd.Series:
    """sin/cos/tan rows (forward and backward) whose low-precision argument has an ulp >= PERIODIC_ULP."""
    packet = frame.op.str.split(".").str[1]
    return pd.Series(periodic_coarse_values(packet.isin(PERIODIC).to_numpy(), frame.in_absmax0.to_numpy(),
                                            frame.out_dtype.tolist()), index=frame.index)


def periodic_coarse_values(periodic, absmax0, out_dtype) -> np.ndarray:
    """:func:`periodic_coarse` on arrays: ``periodic`` bool (a sin/cos/tan), ``absmax0`` its
    argument's largest |x|, ``out_dtype`` format names."""
    with np.errstate(invalid="ignore"):
        return np.asarray(periodic, dtype=bool) & (ulp_values(absmax0, out_dtype) >= PERIODIC_ULP)
