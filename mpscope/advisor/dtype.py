"""bf16 vs fp16 vs fp32, with evidence, for the device the run was recorded on.

Rules:

* fp16 does not fit the forward pass when an activation overflows fp16 (inf in fp16, or a
  ``fp16_overflow_frac`` > 0 for a tensor kept in another dtype) or sits within one binade of
  65504 (absmax >= 2^15). It can be kept when those modules can move to fp32 cheaply: at most
  ``CHEAP_FP32_FRAC`` of the modules with recorded activations.
* fp16 does not fit the gradients when no loss scale keeps the flush-to-zero fraction of non-zero
  gradient elements below ``GRAD_UNDERFLOW_LIMIT`` (the what-if at the largest safe scale).
* bf16 has a fast path on CUDA capability >= 8.0 (Ampere; tensor cores with bf16) and is supported
  by CPU autocast (its default dtype). On older CUDA GPUs it has none.
* Both fit: bf16 on CUDA >= 8.0 (no loss scaling needed); fp16 on older CUDA GPUs; on the CPU the
  run's own choice is kept (its speed depends on the CPU's ISA, which the run does not record),
  unless fp16 fits only tightly: in some module the rounding of the gradient elements below fp16's
  normal range can change the gradient by more than GRAD_UNDERFLOW_ERROR (1 % of its L1 norm)
  even at the largest safe scale (a tail of tiny elements bounded below that changes nothing);
  then bf16.
  fp16 (with a scaler) also wins when a finding shows bf16's 8-bit mantissa failing
  (stagnant_low_precision_weights, integer_precision in bf16).
* Neither fits: float32.

The autocast policy differs by device: CPU autocast(float16) leaves layer_norm, softmax, sum and
pow in fp16, CUDA autocast runs them in fp32. So on the CPU in fp16 the normalisation modules that
a warning or error finding names are listed in ``fp32_modules``; on CUDA autocast already does it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from mpscope.advisor import _frames
from mpscope.advisor.context import Context
from mpscope.advisor.finding import Finding, is_ancestor
from mpscope.advisor.findings import (
    GRAD_UNDERFLOW_ERROR,
    HEADROOM_LIMIT,
    forward_overflow_rows,
)
from mpscope.advisor.scaler import InitExponent, scale_whatif
from mpscope.formats import FP16
from mpscope.schema import GRAD_ROLES, module_label

#: fp16 gradients fit when, at the best loss scale, at most 1 % of non-zero gradient elements flush to zero.
GRAD_UNDERFLOW_LIMIT = 0.01
#: Keeping modules in fp32 is "cheap" while they are at most a quarter of the recorded modules.
CHEAP_FP32_FRAC = 0.25
#: bf16 tensor-core fast path: CUDA compute capability 8.0 (Ampere) and newer.
BF16_MIN_CAPABILITY = (8, 0)


def _bf16_support(c: Context) -> tuple[bool, str]:
    if c.device == "cpu":
        return True, "CPU autocast supports bfloat16 (its default dtype)"
    cap = c.meta.get("cuda_capability")
    if cap is None:
        return False, "CUDA capability unknown, so no bfloat16 fast path is assumed"
    cap = tuple(int(x) for x in cap)
    if cap >= BF16_MIN_CAPABILITY:
        return True, f"CUDA capability {cap[0]}.{cap[1]} >= 8.0 has a bfloat16 fast path"
    return False, f"CUDA capability {cap[0]}.{cap[1]} < 8.0 has no bfloat16 fast path"


def _forward_modules(c: Context) -> tuple[list[str], float, str | None]:
    """Modules whose activations overflow fp16 or lack a binade of headroom; peak |activation|."""
    t = c.t
    act = t[t.role == "activation"]
    over = forward_overflow_rows(c)
    hot = act[act.absmax >= HEADROOM_LIMIT]
    mods: list[str] = []
    if not over.empty:
        first_step = int(over.step.min())
        mods.append(str(over[over.step == first_step].sort_values("_order").iloc[0].module))
    for m in dict.fromkeys(hot.sort_values(["step", "_order"]).module):
        if m not in mods:
            mods.append(str(m))
    # a container whose listed child overflows is covered by keeping that child in fp32
    mods = [m for m in mods if not any(is_ancestor(m, o) for o in mods)]
    peak = float(act.absmax.max()) if len(act) and act.absmax.notna().any() else float("nan")
    peak_mod = str(act.loc[act.absmax.idxmax(), "module"]) if len(act) and act.absmax.notna().any() else None
    if not over.empty and (over.dtype == "float16").any():
        peak = float("inf")
    return mods, peak, peak_mod


def _tight_module(run: Any, init: InitExponent) -> tuple[str, str] | None:
    """(module, what underflows) of the module whose gradient has the largest underflow error bound
    at the largest safe scale ``2^k_max`` (:func:`mpscope.advisor.scaler.underflow_error`), when it
    exceeds GRAD_UNDERFLOW_ERROR; else None."""
    # per role: a module's activation and parameter gradients differ in scale, and the bound is relative
    # to one tensor's L1 norm
    roles = sorted(set(_frames.histograms(run).role) & set(GRAD_ROLES))
    w = pd.concat([scale_whatif(run, ks=[init.k_max], per_module=True, roles=[r]) for r in roles] or [pd.DataFrame()])
    if w.empty:
        return None
    below = w.underflow_error.fillna(0.0)
    i = int(below.to_numpy().argmax())
    frac = float(below.iloc[i])
    return ((str(w.module.iloc[i]), f"elements whose rounding can change it by {100 * frac:.2g} % (L1)")
            if frac > GRAD_UNDERFLOW_ERROR else None)


def _underflow_at_max_scale(c: Context, findings: list[Finding], k_max: int) -> tuple[str, str] | None:
    """(module, what stays below) of the worst warning-level grad_underflow finding seen at a loss scale already at or
    above the largest safe one (2^k_max): on that step no loss scale could have saved it."""
    if not len(c.s):
        return None
    scale_at = dict(zip(c.s.step.astype(int), c.s.loss_scale.astype(float)))
    hits = [f for f in findings if f.code == "grad_underflow" and f.severity != "info"
            and scale_at.get(f.step, 0.0) >= 2.0 ** k_max]
    if not hits:
        return None
    worst = max(hits, key=lambda f: f.value)
    return worst.module, f"{100 * float(worst.value):.0f} % of its elements (see grad_underflow)"


@dataclass(frozen=True)
class DtypeChoice:
    """The training dtype chosen by :func:`choose_dtype`, with what it rests on.

    Attributes:
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        reasons: one sentence per consideration, in order.
        fp32_modules: modules to keep in float32 with ``dtype``.
        fp16_fp32_modules: what float16 would need in float32.
        fp16_forward_ok: the forward activations fit fp16 (more than one binade below 65504).
        fp16_grad_ok: some loss scale fits the gradients into fp16 (None: no gradient evidence).
        bf16_fast: the device runs bfloat16 natively.
        forward_absmax: largest |activation| recorded (NaN if none), and its module.
    """

    dtype: str
    reasons: list
    fp32_modules: list
    fp16_fp32_modules: list
    fp16_forward_ok: bool
    fp16_grad_ok: bool | None
    bf16_fast: bool
    forward_absmax: float
    forward_absmax_module: str | None


def choose_dtype(c: Context, findings: list[Finding], init: InitExponent | None) -> DtypeChoice:
    """Decide the training dtype.

    Args:
        c: the advisor Context of the run.
        findings: module (and op) findings already computed.
        init: :func:`mpscope.advisor.scaler.choose_init_exponent`'s result, or None without grad data.

    Returns a :class:`DtypeChoice`.
    """
    reasons: list[str] = []
    fwd_mods, peak, peak_mod = _forward_modules(c)
    n_mods = max(1, c.t[c.t.role == "activation"].module.nunique())
    fwd_ok = not fwd_mods
    cheap = len(fwd_mods) <= CHEAP_FP32_FRAC * n_mods
    if fwd_ok:
        if not math.isnan(peak):
            reasons.append(f"forward activations peak at |x| = {peak:.4g} (module '{module_label(peak_mod)}'), "
                           f"more than one binade below fp16's maximum {FP16.max:.0f}")
    else:
        what = "overflow fp16" if math.isinf(peak) or peak > FP16.max else "come within one binade of 65504"
        reasons.append(f"forward activations {what} in module(s) {', '.join(repr(m) for m in fwd_mods)}; "
                       f"a loss scale cannot help the forward pass")
    if init is None:
        grad_ok = None
        reasons.append("cannot tell whether fp16 gradients underflow: no finite gradient values were recorded "
                       "(see missing_evidence)")
    else:
        grad_ok = init.min_underflow_frac <= GRAD_UNDERFLOW_LIMIT
        if grad_ok:
            reasons.append(f"at loss scale 2^{init.k} the what-if leaves "
                           f"{100 * (init.underflow_frac + init.subnormal_frac):.2f} % of non-zero gradient "
                           f"elements below fp16's normal range ({100 * init.underflow_frac:.2f} % flushed to zero; fp16 "
                           f"is ruled out above {100 * GRAD_UNDERFLOW_LIMIT:g} % flushed); scales up to "
                           f"2^{init.k_max} keep the largest gradient a binade below 65504")
        else:
            reasons.append(f"no loss scale fits the gradients into fp16: even at 2^{init.k_max} "
                           f"{100 * init.min_underflow_frac:.1f} % flush to zero (their range is wider than fp16's)")
    bf16_fast, bf16_why = _bf16_support(c)
    bf16_problem = [f for f in findings if f.code in ("stagnant_low_precision_weights", "integer_precision")
                    and "bfloat16" in (f.message or "")]
    # normalisation modules with evidence against fp16: a warning or error finding in them
    flagged = [f.module for f in findings if f.severity != "info" and f.module is not None]
    norm_mods = [m for m in dict.fromkeys(c.t[c.t.role == "activation"].module)
                 if _frames.is_norm_module(c.run, m, c.types)
                 and any(f == m or is_ancestor(m, f) for f in flagged)]
    fp16_fits = fwd_ok and grad_ok is not False
    tight = _tight_module(c.run, init) if init is not None and not init.lossy else None
    if tight is None and init is not None:
        tight = _underflow_at_max_scale(c, findings, init.k_max)
    fp16_fixable = (not fwd_ok) and cheap and grad_ok is not False

    unknown = [w for w, gap in (("forward pass", math.isnan(peak)), ("gradients", grad_ok is None)) if gap]
    both = ("both fit" if not unknown else
            f"nothing rules fp16 out, but there is no evidence for the {' and '.join(unknown)} (cannot tell)")
    if fp16_fits:
        if c.device == "cuda" and bf16_fast and not bf16_problem:
            dtype = "bfloat16"
            reasons.append(f"{both}; {bf16_why} and needs no loss scaling")
        elif bf16_problem:
            dtype = "float16"
            reasons.append(f"{both}, but bfloat16's {7}-bit mantissa fails here ({bf16_problem[0].code}); "
                           f"fp16 has 10 bits")
        elif c.device == "cuda":
            dtype = "float16"
            reasons.append(f"{both}; {bf16_why}")
        elif tight and bf16_fast:
            dtype = "bfloat16"
            reasons.append(f"fp16 fits only tightly: even at 2^{init.k_max}, the gradient of module "
                           f"'{module_label(tight[0])}' keeps {tight[1]} below fp16's "
                           f"normal range (limit {100 * GRAD_UNDERFLOW_ERROR:g} %), so bfloat16, whose range holds them, "
                           "is preferred")
        else:
            dtype = c.autocast if c.autocast in ("float16", "bfloat16") else "bfloat16"
            reasons.append(f"{both}; on the CPU the run's own dtype is kept ({dtype}: "
                           f"{'as recorded' if c.autocast else 'CPU autocast default'})")
    elif bf16_fast and not (bf16_problem and fp16_fixable):
        dtype = "bfloat16"
        reasons.append(f"fp16 does not fit; bfloat16 has fp32's exponent range; {bf16_why}")
    elif fp16_fixable:
        dtype = "float16"
        reasons.append(f"fp16 with {', '.join(repr(m) for m in fwd_mods)} kept in fp32 ({bf16_why})")
    else:
        dtype = "float32"
        reasons.append(f"neither fits: fp16 does not and {bf16_why}")

    fp16_fp32 = list(fwd_mods)
    if c.device == "cpu":
        fp16_fp32 += [m for m in norm_mods if m not in fp16_fp32]
    if dtype == "float16":
        fp32_modules = fp16_fp32
        if c.device == "cpu" and norm_mods:
            reasons.append("CPU autocast(float16) leaves layer_norm/softmax/sum/pow in fp16 (CUDA runs them in fp32), "
                           "so the normalisation modules with findings are kept in fp32")
    elif dtype == "bfloat16":
        fp32_modules = []  # bf16 has fp32's range; module-level evidence never needs fp32 islands
    else:
        fp32_modules = []
    return DtypeChoice(
        dtype=dtype,
        reasons=reasons,
        fp32_modules=fp32_modules,
        fp16_fp32_modules=fp16_fp32,
        fp16_forward_ok=fwd_ok,
        fp16_grad_ok=grad_ok,
        bf16_fast=bf16_fast,
        forward_absmax=peak,
        forward_absmax_module=peak_mod,
    )
