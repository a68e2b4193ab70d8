"""Compact summary of a Run (text and HTML): the worst tensors against fp16 limits, skipped steps.

Used by the ``%%mpscope`` cell, ``mpscope demo`` and ``mpscope advise``. A pure view: it reads the
Run's frames and never changes them.
"""

from __future__ import annotations

import html

import pandas as pd

from mpscope.formats import FP16
from mpscope.schema import fmt_number, fmt_scale, module_label


def worst_tensors(run, n: int = 5) -> dict[str, pd.DataFrame]:
    """The tensors closest to or beyond fp16's limits, worst first.

    Returns:
        ``{"overflow": ..., "underflow": ...}``: activations ranked by peak ``absmax / 65504``
        (the fp16 max, from torch.finfo) and gradients (activation_grad, param_grad) ranked by peak
        underflow plus subnormal fraction in their own 16-bit format (fp32 gradients lose nothing), at most ``n`` rows each, with columns
        ``module, role, name, dtype, step`` (where the peak occurred) and the ranking value.
    """
    t = run.tensors
    out = {}
    act = t[t.role.isin(["activation", "op_output"])]
    if len(act):
        a = act.assign(fp16_headroom=FP16.max / act.absmax, nonfinite=act.nan_count + act.inf_count)
        idx = a.groupby(["module", "role", "name"], observed=True).absmax.idxmax().dropna()
        top = a.loc[idx.astype(int)].sort_values(["nonfinite", "absmax"], ascending=False).head(n)
        out["overflow"] = top[["module", "role", "name", "dtype", "step", "absmax", "fp16_overflow_frac", "nonfinite"]]
    else:
        out["overflow"] = pd.DataFrame()
    # only gradients held in a 16-bit format lose anything (fp32 grads after unscale_ lose nothing)
    grads = t[t.role.isin(["activation_grad", "param_grad"]) & t["dtype"].isin(["float16", "bfloat16"])]
    if len(grads):
        is16 = grads["dtype"] == "float16"
        lost = (grads.fp16_underflow_frac + grads.fp16_subnormal_frac).where(
            is16, grads.bf16_underflow_frac + grads.bf16_subnormal_frac)
        g = grads.assign(lost=lost)
        idx = g.groupby(["module", "role", "name"], observed=True).lost.idxmax().dropna()
        top = g.loc[idx.astype(int)].sort_values("lost", ascending=False).head(n)
        top = top[top.lost > 0]
        out["underflow"] = top[["module", "role", "name", "dtype", "step", "lost", "fp16_underflow_frac", "loss_scale"]]
    else:
        out["underflow"] = pd.DataFrame()
    return out


def _step_line(run) -> str:
    s = run.steps
    if not len(s):
        return "no steps recorded"
    skipped = int(s.skipped.sum())
    losses = s.loss[s.loss.notna()]
    parts = [f"{len(s)} steps ({int(s.recorded.sum())} recorded)", f"{skipped} skipped by the GradScaler" if run.meta.get("scaler") else f"{skipped} skipped"]
    if len(losses):
        parts.append(f"loss {losses.iloc[0]:.4g} -> {losses.iloc[-1]:.4g}")
    if run.meta.get("scaler"):
        parts.append(f"loss scale {fmt_scale(s.loss_scale.iloc[0])} -> {fmt_scale(s.scale_after.iloc[-1])}")
    return ", ".join(parts)


def text_summary(run, advice=None, n: int = 5) -> str:
    """Plain-text summary: run line, worst layers vs fp16 limits, and the recommendation headline."""
    meta = run.meta
    lines = [
        f"mpscope: {meta.get('model', '?')} on {meta.get('device', '?')}, autocast {meta.get('autocast_dtype') or 'off'}",
        "  " + _step_line(run),
    ]
    worst = worst_tensors(run, n)
    if len(worst["overflow"]):
        lines.append(f"  largest activations vs the fp16 max {FP16.max:g}:")
        for r in worst["overflow"].itertuples():
            lines.append(
                f"    {module_label(r.module)} {r.name} [{r.dtype}] absmax {fmt_number(r.absmax)} at step {r.step}"
                + (f", {r.nonfinite} non-finite" if r.nonfinite else "")
            )
    if len(worst["underflow"]):
        lines.append(f"  16-bit gradients below their format's normal range (float16: {FP16.min_normal:.3g}), flushed or subnormal:")
        for r in worst["underflow"].itertuples():
            lines.append(
                f"    {module_label(r.module)} {r.role} {r.name}: worst {r.lost:.1%} flushed or subnormal at step {r.step} "
                f"(loss scale {fmt_scale(r.loss_scale)}, scaled units)" if r.loss_scale != 1 else
                f"    {module_label(r.module)} {r.role} {r.name}: worst {r.lost:.1%} flushed or subnormal at step {r.step} (unscaled)"
            )
    if advice is not None:
        lines.append(f"  recommendation: {_headline(advice)}")
    return "\n".join(lines)


def _headline(advice) -> str:
    parts = [f"dtype {advice.dtype}"]
    if advice.grad_scaler:
        parts.append("GradScaler(" + ", ".join(f"{k}={fmt_scale(v) if k == 'init_scale' else fmt_number(v)}" for k, v in advice.grad_scaler.items()) + ")")
    if advice.fp32_modules:
        parts.append("keep in fp32: " + ", ".join(advice.fp32_modules))
    bad = [f for f in advice.findings if f.severity in ("error", "warning")]
    parts.append(f"{len(bad)} warning/error finding(s)" if bad else "no warning or error finding: the run's numbers fit")
    return "; ".join(parts)


#: What the summary tables' columns mean (shown under each table).
_COLUMNS = {
    "overflow": ("step: where the tensor's largest |x| (absmax, any dtype) was recorded; fp16_overflow_frac: "
                 "fraction of its elements that a cast to float16 turns into inf, at that step; nonfinite: NaN + inf "
                 "elements already present."),
    "underflow": ("step: where the most was lost; lost: fraction of elements flushed to 0 or subnormal in the "
                  "gradient's own 16-bit dtype, at that step; fp16_underflow_frac: the flushed part alone; "
                  "loss_scale: the scale the gradient carried (scaled units; 2^0 = unscaled)."),
}


def html_summary(run, advice=None, n: int = 5) -> str:
    """The same summary as an HTML fragment (every name escaped)."""
    e = html.escape
    meta = run.meta
    out = [
        "<div class='mpscope-summary'>",
        f"<b>mpscope</b>: {e(str(meta.get('model', '?')))} on {e(str(meta.get('device', '?')))}, "
        f"autocast {e(str(meta.get('autocast_dtype') or 'off'))}<br>{e(_step_line(run))}",
    ]
    worst = worst_tensors(run, n)
    for key, title in (("overflow", f"Largest activations (fp16 max {FP16.max:g})"), ("underflow", "16-bit gradients flushed or subnormal")):
        frame = worst[key]
        if len(frame):
            frame = frame.assign(module=frame["module"].map(module_label))
            if "loss_scale" in frame:
                frame = frame.assign(loss_scale=frame["loss_scale"].map(fmt_scale))
            out.append(f"<h4>{e(title)}</h4>")
            out.append(frame.to_html(index=False, escape=True, float_format=lambda v: f"{v:.3g}"))
            out.append(f"<p style='font-size:smaller'>{e(_COLUMNS[key])}</p>")
    if advice is not None:
        out.append(f"<p><b>Recommendation</b>: {e(_headline(advice))}</p>")
    out.append("</div>")
    return "\n".join(out)
