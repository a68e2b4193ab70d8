"""Module-level findings: each detector reads the Run's frames and returns :class:`Finding` objects.

Every threshold below is a named constant with its source; limits come from :mod:`mpscope.formats`
(``torch.finfo``). The op-level codes (reduction_precision, mask_overflow, integer_precision,
log_of_zero) live in :mod:`mpscope.advisor.op_findings`, the precision and pole codes in
:mod:`mpscope.advisor.op_precision`, the training-loop codes in :mod:`mpscope.advisor.loop_findings`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from mpscope.advisor import _frames
from mpscope.advisor.context import Context
from mpscope.advisor.finding import Finding, is_ancestor, make_finding, on_rank, rank_of
from mpscope.advisor.loop_findings import stale_grad_evidence
from mpscope.advisor.scaler import underflow_error
from mpscope.formats import FORMATS, FP16
from mpscope.schema import GRAD_ROLES, GRAD_SCALER_DEFAULTS, LOW_PRECISION, Role, fmt_number, fmt_scale, module_label

#: Non-finite values first seen before this step point to overflow (range); later, to underflow
#: or accumulated error (the usual reading of "NaN at step 0" vs "NaN after N steps").
EARLY_STEPS = 10
#: activation_headroom: absmax at or above 2^15, i.e. inside fp16's top binade (65504 = 1.999 * 2^15).
HEADROOM_LIMIT = math.ldexp(1.0, FP16.max_exponent)
#: grad_underflow: at least 10 % of a gradient's elements subnormal (or flushed) in fp16. A tail of a
#: few % subnormal values is normal in healthy fp16 runs (the demo GPT at 2^14-2^16: 1-2 %).
GRAD_UNDERFLOW_FRAC = 0.10
#: grad_underflow: the elements below fp16's normal range matter (a warning) when the error their
#: rounding can add reaches 1 % of the gradient's L1 norm (bound from its exponent histogram at the
#: step's loss scale, mpscope.advisor.scaler.underflow_error); a tail of tiny elements that can change
#: it by less is an info finding. 1 % is 20x fp16's own relative rounding (2^-11).
GRAD_UNDERFLOW_ERROR = 0.01
#: grad_underflow: a gradient counts as flushed when at least 99 % of it is exactly zero after the
#: backward pass reached fp16's subnormal range in the same step.
FLUSHED_ZERO_FRAC = 0.99
#: frozen_layer: all-zero parameter gradient on this many recorded steps (or on all, if fewer).
FROZEN_MIN_STEPS = 10
#: scale_collapse: found_inf on more than this fraction of at least SCALE_COLLAPSE_MIN_STEPS steps.
SCALE_COLLAPSE_FRAC = 0.5
SCALE_COLLAPSE_MIN_STEPS = 10
#: init_scale_too_high: at least this many skipped steps at the start and at least INIT_SKIP_FRAC
#: of the run (PyTorch's default 2^16 costs a few skips at the start in many healthy runs).
INIT_SKIP_MIN = 3
INIT_SKIP_FRAC = 0.05
#: stagnant_low_precision_weights: weight statistics unchanged over this many updated steps.
STAGNANT_MIN_STEPS = 5
#: stale_grad: non-finite on this many consecutive steps whose backward was finite.
STALE_MIN_STEPS = 3
_WEIGHT_STATS = ("min", "max", "absmax", "absmin_nonzero", "zero_frac", "subnormal_frac")
_ADAPTIVE = ("adam", "rmsprop", "adagrad", "adadelta", "adamax", "lion", "adafactor")


# --------------------------------------------------------------------------------------------


def first_nonfinite(c: Context) -> list[Finding]:
    t = c.t
    # op outputs are judged by mpscope.ops.op_findings, which tells an op that creates inf/NaN from
    # one that only carries it (an intentional -inf causal mask is not an error)
    bad = t[t._nonfinite & (t.role != "op_output")]
    handled = c.handled_steps()
    # (under DDP each rank's own gradient too: param_grad_local, scaled alike)
    bad = bad[~(bad.role.isin((*GRAD_ROLES, Role.PARAM_GRAD_LOCAL.value)) & bad.step.isin(handled))]
    if bad.empty:
        return []
    first_step = int(bad.step.min())
    ops = t[t._nonfinite & (t.role == "op_output")]
    if not ops.empty and int(ops.step.min()) <= first_step:
        return []  # op rows see where it started: mpscope.ops.op_findings reports it at the op
    in_step = bad[bad.step == first_step].sort_values("_order")
    r = in_step.iloc[0]
    later = [m for m in dict.fromkeys(in_step.module.iloc[1:]) if m != r.module]
    timing = "" if r.role in ("weight", "optimizer_state") else (
        f"It appeared at step {first_step}, within the first {EARLY_STEPS} steps: that points to a "
        f"range overflow, not to slow accumulation."
        if first_step < EARLY_STEPS
        else f"It appeared late (step {first_step}): that points to underflow (a division by a "
        f"flushed zero) or accumulated error (weights or optimizer state drifting out of range)."
    )
    cons = ""
    if later:
        shown = ", ".join(f"'{m}'" for m in later[:6]) + (" ..." if len(later) > 6 else "")
        cons = f" Downstream, {len(later)} more module(s) became non-finite in the same step as a consequence: {shown}."
    fixes = {
        "activation": "See forward_overflow: keep this module in fp32, rescale its input or weights, or train in bfloat16.",
        "loss": "Compute the loss in fp32 (outside autocast, or .float() on the logits) and check its inputs.",
        "activation_grad": "Use a GradScaler (it skips such steps) and check this module's backward for division by small numbers.",
        "param_grad": "Use a GradScaler (it skips such steps); zero gradients every step (optimizer.zero_grad()).",
        "weight": "The optimizer update produced it: check the optimizer's eps and state dtype (optimizer_state_precision) and the learning rate.",
        "optimizer_state": "Keep optimizer state in fp32 and eps representable in its dtype (optimizer_state_precision).",
    }
    rank = rank_of(c, r)
    msg = (
        f"First non-finite tensor in execution order: {r.role} '{r['name']}' of module '{module_label(r.module)}' at step "
        f"{first_step}{on_rank(rank)} ({int(r.nan_count)} NaN, {int(r.inf_count)} inf of {int(r.numel)} elements, "
        f"dtype {r['dtype']}).{cons} {timing}"
    ).strip()
    return [make_finding("first_nonfinite", r, value=float(r.nan_count + r.inf_count), threshold=0.0, message=msg,
                fix=fixes.get(r.role, "Find the operation that produced it with mpscope.record(..., ops=True)."),
                rank=rank)]


def forward_overflow_rows(c: Context) -> pd.DataFrame:
    t = c.t
    act = t[t.role == "activation"]
    over = ((act.dtype == "float16") & (act.inf_count > 0) & ~act.step.isin(c.pole_steps))
    if "fp16_overflow_frac" in act.columns:
        over |= act.fp16_overflow_frac.fillna(0) > 0
    return act[over]


def forward_overflow(c: Context) -> list[Finding]:
    if not c.fp16_run:
        return []
    rows = forward_overflow_rows(c)
    if rows.empty:
        return []
    first_step = int(rows.step.min())
    r = rows[rows.step == first_step].sort_values("_order").iloc[0]
    others = [m for m in dict.fromkeys(rows[rows.step == first_step].sort_values("_order").module) if m != r.module]
    is_fp16 = r["dtype"] == "float16"
    if is_fp16:
        value = float("inf")
        what = f"produced {int(r.inf_count)} inf of {int(r.numel)} elements in float16"
    else:
        value = float(r.absmax)
        n_over = int(round(float(r.fp16_overflow_frac) * int(r.numel)))
        what = f"reaches |x| = {fmt_number(float(r.absmax))} in {r['dtype']}; {n_over} of {int(r.numel)} elements become inf when cast to float16"
    tail = f" {len(others)} later module(s) in the same step also hold inf." if others else ""
    msg = (
        f"The forward output of module '{module_label(r.module)}' {what} at step {first_step}: above fp16's maximum "
        f"{fmt_number(FP16.max)}. This happens in the forward pass, before any loss scaling, so a loss scale "
        f"(GradScaler) cannot fix it.{tail}"
    )
    fix = (f"Train in bfloat16 (same range as fp32), or keep module '{module_label(r.module)}' in fp32 "
           f"(fp32_modules), or rescale its input/weights so |x| stays below {fmt_number(HEADROOM_LIMIT)}.")
    return [make_finding("forward_overflow", r, value=value, threshold=FP16.max, message=msg, fix=fix)]


def activation_headroom(c: Context) -> list[Finding]:
    if c.autocast == "bfloat16" or not c.fp16_run and c.autocast is not None:
        return []
    t = c.t
    overflowed = set(forward_overflow_rows(c).module)
    act = t[(t.role == "activation") & (t.dtype != "bfloat16") & ~t.module.isin(overflowed)]
    hot = act[(act.absmax >= HEADROOM_LIMIT) & (act.absmax <= FP16.max)]
    hot_mods = set(hot.module)
    out = []
    for module, g in hot.sort_values(["step", "_order"]).groupby("module", sort=False, observed=True):
        if any(is_ancestor(module, o) for o in hot_mods):
            continue  # a container passing on its child's output: the child is reported
        r = g.iloc[0]
        peak = float(g.absmax.max())
        out.append(make_finding(
            "activation_headroom", r, value=peak, threshold=HEADROOM_LIMIT,
            message=(f"Module '{module_label(module)}' output reaches |x| = {fmt_number(peak)} (first at step {int(r.step)}), within one "
                     f"binade of fp16's maximum {fmt_number(FP16.max)}: a doubling overflows it."),
            fix=f"Keep module '{module_label(module)}' in fp32 or train in bfloat16; or rescale its input/weights.",
        ))
    return out


def _underflow_rows(c: Context) -> pd.DataFrame:
    """fp16 gradient rows that are subnormal or flushed at the scale in effect (see grad_underflow)."""
    t = c.t
    g = t[t.role.isin(GRAD_ROLES) & (t.dtype == "float16")].sort_values(["step", "_order"])
    if g.empty:
        return g.assign(lost=[])
    lost = []
    edge_reached: dict[int, bool] = {}
    for r in g.itertuples(index=False):
        sub = float(r.subnormal_frac or 0.0)
        zero = float(r.zero_frac or 0.0)
        reached = edge_reached.get(r.step, False)
        if r.role == "activation_grad" and reached and zero >= FLUSHED_ZERO_FRAC:
            lost.append(sub + zero)
        elif sub >= GRAD_UNDERFLOW_FRAC:
            lost.append(sub)
        else:
            lost.append(np.nan)
        if sub > 0 and r.role == "activation_grad":
            edge_reached[r.step] = True
    g = g.assign(lost=lost)
    return g[g.lost.notna()]


def recording_flushed_gradients(c: Context) -> bool:
    """True when the recorded fp16 gradients themselves lost values to underflow (>= 99 % zero after
    the backward reached the subnormal range): the histograms then miss the smallest gradients."""
    rows = _underflow_rows(c)
    return bool(len(rows) and (rows.zero_frac >= FLUSHED_ZERO_FRAC).any())


def _row_errors(c: Context, rows: pd.DataFrame) -> np.ndarray:
    """:func:`underflow_error` of each gradient row at its step's loss scale, from its exponent
    histogram (NaN where the step has no histogram of that tensor)."""
    h = _frames.histograms(c.run)
    key = ["step", "module", "role", "name"]
    h = h[h.role.isin(GRAD_ROLES) & (h["count"] > 0) & h.step.isin(set(rows.step))]
    keys = rows[key].astype({"module": str, "role": str, "name": str}).assign(
        scale_exp=np.floor(np.log2(rows.loss_scale.astype(float).where(rows.loss_scale.astype(float) > 0, 1.0))).astype(int),
        _i=np.arange(len(rows)))
    out = np.full(len(rows), np.nan)
    hit = h.merge(keys, on=key)
    for i, g in hit.groupby("_i", sort=False):
        out[int(i)] = underflow_error(g.exponent.to_numpy(), g["count"].to_numpy(), int(g.scale_exp.iloc[0]))
    return out


def grad_underflow(c: Context) -> list[Finding]:
    """fp16 gradients with at least 10 % of their elements subnormal or flushed at the step's loss
    scale (or flushed whole). A warning when their rounding can change the gradient by
    GRAD_UNDERFLOW_ERROR of its L1 norm (or its histogram is not recorded, or it flushed whole);
    otherwise an info finding."""
    rows = _underflow_rows(c)
    if rows.empty:
        return []
    rows = rows.assign(err=_row_errors(c, rows))
    out = []
    for module, g in rows.groupby("module", sort=False, observed=True):
        harmful = g[~(g.err < GRAD_UNDERFLOW_ERROR) | (g.zero_frac >= FLUSHED_ZERO_FRAC)]
        r = (harmful if len(harmful) else g).iloc[0]
        ls = float(r.loss_scale)
        where = (f"At loss scale {fmt_scale(ls)}, {100 * float(r.lost):.1f} % of {r.role} '{r['name']}' of module "
                 f"'{module}' is subnormal or flushed to zero in float16 (step {int(r.step)}; "
                 f"{100 * float(r.zero_frac):.1f} % exactly zero, {100 * float(r.subnormal_frac):.1f} % subnormal, "
                 f"below fp16's smallest normal {fmt_number(FP16.min_normal)})")
        err = float(r.err)
        if len(harmful):
            held = "" if math.isnan(err) else f"; their rounding can change it by {100 * err:.2g} % (L1)"
            out.append(make_finding(
                "grad_underflow", r, value=float(r.lost), threshold=GRAD_UNDERFLOW_FRAC,
                message=where + held + ".",
                fix=("Raise the loss scale: use torch.amp.GradScaler with the recommended init_scale (from the "
                     "what-if), or train in bfloat16, whose 8 exponent bits hold these magnitudes."),
            ))
        else:
            out.append(make_finding(
                "grad_underflow", r, value=float(r.lost), threshold=GRAD_UNDERFLOW_FRAC, severity="info",
                message=(f"{where}, but their rounding can change the gradient by at most {100 * err:.2g} % of its "
                         f"L1 norm (limit {100 * GRAD_UNDERFLOW_ERROR:g} %)."),
                fix="None needed: a tail of tiny gradient elements is normal in fp16 training.",
            ))
    return out


def frozen_layer(c: Context) -> list[Finding]:
    t, s = c.t, c.s
    pg = t[t.role == "param_grad"]
    if pg.empty:
        return []
    good = s[~s.skipped & np.isfinite(s.loss.astype(float)) & (s.loss.astype(float) != 0)] if len(s) else None
    if good is not None and "clip_norm" in good.columns:
        # a clip that returned inf multiplied the gradients by 0: grad_norm_overflow, not a frozen layer
        good = good[~np.isinf(good.clip_norm.astype(float))]
    good = good.step if good is not None else pg.step
    pg = pg[pg.step.isin(set(good))]
    if pg.empty:
        return []
    n_recorded = pg.step.nunique()
    need = min(FROZEN_MIN_STEPS, n_recorded)
    underflowed = set(_underflow_rows(c).module)
    out = []
    for module, g in pg.groupby("module", sort=False, observed=True):
        zero = g[(g.zero_frac >= 1.0) & ~g._nonfinite]
        per_name = zero.groupby("name", observed=True).step.nunique()
        frozen = per_name[per_name >= need]
        if frozen.empty or len(frozen) < g.name.nunique():
            continue  # some parameter of the module still learns
        r = zero.sort_values(["step", "_order"]).iloc[0]
        cause = (" Its gradient flushed to zero in fp16 (see grad_underflow): the layer is not learning."
                 if module in underflowed else "")
        out.append(make_finding(
            "frozen_layer", r, name=",".join(frozen.index.astype(str)), value=float(frozen.min()), threshold=float(need),
            message=(f"Every parameter gradient of module '{module_label(module)}' ({', '.join(frozen.index.astype(str))}) is exactly "
                     f"zero on {int(frozen.min())} recorded step(s) while the loss is finite and non-zero.{cause}"),
            fix=("If this is not intended (requires_grad=False), raise the loss scale / use a GradScaler or bfloat16 "
                 "(underflow), and check that the module is on the loss's path."),
        ))
    return out


def scale_collapse(c: Context) -> list[Finding]:
    s = c.s
    if s.empty or not c.uses_scaler:
        return []
    out = []
    low = s[s.loss_scale < 1.0]
    if not low.empty:
        r = low.iloc[0]
        out.append(make_finding(
            "scale_collapse", step=int(r.step), value=float(r.loss_scale), threshold=1.0,
            message=(f"The loss scale fell to {fmt_number(float(r.loss_scale))} at step {int(r.step)}, below 1: the gradients "
                     f"overflow fp16 even unscaled (GradScaler has no minimum scale)."),
            fix=("Find what overflows (first_nonfinite / forward_overflow): often a bf16-pretrained model in fp16; "
                 "train in bfloat16 or keep the overflowing modules in fp32."),
        ))
    frac = float(s.found_inf.mean())
    if len(s) >= SCALE_COLLAPSE_MIN_STEPS and frac > SCALE_COLLAPSE_FRAC and low.empty:
        r = s[s.found_inf].iloc[0]
        out.append(make_finding(
            "scale_collapse", step=int(r.step), value=frac, threshold=SCALE_COLLAPSE_FRAC,
            message=(f"The GradScaler found inf/NaN gradients and backed off on {100 * frac:.0f} % of {len(s)} steps: "
                     f"training barely progresses."),
            fix=("Look for a persistent non-finite source (stale_grad, forward_overflow, first_nonfinite); if none, "
                 "train in bfloat16."),
        ))
    return out


def _leading_skips(s: pd.DataFrame) -> int:
    sk = s.skipped.to_numpy()
    n0 = 0
    while n0 < len(sk) and sk[n0]:
        n0 += 1
    return n0


def init_scale_too_high(c: Context) -> list[Finding]:
    s = c.s
    if s.empty or not c.uses_scaler:
        return []
    n0 = _leading_skips(s)
    need = max(INIT_SKIP_MIN, math.ceil(INIT_SKIP_FRAC * len(s)))
    if n0 < need or n0 == len(s):
        return []
    init = float(s.loss_scale.iloc[0])
    settled = float(s.loss_scale.iloc[n0])
    return [make_finding(
        "init_scale_too_high", step=int(s.step.iloc[0]), value=float(n0), threshold=float(need),
        message=(f"The first {n0} of {len(s)} steps were skipped while the scale backed off from {fmt_scale(init)} to "
                 f"{fmt_scale(settled)}: init_scale was too large for these gradients."),
        fix=f"Start the GradScaler at init_scale={fmt_scale(settled)} or lower (the recommendation's value).",
    )]


def periodic_probe(c: Context) -> list[Finding]:
    s = c.s
    if s.empty or not c.uses_scaler:
        return []
    n0 = _leading_skips(s)
    rest = s.iloc[n0:]
    sk = rest.step[rest.skipped].to_numpy()
    gi = int((c.scaler or {}).get("growth_interval") or GRAD_SCALER_DEFAULTS["growth_interval"])
    if len(sk) == 0 or len(rest) < gi:
        return []
    if len(sk) >= 2:
        gap = float(np.median(np.diff(sk)))
        if not 0.5 * gi <= gap <= 1.5 * gi:
            return []
    rate = len(sk) / len(rest)
    return [make_finding(
        "periodic_probe", step=int(sk[0]), value=rate, threshold=1.0 / gi,
        message=(f"{len(sk)} skipped step(s) after the start, about one every {gi} steps (skip rate {rate:.4f} vs "
                 f"1/growth_interval = {1 / gi:.4f}): the GradScaler's normal probing for a larger scale."),
        fix="Nothing to fix. A larger growth_interval probes less often.",
    )]


def stale_grad(c: Context) -> list[Finding]:
    """A parameter gradient stays non-finite on consecutive steps because it is not reset.

    When the recorder saw whether ``.grad`` was reset before each step's first backward
    (``run.steps.grad_reset``), that evidence decides (see
    :func:`mpscope.advisor.loop_findings.stale_grad_evidence`). Otherwise, for older runs,
    evidence for one step: ``param_grad`` non-finite, loss finite, and every ``activation_grad``
    row of that step finite (the new backward produced finite numbers, so the inf/NaN is left over
    from an earlier step). Steps without activation_grad rows count when the loss is finite.
    Reported when that holds on at least STALE_MIN_STEPS consecutive steps with a non-decreasing
    count of non-finite elements (a fresh overflow in the weight-gradient product itself shrinks
    as the GradScaler halves the scale; a stale one only grows).
    """

    evidence = stale_grad_evidence(c)
    if evidence is not None:  # the recorder saw whether .grad was reset: that decides
        return evidence
    t, s = c.t, c.s
    pg = t[(t.role == "param_grad") & t._nonfinite]
    if pg.empty:
        return []
    finite_loss = set(s.step[np.isfinite(s.loss.astype(float))]) if len(s) else set(pg.step)
    ag = t[t.role == "activation_grad"]
    dirty_bwd = set(ag.step[ag._nonfinite])
    ok_steps = finite_loss - dirty_bwd
    out = []
    for (module, name), g in pg.groupby(["module", "name"], sort=False, observed=True):
        g = g[g.step.isin(ok_steps)].sort_values("step").drop_duplicates("step")
        if g.empty:
            continue
        st = g.step.to_numpy()
        bad = (g.nan_count + g.inf_count).to_numpy()
        run_len, best, start, best_start = 1, 1, st[0], st[0]
        for i in range(1, len(st)):
            if st[i] == st[i - 1] + 1 and bad[i] >= bad[i - 1]:
                run_len += 1
            else:
                run_len, start = 1, st[i]
            if run_len > best:
                best, best_start = run_len, start
        if best >= STALE_MIN_STEPS:
            r = g[g.step == best_start].iloc[0]
            rank = rank_of(c, r)
            out.append(make_finding(
                "stale_grad", r, value=float(best), threshold=float(STALE_MIN_STEPS), rank=rank,
                message=(f"param_grad '{name}' of module '{module_label(module)}' stays non-finite for {best} consecutive steps from "
                         f"step {int(best_start)}{on_rank(rank)} (never fewer non-finite elements) while the loss and that step's "
                         f"backward are finite: the gradient is not being reset."),
                fix="Call optimizer.zero_grad() (or set_to_none) every step, also on steps the GradScaler skips.",
            ))
    return out


def clip_before_unscale(c: Context) -> list[Finding]:
    s = c.s
    if s.empty or "clipped_before_unscale" not in s.columns:
        return []
    bad = s[s.clipped_before_unscale.fillna(False).astype(bool)]
    if bad.empty:
        return []
    finite = bad[np.isfinite(bad.clip_norm.astype(float))] if "clip_norm" in bad.columns else bad
    r = finite.iloc[0] if len(finite) else bad.iloc[0]
    norm = float(r.clip_norm) if "clip_norm" in s.columns else float("nan")
    ls = float(r.loss_scale)
    first = f"on {len(bad)} step(s) (first at step {int(bad.step.iloc[0])})"
    if math.isfinite(norm):
        message = (f"Gradients were clipped while still multiplied by the loss scale {fmt_scale(ls)} {first}: at step "
                   f"{int(r.step)} the clip saw a norm of {fmt_number(norm)}, the true norm is about "
                   f"{fmt_number(norm / ls)}, so the update was shrunk by about {fmt_number(ls)}x.")
    else:
        message = (f"Gradients were clipped while still multiplied by the loss scale {fmt_scale(ls)} {first}: a clip "
                   f"threshold meant for unscaled gradients cut them by up to {fmt_number(ls)}x (the clip's norm was "
                   "not recorded).")
    return [make_finding(
        "clip_before_unscale", step=int(r.step), value=norm, threshold=ls,
        message=message,
        fix="Call scaler.unscale_(optimizer) before torch.nn.utils.clip_grad_norm_(...), then scaler.step(optimizer).",
    )]


def grads_changed_before_unscale(c: Context) -> list[Finding]:
    """The model's gradients were changed in place between the training backward and
    ``scaler.unscale_`` by code no clip helper saw (``run.meta["grads_changed_before_unscale"]``:
    each ``.grad``'s version counter moved). A clip by hand there applies its threshold to scaled
    gradients; a uniform rescale (dividing by the accumulation steps or the world size) is harmless.
    The effect cannot tell them apart, so this is a warning that names both; steps that already
    have a ``clip_before_unscale`` are left to that finding."""
    steps = [int(x) for x in c.meta.get("grads_changed_before_unscale") or []]
    s = c.s
    if not steps or s.empty:
        return []
    clipped = set(s.step[s.clipped_before_unscale.fillna(False).astype(bool)]) if "clipped_before_unscale" in s else set()
    steps = [x for x in steps if x not in clipped]
    if not steps:
        return []
    row = s[s.step == steps[0]]
    ls = float(row.loss_scale.iloc[0]) if len(row) and "loss_scale" in s else float("nan")
    return [make_finding(
        "grads_changed_before_unscale", step=steps[0], value=float(len(steps)), threshold=ls,
        message=(f"The gradients were changed in place before scaler.unscale_ on {len(steps)} step(s) (first at step "
                 f"{steps[0]}), by code that called no torch clip function, while still multiplied by the loss "
                 f"scale {fmt_scale(ls)}. If that code clips (a threshold on the norm or on values), the threshold "
                 f"was applied to scaled gradients and cut them by up to {fmt_number(ls)}x; if it only rescales by a "
                 "constant (dividing by the accumulation steps or the world size), it is harmless."),
        fix=("Move any clipping after scaler.unscale_(optimizer): scaler.unscale_(optimizer), then clip, then "
             "scaler.step(optimizer)."),
    )]


def optimizer_state_precision(c: Context) -> list[Finding]:
    t = c.t
    st = t[(t.role == "optimizer_state") & t.dtype.isin(LOW_PRECISION)]
    eps = (c.meta.get("optimizer_hparams") or {}).get("eps")
    out = []
    for module, g in st.sort_values(["step", "_order"]).groupby("module", sort=False, observed=True):
        r = g.iloc[0]
        fmt = FORMATS[r["dtype"]]
        w = t[(t.role == "weight") & (t.module == module)]
        nan_w = w[w._nonfinite]
        cons = ""
        if not nan_w.empty:
            rw = nan_w.iloc[0]
            cons = (f" After the step, {int(rw.nan_count + rw.inf_count)} of {int(rw.numel)} elements of weight "
                    f"'{rw['name']}' are non-finite (step {int(rw.step)}).")
        second_moment = any(str(n).endswith("exp_avg_sq") for n in g["name"].unique())
        if eps is not None and 0 < float(eps) < fmt.min_subnormal and second_moment:
            value, threshold = float(eps), fmt.min_subnormal
            why = (f"eps = {fmt_number(float(eps))} is below {r['dtype']}'s smallest subnormal {fmt_number(fmt.min_subnormal)} and "
                   f"rounds to 0: where exp_avg_sq is 0 - a zero gradient, or squared gradients below "
                   f"{fmt_number(fmt.min_subnormal)} that underflow - the update divides by 0 (inf, or NaN for a "
                   "zero gradient).")
        elif second_moment:
            value, threshold = float(eps) if eps is not None else None, fmt.min_subnormal
            why = (f"Its moments and every update are rounded to {r['dtype']} ({fmt.mantissa_bits} mantissa bits, "
                   f"range {fmt_number(fmt.min_subnormal)} .. {fmt_number(fmt.max)}); squared gradients below "
                   f"{fmt_number(math.sqrt(fmt.min_subnormal))} vanish from exp_avg_sq.")
        else:
            value, threshold = None, fmt.min_subnormal
            why = (f"It is rounded to {r['dtype']} ({fmt.mantissa_bits} mantissa bits, range "
                   f"{fmt_number(fmt.min_subnormal)} .. {fmt_number(fmt.max)}): each update of it loses what is "
                   "below half its spacing, and values past the range overflow or flush.")
        out.append(make_finding(
            "optimizer_state_precision", r, value=value, threshold=threshold,
            message=f"Optimizer state '{r['name']}' of module '{module_label(module)}' is kept in {r['dtype']}. {why}{cons}",
            fix=("Keep master weights and optimizer state in fp32: leave the model in fp32 and use torch.autocast "
                 f"instead of .half()/.bfloat16(); if the state must stay in {r['dtype']}, use eps >= "
                 f"{fmt_number(fmt.min_normal)} (its smallest normal)."),
        ))
    return out


def stagnant_low_precision_weights(c: Context) -> list[Finding]:
    t, s = c.t, c.s
    w = t[(t.role == "weight") & t.dtype.isin(LOW_PRECISION)]
    if w.empty:
        return []
    ran = set(s.step[~s.skipped]) if len(s) else set(w.step)
    pg = t[(t.role == "param_grad") & (t.absmax > 0) & ~t._nonfinite]
    grad_keys = set(zip(pg.step, pg.module, pg.name))
    hp = c.meta.get("optimizer_hparams") or {}
    opt = str(c.meta.get("optimizer") or "")
    lr = hp.get("lr")
    cols = [k for k in _WEIGHT_STATS if k in w.columns]
    out = []
    for (module, name), g in w.groupby(["module", "name"], sort=False, observed=True):
        g = g[[(st in ran) and ((st, module, name) in grad_keys) for st in g.step]].sort_values("step")
        if len(g) < STAGNANT_MIN_STEPS:
            continue
        vals = g[cols].to_numpy(dtype=float)
        same = np.all((vals == vals[0]) | (np.isnan(vals) & np.isnan(vals[0])))
        if not same:
            continue
        r = g.iloc[0]
        fmt = FORMATS[r["dtype"]]
        limit = math.ldexp(1.0, -(fmt.mantissa_bits + 2))  # half an ulp, over the whole binade
        absmax = float(r.absmax)
        value = None
        detail = ""
        if lr is not None and absmax > 0 and any(a in opt.lower() for a in _ADAPTIVE):
            value = float(lr) / absmax
            detail = (f" {opt} moves each weight by about lr = {fmt_number(float(lr))}, i.e. {fmt_number(value)}·|w| at |w| = "
                      f"{fmt_number(absmax)}, below half a {r['dtype']} ulp (2^-{fmt.mantissa_bits + 2}·|w| = {fmt_number(limit)}·|w|).")
        out.append(make_finding(
            "stagnant_low_precision_weights", r, value=value, threshold=limit,
            message=(f"Weight '{name}' of module '{module_label(module)}' is stored in {r['dtype']} and its values did not change over "
                     f"{len(g)} optimizer steps although its gradient is non-zero: each update is rounded away.{detail}"),
            fix=(f"Keep fp32 master weights: leave the parameters in fp32 and use torch.autocast(dtype=torch.{r['dtype']}), "
                 f"or an optimizer with fp32 master copies / Kahan summation; a larger lr is not a fix."),
        ))
    return out


def norm_statistics(c: Context) -> list[Finding]:
    t = c.t
    mods = [m for m in dict.fromkeys(t.module) if _frames.is_norm_module(c.run, m, c.types)]
    if not mods:
        return []
    sub = t[t.module.isin(mods)]
    out = []
    first_bad = first_nonfinite(c)
    upstream = first_bad[0].module if first_bad else None
    for module, g in sub.sort_values(["step", "_order"]).groupby("module", sort=False, observed=True):
        low_w = g[(g.role == "weight") & g.dtype.isin(LOW_PRECISION)]
        bad = g[g._nonfinite & g.role.isin(("activation", "buffer"))]
        dead = g[(g.role == "activation") & (g.zero_frac >= 1.0) & (g.numel > 1)]
        if not bad.empty:
            r = bad.iloc[0]
            cons = ""
            if upstream and upstream != module:
                cons = f" This is a consequence of the non-finite input from module '{module_label(upstream)}' (first_nonfinite)."
                if "batch" in c.types.get(module, "").lower() or (g.role == "buffer").any():
                    cons += (" In training mode its running statistics (running_mean/running_var buffers) are "
                             "updated from this batch and hold NaN too, although they are fp32.")
            out.append(make_finding(
                "norm_statistics", r, value=float(r.nan_count + r.inf_count), threshold=0.0,
                message=(f"Normalisation module '{module_label(module)}' {r.role} '{r['name']}' holds {int(r.nan_count)} NaN and "
                         f"{int(r.inf_count)} inf of {int(r.numel)} at step {int(r.step)}: its mean/variance "
                         f"overflowed or were computed from non-finite values.{cons}"),
                fix=("Fix the upstream overflow first; compute normalisation statistics in fp32 (keep this module in "
                     "fp32); reset running_mean/running_var (module.reset_running_stats()) after a NaN batch."),
            ))
        elif not dead.empty:
            r = dead.iloc[0]
            out.append(make_finding(
                "norm_statistics", r, value=1.0, threshold=1.0,
                message=(f"Normalisation module '{module_label(module)}' outputs only zeros at step {int(r.step)} ({r['dtype']}): "
                         f"the variance overflowed to inf and its reciprocal square root is 0 (a silent failure, no NaN)."),
                fix="Compute the variance in fp32: keep this module in fp32 (x.float().pow(2).mean()).",
            ))
        elif not low_w.empty:
            r = low_w.iloc[0]
            out.append(make_finding(
                "norm_statistics", r, value=None, threshold=None,
                message=(f"Normalisation module '{module_label(module)}' keeps its parameters in {r['dtype']} (not fp32): its statistics "
                         f"and affine parameters lose precision."),
                fix="Keep normalisation layers in fp32 (autocast does this on CUDA; on CPU cast the module with .float()).",
            ))
    return out


def scaler_desync(c: Context) -> list[Finding]:
    """The ranks' GradScalers disagree on the loss scale, found_inf, the skipped step or the scale
    after update() at some step (``run.tables["rank_disagreement"]`` of a merged multi-rank Run).

    Data-parallel ranks must step the same optimizer state: a rank that skips a step the others take,
    or scales its loss differently, silently desynchronises the replicas.
    """
    d = getattr(c.run, "tables", {}).get("rank_disagreement")
    if d is None or not len(d):
        return []
    first = int(d.step.min())
    at = d[d.step == first]
    what = "; ".join(f"{r.column} from {fmt_number(float(r['min']))} to {fmt_number(float(r['max']))}" for _, r in at.iterrows())
    return [make_finding(
        "scaler_desync", step=first, value=float(d.step.nunique()), threshold=0.0,
        message=(f"The ranks' GradScalers disagree on {d.step.nunique()} step(s), first at step {first} ({what} "
                 f"across ranks): the replicas no longer take the same optimizer steps."),
        fix=("Build the GradScaler with the same arguments on every rank and call scale/step/update on every rank "
             "every step; under FSDP1 use ShardedGradScaler (it all-reduces found_inf)."),
    )]


DETECTORS = (
    first_nonfinite,
    forward_overflow,
    activation_headroom,
    grad_underflow,
    frozen_layer,
    scale_collapse,
    init_scale_too_high,
    periodic_probe,
    stale_grad,
    clip_before_unscale,
    grads_changed_before_unscale,
    optimizer_state_precision,
    stagnant_low_precision_weights,
    norm_statistics,
    scaler_desync,
)


def module_findings(run_or_context: Any) -> list[Finding]:
    """Every module-level finding for a Run, in DETECTORS order (errors are not sorted first)."""
    c = run_or_context if isinstance(run_or_context, Context) else Context(run_or_context)
    out: list[Finding] = []
    for det in DETECTORS:
        out.extend(det(c))
    return out
