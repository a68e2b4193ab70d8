"""What the views say about a Run, as pure functions: the format each tensor is judged in, the
colour class of a value, the most severe finding, and the "first / worst" wording of a finding.

The explorer (:mod:`mpscope.widgets.explorer`), the HTML report (:mod:`mpscope.report`) and the
summary all take their verdicts from here, so a red cell, a ranked table row and a quoted figure
mean the same thing everywhere. Nothing here imports altair or ipywidgets.

**Format a tensor is judged in** (:func:`judged_formats`): a fraction such as ``fp16_underflow_frac``
is an alarm only for a tensor that really lives in float16 or is cast to it; for any other tensor it
is context. The rules, per row of ``Run.tensors``:

* a float16 / bfloat16 tensor is judged in its own dtype;
* a float32 (or float64) gradient of a parameter (``param_grad``), optimizer state and the loss are
  judged in their own dtype: autocast never casts them (``param.grad`` has the parameter's dtype,
  ``torch.optim`` keeps its state in the parameter's dtype, and GradScaler unscales fp32 grads);
* a float32 activation, activation gradient, op output or weight is judged in the run's autocast
  dtype (the *target*): autocast casts fp32 inputs and weights of the ops it lowers, so these meet
  the target on their way — except the weights of a module whose recorded outputs are all fp32 (it
  ran no lowered op: an Embedding, a norm kept in fp32), and the root module's outputs and scalar
  (one-element) outputs, which are the model's result and the loss: autocast runs losses
  (``mse_loss``, ``cross_entropy``, ...) in float32 (``torch.amp`` autocast op reference, "CUDA Ops that can autocast to float32"), so the
  loss gradient (equal to the loss scale, 2^16 by default) is float32 and never overflows.

The target is the run's ``meta["autocast_dtype"]`` when it is float16 or bfloat16, else the dtype a
recommendation gives (``advice.dtype``), else float16 (the question the fp16 statistics answer).

**Colour classes** (:func:`magnitude_classes`, :func:`fraction_classes`): hard boundaries at the
format's limits, derived from :mod:`mpscope.formats` (``torch.finfo``) and the cast rounding rule
(round to nearest even): a value is *flushed* when it rounds to 0, *subnormal* when it rounds to a
non-zero value below the smallest normal, *overflow* when it rounds to inf; between them the normal
range is neutral and its top binade warm. A value's class is the index ``bisect_right(bounds, x)``,
the rule of d3's / Vega's threshold scale.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import pandas as pd

from mpscope.advisor.precision import PRECISION_LOSS_MARGIN_DB
from mpscope.formats import FORMATS, FP16, Format
from mpscope.run import run_format, str_values
from mpscope.schema import (
    GRAD_ROLES,
    LOW_PRECISION,
    SEVERITIES,
    fmt_scale,
    module_label,
)

__all__ = [
    "LOW_PRECISION",
    "ColourClass",
    "autocast_format",
    "compute_format",
    "target_format",
    "judged_formats",
    "row_risk",
    "risk_table",
    "magnitude_classes",
    "fraction_classes",
    "sqnr_classes",
    "classify",
    "class_labels",
    "statistic_format",
    "most_severe",
    "finding_statistic",
    "finding_figures",
    "figures_text",
    "grad_units",
    "module_label",
    "root_label",
    "fmt_scale",
    "shown_grad_role",
    "recorded_log2_scale",
    "judged_run",
    "n_ranks",
    "shown_rows_text",
    "ranks_text",
    "nonfinite_by_rank",
    "first_nonfinite_rank",
]

#: Roles that autocast never casts: judged in their own dtype.
_OWN_DTYPE_ROLES = ("param_grad", "optimizer_state", "loss")
#: Roles whose fp32 values meet the autocast dtype (inputs / weights of lowered ops, their gradients).
_CAST_ROLES = ("activation", "activation_grad", "op_output", "weight")
#: An alias of :func:`mpscope.schema.module_label`, for code that imports it from here.
root_label = module_label


# ----------------------------------------------------------------------------- judged format
def autocast_format(run) -> str | None:
    """The run's autocast dtype (``meta["autocast_dtype"]``) when it is float16 or bfloat16, else None."""
    meta = getattr(run, "meta", None) or {}
    amp = str(meta.get("autocast_dtype") or "").removeprefix("torch.")
    return amp if amp in LOW_PRECISION else None


