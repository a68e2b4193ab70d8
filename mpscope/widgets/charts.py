"""Pure views of a Run: pandas frames in, aggregated frames and altair charts out.

Nothing here holds state or touches a widget: every function takes the Run's DataFrames (columns in
:mod:`mpscope.schema`: ``Run.tensors``, ``Run.steps``, ``Run.histograms``) and returns either a smaller,
aggregated DataFrame (``*_frame``) or an ``altair`` chart built from one (``*_chart``). The layer
explorer (:mod:`mpscope.widgets.explorer`) and the HTML report (:mod:`mpscope.report`) both draw
with these, so the two show the same numbers.

Row limit: altair's default data transformer refuses a dataset of more than 5,000 rows
(``altair.data_transformers`` ``max_rows=5000``). Every ``*_frame`` therefore aggregates steps into
equal-width bins so that its result has at most ``max_rows`` rows (default :data:`MAX_ROWS`), and
each chart carries exactly one such frame (the format windows and limit rules add < 10 rows).

Limits (fp16 max 65504, min normal 2^-14, min subnormal 2^-24; bf16 windows) come from
:mod:`mpscope.formats`, which reads them from ``torch.finfo``. ``altair`` is imported inside the
chart functions, so importing this module costs only pandas / numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from mpscope.formats import BF16, FP16
from mpscope.run import str_values
from mpscope.schema import GRAD_ROLES, ROLES, SHORT_NAMES
from mpscope.widgets import viewmodel as vm

if TYPE_CHECKING:  # pragma: no cover
    import altair as alt

__all__ = [
    "MAX_ROWS",
    "ROLES",
    "GRAD_ROLES",
    "STATISTICS",
    "Statistic",
    "module_order",
    "forward_order",
    "roles_present",
    "step_bins",
    "cell_frame",
    "heatmap_chart",
    "band_frame",
    "band_chart",
    "limit_rules",
    "limits_title",
    "step_columns",
    "step_domain",
    "exponent_frame",
    "exponent_chart",
    "format_windows",
    "prediction_chart",
    "whatif_curve_chart",
    "timeline_frame",
    "timeline_chart",
    "nonfinite_loss",
    "loss_note",
    "dtypes_of",
    "SQNR_STATISTICS",
    "sqnr_frame",
    "sqnr_rules",
    "sqnr_chart",
]

#: Largest number of rows one chart's dataset may hold (altair's default ``max_rows``).
MAX_ROWS = 5000



@dataclass(frozen=True)
class Statistic:
    """One colour channel of the heatmap.

    ``key``: identifier used by the explorer's dropdown. ``label``: axis / legend title.
    ``kind``: ``"log2"`` (log2 of a magnitude column, aggregated by max) or ``"fraction"`` (a
    per-tensor fraction over ``numel``, aggregated over a module's tensors weighted by ``numel``) or
    ``"sqnr"`` (an SQNR in dB from ``Run.precision``, the fp32 shadow: the lowest over a module's
    outputs, lower is worse). ``columns``: the ``Run.tensors`` (``Run.precision`` for ``"sqnr"``)
    columns it is computed from.
    """

    key: str
    label: str
    kind: str
    columns: tuple[str, ...]


#: Heatmap statistics, in dropdown order. Fractions are over ``numel``; the non-finite
#: fraction is ``(nan_count + inf_count) / numel``; a fraction of several columns is their sum
#: (``fp16_below_normal_frac`` = flushed + subnormal in fp16: every element below the normal range,
#: the figure of the ``grad_underflow`` finding).
STATISTICS: dict[str, Statistic] = {
    s.key: s
    for s in (
        Statistic("log2_absmax", "log2 absmax (coloured by the format's limits)", "log2", ("absmax",)),
        Statistic("fp16_underflow_frac", "fp16 underflow fraction", "fraction", ("fp16_underflow_frac",)),
        Statistic("fp16_subnormal_frac", "fp16 subnormal fraction", "fraction", ("fp16_subnormal_frac",)),
        Statistic("fp16_below_normal_frac", f"fp16 subnormal or flushed fraction (below the normal range, < 2^{FP16.min_normal_exponent})",
                  "fraction", ("fp16_underflow_frac", "fp16_subnormal_frac")),
        Statistic("fp16_overflow_frac", "fp16 overflow fraction", "fraction", ("fp16_overflow_frac",)),
        Statistic("bf16_underflow_frac", "bf16 underflow fraction", "fraction", ("bf16_underflow_frac",)),
        Statistic("bf16_below_normal_frac", f"bf16 subnormal or flushed fraction (below the normal range, < 2^{BF16.min_normal_exponent})",
                  "fraction", ("bf16_underflow_frac", "bf16_subnormal_frac")),
        Statistic("zero_frac", "zero fraction", "fraction", ("zero_frac",)),
        Statistic("nonfinite_frac", "non-finite fraction (NaN + inf)", "fraction", ("nan_count", "inf_count")),
        Statistic("sqnr_db", "SQNR against the float32 reference (dB, fp32 shadow)", "sqnr", ("sqnr_db",)),
        Statistic("own_sqnr_db", "own-contribution SQNR against float32 (dB, fp32 shadow)", "sqnr",
                  ("own_sqnr_db",)),
    )
}
#: The statistics read from ``Run.precision`` (runs recorded with ``record(..., shadow=True)``).
SQNR_STATISTICS = tuple(k for k, s in STATISTICS.items() if s.kind == "sqnr")


def _check_columns(frame: pd.DataFrame, columns, what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(
            f"{what} lacks the column(s) {missing}; pass a frame with the Run.{what} schema of "
            f"mpscope.schema (e.g. run.{what})"
        )


def _statistic(statistic: str) -> Statistic:
    try:
        return STATISTICS[statistic]
    except KeyError:
        raise ValueError(f"unknown statistic {statistic!r}; choose one of {list(STATISTICS)}") from None


def module_order(tensors: pd.DataFrame) -> list[str]:
    """Module names in order of first appearance in ``tensors`` (recording order: execution order
    of the forward pass for activations). Unused categories are dropped."""
    modules = tensors["module"]
    if isinstance(modules.dtype, pd.CategoricalDtype):
        codes = modules.cat.codes.to_numpy()
        _, first = np.unique(codes, return_index=True)
        order = codes[np.sort(first)]
        cats = modules.cat.categories
        return [str(cats[c]) for c in order if c >= 0]
    return [str(m) for m in pd.unique(modules)]


def forward_order(tensors: pd.DataFrame) -> list[str]:
    """Modules in forward execution order (first appearance among ``activation`` rows), then any
    module seen only in other roles, in order of appearance. Used so that every view lists modules
    the same way, although gradients are recorded in reverse execution order."""
    if not len(tensors):
        return []
    act = module_order(tensors[tensors["role"] == "activation"])
    seen = set(act)
    return act + [m for m in module_order(tensors) if m not in seen]


def roles_present(tensors: pd.DataFrame) -> list[str]:
    """Roles that have at least one row, in :data:`ROLES` order (unknown roles last)."""
    roles = tensors["role"]
    if isinstance(roles.dtype, pd.CategoricalDtype):  # 1M rows: unique codes, not 1M strings
        codes = np.unique(roles.cat.codes.to_numpy())
        present = {str(roles.cat.categories[c]) for c in codes if c >= 0}
    else:
        present = {str(r) for r in pd.unique(roles)}
    return [r for r in ROLES if r in present] + sorted(present - set(ROLES))


def step_bins(steps: np.ndarray | pd.Series, n_bins: int) -> tuple[np.ndarray, int]:
    """Equal-width step bins: returns (bin start for each step, bin width in steps).

    With ``n_bins`` >= the number of distinct steps the width is 1 and every step is its own bin.
    """
    steps = np.asarray(steps, dtype=np.int64)
    if steps.size == 0:
        return steps, 1
    lo, hi = int(steps.min()), int(steps.max())
    width = max(1, math.ceil((hi - lo + 1) / max(1, n_bins)))
    return lo + (steps - lo) // width * width, width


def _role_rows(tensors: pd.DataFrame, role: str) -> pd.DataFrame:
    return tensors[tensors["role"] == role]


def _per_module_step(rows: pd.DataFrame, stat: Statistic) -> pd.DataFrame:
    """One value per (module, step): a module's tensors (names) of one role combined.

    log2 statistics take the max magnitude over the names; fractions are weighted by numel, i.e.
    the fraction of all the module's elements of that role.
    """
    keys = ["module", "step"]
    if stat.kind == "sqnr":  # the lowest over the module's outputs (NaN only where all are NaN)
        out = rows.groupby(keys, observed=True, sort=False)[stat.columns[0]].min().reset_index()
        return out.rename(columns={stat.columns[0]: "value"})
    if stat.kind == "log2":
        g = rows.groupby(keys, observed=True, sort=False)[stat.columns[0]].max()
        with np.errstate(divide="ignore", invalid="ignore"):
            value = np.log2(g.to_numpy(dtype=np.float64))
        value[~np.isfinite(value)] = np.nan  # absmax 0 (all zero) or NaN (no finite element)
        out = g.reset_index()
        out["value"] = value
        return out.drop(columns=[stat.columns[0]])
    numel = rows["numel"].to_numpy(dtype=np.float64)
    if stat.key == "nonfinite_frac":
        bad = rows["nan_count"].to_numpy(dtype=np.float64) + rows["inf_count"].to_numpy(dtype=np.float64)
    else:
        bad = sum(rows[c].to_numpy(dtype=np.float64) for c in stat.columns) * numel
    tmp = pd.DataFrame({"module": rows["module"].to_numpy(), "step": rows["step"].to_numpy(), "bad": bad, "numel": numel})
    g = tmp.groupby(keys, sort=False)[["bad", "numel"]].sum()
    out = g.reset_index()
    with np.errstate(divide="ignore", invalid="ignore"):
        out["value"] = out["bad"] / out["numel"]
    return out.drop(columns=["bad", "numel"])


def cell_frame(
    tensors: pd.DataFrame,
    role: str,
    statistic: str = "log2_absmax",
    module_filter: str = "",
    max_rows: int = MAX_ROWS,
    order: list[str] | None = None,
    target: str = "float16",
    precision: pd.DataFrame | None = None,
    max_steps: int | None = None,
) -> pd.DataFrame:
    """Heatmap cells: one row per (module, step bin) for one role and statistic.

    Args:
        tensors: ``run.tensors``.
        role: one of :data:`mpscope.schema.ROLES` (``"activation"``, ``"activation_grad"``, ...).
        statistic: a key of :data:`STATISTICS`.
        module_filter: keep modules whose name contains this text (case-insensitive, plain text,
            not a regex); ``""`` keeps all.
        max_rows: at most this many rows are returned (steps are binned; each bin shows its worst
            step, i.e. the largest value, so a spike is never averaged away). When there are more
            modules than ``max_rows // 2``, the modules with the largest values are kept.
        order: module order of the rows (e.g. :func:`forward_order`); modules not in it follow in
            their order of appearance. Default: order of appearance of the role's rows.
        target: the 16-bit format float32 activations meet
            (:func:`mpscope.widgets.viewmodel.target_format`); decides which tensors are judged in
            the statistic's format (:func:`mpscope.widgets.viewmodel.judged_formats`); for the SQNR
            statistics, the format whose ideal SQNR the colours are measured against.
        precision: ``run.precision``, needed by the SQNR statistics (:data:`SQNR_STATISTICS`):
            their value per (module, step) is the lowest ``sqnr_db`` / ``own_sqnr_db`` over the
            module's outputs (+inf: exact), a bin shows its lowest step, and with more modules than
            ``max_rows // 2`` the lowest are kept. Never context.
        max_steps: at most this many step bins (columns) however few the modules; None: as many
            as ``max_rows`` allows. Bins are chosen as for ``max_rows``: equal width, worst step shown.

    Returns:
        DataFrame with columns ``module`` (str), ``step`` (int: the step where the bin's value is
        largest; NaN-valued bins give their first step), ``step_lo``, ``step_hi`` (int: the bin is
        ``step_lo <= step < step_hi``), ``value`` (float, NaN where undefined, e.g. log2 of an
        all-zero tensor), ``order`` (int: position of the module in execution order), ``context``
        (bool: none of the cell's tensors is judged in the statistic's format, so the value is
        shown in grey; otherwise ``value`` is over the tensors judged in it only), ``klass`` (colour
        class key) and ``label`` (its legend text, naming the limit; prefixed by
        :data:`CONTEXT_PREFIX` for context cells). ``frame.attrs["format"]`` is
        the format the statistic is about (None for format-free statistics).

    Raises:
        ValueError: unknown statistic, a frame lacking the Run.tensors (Run.precision) columns, or
            an SQNR statistic without ``precision``.
    """
    stat = _statistic(statistic)
    if stat.kind == "sqnr":
        if precision is None:
            raise ValueError(f"statistic {statistic!r} is read from run.precision: pass precision=run.precision "
                             "(a run recorded with mpscope.record(..., shadow=True))")
        _check_columns(precision, ("step", "module", "role", "name") + stat.columns, "precision")
        tensors = precision
    else:
        _check_columns(tensors, ("step", "module", "role", "numel", "dtype") + stat.columns, "tensors")
    rows = _role_rows(tensors, role)
    if module_filter:
        names = str_values(rows["module"])
        rows = rows[names.str.contains(module_filter, case=False, regex=False).to_numpy()]
    fmt = vm.statistic_format(statistic, target)
    cols = ["module", "step", "step_lo", "step_hi", "value", "order", "context", "klass", "label"]
    if rows.empty:
        empty = pd.DataFrame({c: pd.Series(dtype=object if c in ("module", "klass", "label") else float)
                              for c in cols})
        empty.attrs["format"] = fmt
        return empty
    per = _per_module_step(rows, stat)
    per["context"] = False
    # the value over the tensors judged in the statistic's format, where any (an SQNR is never context)
    if fmt is not None and stat.kind != "sqnr":
        in_fmt = vm.judged_formats(rows, target) == fmt
        if not in_fmt.all():
            per = per.set_index(["module", "step"])
            judged = _per_module_step(rows[in_fmt], stat).set_index(["module", "step"]) if in_fmt.any() \
                else pd.DataFrame(columns=["value"])
            per["context"] = ~per.index.isin(judged.index)
            hit = judged.index.intersection(per.index)
            per.loc[hit, "value"] = judged.loc[hit, "value"]
            per = per.reset_index()
    per["module"] = str_values(per["module"])
    # the worst value is the largest, the lowest for an SQNR
    per["_worst"] = -per["value"] if stat.kind == "sqnr" else per["value"]
    seen = module_order(rows)
    if order is not None:
        present = set(seen)
        known = [m for m in order if m in present]
        known_set = set(known)
        seen = known + [m for m in seen if m not in known_set]
    order = {m: i for i, m in enumerate(seen)}
    n_modules = len(order)
    if n_modules > max_rows // 2:  # keep the modules with the worst values
        worst = per.groupby("module")["_worst"].max().sort_values(ascending=False, na_position="last")
        keep = set(worst.index[: max_rows // 2])
        per = per[per["module"].isin(keep)]
        order = {m: i for i, m in enumerate(m for m in order if m in keep)}
        n_modules = len(order)
    n_bins = max(1, max_rows // max(1, n_modules))
    if max_steps is not None:
        n_bins = min(n_bins, max(1, int(max_steps)))
    per["step_lo"], width = step_bins(per["step"].to_numpy(), n_bins)
    # worst step in each (module, bin): judged cells before context ones, then by value with NaN
    # first; keep the last row
    per["_judged"] = ~per["context"].to_numpy(dtype=bool)
    per = per.sort_values(["module", "step_lo", "_judged", "_worst", "step"], na_position="first", kind="stable")
    cells = per.drop_duplicates(["module", "step_lo"], keep="last").copy()
    cells["step_hi"] = cells["step_lo"] + width
    cells["order"] = cells["module"].map(order).astype(int)
    cells = cells.sort_values(["order", "step_lo"]).reset_index(drop=True)
    for c in ("step", "step_lo", "step_hi"):
        cells[c] = cells[c].astype(int)
    cells["context"] = cells["context"].astype(bool)
    classes = colour_classes(statistic, fmt)
    cells["klass"] = vm.classify(cells["value"].to_numpy(), classes)
    labels = vm.class_labels(cells["klass"], classes)
    cells["label"] = np.where(cells["context"].to_numpy(dtype=bool), np.char.add(CONTEXT_PREFIX, labels.astype(str)),
                              labels).astype(object)
    cells = cells[cols]
    cells.attrs["format"] = fmt
    return cells


def colour_classes(statistic: str, fmt: str | None = "float16") -> list:
    """The colour classes of a heatmap statistic: :func:`mpscope.widgets.viewmodel.magnitude_classes`
    of ``fmt`` (float16 when None) for log2 statistics, :func:`~mpscope.widgets.viewmodel.sqnr_classes`
    for the SQNR ones, else the fraction classes."""
    kind = _statistic(statistic).kind
    if kind == "log2":
        return vm.magnitude_classes(fmt or "float16")
    if kind == "sqnr":
        return vm.sqnr_classes(fmt or "float16")
    return vm.fraction_classes()


#: Legend prefix of a context cell's class (grey shades: no tensor of the cell meets the format).
CONTEXT_PREFIX = "context · "
_GREYS = ("#f7f7f7", "#ebebeb", "#dcdcdc", "#cdcdcd", "#bebebe", "#afafaf")


def class_colours(classes, labels_present=()) -> dict[str, str]:
    """``{legend label: colour}`` of a heatmap: each class, the no-value class, and the grey
    context variant (``CONTEXT_PREFIX`` + label) of the classes among ``labels_present``."""
    every = list(classes) + [vm.NO_VALUE]
    colours = {c.label: c.colour for c in every}
    present = set(labels_present)
    for i, c in enumerate(every):
        if CONTEXT_PREFIX + c.label in present:
            grey = vm.NO_VALUE.colour if c is vm.NO_VALUE else _GREYS[min(i, len(_GREYS) - 1)]
            colours[CONTEXT_PREFIX + c.label] = grey
    return colours


def _color_scale(classes, labels_present=()):
    import altair as alt  # altair: optional ("notebook" extra)

    # nominal classes, computed in Python: the boundaries are exact (cast rounding thresholds) and
    # the legend is a set of swatches named by their limits (no SVG gradient shared between charts)
    colours = class_colours(classes, labels_present)
    return alt.Scale(domain=list(colours), range=list(colours.values()))


def _rows_height(n: int) -> int:
    """Pixels for n module rows: 14 px each (readable labels), between 80 and 4,000 px; beyond
    ~285 modules rows get thinner and the axis drops the labels that would overlap."""
    return int(min(4000, max(80, 14 * n)))


def _module_axis():
    import altair as alt  # altair: optional ("notebook" extra)

    # the root module's name is "" (named_modules()); label it
    return alt.Axis(labelLimit=260, labelOverlap="greedy",
                    labelExpr="datum.value === '' ? '(root)' : datum.value")


def heatmap_chart(cells: pd.DataFrame, statistic: str, title: str = "", selection: str = "cell",
                  width: int = 560, fmt: str | None = None) -> "alt.Chart":
    """Heatmap of modules (rows, execution order) × step bins (columns) from :func:`cell_frame`.

    Carries a point selection named ``selection`` on the fields ``module`` and ``step`` (click a
    cell; double-click clears), read back through ``JupyterChart.selections``. Colour: the cell's
    class (:func:`colour_classes`: hard boundaries at ``fmt``'s limits for log2 statistics, fixed
    fraction bands otherwise), with a legend of every class named by its limits; context cells
    (``context``) are drawn in grey shades (:func:`class_colours`). ``fmt``: default ``cells.attrs["format"]``, else float16.

    The x axis is *ordinal over the recorded step columns* (:func:`step_columns`): one column per
    recorded step (per step bin on long runs, labelled by its first step), and nothing else. A run
    recorded with ``every=2`` therefore shows steps 0, 2, 4, ... side by side, with no blank stripe
    for the steps it did not record, and the axis ends at the last recorded step (no padding, no
    rounding up).
    """
    import altair as alt

    stat = _statistic(statistic)
    fmt = fmt or cells.attrs.get("format") or ("float16" if stat.kind in ("log2", "sqnr") else None)
    classes = colour_classes(statistic, fmt)
    order = cells.sort_values("order")["module"].drop_duplicates().tolist()
    sel = alt.selection_point(name=selection, fields=["module", "step"], on="click", clear="dblclick",
                              empty=False)
    height = _rows_height(len(order))
    value_fmt = ".3%" if stat.kind == "fraction" else (".1f" if stat.kind == "sqnr" else ".2f")
    legend_title = [stat.key, (f"against {fmt}'s ideal SQNR" if stat.kind == "sqnr" else f"judged in {fmt}")
                    if fmt else "any format"]
    if cells["context"].any() if "context" in cells else False:
        legend_title.append(f"grey = context (never {fmt})")
    columns = step_columns(cells)
    width_1 = cells.empty or bool(((cells["step_hi"] - cells["step_lo"]) == 1).all())
    chart = (
        alt.Chart(cells, title=title or f"{stat.label}")
        .mark_rect()
        .encode(
            x=alt.X("step_lo:O", title="step" if width_1 else "step (bin start)", sort=columns,
                    scale=alt.Scale(domain=columns) if columns else alt.Undefined,
                    axis=alt.Axis(labelAngle=0, labelOverlap="greedy")),
            y=alt.Y("module:N", sort=order, title=None, axis=_module_axis()),
            color=alt.Color("label:N", title=legend_title, scale=_color_scale(classes, cells["label"]),
                            legend=alt.Legend(symbolType="square", labelLimit=320, titleLimit=320, orient="right",
                                              symbolStrokeColor="#888", symbolStrokeWidth=0.5,
                                              symbolOpacity=1)),
            # channel objects throughout, not shorthand strings or dicts: altair turns each of
            # those into a channel through a schema lookup that costs about 10 ms
            stroke=alt.StrokeValue(None, condition=alt.condition(sel, alt.value("black"), alt.value(None))["condition"]),
            tooltip=[
                alt.Tooltip("module:N"),
                alt.Tooltip("step:Q", title="worst step"),
                alt.Tooltip("step_lo:Q", title="from step"),
                alt.Tooltip("step_hi:Q", title="to step (excl.)"),
                alt.Tooltip("value:Q", title=stat.key, format=value_fmt),
                alt.Tooltip("label:N", title="class"),
                alt.Tooltip("context:N", title="context only"),
            ],
        )
        .add_params(sel)
        .properties(width=width, height=height)
    )
    return chart


def step_columns(frame: pd.DataFrame) -> list[int]:
    """The heatmap's x domain: the distinct ``step_lo`` of a binned frame, sorted (the recorded
    steps, or the first step of each bin holding one); ``[]`` when empty."""
    if frame.empty or "step_lo" not in frame:
        return []
    return [int(s) for s in np.unique(frame["step_lo"].to_numpy())]


def step_domain(frame: pd.DataFrame) -> list[int]:
    """``[first step_lo, last step_lo]`` of a binned frame: the x domain of a line chart over steps,
    exactly the first and last recorded step (bin), never padded or rounded to a "nice" value
    (``[0, 1]`` when empty; ``[s, s + 1]`` for a single step, so that the scale is not empty)."""
    if frame.empty or "step_lo" not in frame:
        return [0, 1]
    lo, hi = int(frame["step_lo"].min()), int(frame["step_lo"].max())
    return [lo, hi if hi > lo else lo + 1]


def _step_x(frame: pd.DataFrame, **kw):
    """The quantitative step axis of the line charts: domain :func:`step_domain`, no nice rounding."""
    import altair as alt

    return alt.X("step_lo:Q", title="step", axis=alt.Axis(format="d", tickMinStep=1),
                 scale=alt.Scale(domain=step_domain(frame), nice=False, zero=False), **kw)


def band_frame(tensors: pd.DataFrame, module: str, role: str, max_rows: int = MAX_ROWS) -> pd.DataFrame:
    """Magnitude band of one module and role over steps, in log2 units.

    Returns one row per step bin: ``step_lo``, ``step_hi`` (bin ``[step_lo, step_hi)``), ``lo`` =
    log2 of the smallest non-zero |x| (column ``absmin_nonzero``, min over the module's tensors and
    the bin's steps), ``hi`` = log2 of the largest finite |x| (``absmax``, max), and ``min`` /
    ``max`` (signed extremes, float). Rows where a tensor was all zero have NaN ``lo`` / ``hi``.
    """
    _check_columns(tensors, ("step", "module", "role", "min", "max", "absmax", "absmin_nonzero"), "tensors")
    rows = tensors[(tensors["role"] == role) & (str_values(tensors["module"]) == module)]
    cols = ["step_lo", "step_hi", "lo", "hi", "min", "max"]
    if rows.empty:
        return pd.DataFrame({c: pd.Series(dtype=float) for c in cols})
    bins, width = step_bins(rows["step"].to_numpy(), max_rows)
    tmp = pd.DataFrame({
        "step_lo": bins,
        "absmin": rows["absmin_nonzero"].to_numpy(dtype=np.float64),
        "absmax": rows["absmax"].to_numpy(dtype=np.float64),
        "min": rows["min"].to_numpy(dtype=np.float64),
        "max": rows["max"].to_numpy(dtype=np.float64),
    })
    g = tmp.groupby("step_lo").agg(absmin=("absmin", "min"), absmax=("absmax", "max"),
                                   min=("min", "min"), max=("max", "max")).reset_index()
    with np.errstate(divide="ignore", invalid="ignore"):
        g["lo"] = np.log2(g["absmin"].where(g["absmin"] > 0))
        g["hi"] = np.log2(g["absmax"].where(g["absmax"] > 0))
    g["step_hi"] = g["step_lo"] + width
    return g[cols]


#: Short names of the 16-bit formats in limit labels.
#: Rule colours of a format's max, min normal and min subnormal (fp16; bf16 in darker shades).
_LIMIT_COLOURS = {"float16": ["#d7191c", "#fdae61", "#2c7bb6"], "bfloat16": ["#7f0000", "#b35806", "#542788"]}


def limit_rules(fmt: str | None = "float16") -> pd.DataFrame:
    """The horizontal rules of a magnitude band: log2 of the max, min normal and min subnormal of
    ``fmt`` (``"float16"`` or ``"bfloat16"``, from :mod:`mpscope.formats`), columns ``log2``,
    ``limit`` (legend text naming the format) and ``format``. ``fmt=None`` (a run that computes in
    float32): the limits of both 16-bit formats, each label prefixed ``"hypothetical "`` (the run
    never meets them; they show where its values would land)."""
    if fmt is not None and fmt not in SHORT_NAMES:
        raise ValueError(f"fmt must be one of {sorted(SHORT_NAMES)} or None (a float32 run); got {fmt!r}")
    rows = []
    for f in ([FP16, BF16] if fmt is None else [FP16 if fmt == "float16" else BF16]):
        short, pre = SHORT_NAMES[f.name], ("hypothetical " if fmt is None else "")
        rows += [
            (math.log2(f.max), f"{pre}{short} max {f.max:.6g}", f.name),
            (float(f.min_normal_exponent), f"{pre}{short} min normal 2^{f.min_normal_exponent}", f.name),
            (float(f.min_subnormal_exponent), f"{pre}{short} min subnormal 2^{f.min_subnormal_exponent}", f.name),
        ]
    return pd.DataFrame(rows, columns=["log2", "limit", "format"])


def limits_title(fmt: str | None) -> str:
    """The legend title of :func:`limit_rules`: ``"fp16 limits (the run computes in float16)"``, or
    for a float32 run (None) ``"hypothetical fp16 / bf16 limits (the run computes in float32)"``."""
    if fmt is None:
        return "hypothetical fp16 / bf16 limits (the run computes in float32)"
    return f"{SHORT_NAMES[fmt]} limits (the run computes in {fmt})"


def band_chart(band: pd.DataFrame, title: str = "", width: int = 380,
               fmt: str | None = "float16") -> "alt.LayerChart":
    """Band from log2(smallest non-zero |x|) to log2(largest |x|) over steps, with the max, min
    normal and min subnormal of ``fmt`` (the format the run computes in: ``"float16"`` or
    ``"bfloat16"``; None for a float32 run: both, labelled hypothetical; :func:`limit_rules`) drawn
    as horizontal rules. The x domain is exactly the recorded steps (:func:`step_domain`)."""
    import altair as alt

    rules_data = limit_rules(fmt)
    colours = [c for f in dict.fromkeys(rules_data["format"]) for c in _LIMIT_COLOURS[f]]
    base = alt.Chart(band)
    area = base.mark_area(opacity=0.5, interpolate="step-after").encode(
        x=_step_x(band),
        y=alt.Y("lo:Q", title="log2 |x|"),
        y2=alt.Y2("hi:Q"),
        tooltip=[alt.Tooltip("step_lo:Q", title="step"), alt.Tooltip("lo:Q", format=".2f", title="log2 min |x|≠0"),
                 alt.Tooltip("hi:Q", format=".2f", title="log2 absmax"),
                 alt.Tooltip("min:Q", format=".4g"), alt.Tooltip("max:Q", format=".4g")],
    )
    hi_line = base.mark_line(interpolate="step-after").encode(x=alt.X("step_lo:Q"), y=alt.Y("hi:Q"))
    rules = alt.Chart(rules_data).mark_rule(strokeDash=[4, 3]).encode(
        y=alt.Y("log2:Q"), color=alt.Color("limit:N", title=limits_title(fmt),
                                    scale=alt.Scale(domain=rules_data["limit"].tolist(), range=colours),
                                    legend=alt.Legend(orient="bottom", columns=2, titleLimit=380, labelLimit=260)),
        tooltip=[alt.Tooltip("limit:N"), alt.Tooltip("log2:Q", format=".3f")],
    )
    return alt.layer(area, hi_line, rules, title=title or "magnitude band").properties(width=width, height=220)


def exponent_frame(histograms: pd.DataFrame, module: str, role: str, step: int | None = None,
                   shift: int = 0) -> pd.DataFrame:
    """Exponent histogram of one module and role (its tensors' names summed).

    Args:
        histograms: ``run.histograms`` (exponent = floor(log2|x|) in unscaled units).
        step: use this recorded step; ``None`` sums over all recorded histogram steps. If ``step``
            has no histogram (``hist_every`` > 1), the nearest recorded step at or before it is used
            (else the first one after it).
        shift: added to every exponent (log2 of a loss scale: the histogram of ``x * 2**shift``).

    Returns:
        DataFrame ``exponent`` (int, shifted), ``count`` (int), sorted by exponent, and the step used
        in ``frame.attrs["step"]`` (None when summed over steps).
    """
    _check_columns(histograms, ("step", "module", "role", "exponent", "count"), "histograms")
    rows = histograms[(histograms["role"] == role) & (str_values(histograms["module"]) == module)]
    used = None
    if step is not None and not rows.empty:
        steps = np.unique(rows["step"].to_numpy())
        before = steps[steps <= step]
        used = int(before[-1]) if before.size else int(steps[0])
        rows = rows[rows["step"] == used]
    g = rows.groupby("exponent")["count"].sum().reset_index()
    g["exponent"] = g["exponent"].astype(int) + int(shift)
    g["count"] = g["count"].astype(np.int64)
    g = g[g["count"] > 0].sort_values("exponent").reset_index(drop=True)
    g.attrs["step"] = used
    return g


def format_windows(lo: int, hi: int) -> pd.DataFrame:
    """Representable exponent windows of fp16 and bf16 clipped to ``[lo, hi]`` (for shading).

    Rows: ``format`` ("float16" | "bfloat16"), ``kind`` ("normal" | "subnormal"), ``lo``, ``hi``
    (exponent bounds, a binade e spans [e, e+1) on the axis). Windows outside ``[lo, hi]`` are dropped.
    """
    rows = []
    for fmt in (FP16, BF16):
        for kind, a, b in (("subnormal", fmt.min_subnormal_exponent, fmt.min_normal_exponent),
                           ("normal", fmt.min_normal_exponent, fmt.max_exponent + 1)):
            a2, b2 = max(a, lo), min(b, hi)
            if a2 < b2:
                rows.append({"format": fmt.name, "kind": kind, "window": f"{fmt.name} {kind}", "lo": a2, "hi": b2})
    return pd.DataFrame(rows, columns=["format", "kind", "window", "lo", "hi"])


def exponent_chart(hist: pd.DataFrame, title: str = "", width: int = 380) -> "alt.LayerChart":
    """Bars of element counts per binade (from :func:`exponent_frame`) over the shaded fp16 and
    bf16 representable windows (normal and subnormal ranges, from torch.finfo)."""
    import altair as alt

    if hist.empty:
        lo, hi = FP16.min_subnormal_exponent - 2, FP16.max_exponent + 2
    else:
        lo = int(min(hist["exponent"].min(), FP16.min_subnormal_exponent)) - 2
        hi = int(max(hist["exponent"].max(), FP16.max_exponent)) + 3
    windows = format_windows(lo, hi)
    domain = ["float16 normal", "float16 subnormal", "bfloat16 normal", "bfloat16 subnormal"]
    colors = alt.Scale(domain=domain, range=["#1a9641", "#a6d96a", "#7b3294", "#c2a5cf"])
    x = alt.X("lo:Q", title="exponent  floor(log2|x|)", scale=alt.Scale(domain=[lo, hi], nice=False))
    tip = [alt.Tooltip("window:N"), alt.Tooltip("lo:Q", title="from binade"), alt.Tooltip("hi:Q", title="to binade (excl.)")]
    # fp16's windows shade the whole height; bf16's (which usually span the whole axis) are a strip on top
    shade = alt.Chart(windows[windows["format"] == "float16"]).mark_rect(opacity=0.2).encode(
        x=x, x2=alt.X2("hi:Q"), tooltip=tip,
        color=alt.Color("window:N", title="representable", scale=colors,
                        legend=alt.Legend(orient="bottom", columns=2, symbolOpacity=0.5)))
    # bf16's windows: a strip just above the plot area, so that it never covers the bars
    strip = alt.Chart(windows[windows["format"] == "bfloat16"]).mark_rect(opacity=0.6).encode(
        x=x, x2=alt.X2("hi:Q"), y=alt.YValue(-9), y2=alt.Y2Value(-2), color=alt.Color("window:N", scale=colors), tooltip=tip)
    bars_data = hist.assign(exponent_hi=hist["exponent"] + 1)
    bars = alt.Chart(bars_data).mark_rect(color="#404040").encode(
        x=alt.X("exponent:Q"), x2=alt.X2("exponent_hi:Q"),
        y=alt.Y("count:Q", title="elements", scale=alt.Scale(type="symlog"),
                axis=alt.Axis(values=_decades(hist["count"].max() if len(hist) else 1), format=",d")),
        tooltip=[alt.Tooltip("exponent:Q"), alt.Tooltip("count:Q")],
    )
    return alt.layer(shade, strip, bars, title=alt.TitleParams(title or "exponent histogram", offset=12)).properties(
        width=width, height=200)


def _decades(top) -> list[int]:
    """Tick values for a symlog count axis: the powers of ten up to ``top`` (labels that never
    pile up, unlike evenly spaced ticks on a log-like scale)."""
    n = max(0, math.ceil(math.log10(max(1.0, float(top)))))
    return [10**i for i in range(n + 1)]


def prediction_chart(whatif: pd.DataFrame, log2_scale: int, role: str = "activation_grad",
                     order: list[str] | None = None, width: int = 380) -> "alt.Chart":
    """Horizontal bars per module: predicted fp16 underflow (flush to 0) / subnormal / overflow
    fraction of the role's gradient elements at loss scale ``2**log2_scale``.

    Args:
        whatif: rows of ``mpscope.scale_whatif(run, ks=[log2_scale], per_module=True,
            roles=[role])``: ``module``, ``underflow_frac``, ``subnormal_frac``, ``overflow_frac``
            (fractions of the non-zero finite recorded elements).
        order: module order of the y axis (default: as given).
    """
    import altair as alt

    order = list(order) if order is not None else whatif["module"].astype(str).tolist()
    fates = ["underflow_frac", "subnormal_frac", "overflow_frac"]
    long = whatif.assign(module=whatif["module"].astype(str)).melt(
        id_vars=["module"], value_vars=fates, var_name="fate", value_name="fraction")
    height = _rows_height(len(order))
    return (
        alt.Chart(long, title=f"predicted fp16 fate of {role} at loss scale 2^{int(log2_scale)}")
        .mark_bar()
        .encode(
            y=alt.Y("module:N", sort=order, title=None, axis=_module_axis()),
            x=alt.X("fraction:Q", title="fraction of non-zero elements (sqrt scale)",
                    scale=alt.Scale(type="sqrt", domain=[0, 1]), axis=alt.Axis(format="%")),
            yOffset=alt.YOffset("fate:N", sort=fates),
            color=alt.Color("fate:N", scale=alt.Scale(domain=fates, range=["#2c7bb6", "#abd9e9", "#d7191c"])),
            tooltip=[alt.Tooltip("module:N"), alt.Tooltip("fate:N"), alt.Tooltip("fraction:Q", format=".4%")],
        )
        .properties(width=width, height=height)
    )


def whatif_curve_chart(whatif: pd.DataFrame, recorded_k: int | None = None, width: int = 380) -> "alt.LayerChart":
    """Lines of the total predicted fp16 underflow / subnormal / overflow fraction against log2 of
    the loss scale (rows of ``mpscope.scale_whatif(run, ks=...)``: ``k`` and the three fractions),
    with a rule at ``recorded_k`` (the scale the run used)."""
    import altair as alt

    fates = ["underflow_frac", "subnormal_frac", "overflow_frac"]
    long = whatif.melt(id_vars=["k"], value_vars=fates, var_name="fate", value_name="fraction")
    lines = alt.Chart(long).mark_line(point=True).encode(
        x=alt.X("k:Q", title="log2 loss scale"),
        y=alt.Y("fraction:Q", title="fraction of non-zero gradient elements"),
        color=alt.Color("fate:N", scale=alt.Scale(domain=fates, range=["#2c7bb6", "#abd9e9", "#d7191c"])),
        tooltip=[alt.Tooltip("k:Q"), alt.Tooltip("fate:N"), alt.Tooltip("fraction:Q", format=".4%")],
    )
    layers = [lines]
    if recorded_k is not None:
        rule = alt.Chart(pd.DataFrame({"k": [int(recorded_k)], "what": ["recorded scale"]})).mark_rule(
            strokeDash=[4, 3], color="black").encode(x=alt.X("k:Q"), tooltip=[alt.Tooltip("what:N"), alt.Tooltip("k:Q")])
        layers.append(rule)
    return alt.layer(*layers, title="loss-scale what-if (all gradients)").properties(width=width, height=200)


def _step_ranges(steps) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0–2, 5, 7–8"``."""
    steps = sorted(int(s) for s in steps)
    parts, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        parts.append(str(steps[i]) if i == j else f"{steps[i]}–{steps[j]}")
        i = j + 1
    return ", ".join(parts)


def nonfinite_loss(steps: pd.DataFrame) -> dict[str, list[int]]:
    """``{"nan": [steps whose loss is NaN], "inf": [steps whose loss is ±inf]}`` of ``run.steps``."""
    if steps.empty or "loss" not in steps:
        return {"nan": [], "inf": []}
    loss = steps["loss"].to_numpy(dtype=np.float64)
    step = steps["step"].to_numpy()
    return {"nan": [int(x) for x in step[np.isnan(loss)]], "inf": [int(x) for x in step[np.isinf(loss)]]}


def loss_note(steps: pd.DataFrame) -> str:
    """The note the loss chart carries when some losses are not finite (they are not drawn):
    ``"loss NaN at steps 1, 4–5; inf at step 3 (not drawn)"``; ``""`` when every loss is finite.
    When no step has a finite loss it says so (a loop whose loss mpscope did not capture records
    NaN too)."""
    bad = nonfinite_loss(steps)
    if not bad["nan"] and not bad["inf"]:
        return ""
    what = []
    for kind, label in (("nan", "NaN"), ("inf", "inf")):
        if bad[kind]:
            n = len(bad[kind])
            what.append(f"{label} at step{'s' if n > 1 else ''} {_step_ranges(bad[kind])}")
    note = "loss " + "; ".join(what) + " (not drawn)"
    if len(bad["nan"]) + len(bad["inf"]) == len(steps):
        note += ": no step has a finite loss (NaN also where no loss was captured)"
    return note


def timeline_frame(steps: pd.DataFrame, max_rows: int = MAX_ROWS) -> pd.DataFrame:
    """Loss scale and loss over steps, binned to at most ``max_rows`` rows.

    Returns ``step_lo``, ``step_hi`` (bin ``[step_lo, step_hi)``), ``loss`` (mean of the finite
    losses in the bin, NaN if none), ``loss_nonfinite`` (int: steps in the bin whose loss is NaN or
    inf), ``loss_scale_min`` / ``loss_scale_max`` (float, the scale used for backward), ``skipped``
    (int: steps in the bin whose optimizer step did not run) and ``log2_scale`` (log2 of
    ``loss_scale_min``). ``frame.attrs["loss_note"]`` is :func:`loss_note` of ``steps`` (the steps
    whose loss is NaN / inf, by name; ``""`` when all are finite).
    """
    _check_columns(steps, ("step", "loss", "loss_scale", "skipped"), "steps")
    cols = ["step_lo", "step_hi", "loss", "loss_nonfinite", "loss_scale_min", "loss_scale_max", "skipped",
            "log2_scale"]
    if steps.empty:
        out = pd.DataFrame({c: pd.Series(dtype=float) for c in cols})
        out.attrs["loss_note"] = ""
        return out
    bins, width = step_bins(steps["step"].to_numpy(), max_rows)
    loss = steps["loss"].to_numpy(dtype=np.float64)
    tmp = pd.DataFrame({
        "step_lo": bins,
        "loss": np.where(np.isfinite(loss), loss, np.nan),
        "bad": (~np.isfinite(loss)).astype(np.int64),
        "scale": steps["loss_scale"].to_numpy(dtype=np.float64),
        "skipped": steps["skipped"].fillna(False).to_numpy(dtype=bool).astype(np.int64),
    })
    g = tmp.groupby("step_lo").agg(loss=("loss", "mean"), loss_nonfinite=("bad", "sum"),
                                   loss_scale_min=("scale", "min"),
                                   loss_scale_max=("scale", "max"), skipped=("skipped", "sum")).reset_index()
    g["step_hi"] = g["step_lo"] + width
    with np.errstate(divide="ignore", invalid="ignore"):
        g["log2_scale"] = np.log2(g["loss_scale_min"].where(g["loss_scale_min"] > 0))
    out = g[cols].copy()
    out.attrs["loss_note"] = loss_note(steps)
    return out


def timeline_chart(timeline: pd.DataFrame, width: int = 560) -> "alt.VConcatChart":
    """Two stacked charts sharing the step axis (domain exactly the recorded steps, :func:`step_domain`):
    log2 loss scale with skipped steps marked (red triangles), and the loss. Finite losses are drawn
    as a line with a point per step (so a finite step between NaN ones stays visible); steps whose
    loss is NaN / inf are marked by dashed red rules and named in the loss chart's subtitle
    (``timeline.attrs["loss_note"]``, :func:`loss_note`)."""
    import altair as alt

    base = alt.Chart(timeline)
    x = _step_x(timeline)
    scale_line = base.mark_line(interpolate="step-after").encode(
        x=x, y=alt.Y("log2_scale:Q", title="log2 loss scale"),
        tooltip=[alt.Tooltip("step_lo:Q", title="step"), alt.Tooltip("loss_scale_min:Q", title="loss scale"),
                 alt.Tooltip("skipped:Q")],
    )
    skips = base.transform_filter(alt.datum.skipped > 0).mark_point(shape="triangle-down", color="#d7191c",
                                                                      filled=True, size=60).encode(
        x=x, y=alt.Y("log2_scale:Q"),
        tooltip=[alt.Tooltip("step_lo:Q", title="step"), alt.Tooltip("skipped:Q", title="skipped steps"),
                 alt.Tooltip("loss_scale_min:Q", title="loss scale")],
    )
    top = alt.layer(scale_line, skips, title="loss scale (▼ skipped steps)").properties(width=width, height=120)
    note = timeline.attrs.get("loss_note", "")
    finite = base.transform_filter("isValid(datum.loss) && isFinite(datum.loss)")
    loss_line = finite.mark_line(point=True).encode(
        x=x, y=alt.Y("loss:Q", title="loss", scale=alt.Scale(zero=False)),
        tooltip=[alt.Tooltip("step_lo:Q", title="step"), alt.Tooltip("loss:Q", format=".4g")],
    )
    layers = [loss_line]
    if "loss_nonfinite" in timeline and (timeline["loss_nonfinite"] > 0).any():
        layers.append(base.transform_filter(alt.datum.loss_nonfinite > 0).mark_rule(
            color="#d7191c", strokeDash=[2, 2]).encode(
            x=x, tooltip=[alt.Tooltip("step_lo:Q", title="step"),
                          alt.Tooltip("loss_nonfinite:Q", title="steps with NaN/inf loss")]))
    loss_title = alt.TitleParams("loss", subtitle=[note], subtitleColor="#d7191c") if note else "loss"
    loss = alt.layer(*layers, title=loss_title).properties(width=width, height=120)
    return alt.vconcat(top, loss)


def dtypes_of(tensors: pd.DataFrame, module: str, role: str) -> dict[str, str]:
    """``{tensor name: dtype}`` of one module's tensors of one role (last recorded step)."""
    rows = tensors[(tensors["role"] == role) & (str_values(tensors["module"]) == module)]
    if rows.empty:
        return {}
    last = rows[rows["step"] == rows["step"].max()]
    return {str(n): str(d) for n, d in zip(last["name"], last["dtype"])}


# ----------------------------------------------------------------------------- fp32 shadow (SQNR)
#: The two series of :func:`sqnr_frame`.
SQNR_SERIES = {"sqnr_db": "total (against float32)", "own_sqnr_db": "own contribution"}


def sqnr_frame(precision: pd.DataFrame, module: str, role: str = "activation",
               max_rows: int = MAX_ROWS) -> pd.DataFrame:
    """SQNR of one module over steps, from ``run.precision`` (``record(..., shadow=True)``).

    Returns one row per (step bin, series): ``step_lo``, ``step_hi`` (bin ``[step_lo, step_hi)``),
    ``series`` (:data:`SQNR_SERIES`: the total SQNR against the float32 reference, and the module's
    own contribution), ``sqnr_db`` (dB: the lowest over the module's outputs and the bin's steps;
    NaN where it is +inf, i.e. exact, or not measured) and ``exact`` (bool: +inf dB). At most
    ``max_rows`` rows (steps binned).
    """
    _check_columns(precision, ("step", "module", "role", "sqnr_db", "own_sqnr_db"), "precision")
    cols = ["step_lo", "step_hi", "series", "sqnr_db", "exact"]
    rows = precision[(str_values(precision["role"]) == role) & (str_values(precision["module"]) == module)]
    if rows.empty:
        return pd.DataFrame({c: pd.Series(dtype=object if c == "series" else float) for c in cols})
    bins, width = step_bins(rows["step"].to_numpy(), max(1, max_rows // len(SQNR_SERIES)))
    parts = []
    for col, series in SQNR_SERIES.items():
        v = pd.Series(rows[col].to_numpy(dtype=np.float64)).groupby(bins).min()
        parts.append(pd.DataFrame({"step_lo": v.index.astype(int), "step_hi": v.index.astype(int) + width,
                                   "series": series, "sqnr_db": v.where(np.isfinite(v)).to_numpy(),
                                   "exact": np.isposinf(v.to_numpy())}))
    return pd.concat(parts, ignore_index=True)[cols]


def sqnr_rules(fmt: str = "float16") -> pd.DataFrame:
    """The lines an SQNR chart marks: ``db`` and ``limit`` (legend text) of ``fmt``'s ideal SQNR
    (:attr:`mpscope.formats.Format.ideal_sqnr_db`, from ``torch.finfo``) and of the
    ``precision_loss`` threshold (the first boundary of
    :func:`mpscope.widgets.viewmodel.sqnr_classes`)."""
    classes = vm.sqnr_classes(fmt)
    ideal = next(c for c in classes if c.key == "ideal")
    below = next(c for c in classes if c.key == "below")
    return pd.DataFrame({"db": [ideal.lo, below.lo],
                         "limit": [f"{fmt} ideal {ideal.lo:.1f} dB", f"precision_loss threshold {below.lo:.1f} dB"]})


def sqnr_chart(frame: pd.DataFrame, fmt: str = "float16", title: str = "", width: int = 380) -> "alt.LayerChart":
    """Lines of a module's total and own SQNR over steps (:func:`sqnr_frame`), with ``fmt``'s ideal
    SQNR and the ``precision_loss`` threshold drawn as horizontal rules (:func:`sqnr_rules`).
    Exact steps (+inf dB) leave a gap in the line and are named in the tooltip."""
    import altair as alt

    line = alt.Chart(frame).mark_line(point=True, interpolate="step-after").encode(
        x=_step_x(frame),
        y=alt.Y("sqnr_db:Q", title="SQNR (dB)"),
        color=alt.Color("series:N", title=None, scale=alt.Scale(range=["#2c7bb6", "#d7191c"]),
                        legend=alt.Legend(orient="bottom")),
        tooltip=[alt.Tooltip("step_lo:Q", title="step"), alt.Tooltip("series:N"),
                 alt.Tooltip("sqnr_db:Q", format=".1f", title="SQNR (dB)"), alt.Tooltip("exact:N", title="exact")],
    )
    rules = alt.Chart(sqnr_rules(fmt)).mark_rule(strokeDash=[4, 3]).encode(
        y=alt.Y("db:Q"), strokeDash=alt.StrokeDash("limit:N", title=None, legend=alt.Legend(orient="bottom")),
        tooltip=[alt.Tooltip("limit:N"), alt.Tooltip("db:Q", format=".2f")],
    )
    return alt.layer(line, rules, title=title or "SQNR against the float32 reference").properties(
        width=width, height=220)
