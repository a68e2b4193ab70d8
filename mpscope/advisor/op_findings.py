"""Findings from the op recorder's tables (``record(model, ..., ops=True)``).

``reduction_precision`` (a reduction that ran in float16/bfloat16 where the target device's autocast
would not keep it there), ``mask_overflow``, ``integer_precision``, ``log_of_zero``, ``norm_statistics``
for an epsilon lost inside a norm, and op-granularity ``forward_overflow`` / ``first_nonfinite``. The
rules read ``run.tables["op_facts"]`` and ``run.tables["ops"]`` (columns in :mod:`mpscope.schema`)
and the autocast op lists of :mod:`mpscope.recording.autocast_policy`.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from mpscope.advisor.context import Context
from mpscope.advisor.finding import Finding
from mpscope.advisor.findings import first_nonfinite
from mpscope.formats import FORMATS
from mpscope.recording.autocast_policy import (
    CASTS,
    CPU_FP32_OPS,
    CUDA_FP32_OPS,
    LOGS,
    MASKING,
    MATMULS,
    NORM_TAIL,
    POLES,
    REDUCTIONS,
    SUMMING,
    may_overflow,
)
from mpscope.schema import fmt_number

_NOT_OVERFLOW = {"pow"} | set(POLES)  # inf from a finite input by a pole (1/0, log 0), not by exceeding the range


def _target_device(run, target_device):
    if target_device:
        return target_device
    meta = run.meta or {}
    return meta.get("autocast_device_type") or str(meta.get("device") or "cpu").split(":")[0]


def _estimate(row) -> float:
    """Largest magnitude the op's exact result could have had (from its inputs' max |x|)."""
    p = row.op.split(".")[1]
    a, b, s = row.in_absmax0, row.in_absmax1, row.scalar
    if p.startswith("pow") and not math.isnan(s):
        return a ** s
    if p.startswith("mul") or p in ("square",):
        if p == "square":
            return a * a
        return a * (b if not math.isnan(b) else abs(s) if not math.isnan(s) else 1.0)
    if p in ("add", "add_", "sub", "sub_", "rsub"):
        return a + (b if not math.isnan(b) else abs(s) if not math.isnan(s) else 0.0)
    if p in CASTS:
        return row.in_absmax
    return a


def op_findings(run, target_device: str | None = None) -> list:
    """Findings from the op-level rows of a run recorded with ``record(model, ..., ops=True)``.

    Args:
        run: a :class:`mpscope.Run` with ``run.tables["op_facts"]`` and ``run.tables["ops"]``
            (written by :class:`OpRecorder`); a run without them gives ``[]``.
        target_device: ``"cpu"`` or ``"cuda"``: whose autocast policy reductions are judged against.
            Default: ``run.meta["autocast_device_type"]``, else the recorded device's type.

    Returns:
        ``list[mpscope.advisor.Finding]`` in execution order (step, then call order), role
        ``"op_output"``, ``name`` the op row's name (``aten.add.Tensor#0``). Rules (``fmt`` = the
        op's output format from :mod:`mpscope.formats`, i.e. ``torch.finfo``):

        * ``first_nonfinite`` (error): the first forward op whose output holds inf/NaN that its
          inputs did not (inf from finite inputs, or NaN from NaN-free inputs), unless the advisor's
          own ``first_nonfinite`` already names the same op (it walks all rows; this rule skips ops
          fed an intentional ``-inf`` mask). value = non-finite elements, threshold 0.
        * ``mask_overflow`` (error): a finite constant became inf: a Python scalar at or above
          ``fmt.overflow_threshold`` (``masked_fill(m, -1e10)``, ``where(m, x, -1e10)``), an
          add/sub/where/masked_fill with an input of ``|x| >= fmt.max / 2`` (a ``finfo.min`` mask)
          whose output overflowed, or a cast of a value ``>= 256 * fmt.max``. value = the constant,
          threshold = ``fmt.max``.
        * ``forward_overflow`` (error): any other forward op whose finite inputs gave inf (the residual
          add, ``x * x`` inside a norm). value = the largest magnitude the exact result could have
          (from the inputs' max |x|: a·b for mul, a^p for pow, a+b for add), threshold ``fmt.max``.
        * ``reduction_precision`` (warning): (a) a summing reduction (sum, cumsum, the matmul family)
          overflowed in forward, value = reduction length K, threshold = ``floor(fmt.max / term)``;
          (b) a forward summing reduction whose bound ``K * max|a| * max|b|`` reaches ``fmt.max``,
          value = the bound (backward gradients are the GradScaler's to catch);
          (c) a reduction in :data:`REDUCTIONS` (not a matmul) whose forward output was
          float16/bfloat16, unless autocast was on and the target device's autocast runs that op in
          float32 (:data:`CUDA_FP32_OPS`, :data:`CPU_FP32_OPS`); one finding per op, value = the
          longest reduction, threshold NaN.
        * ``integer_precision`` (warning): a cast to float16/bfloat16 of integer values with
          ``max |x| > 2 / fmt.eps`` (2048 for float16, 256 for bfloat16: above it not every integer is
          representable) that changed some of them. value = max |x|, threshold = 2 / eps.
        * ``log_of_zero`` (error): a log whose input held exact zeros (an underflowed softmax /
          probability). value = fraction of zeros in the input, threshold 0.
        * ``norm_statistics`` (warning): a non-zero Python constant that rounds to 0 in the op's
          float16/bfloat16 dtype (``|c| <= fmt.min_subnormal / 2``) inside a module that also
          normalises (rsqrt / sqrt / reciprocal / div): a norm epsilon lost. value = the constant,
          threshold = ``fmt.min_subnormal`` (2^-24 for float16).
    """
    facts = run.tables.get("op_facts")
    table = run.tables.get("ops")
    if facts is None or table is None:
        return []
    target = _target_device(run, target_device)
    found: list[tuple] = []  # (step, seq, Finding)

    def add(row, code, severity, value, threshold, message, fix, seq=None):
        found.append((int(row.step), int(row.seq) if seq is None else seq, Finding(
            code=code, severity=severity, module=str(row.module), role="op_output", name=str(row.name),
            step=int(row.step), value=float(value), threshold=float(threshold), message=message, fix=fix)))

    f = facts.sort_values(["step", "seq"], kind="stable")
    fwd = f[f.phase == "forward"]
    created_inf = (fwd.out_inf > 0) & (fwd.in_inf == 0) & (fwd.in_nan == 0)
    created_nan = (fwd.out_nan > 0) & (fwd.in_nan == 0)
    created = fwd[created_inf | created_nan]
    norm_modules = _norm_modules(table)
    seen: set = set()

    def once(key) -> bool:
        if key in seen:
            return False
        seen.add(key)
        return True

    if len(created) and not _same_as_first_row(run, next(created.itertuples(index=False))):
        r = next(created.itertuples(index=False))
        what = []
        if r.out_inf:
            what.append(f"{int(r.out_inf)} inf")
        if r.out_nan:
            what.append(f"{int(r.out_nan)} NaN")
        add(r, "first_nonfinite", "error", r.out_nan + r.out_inf, 0,
            f"The first non-finite value of step {int(r.step)} appears inside module '{r.module}': "
            f"{r.name} ({r.out_dtype}) produced {' and '.join(what)} from finite inputs"
            + ("" if r.in_inf == 0 else " (its inputs held inf but no NaN)") + ".",
            "See the finding for the same op below for the cause; everything downstream is a consequence.")

    for r in fwd[created_inf].itertuples(index=False):
        fmt = FORMATS.get(r.out_dtype)
        if fmt is None:
            continue
        p = r.op.split(".")[1]
        key = (r.module, r.op)
        big_input = np.nanmax([r.in_absmax0, r.in_absmax1, -1.0])
        if not math.isnan(r.scalar_overflow):
            if once(("mask",) + key):
                add(r, "mask_overflow", "error", r.scalar_overflow, fmt.max,
                    f"The constant {r.scalar_overflow:g} does not fit {r.out_dtype} (max {fmt.max:g}): "
                    f"{r.name} in '{r.module}' turned it into inf in {int(r.out_inf)} elements.",
                    f"Use torch.finfo({r.out_dtype}).min as the mask value (or build the mask in the "
                    "scores' dtype), e.g. scores.masked_fill(mask, torch.finfo(scores.dtype).min).")
        elif p in MASKING and big_input >= fmt.max / 2:
            if once(("mask",) + key):
                add(r, "mask_overflow", "error", -big_input if p != "where" else big_input, fmt.max,
                    f"{r.name} in '{r.module}' added a mask constant of magnitude {big_input:g} (finfo.min "
                    f"of {r.out_dtype} is {-fmt.max:g}) to finite scores: {int(r.out_inf)} elements rounded "
                    "to -inf (finfo.min plus any further negative value overflows), and a fully masked row "
                    "then gives NaN in softmax.",
                    "Clamp after adding masks: torch.clamp(scores + mask, min=torch.finfo(scores.dtype).min), "
                    "combine causal and padding masks with torch.minimum instead of adding them, or "
                    "use masked_fill(mask, torch.finfo(dtype).min).")
        elif p in CASTS and r.in_absmax >= fmt.max * 256:
            if once(("mask",) + key):
                add(r, "mask_overflow", "error", r.in_absmax, fmt.max,
                    f"{r.name} in '{r.module}' cast a constant of magnitude {r.in_absmax:.3g} to {r.out_dtype} "
                    f"(max {fmt.max:g}): it became inf in {int(r.out_inf)} elements (a mask built with "
                    "finfo(float32).min or 1e9 and cast under autocast).",
                    "Build the mask with torch.finfo(<compute dtype>).min, or in the dtype it is added in.")
        elif r.reduction and p in SUMMING:
            term = r.in_absmax0 * (1.0 if math.isnan(r.in_absmax1) else r.in_absmax1)
            thr = math.floor(fmt.max / term) if term > 0 and math.isfinite(term) else math.nan
            if once(("red",) + key):
                add(r, "reduction_precision", "warning", r.reduction_len, thr,
                    f"{r.name} in '{r.module}' sums {int(r.reduction_len)} values per output in "
                    f"{r.out_dtype}; terms reach {fmt_number(term)}, so at most {fmt_number(thr)} of them fit under "
                    f"{fmt.max:g}: {int(r.out_inf)} outputs overflowed to inf.",
                    "Scale before the long sum (divide by the length, or pre-scale q by 1/sqrt(d) before "
                    "Q·Kᵀ), or run this op in float32 / bfloat16.")
        elif p not in _NOT_OVERFLOW or (p == "pow" and not math.isnan(r.scalar) and r.scalar > 0):
            est = _estimate(r)
            if once(("fwd",) + key):
                norm = r.module in norm_modules.get(int(r.step), set())
                add(r, "forward_overflow", "error", est, fmt.max,
                    f"{r.name} in '{r.module}' produced {int(r.out_inf)} inf from finite {r.out_dtype} inputs: "
                    f"its exact result reaches about {fmt_number(est)} > {fmt.max:g}"
                    + (" (inside a normalisation: the variance overflows, rsqrt gives 0 and the row's output "
                       "silently becomes 0)" if norm else "")
                    + ". A loss scale cannot fix a forward overflow.",
                    ("Compute the norm statistics in float32 (x.float().pow(2).mean(...), as LlamaRMSNorm "
                     "does), or keep this module in float32." if norm else
                     f"Keep '{r.module}' in float32, rescale its inputs, or train in bfloat16."))

    lost = f[f.scalar_lost.notna()]
    for r in lost.itertuples(index=False):
        if r.module not in norm_modules.get(int(r.step), set()):
            continue
        fmt = FORMATS[r.out_dtype]
        later = f[(f.step == r.step) & (f.module == r.module) & (f.seq > r.seq) & (f.phase == r.phase)]
        # NaN counted as the lost epsilon's only where a later pole of the norm (rsqrt(0), 1/0) made an inf
        poles = later[later.op.str.split(".").str[1].isin(("rsqrt", "reciprocal", "div", "sqrt", "pow"))
                      & (later.out_inf > 0)]
        nans = int(later.out_nan.max()) if len(poles) else 0
        if once(("eps", r.module, r.op)):
            add(r, "norm_statistics", "warning", r.scalar_lost, fmt.min_subnormal,
                f"The constant {r.scalar_lost:g} in {r.name} ('{r.module}') is below {r.out_dtype}'s smallest "
                f"subnormal {fmt.min_subnormal:.3g} and rounds to 0: a norm epsilon lost"
                + (f"; a zero-variance row then gives rsqrt(0) = inf and 0·inf = NaN ({nans} NaN)." if nans
                   else "; a zero-variance row would give rsqrt(0) = inf."),
                "Run the norm in float32 (the statistics and the epsilon), or use eps >= 1e-5.")

    for r in f[f.op.str.split(".").str[1].isin(LOGS) & (f.in_zero > 0)].itertuples(index=False):
        if once(("log", r.module, r.op)):
            frac = r.in_zero / r.numel
            add(r, "log_of_zero", "error", frac, 0.0,
                f"{r.name} in '{r.module}' took the log of a tensor whose {100 * frac:.1f} % elements "
                f"({int(r.in_zero)} of {int(r.numel)}) are exactly 0 (underflowed probabilities): "
                f"{int(r.out_inf)} outputs are -inf.",
                "Use F.log_softmax / F.cross_entropy on the logits (in float32) instead of "
                "log(softmax(x)); never take the log of a float16 probability.")

    ints = f[(f.int_valued == 1) & (f.changed > 0) & (f.phase == "forward")]
    for r in ints.itertuples(index=False):
        fmt = FORMATS.get(r.out_dtype)
        if fmt is None:
            continue
        exact = 2.0 / fmt.eps
        if r.in_absmax > exact and once(("int", r.module, r.op)):
            distinct = ""
            if not math.isnan(r.distinct_out):
                distinct = (f"; {int(r.distinct_in)} distinct values became {int(r.distinct_out)}" if not
                            math.isnan(r.distinct_in) else f"; {int(r.distinct_out)} distinct values remain")
            add(r, "integer_precision", "warning", r.in_absmax, exact,
                f"{r.name} in '{r.module}' put integers up to {r.in_absmax:g} into {r.out_dtype}, which holds "
                f"every integer only up to {exact:g}: {int(r.changed)} of {int(r.numel)} values changed"
                f"{distinct}. Positions that collide make rotary/positional encodings identical.",
                "Compute positions and angles (arange, position_ids · inv_freq) in float32 with autocast "
                "disabled, and cast only the resulting cos/sin.")

    mo = f[may_overflow(f) & (f.out_inf == 0)] if len(f) else f
    for r in mo.itertuples(index=False):
        fmt = FORMATS[r.out_dtype]
        bound = r.reduction_len * r.in_absmax0 * (1.0 if math.isnan(r.in_absmax1) else r.in_absmax1)
        if once(("red", r.module, r.op)):
            add(r, "reduction_precision", "warning", bound, fmt.max,
                f"{r.name} in '{r.module}' sums {int(r.reduction_len)} terms in {r.out_dtype} whose size reaches "
                f"{fmt_number(bound / r.reduction_len)}: the sum can reach {fmt_number(bound)} >= {fmt.max:g}.",
                "Scale before the long sum (divide first, or pre-scale q before Q·Kᵀ), or run it in float32.")

    found.extend(_policy_findings(table, target))
    found.sort(key=lambda x: (x[0], x[1]))
    return [x[2] for x in found]


_REDUCTION_FIX = {
    "softmax": "Ask for a float32 softmax: F.softmax(x, dim, dtype=torch.float32) (cast back after), ",
    "log_softmax": "Ask for a float32 log_softmax: F.log_softmax(x, dim, dtype=torch.float32), ",
    "sum": "Accumulate in float32: x.sum(dim, dtype=torch.float32), ",
    "mean": "Accumulate in float32: x.mean(dim, dtype=torch.float32) or x.float().mean(dim), ",
    "var": "Compute the statistics in float32: x.float().var(dim), ",
    "std": "Compute the statistics in float32: x.float().std(dim), ",
    "norm": "Compute the norm in float32: torch.linalg.vector_norm(x, dtype=torch.float32), ",
    "layer_norm": "Run the norm in float32: F.layer_norm(x.float(), ...).to(x.dtype), ",
    "group_norm": "Run the norm in float32: F.group_norm(x.float(), ...).to(x.dtype), ",
    "cumsum": "Accumulate in float32: x.cumsum(dim, dtype=torch.float32), ",
    "prod": "Multiply in float32: x.prod(dim, dtype=torch.float32), ",
}


def _same_as_first_row(run, r) -> bool:
    """True when the advisor's own (module-level) ``first_nonfinite`` rule already names op ``r``
    (it walks every row, op rows included, in execution order): no second finding for it."""
    theirs = first_nonfinite(Context(run))
    return any(f.role == "op_output" and f.module == str(r.module) and f.name == str(r.name) and
               f.step == int(r.step) for f in theirs)


def _norm_modules(table: pd.DataFrame) -> dict:
    """step -> modules whose forward contains a normalising op (rsqrt, sqrt, reciprocal, div, *_norm)."""
    if table.empty:
        return {}
    t = table[(table.phase == "forward") & table.op.str.split(".").str[1].isin(NORM_TAIL)]
    return {int(s): set(g.module) for s, g in t.groupby("step")}


def _policy_findings(table: pd.DataFrame, target: str) -> list:
    if table.empty:
        return []
    fp32_ops = CUDA_FP32_OPS if target == "cuda" else CPU_FP32_OPS
    t = table[(table.phase == "forward") & table.reduction.ne("") & table.out_dtype.isin(["float16", "bfloat16"])]
    t = t[~t.op.str.split(".").str[1].isin(MATMULS | {k for k, v in REDUCTIONS.items() if "attention" in v})]
    t = t[~(t.autocast & t.reduction.isin(fp32_ops))]
    out = []
    for op, g in t.groupby("op", sort=False):
        first = g.iloc[0]
        modules = list(dict.fromkeys(g.module))
        shown = ", ".join(f"'{m}'" for m in modules[:5]) + (f" and {len(modules) - 5} more" if len(modules) > 5 else "")
        dtypes = "/".join(sorted(set(g.out_dtype)))
        policy = ""
        if not g.autocast.any():
            policy = (" Autocast was off for it: its inputs were already low precision (cast by hand), so it "
                      "runs in low precision on any device.")
        elif first.reduction in CUDA_FP32_OPS and target == "cpu":
            policy = (f" CPU autocast keeps {first.reduction} in its input's dtype (CUDA autocast would run it "
                      "in float32), so on the CPU it really runs in low precision.")
        msg = (f"{op} ran in {dtypes} in {len(modules)} module(s) ({shown}), reducing up to "
               f"{int(g.max_reduction_len.max())} values per output.{policy}")
        fix = _REDUCTION_FIX.get(first.reduction, f"Run {first.reduction} on float32 inputs (x.float()) ") + \
            "or keep these modules in float32."
        f = Finding(code="reduction_precision", severity="warning", module=str(first.module), role="op_output",
                    name=f"{op}#0", step=int(first.step), value=float(g.max_reduction_len.max()),
                    threshold=math.nan, message=msg, fix=fix)
        out.append((int(first.step), 1 << 60, f))
    return out
