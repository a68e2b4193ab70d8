"""The layer explorer: an ipywidgets panel over one Run, drawn with altair ``JupyterChart``s.

Sections, top to bottom:

1. **Heatmap** of modules (rows, execution order) × steps for one role and one statistic (dropdowns
   ``Explorer.role`` and ``Explorer.statistic``, text filter ``Explorer.module_filter``). Click a
   cell (altair point selection ``cell`` on ``module`` and ``step``, read back through
   ``JupyterChart.selections``) or choose a module in ``Explorer.module`` to open the detail.
2. **Detail** of the selected module and role: the magnitude band over steps with the fp16 max, min
   normal and min subnormal as rules; the exponent histogram of the selected step with the fp16 and
   bf16 representable windows shaded (gradients shifted by the slider's loss scale); its dtypes and
   the advisor's findings that name it. For a run recorded with ``record(..., shadow=True)``, the
   heatmap also offers the SQNR against the float32 reference (total, and the module's own
   contribution) coloured against the format's ideal SQNR, and the detail adds the module's SQNR
   over steps with that ideal and the ``precision_loss`` threshold drawn as rules.
3. **Loss-scale what-if**: a slider over powers of two; the predicted fp16 underflow / subnormal /
   overflow fractions per module of the gradients at that scale, from the advisor's what-if
   (``mpscope.scale_whatif(run, ks=[k], per_module=True, roles=[role])``).
4. **Timeline** of the loss scale with skipped steps marked, and the loss.
5. **Recommendation** (``advice._repr_html_()``) with an export button (format dropdown, path).

Every chart's data is pre-aggregated to at most :data:`charts.MAX_ROWS` rows, so a run of a
million tensor rows opens in well under 2 s (``benchmarks/explorer_open.py``). Charts load their
JavaScript offline (``JupyterChart.enable_offline()``, bundled by vl-convert): no CDN is contacted.

This module imports ipywidgets and altair; ``mpscope`` itself imports it only when
``mpscope.explore`` is first used.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

import altair as alt
import ipywidgets as W
import pandas as pd

from mpscope.advisor import Recommendation, scale_whatif
from mpscope.formats import FORMATS
from mpscope.run import Run, as_run
from mpscope.schema import ExportFormat
from mpscope.widgets import _default_advice, charts
from mpscope.widgets import viewmodel as vm

__all__ = ["explore", "Explorer", "EXPORT_FORMATS"]

#: Export formats of ``Recommendation.export`` and the file suffix offered for each.
EXPORT_FORMATS = {f.value: f.suffix for f in ExportFormat}

#: Loss scales offered by the slider: 2^LOG2_SCALE_RANGE[0] .. 2^LOG2_SCALE_RANGE[1].
LOG2_SCALE_RANGE = (-8, 32)

_EMBED = {"renderer": "svg", "actions": False}


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


class Explorer(W.VBox):
    """The layer explorer widget (an ``ipywidgets.VBox``); build it with :func:`explore`.

    Public attributes, for notebooks and tests: ``role``, ``statistic`` (Dropdowns),
    ``module_filter`` (Text), ``module`` (Dropdown of module names), ``scale`` (SelectionSlider of
    log2 loss scales), ``heatmap``, ``band``, ``histogram``, ``sqnr``, ``prediction``, ``timeline``
    (``altair.JupyterChart``; ``band`` and ``histogram`` hold no chart until a module is selected,
    ``timeline`` is None for a run without steps), ``cells`` (the heatmap's DataFrame), ``predictions`` (DataFrame of
    ``mpscope.scale_whatif`` for the slider's scale, one row per module), ``band_data`` /
    ``histogram_data`` / ``sqnr_data`` (the detail's DataFrames; ``sqnr_data`` from
    ``run.precision``, empty without an fp32 shadow; ``sqnr`` hidden then),
    ``selected`` ((module, step) or None), ``advice`` (Recommendation or None), ``export_format``,
    ``export_path``, ``export_button``, ``export_status``.
    """

    def __init__(self, run, advice=None, **kwargs):
        self.run = as_run(run)
        alt.JupyterChart.enable_offline()
        tensors = self.run.tensors
        self.precision = getattr(self.run, "precision", None)
        shadowed = self.precision is not None and len(self.precision) > 0
        self.advice, self.advice_error = (advice, None) if advice is not None else _default_advice(self.run)
        self.selected: tuple[str, int | None] | None = None
        self._roles = charts.roles_present(tensors)
        self._order = charts.forward_order(tensors)
        self.target = vm.target_format(self.run, self.advice)
        opening = vm.most_severe(getattr(self.advice, "findings", None))
        self.opening = opening
        self._modules_by_role: dict[str, list[str]] = {}

        # ---- controls
        default_role = "activation" if "activation" in self._roles else (self._roles[0] if self._roles else "activation")
        if opening is not None and opening.role in self._roles:
            default_role = opening.role
        self.role = W.Dropdown(options=self._roles or ["activation"], value=default_role, description="role")
        self.statistic = W.Dropdown(options=[(s.label, k) for k, s in charts.STATISTICS.items()
                                             if shadowed or k not in charts.SQNR_STATISTICS],
                                    value=vm.finding_statistic(opening) if opening is not None else "log2_absmax",
                                    description="statistic",
                                    layout=W.Layout(width="420px"))
        self.module_filter = W.Text(value="", placeholder="substring of module names", description="filter",
                                    continuous_update=False)
        for w, cls in ((self.role, "mpscope-role"), (self.statistic, "mpscope-statistic"),
                       (self.module_filter, "mpscope-filter")):
            w.add_class(cls)

        # ---- heatmap
        self.cells = pd.DataFrame()
        self.heatmap = alt.JupyterChart(self._heatmap(), embed_options=_EMBED)
        self.heatmap.add_class("mpscope-heatmap")
        self.heatmap.observe(self._on_heatmap_selection, names="_vl_selections")
        self.heatmap_note = W.HTML(self._heatmap_note())

        # ---- detail
        self.module = W.Dropdown(options=self._module_choices(), value=None,
                                 description="module", layout=W.Layout(width="520px"))
        self.module.add_class("mpscope-module")
        self.detail_info = W.HTML("<i>Click a heatmap cell or choose a module to see its detail.</i>")
        self.band_data = pd.DataFrame()
        self.histogram_data = pd.DataFrame()
        self.sqnr_data = pd.DataFrame()
        # drawn on the first selection (chart None: nothing to embed until then)
        self.band = alt.JupyterChart(None, embed_options=_EMBED)
        self.histogram = alt.JupyterChart(None, embed_options=_EMBED)
        self.sqnr = alt.JupyterChart(None, embed_options=_EMBED, layout=W.Layout(display="none"))
        self.band.add_class("mpscope-band")
        self.histogram.add_class("mpscope-histogram")
        self.sqnr.add_class("mpscope-sqnr")
        self.detail_charts = W.HBox([self.band, self.histogram, self.sqnr], layout=W.Layout(display="none"))

        # ---- loss-scale what-if
        lo, hi = LOG2_SCALE_RANGE
        self.scale = W.SelectionSlider(options=[(f"2^{k}", k) for k in range(lo, hi + 1)],
                                       value=self._initial_log2_scale(), description="loss scale",
                                       continuous_update=False, layout=W.Layout(width="520px"))
        self.scale.add_class("mpscope-scale")
        self.predictions = pd.DataFrame()
        self.prediction = alt.JupyterChart(self._prediction(), embed_options=_EMBED)
        self.prediction.add_class("mpscope-prediction")
        self.prediction_note = W.HTML(self._prediction_note())

        # ---- timeline
        steps = self.run.steps
        if len(steps):
            self.timeline_data = charts.timeline_frame(steps)
            self.timeline = alt.JupyterChart(charts.timeline_chart(self.timeline_data), embed_options=_EMBED)
            self.timeline.add_class("mpscope-timeline")
            timeline_box = self.timeline
        else:
            self.timeline_data, self.timeline = pd.DataFrame(), None
            timeline_box = W.HTML("<i>no steps recorded</i>")

        # ---- recommendation and export
        self.export_format = W.Dropdown(options=list(EXPORT_FORMATS), value="torch", description="format")
        self.export_path = W.Text(value=self._default_path("torch"), description="path")
        self.export_button = W.Button(description="Export", icon="download", button_style="primary")
        self.export_status = W.HTML("")
        self.export_format.observe(self._on_format, names="value")
        self.export_button.on_click(self._on_export)
        if self.advice is None:
            rec_html = f"<b>{_esc(self.advice_error or 'advisor unavailable')}</b>"
            self.export_button.disabled = True
        else:
            rec_html = self.advice._repr_html_()
        self.recommendation = W.HTML(rec_html)

        # ---- wiring
        self.role.observe(self._on_view_change, names="value")
        self.statistic.observe(self._on_view_change, names="value")
        self.module_filter.observe(self._on_view_change, names="value")
        self.module.observe(self._on_module, names="value")
        self.scale.observe(self._on_scale, names="value")

        h = lambda text: W.HTML(f"<h4 style='margin:8px 0 2px 0'>{text}</h4>")  # noqa: E731
        meta = self.run.meta or {}
        title = W.HTML(
            f"<b>mpscope layer explorer</b> — model {_esc(meta.get('model', '?'))}, autocast "
            f"{_esc(meta.get('autocast_dtype'))}, {len(tensors):,} tensor rows, {len(steps):,} steps"
        )
        super().__init__(
            children=[
                title,
                h("Modules × steps"),
                W.HBox([self.role, self.statistic, self.module_filter]),
                self.heatmap_note,
                self.heatmap,
                h("Detail"),
                self.module,
                self.detail_info,
                self.detail_charts,
                h("Loss-scale what-if"),
                self.scale,
                self.prediction_note,
                self.prediction,
                h("Loss scale and loss"),
                timeline_box,
                h("Recommendation"),
                self.recommendation,
                W.HBox([self.export_format, self.export_path, self.export_button]),
                self.export_status,
            ],
            **kwargs,
        )
        self.add_class("mpscope-explorer")
        # open on the answer: the module and step of the most severe finding (else of the tensor
        # nearest its format's limits)
        if opening is not None and str(opening.module) in self._module_options():
            self.select(str(opening.module), opening.step)
        elif len(tensors):
            top = vm.risk_table(tensors[tensors["role"] == self.role.value], self.target, n=1)
            if len(top):
                r = top.iloc[0]
                step = r.overflow_step if r.overflow > 0 else (r.underflow_step if r.underflow > 0 else r.absmax_step)
                self.select(str(r.module), int(step))

    # ------------------------------------------------------------------ heatmap
    def _heatmap(self):
        self.cells = charts.cell_frame(self.run.tensors, self.role.value, self.statistic.value,
                                       self.module_filter.value, order=self._order, target=self.target,
                                       precision=self.precision)
        units = vm.grad_units(self.run.tensors, self.role.value)
        title = f"{self.role.value}{' ' + units if units else ''}: {charts.STATISTICS[self.statistic.value].label}"
        return charts.heatmap_chart(self.cells, self.statistic.value, title=title)

    def _heatmap_note(self) -> str:
        c = self.cells
        sqnr = self.statistic.value in charts.SQNR_STATISTICS
        if c.empty:
            what = f"matching {_esc(self.module_filter.value)!s}" if self.module_filter.value else "recorded"
            shadow = (" in run.precision (the fp32 shadow compares module outputs, role activation, and with "
                      "ops=True op outputs)") if sqnr else ""
            return f"<i>no {_esc(self.role.value)} rows {what}{shadow}</i>"
        width = int((c["step_hi"] - c["step_lo"]).iloc[0])
        binned = f"; steps binned by {width}, each cell shows its worst step" if width > 1 else ""
        units = vm.grad_units(self.run.tensors, self.role.value)
        fmt = c.attrs.get("format")
        judged = (f" Colours judge each tensor in the format it lives in or is cast to ({_esc(fmt)} here); "
                  "grey cells hold only tensors that never meet it (context, not alarms).") if fmt else ""
        if sqnr:
            judged = (f" SQNR against the float32 reference of the same batch (lowest over a module's outputs; "
                      f"{_esc(fmt)}'s ideal {FORMATS[fmt].ideal_sqnr_db:.1f} dB marked in the legend).")
        return (f"{c['module'].nunique()} modules × {c['step_lo'].nunique()} step columns{binned}"
                + (f"; values {_esc(units)}" if units else "") + f".{judged} "
                "Click a cell for its detail (double-click clears).")

    def _on_view_change(self, change=None):
        self.heatmap.chart = self._heatmap()
        self.heatmap_note.value = self._heatmap_note()
        if change is not None and change["owner"] is self.module_filter:
            self._refresh_prediction()
        if change is not None and change["owner"] is self.role:
            k = vm.recorded_log2_scale(self.run, self.role.value)
            if k is not None and self.role.value in charts.GRAD_ROLES:
                self._setting_scale = True  # the what-if at the scale the heatmap's values carry
                try:
                    self.scale.value = int(min(LOG2_SCALE_RANGE[1], max(LOG2_SCALE_RANGE[0], k)))
                finally:
                    self._setting_scale = False
            keep = self.selected[0] if self.selected and self.selected[0] in self._module_options() else None
            self._setting_module = True
            try:
                self.module.options = self._module_choices()
                self.module.value = keep
            finally:
                self._setting_module = False
            if keep is None:
                self.selected = None
                self.detail_charts.layout.display = "none"
                self.detail_info.value = "<i>Click a heatmap cell or choose a module to see its detail.</i>"
            self._refresh_prediction()
            self._refresh_detail()

    def _on_heatmap_selection(self, change):
        sel = getattr(self.heatmap.selections, "cell", None)
        if sel is None or not sel.value:
            return
        point = sel.value[0]
        module = point.get("module")
        step = point.get("step")
        if module is None:
            return
        self.select(str(module), None if step is None else int(step))

    # ------------------------------------------------------------------ detail
    def _module_options(self) -> list[str]:
        role = self.role.value
        if role not in self._modules_by_role:
            present = set(charts.module_order(self.run.tensors[self.run.tensors["role"] == role]))
            self._modules_by_role[role] = [m for m in self._order if m in present]
        return self._modules_by_role[role]

    def _module_choices(self) -> list[tuple[str, str | None]]:
        return [("(click a cell)", None)] + [(m or "(root)", m) for m in self._module_options()]

    def select(self, module: str, step: int | None = None) -> None:
        """Open the detail of ``module`` (for the current role) at ``step`` (None: all steps)."""
        self.selected = (module, step)
        if self.module.value != module and module in self._module_options():
            self._setting_module = True
            try:
                self.module.value = module
            finally:
                self._setting_module = False
        self._refresh_detail()

    def _on_module(self, change):
        if getattr(self, "_setting_module", False):
            return
        if change["new"] is not None:
            self.select(change["new"], None)

    def _shift(self) -> int:
        return int(self.scale.value) if self.role.value in charts.GRAD_ROLES else 0

    def _refresh_detail(self) -> None:
        if self.selected is None:
            return
        module, step = self.selected
        role = self.role.value
        run = self.run
        self.band_data = charts.band_frame(run.tensors, module, role)
        self.histogram_data = charts.exponent_frame(run.histograms, module, role, step=step, shift=self._shift())
        label = module or "(root)"
        self.band.chart = charts.band_chart(self.band_data, title=f"{label} · {role}: magnitude over steps")
        hstep = self.histogram_data.attrs.get("step")
        when = f"step {hstep}" if hstep is not None else "all recorded steps"
        scaled = f", × 2^{self._shift()}" if role in charts.GRAD_ROLES else ""
        self.histogram.chart = charts.exponent_chart(self.histogram_data, title=f"exponents at {when}{scaled}")
        self.sqnr_data = (charts.sqnr_frame(self.precision, module, role) if self.precision is not None
                          else pd.DataFrame())
        if len(self.sqnr_data):
            self.sqnr.chart = charts.sqnr_chart(self.sqnr_data, self.target, title=f"{label}: SQNR against float32")
        self.sqnr.layout.display = "flex" if len(self.sqnr_data) else "none"
        self.detail_charts.layout.display = "flex"
        self.detail_info.value = self._detail_html(module, role, step)

    def findings_for(self, module: str) -> list:
        """The advisor's findings whose ``module`` is ``module`` (empty without an advisor)."""
        if self.advice is None:
            return []
        return [f for f in getattr(self.advice, "findings", []) if getattr(f, "module", None) == module]

    def finding_figures_text(self, finding) -> str:
        """``"first at step 5: 17.3 %, worst at step 11: 38.3 % (...)"`` for a finding ("" when it
        has no per-step statistic)."""
        return vm.figures_text(vm.finding_figures(self.run.tensors, finding, self.target))

    def _detail_html(self, module: str, role: str, step: int | None) -> str:
        dtypes = charts.dtypes_of(self.run.tensors, module, role)
        dt = ", ".join(f"{_esc(n)}: <code>{_esc(d)}</code>" for n, d in dtypes.items()) or "<i>no rows</i>"
        units = vm.grad_units(self.run.tensors, role)
        parts = [f"<b>{_esc(module or '(root)')}</b> · {_esc(role)}"
                 + (f" · selected step {step}" if step is not None else "")
                 + (f" · recorded values {_esc(units)}" if units else ""),
                 f"<div>dtype: {dt}</div>"]
        if self.histogram_data.empty:
            parts.append("<div><i>no exponent histogram recorded for this module and role</i></div>")
        if self.advice is None:
            parts.append(f"<div><i>{_esc(self.advice_error or 'advisor unavailable')}</i></div>")
        else:
            found = self.findings_for(module)
            if not found:
                parts.append("<div>findings: none name this module</div>")
            else:
                items = "".join(
                    f"<li><b>{_esc(f.severity)}</b> <code>{_esc(f.code)}</code> ({_esc(f.role)}; "
                    f"{_esc(self.finding_figures_text(f) or f'first at step {f.step}')}): {_esc(f.message)} "
                    f"<i>Fix:</i> {_esc(f.fix)}</li>" for f in found)
                parts.append(f"<div>findings:<ul>{items}</ul></div>")
        return "".join(parts)

    # ------------------------------------------------------------------ what-if
    def _initial_log2_scale(self) -> int:
        """The scale the what-if's gradients were recorded at (the run's first loss scale for
        activation gradients; 2^0 for gradients recorded after unscale_)."""
        k = vm.recorded_log2_scale(self.run, self.prediction_role())
        lo, hi = LOG2_SCALE_RANGE
        return int(min(hi, max(lo, k if k is not None else 0)))

    def prediction_role(self) -> str:
        """The gradient role the what-if shows: the heatmap's role when it is a gradient role, else
        ``activation_grad`` (or ``param_grad`` when no activation gradients were recorded)."""
        return vm.shown_grad_role(self._roles, self.role.value)

    def _prediction(self):
        role = self.prediction_role()
        k = int(self.scale.value)
        order = self._order
        self.whatif_error = None
        cols = ["module", "underflow_frac", "subnormal_frac", "overflow_frac", "count"]
        pred = pd.DataFrame({c: [] for c in cols})
        try:
            source, self.whatif_hypothetical = vm.judged_run(self.run, role, "float16", self.target)
            w = scale_whatif(source, ks=[k], per_module=True, roles=[role])
            if len(w):
                pred = w[cols].copy()
        except Exception as exc:
            self.whatif_error = f"advisor unavailable: scale_whatif raised {type(exc).__name__}: {exc}"
        if self.module_filter.value and len(pred):  # the filter narrows every module chart
            keep = pred["module"].astype(str).str.contains(self.module_filter.value, case=False, regex=False)
            pred = pred[keep.to_numpy()]
        if len(pred):
            rank = {m: i for i, m in enumerate(order)}
            pred["module"] = pred["module"].astype(str)
            pred = pred.sort_values("module", key=lambda m: m.map(rank).fillna(len(rank)), kind="stable")
            pred = pred.reset_index(drop=True)
        self.predictions = pred
        return charts.prediction_chart(pred, k, role, order=pred["module"].astype(str).tolist())

    def _prediction_note(self) -> str:
        p = self.predictions
        role = _esc(self.prediction_role())
        if self.whatif_error:
            return f"<i>{_esc(self.whatif_error)}</i>"
        if p.empty:
            return f"<i>no exponent histograms recorded for {role}</i>"
        n = float(p["count"].sum())
        tot = {c: float((p[c] * p["count"]).sum() / n) if n else float("nan")
               for c in ("underflow_frac", "subnormal_frac", "overflow_frac")}
        which = ("hypothetical: none of these gradients is float16 in this run"
                 if getattr(self, "whatif_hypothetical", False) else "tensors judged in float16 only")
        units = vm.grad_units(self.run.tensors, self.prediction_role())
        recorded = f" (the heatmap shows them {_esc(units)})" if units else ""
        return (f"At loss scale 2^{int(self.scale.value)} ({which}){recorded}, of the {int(n):,} non-zero "
                f"{role} elements recorded: "
                f"{tot['underflow_frac']:.3%} would flush to 0 in fp16, {tot['subnormal_frac']:.3%} be subnormal, "
                f"{tot['overflow_frac']:.3%} overflow (mpscope.scale_whatif: exponent histograms shifted "
                f"by log2 of the scale, binade granularity).")

    def _refresh_prediction(self) -> None:
        self.prediction.chart = self._prediction()
        self.prediction_note.value = self._prediction_note()

    def _on_scale(self, change):
        if getattr(self, "_setting_scale", False):
            return
        self._refresh_prediction()
        if self.role.value in charts.GRAD_ROLES:
            self._refresh_detail()

    # ------------------------------------------------------------------ export
    @staticmethod
    def _default_path(fmt: str) -> str:
        return f"mpscope_{fmt}{EXPORT_FORMATS[fmt]}"

    def _on_format(self, change):
        if self.export_path.value in ("", self._default_path(change["old"])):
            self.export_path.value = self._default_path(change["new"])

    def _on_export(self, _button=None) -> None:
        if self.advice is None:
            self.export_status.value = f"<b>{_esc(self.advice_error or 'advisor unavailable')}</b>"
            return
        path = self.export_path.value.strip()
        if not path:
            self.export_status.value = "<b>type a file path first</b>"
            return
        try:
            written = self.advice.export(path, format=self.export_format.value)
        except Exception as exc:
            self.export_status.value = f"<b>export failed</b>: {_esc(type(exc).__name__)}: {_esc(exc)}"
            return
        where = Path(written if isinstance(written, (str, os.PathLike)) else path)
        self.export_status.value = f"wrote <code>{_esc(where)}</code> ({_esc(self.export_format.value)})"


def explore(run: Run | str | os.PathLike, advice: Recommendation | None = None) -> W.Widget:
    """The layer explorer of ``run``, an ``ipywidgets`` widget; display it in a notebook.

    Args:
        run: an :class:`mpscope.Run` (``recorder.run``, ``mpscope.Run.load(dir)``) or the path of a
            saved run directory.
        advice: a Recommendation of ``mpscope.advise(run)``; ``None`` calls the advisor (if it cannot
            be imported or fails, the panel says "advisor unavailable" and export is disabled).

    Returns:
        :class:`Explorer`, an ``ipywidgets.VBox``.

    Raises:
        TypeError: ``run`` is neither a Run nor a path.
    """
    return Explorer(run, advice=advice)
