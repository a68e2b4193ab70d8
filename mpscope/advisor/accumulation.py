"""``accumulation_precision``: a running sum kept in float16/bfloat16 that loses its increments.

An add ``acc + g`` in a 16-bit format returns ``acc`` unchanged when ``|g|`` is below half an ulp of
``acc`` (swamping: ``(acc + g) == acc`` while ``g != 0``). Two places where it happens in training:

* gradient accumulation into a 16-bit ``.grad`` (parameters cast to float16/bfloat16, ``backward()``
  on several micro-batches before ``optimizer.step()``): measured exactly by the recorder
  (``run.tables["grad_accumulation"]``, see :mod:`mpscope.recording.grad_accumulation`). Without
  those rows (a run recorded by an older mpscope) the documented bound on the module-level rows is
  used instead: the largest element's mean increment ``absmax / N`` over ``N = backward_count``
  micro-batches is below half an ulp of ``absmax`` (``ulp = 2^floor(log2 absmax) * eps``, eps from
  :func:`torch.finfo`), i.e. ``N > 2 * absmax / ulp(absmax)`` (at least 256 for bfloat16, 2048 for
  float16);
* running sums, metric averages and EMA updates kept in 16-bit buffers (``ops=True``): the op
  recorder counts, for in-place ``add_`` / ``sub_`` / ``lerp_`` and for adds into a module buffer,
  the elements whose result equals the running value while the increment is non-zero
  (``op_facts.acc_swamped`` of ``op_facts.acc_increments``).

Threshold: :data:`SWAMPED_MIN_FRAC` of the non-zero increments swamped.
"""

from __future__ import annotations

import math

import numpy as np

from mpscope.advisor.context import Context
from mpscope.advisor.finding import Finding, make_finding
from mpscope.formats import FORMATS
from mpscope.schema import LOW_PRECISION, fmt_number

#: Report when at least this fraction of the non-zero increments left the running sum unchanged.
#: One lost increment in a thousand is already a systematic bias (the lost ones are the small ones,
#: so the sum drifts towards its largest terms), and it is well above what chance gives in fp32
#: (where an increment 2^-24 of the sum is needed to be lost, against 2^-9 in bfloat16).
SWAMPED_MIN_FRAC = 1e-3

_GRAD_FIX = ("Keep the parameters, and so .grad, in float32 (fp32 master gradients) and let "
             "torch.autocast compute in {dtype}: the micro-batches' gradients then accumulate in float32. "
             "If the parameters must stay 16-bit, accumulate each micro-batch's gradient into a float32 buffer "
             "(grad32 += p.grad.float(); p.grad = None) and copy it back before optimizer.step().")
_STATE_FIX = ("Keep the running value in float32 (register the buffer as torch.float32 and add "
              "increment.float() into it; cast the result down where it is used), or accumulate a "
              "float32 sum and count and divide at the end.")


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def accumulation_precision(c: Context) -> list[Finding]:
    """Every ``accumulation_precision`` finding of the run (see the module docstring)."""
    out = _from_grad_table(c)
    if out is None:
        out = _from_bound(c)
    return out + _from_op_facts(c)


def _from_grad_table(c: Context) -> list[Finding] | None:
    """Exact counts from ``run.tables["grad_accumulation"]``; None when the run has no such table."""
    g = (getattr(c.run, "tables", {}) or {}).get("grad_accumulation")
    if g is None or g.empty:
        return None
    g = g.copy()
    g["module"] = g.module.astype(str)
    inc, sw = int(g.increments.sum()), int(g.swamped.sum())
    if not inc or sw < SWAMPED_MIN_FRAC * inc:
        return []
    frac = sw / inc
    by = g.groupby(["module", "name"], sort=False).agg(inc=("increments", "sum"), sw=("swamped", "sum"),
                                                        first=("step", "min"), dtype=("dtype", "first"))
    by["frac"] = by.sw / by.inc.where(by.inc > 0)
    worst_key = by.frac.idxmax()
    worst = by.loc[worst_key]
    per_step = g.groupby("step").agg(inc=("increments", "sum"), sw=("swamped", "sum"))
    bad_steps = per_step[per_step.sw >= SWAMPED_MIN_FRAC * per_step.inc.clip(lower=1)]
    first = int(bad_steps.index.min()) if len(bad_steps) else int(g.step.min())
    mb = g.groupby("step").micro_batches.max()
    n_mb = int(mb.max()) + 1  # the first backward of a step creates .grad; the rest add into it
    mass = float(g.swamped_abs.sum()) / max(float(g.increment_abs.sum()), 1e-300)
    rounded = float(g.rounded_abs.sum()) / max(float(g.increment_abs.sum()), 1e-300)
    dtype = str(worst["dtype"])
    ulp_note = "below half an ulp of the running sum"
    return [make_finding(
        "accumulation_precision", module=str(worst_key[0]), role="param_grad", name=str(worst_key[1]), step=first,
        value=frac, threshold=SWAMPED_MIN_FRAC,
        message=(f"Gradient accumulation in a {dtype} .grad over {n_mb} micro-batches per step: of the non-zero "
                 f"gradient increments that micro-batches 2..{n_mb} added ({inc} elements over {len(per_step)} "
                 f"recorded step(s)), {sw} ({_pct(frac)}) left .grad unchanged ((acc + g) == acc: {ulp_note}), "
                 f"i.e. {_pct(mass)} of the increments' total |g| was lost outright, and the {dtype} adds rounded "
                 f"away {_pct(rounded)} of it in all. Worst: parameter '{worst_key[1]}' of module '{worst_key[0]}' "
                 f"({int(worst.sw)} of {int(worst.inc)}, {_pct(float(worst.frac))})."),
        fix=_GRAD_FIX.format(dtype=dtype),
    )]


