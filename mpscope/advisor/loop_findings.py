"""Findings about the training loop itself, from ``run.steps`` and the rows around the step end.

* ``grad_norm_overflow``: ``clip_grad_norm_`` returned inf/NaN while every gradient was finite.
* ``amp_misuse``: the optimizer stepped on gradients still multiplied by the loss scale, or stepped
  although the GradScaler had found inf/NaN in them.
* ``stale_forward``: weights changed while the loss and every activation stayed bit-identical.
* ``stale_grad`` (evidence-based): a non-finite gradient carried into a step whose ``.grad`` was not
  reset before its first backward (``run.steps.grad_reset`` = 0).

Each detector takes the advisor's :class:`~mpscope.advisor.context.Context` and returns a list of
:class:`~mpscope.advisor.finding.Finding`. Thresholds are the named constants below.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from mpscope.advisor.context import Context
from mpscope.advisor.finding import Finding, make_finding
from mpscope.formats import FORMATS
from mpscope.schema import LOW_PRECISION, fmt_number, fmt_scale

#: stale_forward: the loss and the activations stay bit-identical on at least this many consecutive
#: steps while weights change (two equal losses in a row happen by chance; three in a row with
#: every activation equal too do not, once the weights move).
STALE_FORWARD_MIN_STEPS = 3
#: Activation statistics compared between steps (exact equality).
_ACT_STATS = ("min", "max", "absmax", "zero_frac", "nan_count", "inf_count")
_W_STATS = ("min", "max", "absmax", "absmin_nonzero", "zero_frac")


def _col(s: pd.DataFrame, name: str, default) -> pd.Series:
    return s[name] if name in s.columns else pd.Series(default, index=s.index)


def grad_norm_overflow(c: Context) -> list[Finding]:
    """``clip_grad_norm_`` returned a non-finite norm on a step whose gradients were all finite.

    Evidence per step: ``run.steps.clip_norm`` is inf/NaN, the float32 norm of the same gradients
    (``clip_norm_fp32``, taken just before the clip) is finite when recorded, and no ``param_grad``
    row of the step holds inf/NaN (after a clip with coefficient ``max_norm / inf = 0`` finite
    gradients become 0, while an inf gradient becomes NaN, so finite rows prove finite inputs).
    value = the float32 norm (inf when not recorded), threshold = the gradients' format maximum.
    """
    s, t = c.s, c.t
    if s.empty or "clip_norm" not in s.columns:
        return []
    clip = s.clip_norm.astype(float)
    bad = s[~np.isfinite(clip.fillna(0.0))]  # NaN = no clip this step
    if bad.empty:
        return []
    pg = t[t.role == "param_grad"]
    dirty = set(pg.step[pg._nonfinite])
    n32 = _col(bad, "clip_norm_fp32", math.nan).astype(float)
    ok = bad[~bad.step.isin(dirty) & (n32.isna() | np.isfinite(n32))]
    if ok.empty:
        return []
    r = ok.iloc[0]
    norm32 = float(_col(ok, "clip_norm_fp32", math.nan).iloc[0])
    gmax = float(_col(ok, "clip_grad_absmax", math.nan).iloc[0])
    grads = pg[pg.step == int(r.step)]
    dtype = next((d for d in LOW_PRECISION if (grads.dtype == d).any()), None) if len(grads) else None
    dtype = dtype or next((d for d in LOW_PRECISION if (c.meta.get("param_dtypes") or {}).get(d)), "float16")
    fmt = FORMATS[dtype]
    why = (f"the same norm computed in float32 is {fmt_number(norm32)} > {fmt_number(fmt.max)}, {dtype}'s maximum"
           if math.isfinite(norm32) else f"the norm exceeds {dtype}'s maximum {fmt_number(fmt.max)}")
    peak = f" (largest |g| = {fmt_number(gmax)})" if math.isfinite(gmax) else ""
    lowp = (c.meta.get("param_dtypes") or {}).get(dtype)
    where = (f" The parameters, and so their .grad, are {dtype} (the model was cast with .half()/.to()), "
             f"so clip_grad_norm_ sums the squares in {dtype}." if lowp else "")
    return [make_finding(
        "grad_norm_overflow", module=None, role="param_grad", name=None, step=int(r.step),
        value=norm32 if math.isfinite(norm32) else math.inf, threshold=fmt.max,
        message=(f"clip_grad_norm_ returned {fmt_number(float(r.clip_norm))} on {len(ok)} of {len(s)} steps (first at step "
                 f"{int(r.step)}) although every gradient was finite{peak}: {why}. The clip coefficient "
                 f"max_norm / inf = 0 then multiplied every gradient by 0, so the weights did not move.{where}"),
        fix=("Keep the parameters in float32 and run the forward under torch.autocast (gradients, and their norm, "
             "are then float32); if they must stay low precision, compute the total norm in float32 "
             "(torch.linalg.vector_norm of per-tensor norms taken with dtype=torch.float32) and scale the "
             "gradients by max_norm / norm yourself."),
    )]


def amp_misuse(c: Context) -> list[Finding]:
    """GradScaler used wrongly: (a) ``optimizer.step()`` ran on gradients still multiplied by the
    loss scale (``run.steps.opt_scaled``: the loop called it directly instead of
    ``scaler.step(optimizer)``); (b) the scaler found inf/NaN gradients and the optimizer still
    stepped (``found_inf`` and not ``skipped``, with the optimizer known): the loop unscaled and
    stepped itself, so the scaler's inf check was ignored. value = the loss scale (a) / the number
    of such steps (b)."""
    s = c.s
    if s.empty:
        return []
    out = []
    scaled = s[_col(s, "opt_scaled", False).fillna(False).astype(bool)]
    if len(scaled):
        r = scaled.iloc[0]
        ls = float(r.loss_scale)
        out.append(make_finding(
            "amp_misuse", module=None, role="param_grad", name=None, step=int(r.step), value=ls, threshold=1.0,
            message=(f"optimizer.step() ran on gradients still multiplied by the loss scale {fmt_scale(ls)} on "
                     f"{len(scaled)} of {len(s)} steps (first at step {int(r.step)}): the loop calls "
                     f"scaler.scale(loss).backward() and then optimizer.step() itself, so every update is "
                     f"{fmt_scale(ls)} times too large and steps with inf/NaN gradients are not skipped. "
                     f"GradScaler.update() is never reached either, so the scale never adapts.{_nan_weights(c)}"),
            fix=("Step through the scaler: scaler.step(optimizer); scaler.update() (call scaler.unscale_(optimizer) "
                 "first if you clip or inspect the gradients)."),
        ))
    if c.scaler is not None and c.meta.get("optimizer") and len(s):
        ignored = s[s.found_inf & ~s.skipped & ~_col(s, "opt_scaled", False).fillna(False).astype(bool)]
        if len(ignored):
            r = ignored.iloc[0]
            out.append(make_finding(
                "amp_misuse", module=None, role="param_grad", name=None, step=int(r.step),
                value=float(len(ignored)), threshold=0.0,
                message=(f"The GradScaler found inf/NaN gradients on {len(ignored)} step(s) (first at step "
                         f"{int(r.step)}) and the optimizer stepped anyway: the loop unscales and calls "
                         f"optimizer.step() itself, which ignores the scaler's inf check.{_nan_weights(c)}"),
                fix=("Let the scaler step: scaler.step(optimizer) (it skips the update when the gradients hold "
                     "inf/NaN), then scaler.update()."),
            ))
    return out


def _nan_weights(c: Context) -> str:
    t = c.t
    w = t[(t.role == "weight") & t._nonfinite]
    if w.empty:
        return ""
    r = w.sort_values(["step", "_order"]).iloc[0]
    return (f" Weight '{r['name']}' of module '{r.module}' holds {int(r.nan_count + r.inf_count)} non-finite "
            f"values of {int(r.numel)} after step {int(r.step)}.")


def stale_forward(c: Context) -> list[Finding]:
    """Weights change while the forward pass does not: the loss and every recorded activation
    are bit-identical on at least STALE_FORWARD_MIN_STEPS consecutive steps whose weight rows
    changed, by more than the compute dtype's eps from the first to the last of them (relative
    change of a weight's min, max or absmax: smaller updates may legitimately vanish in a low-precision forward). value = the number of such steps; ``autocast_at_step`` says whether autocast was
    enabled while the optimizer stepped (one autocast region around the loop)."""
    s, t = c.s, c.t
    if len(s) < STALE_FORWARD_MIN_STEPS:
        return []
    w = t[t.role == "weight"]
    act = t[t.role.isin(("activation", "loss"))]
    if w.empty or act.empty:
        return []
    loss = s.set_index("step").loss.astype(float)
    wcols = [k for k in _W_STATS if k in w.columns]
    acols = [k for k in _ACT_STATS if k in act.columns]
    wsig = w.sort_values("_order").groupby("step")[wcols].apply(lambda g: tuple(np.nan_to_num(g.to_numpy(float), nan=-1).ravel()))
    asig = act.sort_values("_order").groupby("step")[acols].apply(lambda g: tuple(np.nan_to_num(g.to_numpy(float), nan=-1).ravel()))
    steps = [int(x) for x in sorted(set(wsig.index) & set(asig.index) & set(loss.index))]
    # the weights must move by more than the forward's own rounding (an update below half an ulp of
    # the compute dtype legitimately leaves a low-precision forward unchanged)
    act_dtype = act[act.role == "activation"].dtype.mode()
    tol = FORMATS[act_dtype.iloc[0]].eps if len(act_dtype) and act_dtype.iloc[0] in FORMATS else 0.0
    wv = w.set_index(["step", "module", "name"])[["min", "max", "absmax"]].astype(float)

    def moved(a: int, b: int) -> bool:
        try:
            x, y = wv.loc[a], wv.loc[b]
        except KeyError:
            return False
        x, y = x.align(y, join="inner")
        rel = ((y - x).abs() / x.abs().where(x.abs() > 0)).to_numpy()
        return bool(np.nanmax(rel, initial=0.0) > tol)

    runs: list[list[int]] = []
    for a, b in zip(steps, steps[1:]):
        same = (b == a + 1 and loss[a] == loss[b] and math.isfinite(loss[a]) and asig[a] == asig[b]
                and wsig[a] != wsig[b])
        if not same:
            continue
        if runs and runs[-1][-1] == a:
            runs[-1].append(b)
        else:
            runs.append([a, b])
    runs = [r for r in runs if len(r) >= STALE_FORWARD_MIN_STEPS and moved(r[0], r[-1])]
    best, best_start = (len(runs[0]), runs[0][0]) if runs else (0, None)
    if best < STALE_FORWARD_MIN_STEPS:
        return []
    span = s[(s.step >= best_start) & (s.step < best_start + best)]
    in_ac = bool(_col(span, "autocast_at_step", False).fillna(False).astype(bool).any())
    cause = ("autocast was enabled while optimizer.step() ran: one torch.autocast region spans the optimizer step, "
             "and autocast caches the low-precision copy of each fp32 weight until the region exits, so every forward "
             "uses the copy made at the first step." if in_ac else
             "the forward computes from a copy of the weights made once (a cached .half()/.to() copy, a deepcopy, or "
             "weights replaced outside the optimizer), not from the parameters the optimizer updates.")
    fix = ("Enter torch.autocast per forward pass (around the model call and the loss only, never around "
           "optimizer.step()), or pass cache_enabled=False." if in_ac else
           "Compute the forward from the parameters themselves each step (cast inside forward, or re-make the copy "
           "after every optimizer.step()).")
    n_act = int((act.step == best_start).sum())
    return [make_finding(
        "stale_forward", module=None, role="loss", name="loss", step=int(best_start), value=float(best),
        threshold=float(STALE_FORWARD_MIN_STEPS),
        message=(f"From step {int(best_start)} on, for {best} consecutive steps, the weights changed after every "
                 f"optimizer step while the loss ({fmt_number(float(loss[best_start]))}) and all {n_act} recorded "
                 f"activation rows stayed bit-identical: the forward pass does not see the updated weights. {cause}"),
        fix=fix,
    )]


def stale_grad_evidence(c: Context) -> list[Finding] | None:
    """``stale_grad`` from the recorder's ``grad_reset`` evidence; None when the run has none.

    A parameter gradient that is non-finite on a step, and non-finite again on the next step whose
    ``.grad`` was *not* reset before its first backward (``grad_reset`` = 0), carries the old
    inf/NaN forward. With ``grad_reset`` = 1 on every step there is no stale gradient, however
    often non-finite counts repeat (a GradScaler backing off from a too-high scale).
    value = the number of such steps, threshold 1.
    """
    s, t = c.s, c.t
    if s.empty or "grad_reset" not in s.columns or s.grad_reset.isna().all():
        return None
    reset = dict(zip(s.step.astype(int), s.grad_reset.astype(float)))
    pg = t[(t.role == "param_grad") & t._nonfinite]
    out = []
    for (module, name), g in pg.groupby(["module", "name"], sort=False, observed=True):
        st = sorted(set(int(x) for x in g.step))
        carried = [b for a, b in zip(st, st[1:]) if b == a + 1 and reset.get(b) == 0.0]
        if not carried:
            continue
        r = g[g.step == carried[0]].iloc[0]
        out.append(make_finding(
            "stale_grad", r, value=float(len(carried)), threshold=1.0,
            message=(f"param_grad '{name}' of module '{module}' was non-finite at step {carried[0] - 1} and its .grad "
                     f"was not reset before step {carried[0]}'s backward (no zero_grad), so the inf/NaN was carried "
                     f"into {len(carried)} later step(s) and every new gradient is added to it."),
            fix="Call optimizer.zero_grad() (or set_to_none) every step, also on steps the GradScaler skips.",
        ))
    return out


DETECTORS = (grad_norm_overflow, amp_misuse, stale_forward)


def loop_findings(c: Context) -> list[Finding]:
    """Every finding of this module, in DETECTORS order."""
    out: list[Finding] = []
    for det in DETECTORS:
        out.extend(det(c))
    return out
