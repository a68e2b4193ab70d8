"""Standalone HTML report of a Run: one file, no network needed to open it.

``write_report(run, path)`` (also ``run.report(path)`` and ``mpscope report RUN_DIR -o report.html``)
writes the layer explorer's views, static: the recommendation, a table of the modules nearest the
fp16 limits, heatmaps of modules × steps per role, the predicted fp16 fate of the gradients at the
recorded loss scale, the loss-scale timeline, and the detail (magnitude band and exponent
histogram) of the modules the findings name. A run recorded with ``record(..., shadow=True)`` adds
the SQNR against the float32 reference per module × step (total and own contribution, coloured
against the format's ideal SQNR) and the SQNR over steps of the network output and of the modules
``precision_loss`` names, with the ideal and the finding's threshold drawn as rules. Charts come
from :mod:`mpscope.widgets.charts`, so the numbers are the explorer's.

Heatmaps have at most :data:`MAX_STEP_COLUMNS` step columns: a longer run's steps are binned, each
column showing its worst step, and the report says so. Gradient and optimizer-state heatmaps show
the fraction below the normal range of the run's 16-bit format (subnormal + flushed), the figure of
the ``grad_underflow`` finding. Red-edged rows of the limits table are explained under it.

Self-contained and small: the Vega / Vega-Lite / vega-embed JavaScript is inlined once (bundled by
``vl_convert.javascript_bundle``, as altair's ``save(inline=True)`` does, and cached on disk) and the
charts' specs, data included, are inlined as gzip-compressed JSON in base64, which the page unpacks
with the browser's ``DecompressionStream`` (:func:`embedded_specs` reads them in Python). The file
has no ``<script src>``, stylesheet link or image URL. Every string from the run (module, tensor and
model names, findings) is HTML-escaped in markup, and base64 holds no ``<``, so a module named
``</script><script>alert(1)</script>`` is shown, never executed. The demo run (200 steps, 70 modules)
gives a report of about 1.3 MB, 0.9 MB of it the JavaScript.
"""

from __future__ import annotations

import base64
import datetime as _dt
import functools
import gzip
import html
import json
import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from mpscope.advisor import scale_whatif
from mpscope.formats import FORMATS
from mpscope.kernel import cache_dir
from mpscope.run import as_path, as_run, select_rank
from mpscope.schema import GRAD_ROLES
from mpscope.widgets import _default_advice, charts
from mpscope.widgets import viewmodel as vm

__all__ = ["write_report", "render_report", "embedded_specs"]

#: Most modules drawn with a detail panel (band + exponent histogram).
MAX_DETAIL_MODULES = 6
#: Rows of the "nearest the limits" table.
MAX_TABLE_ROWS = 30
#: Most step columns of a heatmap: longer runs are binned (equal width, each bin shows its worst step).
MAX_STEP_COLUMNS = 50
#: Most points of a line or band over steps (timeline, magnitude band, SQNR); longer runs are binned.
MAX_STEP_POINTS = 500


