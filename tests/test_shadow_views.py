"""SQNR of the fp32 shadow in the views: the heatmap statistic, the detail chart with the format's
ideal SQNR marked, the explorer and the HTML report, all reading ``run.precision``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import mpscope
from mpscope.advisor.precision import PRECISION_LOSS_MARGIN_DB

alt = pytest.importorskip("altair")
pytest.importorskip("vl_convert")

from mpscope.widgets import charts  # noqa: E402
from mpscope.widgets import viewmodel as vm  # noqa: E402

from cases.shadow_scenarios import SCENARIOS  # noqa: E402

STEPS = 4


class Scale(nn.Module):
    def forward(self, x):  # exact: a power-of-two scaling of bf16-representable inputs in float32
        return x * 2.0


class TwoHeads(nn.Module):
    def forward(self, h):  # two outputs (output.0, output.1): a cell shows the lower SQNR
        return h * 0.5, h.cumsum(-1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = Scale()
        self.lin = nn.Linear(16, 16)
        self.heads = TwoHeads()

    def forward(self, x):
        a, b = self.heads(self.lin(self.scale(x)))
        return a + b


def _ideal(dtype: torch.dtype) -> float:
    """20·log10(2) dB per significand bit: the stored bits (-log2 eps) plus the implicit one."""
    return 20 * math.log10(2) * (-math.log2(torch.finfo(dtype).eps) + 1)


@pytest.fixture(scope="module")
def shadow_run():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with mpscope.record(model, opt, shadow=True) as rec:
        for _ in range(STEPS):
            x = torch.randn(64, 16).to(torch.bfloat16).float()  # values bf16 holds exactly
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return rec.run


@pytest.fixture(scope="module")
def culprit_run():
    cls, batch, culprit = SCENARIOS["timesteps"]
    torch.manual_seed(0)
    model = cls()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with mpscope.record(model, opt, shadow=True) as rec:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(*batch())
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    return rec.run, culprit


def _lowest(precision, column: str) -> dict:
    """(module, step) -> the lowest value of ``column`` over the module's outputs, read row by row."""
    out: dict = {}
    for r in precision.itertuples(index=False):
        key = (str(r.module), int(r.step))
        v = float(getattr(r, column))
        out[key] = v if key not in out or v < out[key] else out[key]
    return out


@pytest.mark.parametrize("stat", ["sqnr_db", "own_sqnr_db"])
def test_heatmap_data_equals_run_precision(shadow_run, stat):
    p = shadow_run.precision
    assert set(p.name[p.module == "heads"]) == {"output.0", "output.1"}
    target = vm.target_format(shadow_run)
    assert target == "bfloat16"
    cells = charts.cell_frame(shadow_run.tensors, "activation", stat, precision=p, target=target)
    expected = _lowest(p, stat)
    assert len(cells) == len(expected) == p.module.nunique() * STEPS
    data = next(iter(charts.heatmap_chart(cells, stat).to_dict()["datasets"].values()))
    ideal = _ideal(torch.bfloat16)
    for row in data:  # the chart's own dataset, as the browser receives it
        want = expected[(row["module"], row["step"])]
        if math.isinf(want):
            assert row["klass"] == "exact" and row["value"] in (None, math.inf)
            continue
        assert row["value"] == pytest.approx(want, rel=1e-12)
        klass = "loss" if want < ideal - PRECISION_LOSS_MARGIN_DB else ("below" if want < ideal else "ideal")
        assert row["klass"] == klass, row
    # the exact scaling of bf16-held inputs has no error at all: +inf dB, drawn as exact
    assert (cells[cells.module == "scale"].klass == "exact").all()
    assert np.isposinf(p[p.module == "scale"][stat]).all()


def test_heatmap_bins_show_their_lowest_step(shadow_run):
    p = shadow_run.precision
    n_modules = p.module.nunique()
    cells = charts.cell_frame(shadow_run.tensors, "activation", "sqnr_db", precision=p, target="bfloat16",
                              max_rows=2 * n_modules)  # two bins of two steps
    lowest = _lowest(p, "sqnr_db")
    for r in cells.itertuples(index=False):
        assert r.step_hi - r.step_lo == 2
        vals = {s: lowest[(r.module, s)] for s in range(r.step_lo, r.step_hi)}
        assert r.value == min(vals.values()) and lowest[(r.module, r.step)] == r.value


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ideal_line_equals_the_formula_from_finfo(dtype):
    fmt = str(dtype).removeprefix("torch.")
    ideal = _ideal(dtype)
    assert ideal == pytest.approx({torch.float16: 66.2, torch.bfloat16: 48.2}[dtype], abs=0.05)
    frame = charts.sqnr_frame(_one_row_precision(), "m")
    spec = charts.sqnr_chart(frame, fmt).to_dict()
    rules = [d for d in spec["datasets"].values() if d and "db" in d[0]][0]
    assert rules[0]["db"] == pytest.approx(ideal, rel=1e-12) and f"{ideal:.1f} dB" in rules[0]["limit"]
    assert rules[1]["db"] == pytest.approx(ideal - PRECISION_LOSS_MARGIN_DB, rel=1e-12)
    # the heatmap's colour boundaries sit at the same values
    keys = vm.classify([ideal - PRECISION_LOSS_MARGIN_DB - 1e-9, ideal - PRECISION_LOSS_MARGIN_DB,
                        np.nextafter(ideal, -np.inf), ideal, math.inf, math.nan], vm.sqnr_classes(fmt))
    assert list(keys) == ["loss", "below", "below", "ideal", "exact", "none"]
    assert len(frame) == 2