def compute_format(run, advice=None) -> str | None:
    """The 16-bit format the run computes in, for the limits a view draws
    (:func:`mpscope.run.run_format`), else the 16-bit dtype the advisor found it ran in
    (``advice.evidence["run_dtype"]``), else None (a float32 run)."""
    fmt = run_format(run)
    if fmt is not None:
        return fmt
    evidence = getattr(advice, "evidence", None) or {}
    ran = str(evidence.get("run_dtype") or "").removeprefix("torch.")
    return ran if ran in LOW_PRECISION else None


def target_format(run, advice=None) -> str:
    """The 16-bit format the run's float32 activations meet: its autocast dtype (float16 or
    bfloat16), else ``advice.dtype`` when that is 16-bit, else ``"float16"``."""
    amp = autocast_format(run)
    if amp is not None:
        return amp
    rec = str(getattr(advice, "dtype", "") or "")
    return rec if rec in LOW_PRECISION else "float16"


def judged_formats(tensors: pd.DataFrame, target: str = "float16") -> np.ndarray:
    """The format each row of ``tensors`` is judged in (array of dtype names, one per row), by the
    rules of this module's docstring.

    Args:
        tensors: ``run.tensors`` (needs ``module``, ``role``, ``dtype``, ``numel``).
        target: the 16-bit format float32 activations meet (:func:`target_format`).
    """
    if target not in FORMATS:
        raise ValueError(f"target must be one of {sorted(FORMATS)}; got {target!r}")
    dtype = str_values(tensors["dtype"]).to_numpy()
    role = str_values(tensors["role"]).to_numpy()
    module = str_values(tensors["module"]).to_numpy()
    numel = tensors["numel"].to_numpy()
    wide = ~np.isin(dtype, LOW_PRECISION)
    leaves_model = (module == "") | (numel == 1)  # the model's result and the loss stay fp32
    cast = wide & np.isin(role, _CAST_ROLES) & ~(leaves_model & (role != "weight"))
    # a weight meets the autocast dtype only in a module that ran a lowered op: one whose outputs
    # were recorded in a 16-bit dtype (an Embedding or a LayerNorm kept in fp32 never casts its own)
    is_weight = role == "weight"
    if is_weight.any():
        act = (role == "activation")
        ran_fp32 = set(module[act & wide]) - set(module[act & ~wide])
        cast &= ~(is_weight & np.isin(module, list(ran_fp32)))
    out = dtype.astype(object)
    out[cast] = target
    return out


