"""Op-level findings about precision and poles, from ``run.tables["op_facts"]`` (``record(ops=True)``).

* ``lost_constant`` (error): a Python constant of an op that its float16/bfloat16 dtype cannot hold and
  that rounds onto the value it guards against: ``1 - 1e-6`` -> 1.0 (a clamp bound), or an eps that
  rounds to 0 outside a normalisation (``x / (y + 1e-8)``).
* ``pole`` (error): inf/NaN that an op with a pole (log, log1p, division, reciprocal, rsqrt, atanh)
  created from finite inputs because some input sat exactly at the pole: not an overflow.
* ``float_precision`` (warning): non-integer values whose spacing (ulp) at their magnitude is too
  coarse for the periodic function they feed: a low-precision cast of a vector of timesteps /
  positions / angles that reaches a sin/cos, or a sin/cos whose argument is itself float16/bfloat16.

Thresholds: :data:`mpscope.recording.autocast_policy.PERIODIC_ULP` (2^-3 rad), format limits from :mod:`mpscope.formats`.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from mpscope.advisor.finding import Finding
from mpscope.formats import FORMATS
from mpscope.recording.autocast_policy import LOGS, NORM_TAIL, PERIODIC_ULP, POLES
from mpscope.schema import fmt_number

#: Ops whose Python constant is a guard (an added eps, a clamp bound): a guard that rounds onto the
#: value it guards against is a lost constant.
GUARD_OPS = {"add", "add_", "sub", "sub_", "rsub", "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max",
             "clamp_max_", "maximum", "minimum", "where", "masked_fill", "masked_fill_", "div", "div_"}
_POLE_TEXT = {"log1p": "log1p(-1) = -inf", "div": "x / 0 = inf (0 / 0 = NaN)", "reciprocal": "1 / 0 = inf",
              "rsqrt": "rsqrt(0) = inf", "atanh": "atanh(+-1) = inf", "log": "log(0) = -inf"}


def _packet(op: str) -> str:
    return op.split(".")[1] if "." in op else op


def _round_to(x: float, dtype: str) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(getattr(torch, dtype)))


def lost_in(value: float, dtype: str) -> float | None:
    """The boundary (0, 1 or -1) that ``value`` rounds onto in ``dtype`` when it is not that value
    itself, else None (oracle: ``torch.tensor(value).to(dtype)``)."""
    r = _round_to(value, dtype)
    return r if r in (0.0, 1.0, -1.0) and r != value else None


def _facts(run: Any) -> pd.DataFrame | None:
    tables = getattr(run, "tables", None) or {}
    f = tables.get("op_facts")
    if f is None or f.empty:
        return None
    f = f.sort_values(["step", "seq"], kind="stable").copy()
    for c in ("in_pole", "cast_err", "scalar_rounded", "periodic_src"):
        if c not in f.columns:
            f[c] = math.nan
    f["packet"] = f.op.map(_packet)
    return f


def _norm_eps_rows(f: pd.DataFrame) -> set:
    """(step, module) pairs where a constant rounded to 0 inside a normalisation (norm_statistics)."""

    fwd = f[f.phase == "forward"]
    normalising = fwd[fwd.packet.isin(NORM_TAIL)]
    norm = set(zip(normalising.step, normalising.module))
    lost = f[f.scalar_lost.notna()]
    return {(s, m) for s, m in zip(lost.step, lost.module) if (s, m) in norm}


def _guard_constants(f: pd.DataFrame) -> pd.DataFrame:
    """Rows whose constant rounded onto a boundary: +-1 anywhere, 0 in a guard op outside norms."""
    norm_eps = _norm_eps_rows(f)
    rounded = f.scalar_rounded.notna()
    lost0 = f.scalar_lost.notna() & f.packet.isin(GUARD_OPS) & \
        ~pd.Series([(s, m) in norm_eps for s, m in zip(f.step, f.module)], index=f.index, dtype=bool)
    return f[(rounded | lost0) & (f.phase == "forward")]


def _poles(f: pd.DataFrame) -> pd.DataFrame:

    fwd = f[(f.phase == "forward") & f.packet.isin(POLES)]
    created = ((fwd.out_inf + fwd.out_nan) > 0) & (fwd.in_inf == 0) & (fwd.in_nan == 0) & (fwd.in_pole.fillna(1) > 0)
    rows = fwd[created]
    # log of an underflowed probability is log_of_zero; a norm epsilon lost is norm_statistics
    norm_eps = _norm_eps_rows(f)
    keep = [not ((p in LOGS and z > 0) or (s, m) in norm_eps)
            for p, z, s, m in zip(rows.packet, rows.in_zero.fillna(0), rows.step, rows.module)]
    return rows[pd.Series(keep, index=rows.index, dtype=bool)]


def lost_constant_and_pole(run: Any) -> list[Finding]:
    """``lost_constant`` and ``pole`` findings (see the module docstring), one per (module, op)."""
    f = _facts(run)
    if f is None:
        return []
    out: list[tuple[int, int, Finding]] = []
    consts = _guard_constants(f)
    poles = _poles(f)
    seen: set = set()
    for r in consts.itertuples(index=False):
        key = ("c", r.module, r.op)
        if key in seen:
            continue
        seen.add(key)
        value = r.scalar_rounded if not math.isnan(r.scalar_rounded) else r.scalar_lost
        fmt = FORMATS[r.out_dtype]
        onto = lost_in(float(value), r.out_dtype)
        onto = 0.0 if onto is None else onto
        other = "bfloat16" if r.out_dtype == "float16" else "float16"
        also = lost_in(float(value), other) is not None
        later = poles[(poles.step == r.step) & (poles.module == r.module) & (poles.seq > r.seq)]
        then = ""
        if len(later):
            p = later.iloc[0]
            then = (f" Then {p['name']} hit its pole ({_POLE_TEXT.get(p.packet.rstrip('_'), 'a pole')}) in "
                    f"{int(p.in_pole) if not math.isnan(p.in_pole) else int(p.out_inf + p.out_nan)} elements.")
        spacing = fmt.eps / 2 if onto in (1.0, -1.0) else fmt.min_subnormal
        msg = (f"The constant {value:.10g} in {r.name} ('{r.module}') is {onto:g} in {r.out_dtype} (its spacing there "
               f"is {fmt_number(spacing)}): the guard rounds onto the very value it should keep the data away from."
               f"{then} In {other} it is {'also ' + format(lost_in(float(value), other), 'g') if also else 'kept'}"
               f"{', so bfloat16 does not help either.' if also and other == 'bfloat16' else '.'}")
        fix = (f"Keep module '{r.module}' in float32 (fp32_modules), or use a constant {r.out_dtype} holds (for 1 - eps "
               f"at least eps = {fmt_number(fmt.eps / 2)}), or a stable form that needs no guard (F.logsigmoid(-x) for "
               "log(1 - sigmoid(x)), F.binary_cross_entropy_with_logits).")
        out.append((int(r.step), int(r.seq), Finding(  # (an error where it then reached a pole; a risk until then)
            "lost_constant", "error" if len(later) else "warning", str(r.module), "op_output", str(r.name),
            int(r.step), float(value),
            float(onto), msg, fix)))
    for r in poles.itertuples(index=False):
        key = ("p", r.module, r.op)
        if key in seen:
            continue
        seen.add(key)
        cause = consts[(consts.step == r.step) & (consts.module == r.module) & (consts.seq < r.seq)]
        why = ""
        if len(cause):
            c = cause.iloc[-1]
            v = c.scalar_rounded if not math.isnan(c.scalar_rounded) else c.scalar_lost
            why = f" Its input reached the pole because the constant {v:.10g} of {c['name']} rounded onto it (lost_constant)."
        n_at = int(r.in_pole) if not math.isnan(r.in_pole) else None
        what = " and ".join(x for x in (f"{int(r.out_inf)} inf" if r.out_inf else "",
                                        f"{int(r.out_nan)} NaN" if r.out_nan else "") if x)
        msg = (f"{r.name} in '{r.module}' ({r.out_dtype}) returned {what} from finite inputs"
               + (f": {n_at} input element(s) sat exactly at its pole ({_POLE_TEXT.get(r.packet.rstrip('_'), 'a pole')})"
                  if n_at else "")
               + ". This is a pole, not an overflow: no value exceeded the format's maximum, so neither a loss scale "
               f"nor bfloat16's wider range removes it; its gradient is inf/NaN as well.{why}")
        fix = (f"Keep the data away from the pole in a precision that holds the guard: keep module '{r.module}' in "
               "float32 (fp32_modules), or use a stable fused form (F.logsigmoid, F.log_softmax, torch.xlogy, "
               "F.binary_cross_entropy_with_logits) instead of log/log1p/division of a saturated value.")
        out.append((int(r.step), int(r.seq), Finding(
            "pole", "error", str(r.module), "op_output", str(r.name), int(r.step),
            float(n_at if n_at is not None else r.out_inf + r.out_nan), 0.0, msg, fix)))
    out.sort(key=lambda x: (x[0], x[1]))
    return [x[2] for x in out]


def float_precision(run: Any) -> list[Finding]:
    """``float_precision`` findings: (a) at a low-precision cast of a vector of non-integer data whose
    values reach a sin/cos/tan (``periodic_src``), when the format's spacing at the data's largest
    magnitude is at least :data:`~mpscope.recording.autocast_policy.PERIODIC_ULP` or distinct values collided; (b) at a
    sin/cos/tan whose own argument is float16/bfloat16 with that spacing at its largest magnitude.
    value = the spacing (ulp), threshold = PERIODIC_ULP."""

    f = _facts(run)
    if f is None:
        return []
    out: list[tuple[int, int, Finding]] = []
    seen: set = set()
    fwd = f[f.phase == "forward"]
    for r in fwd[fwd.periodic_src.notna()].itertuples(index=False):
        src = fwd[(fwd.step == r.step) & (fwd.seq == int(r.periodic_src))]
        if src.empty:
            continue
        c = src.iloc[0]
        if c.out_dtype not in FORMATS or not c.in_absmax > 0:
            continue
        fmt = FORMATS[c.out_dtype]
        ulp = math.ldexp(1.0, math.floor(math.log2(c.in_absmax)) - fmt.mantissa_bits)
        collided = not math.isnan(c.distinct_out) and not math.isnan(c.distinct_in) and c.distinct_out < c.distinct_in
        if not (ulp >= PERIODIC_ULP or collided) or ("cast", c.module, c.op) in seen:
            continue
        seen.add(("cast", c.module, c.op))
        distinct = (f" {int(c.distinct_in)} distinct values became {int(c.distinct_out)};" if collided else "")
        moved = f" values moved by up to {fmt_number(float(c.cast_err))};" if not math.isnan(c.cast_err) else ""
        msg = (f"{c['name']} in '{c.module}' rounded {int(c.numel)} non-integer values up to {fmt_number(float(c.in_absmax))} "
               f"to {c.out_dtype}, whose spacing at that magnitude is {fmt_number(ulp)}:{distinct}{moved} they feed "
               f"{r.name} in '{r.module}', a periodic function, whose phase shifts by as much as the values moved "
               "times the frequency (timestep / positional / rotary embeddings).")
        fix = ("Keep this computation in float32: pass timesteps / positions as float32 and build the sin/cos "
               "embedding under torch.autocast(enabled=False), casting only its output.")
        out.append((int(c.step), int(c.seq), Finding(
            "float_precision", "warning", str(c.module), "op_output", str(c["name"]), int(c.step), ulp,
            PERIODIC_ULP, msg, fix)))
    direct = fwd[fwd.packet.isin({"sin", "cos", "tan", "sin_", "cos_", "tan_"}) & fwd.in_absmax0.notna()
                 & fwd.out_dtype.isin(["float16", "bfloat16"])]
    for r in direct.itertuples(index=False):
        fmt = FORMATS[r.out_dtype]
        if not r.in_absmax0 > 0:
            continue
        ulp = math.ldexp(1.0, math.floor(math.log2(r.in_absmax0)) - fmt.mantissa_bits)
        if ulp < PERIODIC_ULP or ("sin", r.module, r.op) in seen:
            continue
        seen.add(("sin", r.module, r.op))
        msg = (f"{r.name} in '{r.module}' takes arguments held in {r.out_dtype} up to {fmt_number(float(r.in_absmax0))} rad; "
               f"the spacing of {r.out_dtype} there is {fmt_number(ulp)} rad (>= {fmt_number(PERIODIC_ULP)}), so neighbouring "
               "angles collapse and the phase is off by up to half of that: rotary / positional angles lose "
               "their meaning at large positions.")
        fix = ("Compute the angles (positions · inv_freq) and their sin/cos in float32 with autocast disabled "
               "(as Hugging Face's rotary embeddings do), and cast only the resulting cos/sin.")
        out.append((int(r.step), int(r.seq), Finding(
            "float_precision", "warning", str(r.module), "op_output", str(r.name), int(r.step), ulp,
            PERIODIC_ULP, msg, fix)))
    out.sort(key=lambda x: (x[0], x[1]))
    return [x[2] for x in out]


def op_precision_findings(run: Any) -> list[Finding]:
    """lost_constant, pole and float_precision findings of a run recorded with ``ops=True``."""
    return lost_constant_and_pole(run) + float_precision(run)


def pole_only_steps(run: Any) -> set:
    """Steps whose first forward inf/NaN were all created by poles (or lost constants), none by an
    overflow: module-level inf on those steps is a consequence of a pole, not a range overflow."""

    f = _facts(run)
    if f is None:
        return set()
    fwd = f[f.phase == "forward"]
    created = fwd[((fwd.out_inf + fwd.out_nan) > 0) & (fwd.in_inf == 0) & (fwd.in_nan == 0)]
    out = set()
    for step, g in created.groupby("step"):
        if g.packet.isin(POLES).all():
            out.add(int(step))
    return out