def _ulp(x: float, eps: float) -> float:
    return math.ldexp(eps, math.frexp(x)[1] - 1)


def _from_bound(c: Context) -> list[Finding]:
    """The documented bound on module-level rows (no per-increment evidence recorded)."""
    s, t = c.s, c.t
    if s.empty or "backward_count" not in s.columns:
        return []
    n = dict(zip(s.step.astype(int), s.backward_count.fillna(0).astype(int)))
    pg = t[(t.role == "param_grad") & t.dtype.isin(LOW_PRECISION) & (t.absmax > 0)]
    for r in pg.sort_values(["step", "_order"]).itertuples(index=False):
        k = n.get(int(r.step), 0)
        if k < 2:
            continue
        a = float(r.absmax) / float(r.loss_scale or 1.0)
        fmt = FORMATS[r.dtype]
        limit = 2 * a / _ulp(a, fmt.eps)
        if k > limit:
            return [make_finding(
                "accumulation_precision", module=r.module, role="param_grad", name=r.name, step=int(r.step),
                value=float(k), threshold=limit,
                message=(f"Gradient accumulation in a {r.dtype} .grad over {k} micro-batches: the largest gradient "
                         f"element of '{r.name}' in module '{r.module}' reached {fmt_number(a)}, where one ulp is "
                         f"{fmt_number(_ulp(a, fmt.eps))}; its mean increment {fmt_number(a / k)} is below half an "
                         f"ulp, so such increments are lost entirely once the sum is that large (a bound: this run "
                         f"holds no per-increment counts; record it again with this mpscope for the exact count)."),
                fix=_GRAD_FIX.format(dtype=r.dtype),
            )]
    return []


def _from_op_facts(c: Context) -> list[Finding]:
    """Running sums / EMAs in 16-bit buffers, from ``op_facts.acc_swamped`` (``ops=True``)."""
    f = (getattr(c.run, "tables", {}) or {}).get("op_facts")
    if f is None or f.empty or "acc_increments" not in f.columns:
        return []
    f = f[f.acc_increments.fillna(0) > 0].copy()
    if f.empty:
        return []
    f["module"] = f.module.astype(str)
    out = []
    for (module, op), g in f.groupby(["module", "op"], sort=False):
        inc, sw = float(g.acc_increments.sum()), float(g.acc_swamped.fillna(0).sum())
        if sw < SWAMPED_MIN_FRAC * inc:
            continue
        frac = sw / inc
        per_call = g.acc_swamped.fillna(0) / g.acc_increments
        r = g[per_call >= SWAMPED_MIN_FRAC].sort_values(["step", "seq"]).iloc[0]
        frozen = int((g.acc_swamped >= g.acc_increments).sum())
        dtype = str(r.out_dtype)
        stuck = (f"; {frozen} of the {len(g)} updates changed nothing at all, so the value stopped following its "
                 f"inputs" if frozen else "")
        ulp = ""
        if np.isfinite(float(r.in_absmax0)) and dtype in FORMATS and float(r.in_absmax0) > 0:
            ulp = (f" (a running value of {fmt_number(float(r.in_absmax0))} has an ulp of "
                   f"{fmt_number(_ulp(float(r.in_absmax0), FORMATS[dtype].eps))} in {dtype})")
        out.append(make_finding(
            "accumulation_precision", module=module, role="op_output", name=str(r["name"]), step=int(r.step),
            value=frac, threshold=SWAMPED_MIN_FRAC,
            message=(f"A running sum / average kept in {dtype} in module '{module}' ({op}, {len(g)} update(s) recorded): "
                     f"{int(sw)} of {int(inc)} non-zero increments ({_pct(frac)}) left it unchanged ((acc + x) == acc: "
                     f"below half an ulp of the running value{ulp}){stuck}."),
            fix=_STATE_FIX,
        ))
    return out