def _heatmap_statistics(role: str, target: str) -> tuple[str, ...]:
    """The heatmaps of a role: log2 absmax, and the fraction the findings about that role quote:
    overflow for activations, for gradients and optimizer state everything below the normal range
    of ``target`` (the run's 16-bit format: subnormal + flushed, the ``grad_underflow`` figure)."""
    below = "bf16_below_normal_frac" if target == "bfloat16" else "fp16_below_normal_frac"
    return {
        "activation": ("log2_absmax", "fp16_overflow_frac"),
        "activation_grad": ("log2_absmax", below),
        "param_grad": ("log2_absmax", below),
        "weight": ("log2_absmax",),
        "optimizer_state": ("log2_absmax", below),
    }.get(role, ("log2_absmax",))


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _clean(obj):
    """Replace NaN / inf (invalid JSON) by null throughout a spec."""
    if isinstance(obj, dict):
        return {k: (_clean_rows(v) if k == "datasets" else _clean(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _clean_rows(datasets: dict) -> dict:
    """:func:`_clean` of a spec's ``datasets`` (lists of flat row dicts, in place), row by row."""
    for name, rows in datasets.items():
        if not (isinstance(rows, list) and all(isinstance(r, dict) for r in rows)):
            datasets[name] = _clean(rows)
            continue
        for row in rows:
            for k, v in row.items():
                if isinstance(v, float) and not math.isfinite(v):
                    row[k] = None
                elif isinstance(v, (dict, list)):
                    row[k] = _clean(v)
    return datasets


@functools.lru_cache(maxsize=1)
def _vega_bundle() -> str:
    """The Vega / Vega-Lite / vega-embed JavaScript, bundled by vl-convert (about 2 s) and kept in
    mpscope's cache directory (:func:`mpscope.kernel.cache_dir`) under the vl-convert and
    Vega-Lite versions, so that later reports read it (an unwritable cache is skipped)."""
    from altair.utils._importers import (  # altair / vl-convert: optional ("notebook" extra)
        import_vl_convert,
        vl_version_for_vl_convert,
    )

    vlc = import_vl_convert()
    vl_version = vl_version_for_vl_convert()
    cached = cache_dir() / f"vega-bundle-{getattr(vlc, '__version__', 'unknown')}-vl{vl_version}.js"
    try:
        js = cached.read_text(encoding="utf-8")
        if "vegaEmbed" in js:
            return js
    except OSError:
        pass
    js = vlc.javascript_bundle(vl_version=vl_version).replace("</script", "<\\/script")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        tmp.write_text(js, encoding="utf-8")
        os.replace(tmp, cached)
    except OSError:
        pass
    return js


def _specs_payload(specs: list[dict]) -> str:
    """The charts' specs as the report carries them: compact JSON, gzip-compressed, base64 (ASCII
    letters, digits, ``+/=``: nothing in it can end a ``<script>`` element). The heatmaps' cells
    compress about tenfold; :func:`embedded_specs` reads them back."""
    data = json.dumps(specs, allow_nan=False, default=str, separators=(",", ":")).encode("utf-8")
    return base64.b64encode(gzip.compress(data, compresslevel=6, mtime=0)).decode("ascii")


#: The report's script: decompress the specs (the browser's own DecompressionStream), embed each chart.
_EMBED_JS = """(async () => {
  if (typeof DecompressionStream === "undefined") {
    document.querySelectorAll(".chart").forEach(el => { el.textContent =
      "This browser cannot decompress the report's charts (DecompressionStream: Chrome 80, Firefox 113, " +
      "Safari 16.4 or later)."; });
    return;
  }
  const bytes = Uint8Array.from(atob(mpscopeSpecsGzip), c => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  const specs = JSON.parse(await new Response(stream).text());
  specs.forEach((spec, i) => {
    vegaEmbed("#chart-" + i, spec, {renderer: "svg", actions: false}).catch(console.error);
  });
})().catch(console.error);"""

_PAYLOAD = re.compile(r'const mpscopeSpecsGzip = "([A-Za-z0-9+/=]*)";')


def embedded_specs(text: str) -> list[dict]:
    """The Vega-Lite specs a report embeds (the text of a file :func:`write_report` wrote), in
    chart order, as the report's script hands them to vega-embed.

    Raises:
        ValueError: ``text`` holds no mpscope chart specs.
    """
    m = _PAYLOAD.search(text)
    if m is None:
        raise ValueError("no mpscope chart specs in this text: pass the content of a report written by "
                         "mpscope.report.write_report (or `mpscope report`)")
    return json.loads(gzip.decompress(base64.b64decode(m.group(1))).decode("utf-8"))


def _pct(x: float, muted: bool = False) -> str:
    cell = f"{x:.3%}" if np.isfinite(x) else "—"
    return f"<td class='context'>{cell}</td>" if muted else f"<td>{cell}</td>"


def _limits_table(tensors: pd.DataFrame, target: str, skipped=()) -> str:
    """Modules nearest their judged format's limits (:func:`mpscope.widgets.viewmodel.risk_table`),
    each figure with the step of its worst value; fp16 fractions of tensors that never meet fp16 muted."""
    if tensors.empty:
        return "<p><i>no tensor rows</i></p>"
    g = vm.risk_table(tensors, target, n=MAX_TABLE_ROWS, skipped_steps=skipped)
    head = ("<tr><th>module</th><th>role</th><th>dtype</th><th>judged in</th><th>max |x| (step)</th>"
            "<th>overflow (step)</th><th>flushed to 0 (step)</th><th>subnormal (step)</th>"
            "<th>non-finite elements</th><th>fp16 overflow / flushed / subnormal</th></tr>")

    def at(v, step, unit="pct"):
        if not np.isfinite(v) or v == 0:
            return "0" if unit == "pct" and v == 0 else "—"
        return (f"{v:.3%}" if unit == "pct" else f"{v:.4g}") + f" (step {int(step)})"

    body = "".join(
        f"<tr class='{'alarm' if r.alarm else 'quiet'}'><td><code>{_esc(vm.module_label(r.module))}</code></td>"
        f"<td>{_esc(r.role)}</td><td>{_esc(r.dtype)}</td><td>{_esc(r.format)}</td>"
        f"<td>{at(r.absmax, r.absmax_step, 'abs')}</td><td>{at(r.overflow, r.overflow_step)}</td>"
        f"<td>{at(r.underflow, r.underflow_step)}</td><td>{at(r.subnormal, r.subnormal_step)}</td>"
        f"<td>{int(r.nonfinite)}{f' (+{int(r.nonfinite_skipped)} in skipped steps)' if r.nonfinite_skipped else ''}</td>"
        f"<td class='{'context' if r.fp16_context else ''}'>{r.fp16_overflow:.3%} / {r.fp16_underflow:.3%} / "
        f"{r.fp16_subnormal:.3%}{' (context: never fp16)' if r.fp16_context else ''}</td></tr>"
        for r in g.itertuples()
    )
    return f"<table>{head}{body}</table>" + _alarm_legend(g, target)


def _pow2(x: float) -> str:
    k = math.log2(x)
    return f"2^{int(k)}" if k.is_integer() else f"{x:g}"


def _alarm_legend(g: pd.DataFrame, target: str) -> str:
    """What a red-edged row of the limits table means (:func:`mpscope.widgets.viewmodel.risk_table`'s
    ``alarm``), with the thresholds of the 16-bit formats its rows are judged in, and why a float32
    weight is judged in ``target``."""
    formats = sorted({f for fs in g["format"] for f in str(fs).split(", ") if f in FORMATS and f != "float32"}
                     or {target})
    limits = "; ".join(f"{_esc(f)}: |x| ≤ {_pow2(FORMATS[f].underflow_threshold)} rounds to 0, |x| ≥ "
                       f"{FORMATS[f].overflow_threshold:.6g} rounds to inf" for f in formats)
    text = ("<p class='legend'><span class='swatch'></span> <b>Red left edge</b>: something of this module and "
            "role is lost in the format it is judged in: in at least one step an element was flushed to 0 "
            "(the <i>flushed</i> column), overflowed to inf, or was NaN / inf; threshold: any such element, "
            f"a fraction above 0 ({limits}; the limits are <code>torch.finfo</code>'s, the rounding is a cast's, "
            "round to nearest even). Subnormal values alone do not mark a row: they keep a value, with fewer "
            "bits. The findings above apply the advisor's own thresholds; a red edge is not a finding.")
    alarm_roles = set(g.loc[g["alarm"].astype(bool), "role"].astype(str))
    if "weight" in alarm_roles:
        text += (f" <b>Weights</b> are float32 parameters, judged in {_esc(target)} because autocast casts them to "
                 f"{_esc(target)} for the ops it runs in {_esc(target)} (matmuls, linear layers; the weights of a "
                 "module whose outputs were all float32, such as an Embedding, are judged in float32): a flushed "
                 "weight element is a weight that op sees as 0. The float32 weight itself keeps its value.")
    return text + "</p>"


def _findings_table(tensors: pd.DataFrame, advice, target: str) -> str:
    """Every finding with the first and the worst step of the figure it quotes (and the rank, for
    findings of a multi-rank run that rest on one rank's data)."""
    found = list(getattr(advice, "findings", None) or [])
    if not found:
        return ""
    ranked = any(getattr(f, "rank", None) is not None for f in found)

    def rank_cell(f) -> str:
        r = getattr(f, "rank", None)
        return f"<td>{'—' if r is None else _esc(r)}</td>" if ranked else ""

    rows = "".join(
        f"<tr><td>{_esc(f.severity)}</td><td><code>{_esc(f.code)}</code></td>"
        f"<td><code>{_esc(vm.module_label(f.module)) if f.module is not None else '—'}</code></td>"
        f"<td>{_esc(f.role or '—')}</td>{rank_cell(f)}"
        f"<td>{_esc(vm.figures_text(vm.finding_figures(tensors, f, target)) or f'first at step {f.step}')}</td></tr>"
        for f in found)
    return ("<h3>Findings: first and worst step</h3><table><tr><th>severity</th><th>code</th><th>module</th>"
            f"<th>role</th>{'<th>rank</th>' if ranked else ''}<th>figures</th></tr>{rows}</table>")


def _ranks_section(run) -> str:
    """For a merged multi-rank Run: the tensors that held NaN / inf, in the order they appeared,
    with the lowest rank that saw each, and the steps where the ranks' GradScalers disagreed."""
    nf = vm.nonfinite_by_rank(run)
    dis = (getattr(run, "tables", None) or {}).get("rank_disagreement")
    if nf.empty and (dis is None or dis.empty):
        return ""
    n = len(run.ranks)
    body = (f"<p>Rows merged over {n} ranks ({_esc(', '.join(map(str, run.ranks)))}); one rank's own rows: "
            "<code>run.report(path, rank=N)</code>, <code>mpscope.explore(run, rank=N)</code>.</p>")
    if len(nf):
        shown = nf.head(20)
        rows = "".join(f"<tr><td>{int(r.step)}</td><td><code>{_esc(vm.module_label(r.module))}</code></td>"
                       f"<td>{_esc(r.role)}</td><td>{_esc(r['name'])}</td><td>{int(r.first_rank)}</td>"
                       f"<td>{int(r.ranks)} of {n}</td></tr>" for _, r in shown.iterrows())
        more = f"<p>… and {len(nf) - len(shown)} more.</p>" if len(nf) > len(shown) else ""
        body += ("<h3>Non-finite tensors by rank (first first)</h3><table><tr><th>step</th><th>module</th>"
                 f"<th>role</th><th>name</th><th>first rank</th><th>ranks</th></tr>{rows}</table>{more}")
    if dis is not None and len(dis):
        body += "<h3>GradScaler values the ranks disagree on</h3>" + dis.head(20).to_html(index=False, border=0)
    return f"<section><h2>Ranks</h2>{body}</section>"


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


def _binning_note(widths: set[int], steps: pd.DataFrame, tensors: pd.DataFrame) -> str:
    """The sentence saying that the heatmaps' steps were binned and how (``""`` when every column is
    one step)."""
    widths = sorted(int(w) for w in widths)
    if not widths or widths[-1] <= 1:
        return ""
    recorded = int(tensors["step"].nunique()) if len(tensors) else 0
    each = " or ".join(str(w) for w in widths)
    return (f"<p class='note'><b>Steps binned:</b> {recorded:,} recorded steps, at most {MAX_STEP_COLUMNS} columns "
            f"per heatmap: each column spans {each} steps and shows its worst step (the largest value; the lowest "
            "SQNR), which its tooltip names with the column's range. The explorer "
            f"(<code>mpscope.explore(run)</code>) draws up to {charts.MAX_ROWS:,} cells per heatmap.</p>")


def _precision_section(precision: pd.DataFrame, advice, target: str, chart) -> str:
    """The fp32 shadow's section: SQNR over steps of the network output (root) and of the modules
    named by ``precision_loss`` findings (at most :data:`MAX_DETAIL_MODULES`), ``chart`` embedding
    each."""
    named = [f.module for f in getattr(advice, "findings", None) or [] if f.code == "precision_loss"]
    modules = list(dict.fromkeys([""] + named))[:MAX_DETAIL_MODULES]
    ideal = FORMATS[target].ideal_sqnr_db
    figs = "".join(chart(charts.sqnr_chart(charts.sqnr_frame(precision, m, max_rows=2 * MAX_STEP_POINTS), target,
                                           title=f"{vm.module_label(m)}: SQNR against float32"))
                   for m in modules if (precision["module"].astype(str) == m).any())
    return ("<section><h2>Precision against the float32 reference (fp32 shadow)</h2>"
            f"<p>SQNR = 10·log10(Σ ref² / Σ (x − ref)²) of each module's output against a float32 forward of the "
            f"same batch; own contribution: the module fed the reference's inputs. Dashed: {_esc(target)}'s ideal "
            f"SQNR ({ideal:.1f} dB, 6.02 dB per significand bit) and the precision_loss threshold.</p>"
            f"<div class='row'>{figs}</div></section>")


#: The stages :func:`render_report` reports progress on, in order.
_STAGES = ("advice", "limits table", "heatmaps", "loss-scale what-if", "timeline", "detail", "page")


def render_report(run, advice=None, title: str | None = None, rank: int | None = None,
                  progress: bool = False) -> str:
    """The report's HTML text (see :func:`write_report`); ``progress``: a tqdm bar on stderr
    through the stages, shown once rendering has taken half a second."""
    from tqdm.auto import tqdm  # (lazily: import mpscope stays light)

    bar = tqdm(total=len(_STAGES), desc="report", unit="stage", disable=not progress, delay=0.5,
               file=sys.stderr, leave=False)
    try:
        return _render(run, advice, title, rank, bar)
    finally:
        bar.close()


def _render(run, advice, title, rank, bar) -> str:
    def stage(name: str) -> None:
        bar.set_postfix_str(name, refresh=False)
        bar.update(1)

    run = select_rank(as_run(run), rank)
    bar.set_postfix_str(_STAGES[0], refresh=False)
    if advice is None:
        advice, advice_error = _default_advice(run)
    else:
        advice_error = None
    stage(_STAGES[1])
    tensors, steps, hists, meta = run.tensors, run.steps, run.histograms, dict(run.meta or {})
    specs: list[dict] = []
    sections: list[str] = []

    def chart(c, caption: str = "") -> str:
        # not validated here (about 0.1 s a chart): tests/test_report.py validates every spec
        # against the Vega-Lite schema
        specs.append(_clean(c.to_dict(validate=False)))
        cap = f"<figcaption>{_esc(caption)}</figcaption>" if caption else ""
        return f'<figure><div class="chart" id="chart-{len(specs) - 1}"></div>{cap}</figure>'

    # -- recommendation
    if advice is not None and hasattr(advice, "_repr_html_"):
        rec = advice._repr_html_()
    else:
        rec = f"<p><b>{_esc(advice_error or 'advisor unavailable')}</b></p>"
    target = vm.target_format(run, advice)
    skipped = steps.loc[steps["skipped"].fillna(False).astype(bool), "step"].tolist() if len(steps) else []
    sections.append(f"<section><h2>Recommendation</h2>{rec}{_findings_table(tensors, advice, target)}</section>")
    sections.append(_ranks_section(run))

    # -- table
    sections.append("<section><h2>Modules nearest their format's limits</h2>"
                    "<p>Per module and role, the worst value over the run and its step, judged in the format "
                    "each tensor lives in or is cast to (float16: max 65504, min normal 2^-14, min subnormal "
                    "2^-24). The last column shows the recorded fp16 fractions; greyed where the tensors never "
                    "meet fp16 (fp32 optimizer state, fp32 parameter gradients, the loss gradient): context, "
                    "not alarms.</p>" + _limits_table(tensors, target, skipped) + "</section>")

    # -- heatmaps (modules in forward execution order in every view)
    stage(_STAGES[2])
    order = charts.forward_order(tensors)
    parts = []
    widths: set[int] = set()

    def heatmap(role: str, stat: str, title: str, **kw) -> None:
        cells = charts.cell_frame(tensors, role, stat, order=order, target=target, max_steps=MAX_STEP_COLUMNS, **kw)
        if cells.empty:
            return
        widths.update((cells["step_hi"] - cells["step_lo"]).unique().tolist())
        parts.append(chart(charts.heatmap_chart(cells, stat, title=title)))

    for role in charts.roles_present(tensors):
        for stat in _heatmap_statistics(role, target):
            units = vm.grad_units(tensors, role)
            heatmap(role, stat, f"{role}{' ' + units if units else ''}: {charts.STATISTICS[stat].label}")
    if int(tensors["nan_count"].sum() + tensors["inf_count"].sum()) > 0 if len(tensors) else False:
        for role in charts.roles_present(tensors):
            rows = tensors[tensors["role"] == role]
            if int(rows["nan_count"].sum() + rows["inf_count"].sum()) > 0:
                heatmap(role, "nonfinite_frac", f"{role}: non-finite fraction")
    precision = getattr(run, "precision", None)
    if precision is not None and len(precision):
        for stat in charts.SQNR_STATISTICS:
            heatmap("activation", stat, f"activation: {charts.STATISTICS[stat].label}", precision=precision)
    sections.append("<section><h2>Modules × steps</h2><p>Colours have hard boundaries at the format's limits "
                    "(legend); grey cells hold only tensors that never meet the format (context, not alarms). "
                    "Gradients and optimizer state are coloured by the fraction of their elements below the "
                    f"normal range of {_esc(target)} (subnormal or flushed to 0), the figure the gradient "
                    "findings quote.</p>" + _binning_note(widths, steps, tensors)
                    + ("".join(parts) or "<p><i>no tensor rows</i></p>")
                    + "</section>")

    # -- what-if: the advisor's scale_whatif, totals over k and per module at the recorded scale
    stage(_STAGES[3])
    roles = set(charts.roles_present(tensors))
    grad_role = vm.shown_grad_role(roles) if roles & set(GRAD_ROLES) else None
    k = (vm.recorded_log2_scale(run, grad_role) or 0) if grad_role else 0
    if grad_role is not None and len(hists):
        body = ""
        try:
            curve = scale_whatif(run, ks=range(k - 24, k + 17))
            source, hypothetical = vm.judged_run(run, grad_role, "float16", target)
            per = scale_whatif(source, ks=[k], per_module=True, roles=[grad_role])
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
                which = ("hypothetical: none of these gradients is float16 in this run" if hypothetical
                         else "only the tensors judged in float16; the loss gradient and other fp32 "
                         "tensors are left out")
                body += chart(charts.prediction_chart(per, k, grad_role),
                              f"Per module at the recorded scale 2^{k} ({which}).")
        if body:
            sections.append("<section><h2>Loss-scale what-if</h2>" + body + "</section>")

    # -- timeline
    stage(_STAGES[4])
    if len(steps):
        sections.append("<section><h2>Loss scale and loss</h2>"
                        + chart(charts.timeline_chart(charts.timeline_frame(steps, max_rows=MAX_STEP_POINTS)))
                        + "</section>")

    # -- details
    def hist_title(shift: int) -> str:
        return "exponents, all recorded steps" + (f", × 2^{shift} (the run's loss scale)" if shift else "")

    stage(_STAGES[5])
    det = []
    fmt = vm.compute_format(run, advice)  # the limits of the format the run computes in
    for module, role in _detail_modules(run, advice):
        band = charts.band_frame(tensors, module, role, max_rows=MAX_STEP_POINTS)
        shift = k if role in charts.GRAD_ROLES else 0  # gradients as fp16 holds them at the run's scale
        hist = charts.exponent_frame(hists, module, role, shift=shift)
        dtypes = ", ".join(f"{_esc(n)}: {_esc(d)}" for n, d in charts.dtypes_of(tensors, module, role).items())
        det.append(f"<h3><code>{_esc(vm.module_label(module))}</code> · {_esc(role)}</h3><p>dtype: {dtypes or '—'}</p>"
                   f"<div class='row'>{chart(charts.band_chart(band, fmt=fmt))}"
                   f"{chart(charts.exponent_chart(hist, title=hist_title(shift)))}</div>")
    if det:
        sections.append("<section><h2>Detail</h2>" + "".join(det) + "</section>")
    if precision is not None and len(precision):
        sections.append(_precision_section(precision, advice, target, chart))

    stage(_STAGES[6])
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
td.context {{ color: #999; }}
tr.alarm td:first-child {{ border-left: 3px solid #d7191c; }}
p.legend {{ font-size: 13px; max-width: 70em; }}
span.swatch {{ display: inline-block; width: 3px; height: 1em; background: #d7191c; vertical-align: middle; }}
p.note {{ font-size: 13px; max-width: 70em; }}
</style>
<script>
{_vega_bundle()}
</script>
</head>
<body>
<h1>{_esc(title)}</h1>
<p>{len(tensors):,} tensor rows, {len(steps):,} steps{_esc(', ' + vm.ranks_text(run)) if vm.ranks_text(run) else ''}, written {now} by mpscope.</p>
<details><summary>run metadata</summary><table>{meta_rows}</table></details>
{''.join(sections)}
<script>
const mpscopeSpecsGzip = "{_specs_payload(specs)}";
{_EMBED_JS}
</script>
</body>
</html>
"""


def write_report(run, path, advice=None, rank: int | None = None, progress: bool = False) -> Path:
    """Write the standalone HTML report of ``run`` to ``path`` (UTF-8) and return the path.

    Args:
        run: an :class:`mpscope.Run` or the directory of a saved run.
        path: the ``.html`` file to write; its parent directory must exist.
        advice: a Recommendation; ``None`` calls ``mpscope.advise(run)`` (if the advisor is
            unavailable, the report says so and shows everything else).
        rank: report rank ``rank``'s own rows of a multi-rank run (``run.for_rank(rank)``);
            None: the run as given (a merged Run: all ranks, with a "Ranks" section listing where
            NaN / inf appeared and on which rank first).
        progress: show a progress bar (tqdm, on stderr) through the report's stages once writing
            has taken half a second; False (default): silent.

    Returns:
        ``pathlib.Path`` of the written file (the inlined Vega libraries are ~0.9 MB, the charts'
        compressed data a few hundred kB).

    Raises:
        FileNotFoundError: the parent directory of ``path`` does not exist.
        TypeError: ``run`` is neither a Run nor a path, or ``path`` is no path, or ``rank`` is
            not an int.
        ValueError: ``rank`` is not one of ``run.ranks``, or its rows are not at hand (see
            :meth:`mpscope.Run.for_rank`).
    """
    path = as_path(path, "write the report to", "file")
    if not path.parent.exists():
        raise FileNotFoundError(f"cannot write the report to {path}: directory {path.parent} does not exist; "
                                "create it first or pass another path")
    text = render_report(run, advice=advice, rank=rank, progress=progress)
    path.write_text(text, encoding="utf-8")
    return path
