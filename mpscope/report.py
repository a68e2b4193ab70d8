"""Standalone HTML report of a Run: one file, no network needed to open it.

``write_report(run, path)`` (also ``run.report(path)`` and ``mpscope report RUN_DIR -o report.html``)
writes the layer explorer's views, static: the recommendation, a table of the modules nearest the
fp16 limits, heatmaps of modules × steps per role, the predicted fp16 fate of the gradients at the
recorded loss scale, the loss-scale timeline, and the detail (magnitude band and exponent
histogram) of the modules the findings name. Charts come from :mod:`mpscope.widgets.charts`, so the
numbers are the explorer's.

Self-contained: the Vega / Vega-Lite / vega-embed JavaScript is inlined once (bundled by
``vl_convert.javascript_bundle``, as altair's ``save(inline=True)`` does) and every chart's data is
inlined in its spec; the file has no ``<script src>``, stylesheet link or image URL. Every string
from the run (module, tensor and model names, findings) is HTML-escaped in markup, and JSON inside
``<script>`` has ``<``, ``>`` and ``&`` written as ``\\u003c`` etc., so a module named
``</script><script>alert(1)</script>`` is shown, never executed.
"""

from __future__ import annotations

import datetime as _dt
import functools
import html
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd

from mpscope.widgets import _advisor_function, _as_run, _default_advice, charts

__all__ = ["write_report", "render_report"]

#: Most modules drawn with a detail panel (band + exponent histogram).
MAX_DETAIL_MODULES = 6
#: Rows of the "nearest the limits" table.
MAX_TABLE_ROWS = 30

