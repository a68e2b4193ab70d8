"""The layer explorer: an ipywidgets panel over one Run, drawn with altair ``JupyterChart``s.

Sections, top to bottom:

1. **Heatmap** of modules (rows, execution order) × steps for one role and one statistic (dropdowns
   ``Explorer.role`` and ``Explorer.statistic``, text filter ``Explorer.module_filter``). Click a
   cell (altair point selection ``cell`` on ``module`` and ``step``, read back through
   ``JupyterChart.selections``) or choose a module in ``Explorer.module`` to open the detail.
2. **Detail** of the selected module and role: the magnitude band over steps with the max, min
   normal and min subnormal of the format the run computes in as rules (``Explorer.compute_format``:
   its autocast dtype, else its 16-bit parameter dtype; a float32 run gets both fp16's and bf16's,
   labelled hypothetical); the exponent histogram of the selected step with the fp16 and
   bf16 representable windows shaded (gradients shifted by the slider's loss scale); its dtypes and
   the advisor's findings that name it. For a run recorded with ``record(..., shadow=True)``, the
   heatmap also offers the SQNR against the float32 reference (total, and the module's own
   contribution) coloured against the format's ideal SQNR, and the detail adds the module's SQNR
   over steps with that ideal and the ``precision_loss`` threshold drawn as rules.
3. **Loss-scale what-if**: a slider over powers of two; the predicted fp16 underflow / subnormal /
   overflow fractions per module of the gradients at that scale, from the advisor's what-if
   (``mpscope.scale_whatif(run, ks=[k], per_module=True, roles=[role])``).
4. **Timeline** of the loss scale with skipped steps marked, and the loss (finite losses drawn;
   steps whose loss is NaN / inf marked and named in ``Explorer.timeline_note`` and the chart's
   subtitle).

Step axes: the heatmap's x axis is ordinal over the recorded steps (a run recorded with ``every=2``
has columns 0, 2, 4, ... and no blank stripes); the line charts' step axes span exactly the first to
the last recorded step, never rounded up.
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
from mpscope.run import Run, RunFileError, as_run, select_rank
from mpscope.schema import ExportFormat
from mpscope.widgets import _default_advice, charts
from mpscope.widgets import viewmodel as vm

__all__ = ["explore", "Explorer", "EXPORT_FORMATS"]

#: Export formats of ``Recommendation.export`` and the file suffix offered for each.
EXPORT_FORMATS = {f.value: f.suffix for f in ExportFormat}

#: Loss scales offered by the slider: 2^LOG2_SCALE_RANGE[0] .. 2^LOG2_SCALE_RANGE[1].
LOG2_SCALE_RANGE = (-8, 32)

_EMBED = {"renderer": "svg", "actions": False}

#: Text of the explorer's HTML widgets is left-aligned and wraps: notebook front ends right-align
#: table cells (JupyterLab's ``.jp-RenderedHTMLCommon td``), which put long finding messages and
#: fixes flush right. Scoped to the explorer (class ``mpscope-explorer``).
_TEXT_STYLE = ("<style>.mpscope-explorer .mpscope-text, .mpscope-explorer .mpscope-text td, "
               ".mpscope-explorer .mpscope-text th, .mpscope-explorer .mpscope-text li "
               "{text-align: left !important; vertical-align: top; white-space: normal;}</style>")


def _left(body: str) -> str:
    """``body`` in a left-aligned block (:data:`_TEXT_STYLE`)."""
    return f"{_TEXT_STYLE}<div class='mpscope-text' style='text-align:left'>{body}</div>"


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


class Explorer(W.VBox):
    """The layer explorer widget (an ``ipywidgets.VBox``); build it with :func:`explore`.

    Public attributes, for notebooks and tests: ``role``, ``statistic`` (Dropdowns),
    ``module_filter`` (Text), ``module`` (Dropdown of module names), ``scale`` (SelectionSlider of
    log2 loss scales), ``heatmap``, ``band``, ``histogram``, ``sqnr``, ``prediction``, ``timeline``
    (``altair.JupyterChart``; ``band`` and ``histogram`` hold no chart until a module is selected,
    ``timeline`` is None for a run without steps; ``timeline_note``: HTML naming the steps whose loss
    is NaN / inf, empty when none), ``compute_format`` (the format whose limits the band draws:
    ``"float16"``, ``"bfloat16"`` or None for a float32 run), ``cells`` (the heatmap's DataFrame), ``predictions`` (DataFrame of
    ``mpscope.scale_whatif`` for the slider's scale, one row per module), ``band_data`` /
    ``histogram_data`` / ``sqnr_data`` (the detail's DataFrames; ``sqnr_data`` from
    ``run.precision``, empty without an fp32 shadow; ``sqnr`` hidden then),
    ``selected`` ((module, step) or None), ``advice`` (Recommendation or None), ``export_format``,
    ``export_path``, ``export_button``, ``export_status``.

    Multi-rank runs: ``rank_choice`` (Dropdown: ``None`` for the merged rows, else a rank; hidden
    for a run of one rank), ``rank_note`` (HTML: which rows are shown, where NaN / inf first
    appeared and on which rank, or why a rank's rows cannot be shown), ``rank_jump`` (Button opening
    the rank that saw the first NaN / inf; hidden when none did), ``merged_run`` (the Run given),
    ``run`` (the rows shown: ``merged_run.for_rank(rank_choice.value)``).
    """

    def __init__(self, run, advice=None, rank: int | None = None, **kwargs):
        self.merged_run = as_run(run)
        shown = select_rank(self.merged_run, rank)  # raises before anything is drawn
        alt.JupyterChart.enable_offline()
        self._advice_by_rank: dict = {rank: (advice, None)} if advice is not None else {}
        self._use(shown, rank)
        self.selected: tuple[str, int | None] | None = None

        # ---- ranks (a multi-rank job: the merged rows or one rank's own)
        ranks = self.merged_run.ranks
        self.rank_choice = W.Dropdown(options=[("merged", None)] + [(f"rank {r}", r) for r in ranks], value=rank,
                                      description="rank")
        self.rank_jump = W.Button(description="open first NaN/inf rank", icon="search")
        self.rank_note = W.HTML("")
        self.rank_choice.add_class("mpscope-rank")
        self.rank_jump.add_class("mpscope-rank-jump")
        self.rank_note.add_class("mpscope-rank-note")
        self.rank_box = W.HBox([self.rank_choice, self.rank_jump, self.rank_note],
                               layout=W.Layout(display="flex" if len(ranks) > 1 else "none"))
        self._first_bad = vm.first_nonfinite_rank(self.merged_run, self._advice_by_rank.get(None, (None,))[0]
                                                  if rank is None else None)
        self._refresh_rank_note()

        # ---- controls
        self.role = W.Dropdown(options=self._roles or ["activation"], value=self._default_role(), description="role")
        self.statistic = W.Dropdown(options=self._statistic_options(), value=self._default_statistic(),
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
        self.timeline = None
        self.timeline_note = W.HTML("")
        self.timeline_note.add_class("mpscope-timeline-note")
        self.timeline_box = W.VBox()
        self._refresh_timeline()

        # ---- recommendation and export
        self.export_format = W.Dropdown(options=list(EXPORT_FORMATS), value="torch", description="format")
        self.export_path = W.Text(value=self._default_path("torch"), description="path")
        self.export_button = W.Button(description="Export", icon="download", button_style="primary")
        self.export_status = W.HTML("")
        self.export_format.observe(self._on_format, names="value")
        self.export_button.on_click(self._on_export)
        self.recommendation = W.HTML(self._recommendation_html())

        # ---- wiring
        self.role.observe(self._on_view_change, names="value")
        self.statistic.observe(self._on_view_change, names="value")
        self.module_filter.observe(self._on_view_change, names="value")
        self.module.observe(self._on_module, names="value")
        self.scale.observe(self._on_scale, names="value")
        self.rank_choice.observe(self._on_rank, names="value")
        self.rank_jump.on_click(self._on_rank_jump)

        h = lambda text: W.HTML(f"<h4 style='margin:8px 0 2px 0'>{text}</h4>")  # noqa: E731
        self.title = W.HTML(self._title_html())
        super().__init__(
            children=[
                self.title,
                self.rank_box,
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
                self.timeline_box,
                h("Recommendation"),
                self.recommendation,
                W.HBox([self.export_format, self.export_path, self.export_button]),
                self.export_status,
            ],
            **kwargs,
        )
        self.add_class("mpscope-explorer")
        self._open_on_answer()

    # ------------------------------------------------------------------ the run shown
    def _use(self, run, rank: int | None) -> None:
        """Make ``run`` (the merged rows, or rank ``rank``'s own) the one every section reads."""
        self.run = run
        if rank not in self._advice_by_rank:
            self._advice_by_rank[rank] = _default_advice(run)
        self.advice, self.advice_error = self._advice_by_rank[rank]
        self.precision = getattr(run, "precision", None)
        self._roles = charts.roles_present(run.tensors)
        self._order = charts.forward_order(run.tensors)
        self.target = vm.target_format(run, self.advice)
        self.compute_format = vm.compute_format(run, self.advice)
        self.opening = vm.most_severe(getattr(self.advice, "findings", None))
        self._modules_by_role: dict[str, list[str]] = {}

    def _default_role(self) -> str:
        roles, opening = self._roles, self.opening
        if opening is not None and opening.role in roles:
            return opening.role
        return "activation" if "activation" in roles else (roles[0] if roles else "activation")

    def _statistic_options(self) -> list[tuple[str, str]]:
        shadowed = self.precision is not None and len(self.precision) > 0
        return [(s.label, k) for k, s in charts.STATISTICS.items() if shadowed or k not in charts.SQNR_STATISTICS]

    def _default_statistic(self) -> str:
        return vm.finding_statistic(self.opening) if self.opening is not None else "log2_absmax"

    def _title_html(self) -> str:
        meta, tensors = self.run.meta or {}, self.run.tensors
        which = vm.ranks_text(self.run)
        return (f"<b>mpscope layer explorer</b> — model {_esc(meta.get('model', '?'))}, autocast "
                f"{_esc(meta.get('autocast_dtype'))}, {len(tensors):,} tensor rows, {len(self.run.steps):,} steps"
                + (f", {_esc(which)}" if which else ""))

    def _recommendation_html(self) -> str:
        self.export_button.disabled = self.advice is None
        if self.advice is None:
            return _left(f"<b>{_esc(self.advice_error or 'advisor unavailable')}</b>")
        return _left(self.advice._repr_html_())

    def _refresh_timeline(self) -> None:
        steps = self.run.steps
        if not len(steps):
            self.timeline_data, self.timeline = pd.DataFrame(), None
            self.timeline_note.value = ""
            self.timeline_box.children = [W.HTML("<i>no steps recorded</i>")]
            return
        self.timeline_data = charts.timeline_frame(steps)
        note = self.timeline_data.attrs.get("loss_note", "")
        self.timeline_note.value = f"<b style='color:#d7191c'>{_esc(note)}.</b>" if note else ""
        if self.timeline is None:
            self.timeline = alt.JupyterChart(charts.timeline_chart(self.timeline_data), embed_options=_EMBED)
            self.timeline.add_class("mpscope-timeline")
        else:
            self.timeline.chart = charts.timeline_chart(self.timeline_data)
        self.timeline_box.children = [self.timeline_note, self.timeline]

    def _open_on_answer(self) -> None:
        """Open the detail of the most severe finding's module and step (else of the tensor nearest
        its format's limits)."""
        opening, tensors = self.opening, self.run.tensors
        if opening is not None and str(opening.module) in self._module_options():
            self.select(str(opening.module), opening.step)
        elif len(tensors):
            top = vm.risk_table(tensors[tensors["role"] == self.role.value], self.target, n=1)
            if len(top):
                r = top.iloc[0]
                step = r.overflow_step if r.overflow > 0 else (r.underflow_step if r.underflow > 0 else r.absmax_step)
                self.select(str(r.module), int(step))

    # ------------------------------------------------------------------ ranks
    def _refresh_rank_note(self, problem: str | None = None) -> None:
        bad, n = self._first_bad, len(self.merged_run.ranks)
        shown = self.rank_choice.value
        parts = [vm.shown_rows_text(n, shown)]
        if bad is not None:
            seen = f", seen by {bad['ranks']} of {vm.n_ranks(n)}" if bad.get("ranks") else ""
            parts.append(f"NaN/inf first at step {bad['step']} in {_esc(bad['role'])} of "
                         f"<code>{_esc(vm.module_label(bad['module']))}</code>, first on <b>rank {bad['rank']}</b>{seen}")
            self.rank_jump.description = f"open rank {bad['rank']}"
        self.rank_jump.layout.display = "none" if bad is None or bad["rank"] == shown else "flex"
        if problem:
            parts.append(f"<b>{_esc(problem)}</b>")
        self.rank_note.value = "; ".join(parts) + "."

    def _on_rank_jump(self, _button=None) -> None:
        if self._first_bad is not None:
            self.rank_choice.value = self._first_bad["rank"]

    def _on_rank(self, change) -> None:
        if getattr(self, "_setting_rank", False):
            return
        rank = change["new"]
        try:
            run = select_rank(self.merged_run, rank)
        except (ValueError, RunFileError) as exc:  # no directory holding that rank's rows, or its files are gone
            self._setting_rank = True
            try:
                self.rank_choice.value = change["old"]
            finally:
                self._setting_rank = False
            self._refresh_rank_note(f"rank {rank}: {exc}")
            return
        self.show_rank_run(run, rank)

    def show_rank_run(self, run, rank: int | None) -> None:
        """Redraw every section from ``run`` (the rows of ``rank``; None: the merged rows)."""
        self._use(run, rank)
        self._setting_module = True
        try:
            self.role.unobserve(self._on_view_change, names="value")
            self.statistic.unobserve(self._on_view_change, names="value")
            self.role.options = self._roles or ["activation"]
            self.role.value = self._default_role()
            self.statistic.options = self._statistic_options()
            self.statistic.value = self._default_statistic()
            self.module.options = self._module_choices()
            self.module.value = None
        finally:
            self.role.observe(self._on_view_change, names="value")
            self.statistic.observe(self._on_view_change, names="value")
            self._setting_module = False
        self.selected = None
        self.detail_charts.layout.display = "none"
        self.detail_info.value = "<i>Click a heatmap cell or choose a module to see its detail.</i>"
        self.heatmap.chart = self._heatmap()
        self.heatmap_note.value = self._heatmap_note()
        self._setting_scale = True
        try:
            self.scale.value = self._initial_log2_scale()
        finally:
            self._setting_scale = False
        self._refresh_prediction()
        self._refresh_timeline()
        self.recommendation.value = self._recommendation_html()
        self.export_status.value = ""
        self.title.value = self._title_html()
        self._refresh_rank_note()
        self._open_on_answer()

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
        return (f"{c['module'].nunique()} modules × {c['step_lo'].nunique()} step columns (recorded steps only)"
                f"{binned}"
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
        self.band.chart = charts.band_chart(self.band_data, title=f"{label} · {role}: magnitude over steps",
                                            fmt=self.compute_format)
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
        return _left("".join(parts))

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


def explore(run: Run | str | os.PathLike, advice: Recommendation | None = None,
            rank: int | None = None) -> W.Widget:
    """The layer explorer of ``run``, an ``ipywidgets`` widget; display it in a notebook.

    Args:
        run: an :class:`mpscope.Run` (``recorder.run``, ``mpscope.Run.load(dir)``) or the path of a
            saved run directory (a multi-rank ``out=`` directory gives its merged Run).
        advice: a Recommendation of the rows first shown (``mpscope.advise(run, rank=rank)``);
            ``None`` calls the advisor (if it cannot be imported or fails, the panel says "advisor
            unavailable" and export is disabled). Other ranks chosen later get their own advice.
        rank: open on rank ``rank``'s own rows of a multi-rank run (``run.for_rank(rank)``); None:
            the merged rows. A rank dropdown switches between them; it lists every rank of the run,
            and choosing a rank whose rows are not at hand (a merged Run recorded without ``out=``
            holds only rank 0's own) leaves the view as it was and says why.

    Returns:
        :class:`Explorer`, an ``ipywidgets.VBox``.

    Raises:
        TypeError: ``run`` is neither a Run nor a path, or ``rank`` is not an int.
        ValueError: ``rank`` is not one of ``run.ranks``, or its rows are not at hand (see
            :meth:`mpscope.Run.for_rank`).
    """
    return Explorer(run, advice=advice, rank=rank)