def _one_row_precision():
    import pandas as pd

    return pd.DataFrame({"step": [0], "module": ["m"], "role": ["activation"], "name": ["output"],
                         "sqnr_db": [40.0], "own_sqnr_db": [math.inf]})


def test_sqnr_detail_frame_equals_run_precision(shadow_run):
    p = shadow_run.precision
    f = charts.sqnr_frame(p, "heads")
    for col, series in charts.SQNR_SERIES.items():
        got = f[f.series == series].set_index("step_lo")
        low = _lowest(p, col)
        for s in range(STEPS):
            want = low[("heads", s)]
            assert got.loc[s, "exact"] == np.isposinf(want)
            assert got.loc[s, "sqnr_db"] == pytest.approx(want, rel=1e-12) or np.isposinf(want)


def test_sqnr_statistics_need_the_precision_table(shadow_run):
    with pytest.raises(ValueError, match="shadow=True"):
        charts.cell_frame(shadow_run.tensors, "activation", "sqnr_db")


def test_explorer_opens_on_the_culprit_with_its_sqnr(culprit_run):
    pytest.importorskip("ipywidgets")
    from mpscope.widgets.explorer import Explorer

    run, culprit = culprit_run
    e = Explorer(run)
    assert e.statistic.value == "own_sqnr_db" and e.selected[0] == culprit
    low = _lowest(run.precision, "own_sqnr_db")
    assert {(r.module, r.step): r.value for r in e.cells.itertuples()} == pytest.approx(low)
    worst = e.cells.sort_values("value").iloc[0]
    assert worst.module == culprit and worst.klass == "loss"
    rows = run.precision[run.precision.module == culprit].sort_values("step")
    own = e.sqnr_data[e.sqnr_data.series == charts.SQNR_SERIES["own_sqnr_db"]]
    assert own.sqnr_db.tolist() == pytest.approx(rows.own_sqnr_db.tolist())
    assert e.sqnr.layout.display != "none"
    assert f"{_ideal(torch.bfloat16):.1f} dB" in e.heatmap_note.value
    e.statistic.value = "sqnr_db"
    total = _lowest(run.precision, "sqnr_db")
    assert {(r.module, r.step): r.value for r in e.cells.itertuples()} == pytest.approx(total)


def test_explorer_without_a_shadow_offers_no_sqnr():
    pytest.importorskip("ipywidgets")
    from loops import record_fp16_mlp
    from mpscope.widgets.explorer import Explorer

    run = record_fp16_mlp(steps=2)
    assert run.precision.empty
    e = Explorer(run)
    offered = [v for _, v in e.statistic.options]
    assert not set(charts.SQNR_STATISTICS) & set(offered) and "log2_absmax" in offered


def test_report_shows_sqnr_heatmaps_and_the_ideal(culprit_run):
    from mpscope.report import embedded_specs, render_report

    run, culprit = culprit_run
    html = render_report(run)
    specs = embedded_specs(html)
    datasets = [d for s in specs for d in s.get("datasets", {}).values()]
    for stat in charts.SQNR_STATISTICS:
        low = _lowest(run.precision, stat)
        title = charts.STATISTICS[stat].label
        spec = next(s for s in specs if title in json.dumps(s.get("title", "")))
        cells = next(iter(spec["datasets"].values()))
        assert {(c["module"], c["step"]): c["value"] for c in cells} == pytest.approx(low)
    rules = [d for d in datasets if d and set(d[0]) == {"db", "limit"}]
    assert rules and all(r[0]["db"] == pytest.approx(_ideal(torch.bfloat16)) for r in rules)
    # the output's and the culprit's SQNR over steps
    lines = [d for d in datasets if d and "series" in d[0]]
    assert len(lines) == 2
    titles = json.dumps([s.get("title") for s in specs], ensure_ascii=False)
    assert f"{culprit}: SQNR against float32" in titles and "(root): SQNR against float32" in titles
    assert "<title>mpscope report — " in html  # the page keeps its own title