_HEATMAP_STATS = {
    "activation": ("log2_absmax", "fp16_overflow_frac"),
    "activation_grad": ("log2_absmax", "fp16_underflow_frac"),
    "param_grad": ("log2_absmax", "fp16_underflow_frac"),
    "weight": ("log2_absmax",),
    "optimizer_state": ("log2_absmax", "fp16_underflow_frac"),
}


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _script_json(obj) -> str:
    """JSON safe to place inside a <script> element (no '</script>', no HTML comment openers)."""
    s = json.dumps(obj, allow_nan=False, default=str)
    return (s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _clean(obj):
    """Replace NaN / inf (invalid JSON) by null throughout a spec."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


@functools.lru_cache(maxsize=1)
def _vega_bundle() -> str:
    from altair.utils._importers import import_vl_convert, vl_version_for_vl_convert

    vlc = import_vl_convert()
    js = vlc.javascript_bundle(vl_version=vl_version_for_vl_convert())
    return js.replace("</script", "<\\/script")


def _limits_table(tensors: pd.DataFrame) -> str:
    if tensors.empty:
        return "<p><i>no tensor rows</i></p>"
    t = tensors
    nonfinite = t["nan_count"].to_numpy(dtype=np.float64) + t["inf_count"].to_numpy(dtype=np.float64)
    tmp = pd.DataFrame({
        "module": t["module"].astype(str).to_numpy(), "role": t["role"].astype(str).to_numpy(),
        "dtype": t["dtype"].astype(str).to_numpy(), "absmax": t["absmax"].to_numpy(dtype=np.float64),
        "ovf": t["fp16_overflow_frac"].to_numpy(dtype=np.float64),
        "unf": t["fp16_underflow_frac"].to_numpy(dtype=np.float64),
        "sub": t["fp16_subnormal_frac"].to_numpy(dtype=np.float64), "nonfinite": nonfinite,
    })
    g = tmp.groupby(["module", "role"], sort=False).agg(
        dtype=("dtype", lambda s: ", ".join(sorted(set(s)))), absmax=("absmax", "max"), ovf=("ovf", "max"),
        unf=("unf", "max"), sub=("sub", "max"), nonfinite=("nonfinite", "sum")).reset_index()
    # nearest the limits: any non-finite, then overflow, then underflow, then absmax
    g = g.sort_values(["nonfinite", "ovf", "unf", "absmax"], ascending=False, na_position="last").head(MAX_TABLE_ROWS)
    head = ("<tr><th>module</th><th>role</th><th>dtype</th><th>max |x|</th><th>max fp16 overflow</th>"
            "<th>max fp16 underflow</th><th>max fp16 subnormal</th><th>non-finite elements</th></tr>")
    body = "".join(
        f"<tr><td><code>{_esc(r.module or '(root)')}</code></td><td>{_esc(r.role)}</td><td>{_esc(r.dtype)}</td>"
        f"<td>{r.absmax:.4g}</td><td>{r.ovf:.3%}</td><td>{r.unf:.3%}</td><td>{r.sub:.3%}</td>"
        f"<td>{int(r.nonfinite)}</td></tr>"
        for r in g.itertuples()
    )
    return f"<table>{head}{body}</table>"


def _detail_modules(run, advice) -> list[tuple[str, str]]:
    """(module, role) pairs for detail panels: those the findings name, else the activations with
    the largest absmax."""
    out: list[tuple[str, str]] = []
    present = set(charts.roles_present(run.tensors))
    for f in getattr(advice, "findings", []) or []:
        mod, role = getattr(f, "module", None), getattr(f, "role", None)
        if mod is None or role not in present:
            continue
        if (str(mod), role) not in out:
            out.append((str(mod), role))
    if not out and "activation" in present:
        t = run.tensors[run.tensors["role"] == "activation"]
        worst = t.groupby(t["module"].astype(str))["absmax"].max().sort_values(ascending=False)
        out = [(m, "activation") for m in worst.index[:3]]
    return out[:MAX_DETAIL_MODULES]


def render_report(run, advice=None, title: str | None = None) -> str:
    """The report's HTML text (see :func:`write_report`)."""
    run = _as_run(run)
    if advice is None:
        advice, advice_error = _default_advice(run)
    else:
        advice_error = None
    tensors, steps, hists, meta = run.tensors, run.steps, run.histograms, dict(run.meta or {})
    specs: list[dict] = []
    sections: list[str] = []

    def chart(c, caption: str = "") -> str:
        specs.append(_clean(c.to_dict()))
        cap = f"<figcaption>{_esc(caption)}</figcaption>" if caption else ""
        return f'<figure><div class="chart" id="chart-{len(specs) - 1}"></div>{cap}</figure>'

    # -- recommendation
    if advice is not None and hasattr(advice, "_repr_html_"):
        rec = advice._repr_html_()
    else:
        rec = f"<p><b>{_esc(advice_error or 'advisor unavailable')}</b></p>"
    sections.append(f"<section><h2>Recommendation</h2>{rec}</section>")

    # -- table
    sections.append("<section><h2>Modules nearest the fp16 limits</h2>"
                    "<p>Per module and role, the worst value over the run (fp16 max 65504, min normal "
                    "2^-14, min subnormal 2^-24).</p>" + _limits_table(tensors) + "</section>")

    # -- heatmaps (modules in forward execution order in every view)
    order = charts.forward_order(tensors)
    parts = []
    for role in charts.roles_present(tensors):
        for stat in _HEATMAP_STATS.get(role, ("log2_absmax",)):
            cells = charts.cell_frame(tensors, role, stat, order=order)
            if cells.empty:
                continue
            parts.append(chart(charts.heatmap_chart(cells, stat, title=f"{role}: {charts.STATISTICS[stat].label}")))
    if int(tensors["nan_count"].sum() + tensors["inf_count"].sum()) > 0 if len(tensors) else False:
        for role in charts.roles_present(tensors):
            cells = charts.cell_frame(tensors, role, "nonfinite_frac", order=order)
            if cells["value"].fillna(0).gt(0).any():
                parts.append(chart(charts.heatmap_chart(cells, "nonfinite_frac", title=f"{role}: non-finite fraction")))
    sections.append("<section><h2>Modules × steps</h2>" + ("".join(parts) or "<p><i>no tensor rows</i></p>")
                    + "</section>")

    # -- what-if: the advisor's scale_whatif, totals over k and per module at the recorded scale
    roles = set(charts.roles_present(tensors))
    grad_role = "activation_grad" if "activation_grad" in roles else ("param_grad" if "param_grad" in roles else None)
    scales = steps["loss_scale"][steps["loss_scale"] > 0] if len(steps) else pd.Series([], dtype=float)
    k = int(round(np.log2(float(scales.iloc[0])))) if len(scales) else 0  # the run's first loss scale
    if grad_role is not None and len(hists):
        whatif, error = _advisor_function("scale_whatif")
        body = ""
        if whatif is None:
            body = f"<p><i>{_esc(error)}</i></p>"
        else:
            try:
                curve = whatif(run, ks=range(k - 24, k + 17))
                per = whatif(run, ks=[k], per_module=True, roles=[grad_role])
            except Exception as exc:
                body = f"<p><i>advisor unavailable: scale_whatif raised {_esc(type(exc).__name__)}: {_esc(exc)}</i></p>"
            else:
                if len(curve):
                    body += chart(charts.whatif_curve_chart(curve, k),
                                  "Gradient elements (activation and parameter gradients) by fp16 fate "
                                  "against the loss scale; dashed: the recorded scale.")
                if len(per):
                    rank = {m: i for i, m in enumerate(order)}
                    per = per.assign(module=per["module"].astype(str))
                    per = per.sort_values("module", key=lambda m: m.map(rank).fillna(len(rank)), kind="stable")
                    body += chart(charts.prediction_chart(per, k, grad_role))
        if body:
            sections.append("<section><h2>Loss-scale what-if</h2>" + body + "</section>")

    # -- timeline
    if len(steps):
        sections.append("<section><h2>Loss scale and loss</h2>"
                        + chart(charts.timeline_chart(charts.timeline_frame(steps))) + "</section>")

    # -- details
    def hist_title(shift: int) -> str:
        return "exponents, all recorded steps" + (f", × 2^{shift} (the run's loss scale)" if shift else "")

    det = []
    for module, role in _detail_modules(run, advice):
        band = charts.band_frame(tensors, module, role)
        shift = k if role in charts.GRAD_ROLES else 0  # gradients as fp16 holds them at the run's scale
        hist = charts.exponent_frame(hists, module, role, shift=shift)
        dtypes = ", ".join(f"{_esc(n)}: {_esc(d)}" for n, d in charts.dtypes_of(tensors, module, role).items())
        det.append(f"<h3><code>{_esc(module or '(root)')}</code> · {_esc(role)}</h3><p>dtype: {dtypes or '—'}</p>"
                   f"<div class='row'>{chart(charts.band_chart(band))}"
                   f"{chart(charts.exponent_chart(hist, title=hist_title(shift)))}</div>")
    if det:
        sections.append("<section><h2>Detail</h2>" + "".join(det) + "</section>")

    meta_rows = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in meta.items())
    title = title or f"mpscope report — {meta.get('model', 'run')}"
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{_esc(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 2px 6px; text-align: left; }}
figure {{ margin: 0.5em 0; display: inline-block; vertical-align: top; }}
figcaption {{ font-size: 12px; color: #555; }}
.row {{ display: flex; flex-wrap: wrap; gap: 1em; }}
details summary {{ cursor: pointer; }}
</style>
<script>
{_vega_bundle()}
</script>
</head>
<body>
<h1>{_esc(title)}</h1>
<p>{len(tensors):,} tensor rows, {len(steps):,} steps, written {now} by mpscope.</p>
<details><summary>run metadata</summary><table>{meta_rows}</table></details>
{''.join(sections)}
<script>
const mpscopeSpecs = {_script_json(specs)};
mpscopeSpecs.forEach((spec, i) => {{
  vegaEmbed("#chart-" + i, spec, {{renderer: "svg", actions: false}}).catch(console.error);
}});
</script>
</body>
</html>
"""


def write_report(run, path, advice=None) -> Path:
    """Write the standalone HTML report of ``run`` to ``path`` (UTF-8) and return the path.

    Args:
        run: an :class:`mpscope.Run` or the directory of a saved run.
        path: the ``.html`` file to write; its parent directory must exist.
        advice: a Recommendation; ``None`` calls ``mpscope.advise(run)`` (if the advisor is
            unavailable, the report says so and shows everything else).

    Returns:
        ``pathlib.Path`` of the written file (about 1 MB: the inlined Vega libraries are ~0.9 MB).

    Raises:
        FileNotFoundError: the parent directory of ``path`` does not exist.
        TypeError: ``run`` is neither a Run nor a path.
    """
    path = Path(os.fspath(path))
    if not path.parent.exists():
        raise FileNotFoundError(f"cannot write the report to {path}: directory {path.parent} does not exist; "
                                "create it first or pass another path")
    text = render_report(run, advice=advice)
    path.write_text(text, encoding="utf-8")
    return path