def row_risk(tensors: pd.DataFrame, formats: np.ndarray) -> pd.DataFrame:
    """Per row, the fractions that matter in the row's judged format.

    Returns a frame aligned with ``tensors`` (same index): ``format`` (judged format), ``overflow``,
    ``underflow`` (flushed to 0), ``subnormal`` (fractions over ``numel`` in that format: the
    ``fp16_*`` / ``bf16_*`` columns, zero overflow and underflow for float32, whose own
    ``subnormal_frac`` is used), ``nonfinite`` (NaN + inf count) and ``headroom`` (binades between
    ``absmax`` and the format's max; negative beyond it).
    """
    n = len(tensors)
    over, under, sub = np.zeros(n), np.zeros(n), np.zeros(n)
    for name, prefix in (("float16", "fp16"), ("bfloat16", "bf16")):
        m = formats == name
        if m.any():
            for arr, col in ((over, f"{prefix}_overflow_frac"), (under, f"{prefix}_underflow_frac"),
                             (sub, f"{prefix}_subnormal_frac")):
                if col in tensors:
                    arr[m] = tensors[col].to_numpy(dtype=np.float64)[m]
    wide = ~np.isin(formats, LOW_PRECISION)
    if wide.any() and "subnormal_frac" in tensors:
        sub[wide] = tensors["subnormal_frac"].to_numpy(dtype=np.float64)[wide]
    fmax = np.array([FORMATS[f].max for f in formats], dtype=np.float64) if n else np.zeros(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        headroom = np.log2(fmax / tensors["absmax"].to_numpy(dtype=np.float64))
    return pd.DataFrame({
        "format": formats, "overflow": np.nan_to_num(over), "underflow": np.nan_to_num(under),
        "subnormal": np.nan_to_num(sub),
        "nonfinite": tensors["nan_count"].to_numpy(dtype=np.float64) + tensors["inf_count"].to_numpy(dtype=np.float64),
        "headroom": headroom,
    }, index=tensors.index)


def risk_table(tensors: pd.DataFrame, target: str = "float16", n: int | None = None,
               skipped_steps=()) -> pd.DataFrame:
    """One row per (module, role), ranked by the risk in each tensor's judged format, worst first.

    Ranking: any non-finite element, then the largest overflow fraction, then the largest flushed
    fraction, then the largest subnormal fraction, then the smallest headroom. Each figure is the
    worst over the run, with the step where it occurred. Non-finite gradients (activation_grad,
    param_grad) in ``skipped_steps`` (steps the GradScaler skipped: it found them and did not step)
    are counted apart, in ``nonfinite_skipped``, and do not rank.

    Returns columns ``module, role, dtype`` (the dtypes seen), ``format`` (judged in; several joined
    by ", "), ``absmax``, ``absmax_step``, ``overflow``, ``overflow_step``, ``underflow``,
    ``underflow_step``, ``subnormal``, ``subnormal_step``, ``nonfinite`` (elements, summed),
    ``alarm`` (bool: something is lost in the judged format), ``fp16_overflow``, ``fp16_underflow``,
    ``fp16_subnormal`` (the recorded fp16 fractions, worst over the run) and ``fp16_context`` (True
    when no tensor of the row is judged in float16: those three are context, not alarms).
    """
    cols = ["module", "role", "dtype", "format", "absmax", "absmax_step", "overflow", "overflow_step",
            "underflow", "underflow_step", "subnormal", "subnormal_step", "nonfinite", "nonfinite_skipped", "alarm",
            "fp16_overflow", "fp16_underflow", "fp16_subnormal", "fp16_context"]
    if tensors.empty:
        return pd.DataFrame(columns=cols)
    formats = judged_formats(tensors, target)
    risk = row_risk(tensors, formats)
    t = pd.DataFrame({
        "module": str_values(tensors["module"]).to_numpy(), "role": str_values(tensors["role"]).to_numpy(),
        "dtype": str_values(tensors["dtype"]).to_numpy(), "step": tensors["step"].to_numpy(),
        "absmax": tensors["absmax"].to_numpy(dtype=np.float64),
        "fp16_overflow": tensors["fp16_overflow_frac"].to_numpy(dtype=np.float64),
        "fp16_underflow": tensors["fp16_underflow_frac"].to_numpy(dtype=np.float64),
        "fp16_subnormal": tensors["fp16_subnormal_frac"].to_numpy(dtype=np.float64),
        "in_fp16": formats == "float16",
    })
    for c in ("format", "overflow", "underflow", "subnormal", "nonfinite", "headroom"):
        t[c] = risk[c].to_numpy()
    handled = np.isin(t["role"], ("activation_grad", "param_grad")) & np.isin(t["step"], list(skipped_steps))
    t["nonfinite_skipped"] = np.where(handled, t["nonfinite"], 0.0)
    t.loc[handled, ["nonfinite", "overflow"]] = 0.0
    g = t.groupby(["module", "role"], sort=False)
    out = g.agg(nonfinite=("nonfinite", "sum"), nonfinite_skipped=("nonfinite_skipped", "sum"),
                headroom=("headroom", "min"),
                fp16_overflow=("fp16_overflow", "max"), fp16_underflow=("fp16_underflow", "max"),
                fp16_subnormal=("fp16_subnormal", "max"), in_fp16=("in_fp16", "any"))
    for c in ("dtype", "format"):  # the distinct values, sorted and joined (from the distinct rows only)
        distinct = t[["module", "role", c]].drop_duplicates()
        out[c] = distinct.groupby(["module", "role"], sort=False)[c].agg(lambda s: ", ".join(sorted(set(s))))
    for c in ("absmax", "overflow", "underflow", "subnormal"):
        best = t.loc[t[c].fillna(-np.inf).groupby([t["module"], t["role"]], sort=False).idxmax()]
        best = best.set_index(["module", "role"])
        out[c] = best[c]
        out[f"{c}_step"] = best["step"].astype(int)
    out = out.reset_index()
    out["fp16_context"] = ~out["in_fp16"]
    out["alarm"] = (out["nonfinite"] > 0) | (out["overflow"] > 0) | (out["underflow"] > 0)
    out = out.sort_values(["nonfinite", "overflow", "underflow", "subnormal", "headroom"],
                          ascending=[False, False, False, False, True], na_position="last", kind="stable")
    out = out.reset_index(drop=True)[cols]
    return out if n is None else out.head(n)


# ----------------------------------------------------------------------------- colour classes
@dataclass(frozen=True)
class ColourClass:
    """One colour class of a heatmap: values ``lo <= x < next class's lo`` (the first class has
    ``lo = -inf``). ``key``: short identifier; ``label``: legend text naming the limit; ``colour``: CSS."""

    key: str
    label: str
    lo: float
    colour: str


#: Class of cells with no value (log2 of an all-zero tensor, or no finite element).
NO_VALUE = ColourClass("none", "no non-zero finite value", math.nan, "#ffffff")


def _short(x: float) -> str:
    k = math.log2(x)
    return f"2^{int(k)}" if k.is_integer() else f"{x:g}"


def magnitude_classes(fmt: Format | str = FP16) -> list[ColourClass]:
    """Colour classes of log2 |x| (the heatmap's ``log2_absmax``) for one format, in increasing order.

    ``flushed`` (rounds to 0: |x| <= min_subnormal / 2), ``subnormal`` (rounds below min_normal),
    ``normal`` (neutral), ``top binade`` (rounds to >= 2^max_exponent, warm), ``overflow`` (rounds
    to inf: |x| >= max + ulp(max) / 2). float16 boundaries: 2^-25 (inclusive below), 2^-14 - 2^-25,
    2^15 - 8, 65520.
    """
    f = FORMATS[fmt] if isinstance(fmt, str) else fmt
    short = "fp16" if f.name == "float16" else ("bf16" if f.name == "bfloat16" else f.name)
    flush = math.log2(f.underflow_threshold)
    return [
        ColourClass("flushed", f"flushed to 0 in {short} (|x| ≤ {_short(f.underflow_threshold)})", -math.inf, "#08306b"),
        # the tie at exactly min_subnormal / 2 rounds to 0, so the next class starts just above it
        ColourClass("subnormal", f"subnormal in {short} (< 2^{f.min_normal_exponent})",
                    float(np.nextafter(flush, np.inf)), "#6baed6"),
        ColourClass("normal", f"normal range of {short}", math.log2(f.normal_threshold), "#f7f7f7"),
        # values within half an ulp below 2^max_exponent round up into the top binade
        ColourClass("top", f"top binade (≥ 2^{f.max_exponent})",
                    math.log2(2.0 ** f.max_exponent - 2.0 ** (f.max_exponent - f.mantissa_bits - 2)), "#fdae61"),
        ColourClass("overflow", f"overflows {short} (≥ {f.overflow_threshold:g} → inf; max {f.max:g})"
                    if f.name == "float16" else f"overflows {short} (> max {f.max:.3g})",
                    math.log2(f.overflow_threshold), "#d7191c"),
    ]


def fraction_classes() -> list[ColourClass]:
    """Colour classes of a fraction in [0, 1]: exactly 0 (neutral), then below 0.1 %, 1 %, 10 %,
    50 % and the rest. 1 % flushed is where the advisor rules fp16 out; 10 % is its per-tensor
    gradient-underflow threshold."""
    return [
        ColourClass("zero", "0", -math.inf, "#f7f7f7"),
        ColourClass("lt0.1", "> 0 and < 0.1 %", 5e-324, "#fee5d9"),
        ColourClass("lt1", "0.1 % – 1 %", 1e-3, "#fcae91"),
        ColourClass("lt10", "1 % – 10 %", 1e-2, "#fb6a4a"),
        ColourClass("lt50", "10 % – 50 %", 1e-1, "#de2d26"),
        ColourClass("ge50", "≥ 50 %", 0.5, "#a50f15"),
    ]


def sqnr_classes(fmt: Format | str = FP16) -> list[ColourClass]:
    """Colour classes of an SQNR in dB against the float32 reference (``run.precision``), for the
    format the run computed in, in increasing order.

    ``ideal`` is the format's :attr:`~mpscope.formats.Format.ideal_sqnr_db` (20·log10(2) ≈ 6.02 dB
    per significand bit, the implicit bit included, bits from ``torch.finfo``: float16 66.2 dB,
    bfloat16 48.2 dB). Classes: ``loss`` (below ``ideal - PRECISION_LOSS_MARGIN_DB``, the
    ``precision_loss`` finding's threshold of :mod:`mpscope.advisor.precision`), ``below`` (below the
    ideal), ``ideal`` (at or above it: no more error than one ideal rounding), ``exact`` (+inf: the
    output equals the reference bit for bit).
    """
    f = FORMATS[fmt] if isinstance(fmt, str) else fmt
    ideal = f.ideal_sqnr_db
    floor = ideal - PRECISION_LOSS_MARGIN_DB
    return [
        ColourClass("loss", f"< {floor:.1f} dB (precision_loss threshold: ideal − {PRECISION_LOSS_MARGIN_DB:g} dB)",
                    -math.inf, "#a50f15"),
        ColourClass("below", f"{floor:.1f} – {ideal:.1f} dB (below {f.name}'s ideal)", floor, "#fcae91"),
        ColourClass("ideal", f"≥ {ideal:.1f} dB ({f.name}'s ideal: 6.02 dB × {f.mantissa_bits + 1} bits)",
                    ideal, "#f7f7f7"),
        ColourClass("exact", "exact (∞ dB)", math.inf, "#c7e9c0"),
    ]


def classify(values, classes: list[ColourClass]) -> np.ndarray:
    """The class key of each value (NaN: ``"none"``): index ``bisect_right(bounds, x)`` with
    ``bounds`` the classes' ``lo`` after the first, as d3's threshold scale does."""
    bounds = [c.lo for c in classes[1:]]
    v = np.asarray(values, dtype=np.float64).ravel()
    out = np.empty(v.shape, dtype=object)
    for i, x in enumerate(v):
        out[i] = NO_VALUE.key if math.isnan(x) else classes[bisect.bisect_right(bounds, x)].key
    return out


def class_labels(keys, classes: list[ColourClass]) -> np.ndarray:
    """Legend labels of class keys (``"none"`` -> :data:`NO_VALUE`'s label)."""
    by_key = {c.key: c.label for c in classes + [NO_VALUE]}
    return np.array([by_key[k] for k in keys], dtype=object)


def statistic_format(statistic: str, target: str) -> str | None:
    """The format a heatmap statistic is about: ``float16`` for ``fp16_*``, ``bfloat16`` for
    ``bf16_*``, the target for ``log2_absmax``; None for format-free statistics (zero fraction,
    non-finite fraction), which are never context. The SQNR statistics of the fp32 shadow
    (``sqnr_db``, ``own_sqnr_db``) are about the target: the format the run computed in."""
    if statistic.startswith("fp16_"):
        return "float16"
    if statistic.startswith("bf16_"):
        return "bfloat16"
    if statistic in ("log2_absmax", "sqnr_db", "own_sqnr_db"):
        return target
    return None


# ----------------------------------------------------------------------------- findings
def most_severe(findings) -> object | None:
    """The finding to open the explorer on: highest severity (error > warning > info), then the
    largest ``value / threshold``, then the earliest step; None without findings that name a module."""
    best, key = None, None
    for f in findings or []:
        if getattr(f, "module", None) is None:
            continue
        value, thr = getattr(f, "value", None), getattr(f, "threshold", None)
        try:
            ratio = float(value) / float(thr) if value is not None and thr else 0.0
        except (TypeError, ValueError, ZeroDivisionError):
            ratio = 0.0
        ratio = ratio if math.isfinite(ratio) else math.inf
        step = f.step if f.step is not None else math.inf
        k = ((SEVERITIES.index(f.severity) if f.severity in SEVERITIES else -1), ratio, -step)
        if key is None or k > key:
            best, key = f, k
    return best


#: The heatmap statistic that shows what a finding is about (others: log2 absmax).
FINDING_STATISTIC = {
    "grad_underflow": "fp16_below_normal_frac",
    "forward_overflow": "fp16_overflow_frac",
    "first_nonfinite": "nonfinite_frac",
    "stale_grad": "nonfinite_frac",
    "frozen_layer": "zero_frac",
    "precision_loss": "own_sqnr_db",
}


def finding_statistic(finding) -> str:
    """The heatmap statistic to open a finding on (:data:`FINDING_STATISTIC`, else ``log2_absmax``)."""
    return FINDING_STATISTIC.get(getattr(finding, "code", ""), "log2_absmax")


def _stat_for(code: str, fmt: str):
    """(statistic name, per-row value function, unit) of a finding code, or None."""
    p = "fp16" if fmt == "float16" else "bf16"
    if code in ("grad_underflow",):
        return (f"{fmt} subnormal or flushed fraction",
                lambda r: r[f"{p}_underflow_frac"] + r[f"{p}_subnormal_frac"], "frac")
    if code in ("forward_overflow",):
        return (f"{fmt} overflow or non-finite fraction",
                lambda r: r["fp16_overflow_frac"] + (r["nan_count"] + r["inf_count"]) / r["numel"], "frac")
    if code in ("activation_headroom",):
        return "absmax", lambda r: r["absmax"], "abs"
    if code in ("first_nonfinite", "stale_grad"):
        return "non-finite elements", lambda r: r["nan_count"] + r["inf_count"], "count"
    return None


def _fmt_value(v: float, unit: str) -> str:
    if unit == "frac":
        return f"{100 * v:.1f} %"
    if unit == "count":
        return f"{int(v):,}"
    return f"{v:.4g}"


def finding_figures(tensors: pd.DataFrame, finding, target: str = "float16") -> dict | None:
    """The first and the worst step of the statistic a finding is about, from ``run.tensors``.

    Uses the finding's module, role and name (all names of the module and role when ``name`` is
    None, summed per step for counts and fractions weighted by ``numel``). The first step is the
    finding's own ``step`` (where it first crossed its threshold); the worst is the step with the
    largest value (earliest on ties).

    Returns ``{"statistic", "first_step", "first", "worst_step", "worst", "unit", "scale"}`` (values
    as floats; ``unit`` ``"frac"`` | ``"abs"`` | ``"count"``; ``scale`` the loss scale of the worst
    step's rows, 1.0 for unscaled), or None for codes without a per-step statistic or no rows.
    """
    role = getattr(finding, "role", None)
    spec = _stat_for(getattr(finding, "code", ""), target)
    if spec is None or finding.module is None:
        return None
    label, fn, unit = spec
    t = tensors
    m = (str_values(t["module"]) == str(finding.module))
    if role is not None:
        m &= str_values(t["role"]) == str(role)
    if getattr(finding, "name", None) is not None:
        m &= str_values(t["name"]) == str(finding.name)
    rows = t[m.to_numpy()]
    if rows.empty:
        return None
    vals = fn(rows).astype(np.float64)
    if unit == "frac":  # numel-weighted over the names of a step
        w = rows["numel"].to_numpy(dtype=np.float64)
        per = pd.Series(vals.to_numpy() * w).groupby(rows["step"].to_numpy()).sum() / \
            pd.Series(w).groupby(rows["step"].to_numpy()).sum()
    elif unit == "count":
        per = pd.Series(vals.to_numpy()).groupby(rows["step"].to_numpy()).sum()
    else:
        per = pd.Series(vals.to_numpy()).groupby(rows["step"].to_numpy()).max()
    per = per.sort_index()
    first_step = int(finding.step) if finding.step is not None and finding.step in per.index else int(per.index[0])
    worst_step = int(per.idxmax()) if per.notna().any() else first_step
    scales = rows.loc[rows["step"] == worst_step, "loss_scale"] if "loss_scale" in rows else pd.Series([1.0])
    return {"statistic": label, "first_step": first_step, "first": float(per.loc[first_step]),
            "worst_step": worst_step, "worst": float(per.loc[worst_step]), "unit": unit,
            "scale": float(scales.iloc[0]) if len(scales) else 1.0}


def figures_text(fig: dict | None) -> str:
    """``"first at step 5: 17.3 %, worst at step 11: 38.3 % (float16 subnormal or flushed fraction,
    scaled ×2^16)"``; ``""`` for None."""
    if not fig:
        return ""
    first = _fmt_value(fig["first"], fig["unit"])
    worst = _fmt_value(fig["worst"], fig["unit"])
    units = f", scaled ×{fmt_scale(fig['scale'])}" if fig["scale"] not in (None, 1.0) else ""
    return (f"first at step {fig['first_step']}: {first}, worst at step {fig['worst_step']}: {worst} "
            f"({fig['statistic']}{units})")


def grad_units(tensors: pd.DataFrame, role: str) -> str:
    """How a role's recorded values relate to the loss scale: ``"scaled (× loss scale 2^16)"`` when
    every row carries one scale > 1, ``"scaled (× loss scale, 2^10 … 2^16)"`` for several,
    ``"unscaled"`` when all rows have scale 1 (after GradScaler.unscale_, or no scaler), ``""`` for
    roles that are not gradients."""
    if role not in ("activation_grad", "param_grad") or "loss_scale" not in tensors:
        return ""
    s = tensors.loc[str_values(tensors["role"]) == role, "loss_scale"].to_numpy(dtype=np.float64)
    s = s[np.isfinite(s)]
    if s.size == 0:
        return ""
    lo, hi = float(s.min()), float(s.max())
    if hi == 1.0 and lo == 1.0:
        return "unscaled"
    if lo == hi:
        return f"scaled (× loss scale {fmt_scale(lo)})"
    return f"scaled (× loss scale, {fmt_scale(lo)} … {fmt_scale(hi)})"


def shown_grad_role(roles: Iterable[str], current: str | None = None) -> str:
    """The gradient role a what-if shows: ``current`` when it is a gradient role, else
    ``activation_grad``, or ``param_grad`` when only parameter gradients were recorded."""
    if current in GRAD_ROLES:
        return current
    roles = set(roles)
    return "activation_grad" if "activation_grad" in roles or "param_grad" not in roles else "param_grad"


def recorded_log2_scale(run, role: str) -> int | None:
    """log2 of the loss scale a gradient role's first recorded row carries (0 for unscaled rows),
    else of the run's first loss scale; None when neither exists."""
    t = run.tensors
    if "loss_scale" in t:
        s = t.loc[str_values(t["role"]) == role, "loss_scale"].to_numpy(dtype=np.float64)
        s = s[np.isfinite(s) & (s > 0)]
        if s.size:
            return int(round(math.log2(float(s[0]))))
    steps = getattr(run, "steps", None)
    if steps is not None and len(steps) and "loss_scale" in steps:
        s = steps["loss_scale"].to_numpy(dtype=np.float64)
        s = s[np.isfinite(s) & (s > 0)]
        if s.size:
            return int(round(math.log2(float(s[0]))))
    return None


@dataclass(frozen=True)
class _RunView:
    """A read-only Run look-alike holding a subset of a Run's histograms (for the what-if)."""

    tensors: pd.DataFrame
    steps: pd.DataFrame
    histograms: pd.DataFrame
    meta: dict


def judged_run(run, role: str, fmt: str = "float16", target: str = "float16"):
    """(run view, hypothetical): ``run`` with its histograms of ``role`` restricted to the tensors
    judged in ``fmt`` (:func:`judged_formats`), for a what-if about ``fmt``; when no tensor of the
    role is judged in ``fmt``, the run itself and ``True`` (the what-if is then hypothetical)."""
    t, h = run.tensors, run.histograms
    rows = t[str_values(t["role"]) == role]
    if rows.empty or h is None or h.empty:
        return run, False
    judged = judged_formats(rows, target) == fmt
    if not judged.any():
        return run, True
    if judged.all():
        return run, False
    keys = ["module", "role", "name"] + (["dtype"] if "dtype" in h.columns else [])
    ok = set(zip(*(str_values(rows[k]).to_numpy()[judged] for k in keys)))
    # each distinct (module, role, name, dtype) of the histograms once, by its factorized codes
    codes, uniques = zip(*(pd.factorize(h[k], use_na_sentinel=False) for k in keys))
    combo = np.ravel_multi_index(codes, [max(1, len(u)) for u in uniques])
    distinct, inverse = np.unique(combo, return_inverse=True)
    parts = np.unravel_index(distinct, [max(1, len(u)) for u in uniques])
    keyed = zip(*(np.asarray(u, dtype=object)[p] for u, p in zip(uniques, parts)))
    keep = np.array([str(key[1]) != role or tuple(map(str, key)) in ok for key in keyed], dtype=bool)[inverse]
    return _RunView(t, run.steps, h[keep], dict(run.meta or {})), False


# ----------------------------------------------------------------------------- ranks
def n_ranks(n: int) -> str:
    """``"1 rank"``, ``"2 ranks"``."""
    return f"{int(n)} rank{'' if int(n) == 1 else 's'}"


def shown_rows_text(n: int, rank: int | None = None) -> str:
    """What rows of an ``n``-rank run a view shows: rank ``rank``'s own (``"showing rank 1's own
    rows"``), else the merged rows: ``"showing the rows of its one rank"`` (n = 1; nothing was merged),
    ``"showing the rows merged over both ranks"`` (n = 2), ``"showing the rows merged over all 4 ranks"``."""
    if rank is not None:
        return f"showing rank {rank}'s own rows"
    if n <= 1:
        return "showing the rows of its one rank"
    return "showing the rows merged over " + ("both ranks" if n == 2 else f"all {n} ranks")


def ranks_text(run) -> str:
    """What rows a run of a multi-rank job holds, for a view's title: ``"merged over 2 ranks (0, 1)"``,
    ``"rank 1's own rows (of 2 ranks)"``; ``""`` for a single-process run."""
    meta = dict(getattr(run, "meta", None) or {})
    ranks = [int(r) for r in meta.get("ranks", [])]
    dist = meta.get("distributed") or {}
    if len(ranks) > 1:
        return f"merged over {len(ranks)} ranks ({', '.join(map(str, ranks))})"
    if dist and len(ranks) == 1:
        world = dist.get("world_size")
        return f"rank {ranks[0]}'s own rows" + (f" (of {n_ranks(world)})" if world else "")
    return ""


def nonfinite_by_rank(run) -> pd.DataFrame:
    """``run.tables["nonfinite_ranks"]`` of a merged multi-rank Run in the order NaN / inf appeared:
    by step, then in the order the rows were recorded (execution order within a step). Columns
    ``step, module, role, name, dtype, first_rank`` (the lowest rank that saw NaN / inf in that
    tensor at that step) and ``ranks`` (how many ranks saw it). Empty for other runs."""
    nf = (getattr(run, "tables", None) or {}).get("nonfinite_ranks")
    cols = ["step", "module", "role", "name", "dtype", "first_rank", "ranks"]
    if nf is None or nf.empty:
        return pd.DataFrame({c: [] for c in cols})
    return nf[cols].sort_values("step", kind="stable").reset_index(drop=True)


def first_nonfinite_rank(run, advice=None) -> dict | None:
    """Where NaN / inf first appeared in a merged multi-rank Run: ``{"rank", "step", "module",
    "role", "ranks"}`` (``ranks``: how many ranks saw it there), from the advisor's
    ``first_nonfinite`` finding when it names a rank (it picks the first tensor in execution order),
    else from the first row of :func:`nonfinite_by_rank`; None when no rank saw a non-finite value."""
    nf = nonfinite_by_rank(run)
    if nf.empty:
        return None
    for f in getattr(advice, "findings", None) or []:
        if f.code == "first_nonfinite" and getattr(f, "rank", None) is not None:
            hit = nf[(nf.step == f.step) & (nf.module.astype(str) == str(f.module)) & (nf.role.astype(str) == f.role)]
            return {"rank": int(f.rank), "step": int(f.step), "module": str(f.module), "role": str(f.role),
                    "ranks": int(hit.ranks.max()) if len(hit) else None}
    r = nf.iloc[0]
    return {"rank": int(r.first_rank), "step": int(r.step), "module": str(r.module), "role": str(r.role),
            "ranks": int(r.ranks)}
