"""Layer explorer without a browser: built from real recorded runs, every chart validated against
the Vega-Lite schema altair ships, selections and slider moves simulated the way the browser sends
them, and every number checked against oracles outside the explorer: the run's own frames, and
the real tensors cast with ``Tensor.to(torch.float16)``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import mpscope
from loops import record_fp16, record_fp16_mlp

alt = pytest.importorskip("altair")
pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")
jsonschema = pytest.importorskip("jsonschema")

from mpscope.widgets import charts  # noqa: E402
from mpscope.widgets import viewmodel as vm  # noqa: E402
from mpscope.widgets.explorer import Explorer, explore  # noqa: E402

FP16_TINY = torch.finfo(torch.float16).tiny  # 2^-14, the oracle's min normal
LOG2_S0 = 0  # the tanh run's loss scale: 1, so that the early layers' gradients flush to zero


# ----------------------------------------------------------------------------- recorded runs
class Capture:
    """Our own hooks (not mpscope's) keeping every module output and its gradient as seen."""

    def __init__(self, model):
        self.out: dict[str, list[torch.Tensor]] = {}
        self.grad: dict[str, list[torch.Tensor]] = {}
        self.handles = []
        for name, mod in model.named_modules():
            if name:
                self.handles.append(mod.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def fwd(mod, inp, out):
            self.out.setdefault(name, []).append(out.detach().clone())
            out.register_hook(lambda g: self.grad.setdefault(name, []).append(g.detach().clone()))

        return fwd

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.fixture(scope="module")
def tanh_run():
    """A deep tanh MLP (CASES.md C06 shape) trained 4 steps under CPU fp16 autocast with a GradScaler
    held at 2^0 (growth_interval beyond the run): its early activation gradients flush to zero."""
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        lin = torch.nn.Linear(64, 64)
        torch.nn.init.normal_(lin.weight, std=0.04)
        layers += [lin, torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**LOG2_S0, growth_interval=10**6)
    g = torch.Generator().manual_seed(1)
    cap = Capture(model)
    try:
        with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
            for _ in range(4):
                x, y = torch.randn(128, 64, generator=g), torch.randn(128, 10, generator=g)
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    finally:
        cap.remove()
    run = rec.run
    assert set(run.steps["loss_scale"]) == {2.0**LOG2_S0}, "precondition: constant loss scale"
    return run, cap


@pytest.fixture(scope="module")
def tanh_explorer(tanh_run):
    run, _ = tanh_run
    return explore(run, advice=mpscope.advise(run))


def vl_schema():
    path = Path(alt.__file__).parent / "vegalite" / alt.SCHEMA_VERSION.split(".")[0] / "schema" / "vega-lite-schema.json"
    return json.loads(path.read_text())


def datasets_rows(spec: dict) -> list[int]:
    return [len(v) for v in spec.get("datasets", {}).values()]


def select_cell(jchart, module: str, step: int) -> None:
    """What the browser sends when a heatmap cell is clicked: the point selection's Vega signal."""
    jchart._vl_selections = {
        "cell": {"value": {"vlPoint": {"or": [{"module": module, "step": step}]}, "module": [module], "step": [step]},
                 "store": [{"unit": "", "fields": [], "values": [module, step]}]}
    }


# ----------------------------------------------------------------------------- tests
def test_import_mpscope_stays_light():
    code = ("import sys, mpscope, mpscope.widgets, mpscope.widgets.charts, mpscope.report; "
            "heavy = {'altair', 'ipywidgets', 'anywidget', 'IPython'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_chart_validates_against_the_vega_lite_schema(tanh_explorer):
    e = tanh_explorer
    module = e.cells["module"].iloc[0]
    e.select(module, int(e.cells["step"].iloc[0]))  # so the detail charts hold data
    validator = jsonschema.Draft7Validator(vl_schema())
    jcharts = {"heatmap": e.heatmap, "band": e.band, "histogram": e.histogram,
               "prediction": e.prediction, "timeline": e.timeline}
    for name, jc in jcharts.items():
        assert jc.chart is not None, name
        for spec in (jc.chart.to_dict(), jc.spec):  # what altair builds and what the browser gets
            errors = list(validator.iter_errors(spec))
            assert not errors, f"{name}: {errors[0].message[:300]}"
            assert all(n <= charts.MAX_ROWS for n in datasets_rows(spec)), name
    # every statistic and every role the dropdowns offer
    for role in e.role.options:
        for _, stat in e.statistic.options:
            e.role.value, e.statistic.value = role, stat
            errors = list(validator.iter_errors(e.heatmap.spec))
            assert not errors, f"heatmap {role}/{stat}: {errors[0].message[:300]}"
    e.role.value, e.statistic.value = "activation", "log2_absmax"
    # offline: the widgets' JavaScript is the vl-convert bundle, no CDN import
    assert alt.JupyterChart._is_offline
    assert "https://esm.sh" not in e.heatmap._esm


def test_heatmap_cells_match_the_real_tensors(tanh_run, tanh_explorer):
    run, cap = tanh_run
    e = tanh_explorer
    e.role.value, e.statistic.value, e.module_filter.value = "activation", "log2_absmax", ""
    cells = e.cells.set_index(["module", "step"])["value"]
    assert len(cells) == (1 + len(cap.out)) * 4  # the root "" and every submodule, x 4 steps
    for name, outs in cap.out.items():
        for step, o in enumerate(outs):
            assert cells[(name, step)] == pytest.approx(math.log2(o.abs().max().item()), abs=1e-9)
    # zero fraction of the activation gradients: the oracle is the captured gradient itself
    e.role.value, e.statistic.value = "activation_grad", "zero_frac"
    cells = e.cells.set_index(["module", "step"])["value"]
    first = "0"
    for step, g in enumerate(cap.grad[first]):
        assert cells[(first, step)] == pytest.approx((g == 0).double().mean().item(), abs=1e-12)
    assert cells[(first, 0)] > 0.05  # at 2^0 the first layer's gradients really do flush
    # the statistic dropdown changed the spec the browser draws
    spec_zero = json.dumps(e.heatmap.spec, sort_keys=True)
    e.statistic.value = "fp16_subnormal_frac"
    assert json.dumps(e.heatmap.spec, sort_keys=True) != spec_zero


def test_module_filter(tanh_run, tanh_explorer):
    _, cap = tanh_run
    e = tanh_explorer
    e.role.value, e.statistic.value = "activation", "log2_absmax"
    e.module_filter.value = "1"
    assert set(e.cells["module"]) == {m for m in cap.out if "1" in m} == {"1", *map(str, range(10, 17))}
    e.module_filter.value = "no such module"
    assert e.cells.empty and "no activation rows matching" in e.heatmap_note.value
    e.module_filter.value = ""
    assert e.cells["module"].nunique() == 1 + len(cap.out)


def test_selecting_a_cell_opens_its_detail(tanh_run, tanh_explorer):
    run, cap = tanh_run
    e = tanh_explorer
    e.role.value, e.statistic.value, e.module_filter.value = "activation", "log2_absmax", ""
    select_cell(e.heatmap, "4", 2)
    # read back through JupyterChart.selections, as the explorer does
    assert e.heatmap.selections.cell.value == [{"module": "4", "step": 2}]
    assert e.selected == ("4", 2) and e.module.value == "4"
    band = e.band_data.set_index("step_lo")
    for step, o in enumerate(cap.out["4"]):
        a = o.abs().double()
        assert band.loc[step, "hi"] == pytest.approx(math.log2(a.max().item()))
        assert band.loc[step, "lo"] == pytest.approx(math.log2(a[a > 0].min().item()))
    # exponent histogram of the selected step: floor(log2|x|) of the captured output (activations
    # are not scaled, so the slider does not shift them)
    o = cap.out["4"][2].double().flatten()
    o = o[(o != 0) & torch.isfinite(o)]
    exps = (torch.frexp(o)[1] - 1).numpy()
    want = pd.Series(exps).value_counts().sort_index()
    got = e.histogram_data.set_index("exponent")["count"]
    assert e.histogram_data.attrs["step"] == 2
    pd.testing.assert_series_equal(got, want, check_names=False, check_index_type=False, check_dtype=False)
    # dtype and the data behind the charts the browser shows
    assert "float16" in e.detail_info.value and e.detail_charts.layout.display == "flex"
    assert e.band.chart is not None and len(e.band.spec["datasets"]) >= 1
    # a cleared selection (double-click) keeps the detail
    e.heatmap._vl_selections = {"cell": {"value": None, "store": []}}
    assert e.selected == ("4", 2)
    # choosing a module in the dropdown selects it over all steps
    e.module.value = "6"
    assert e.selected == ("6", None)


def oracle_fates(grads: list[torch.Tensor], k: int) -> dict[str, float]:
    """fp16 fate of the captured gradients rescaled from 2^LOG2_S0 to 2^k, by a real cast, counted
    the way scale_whatif documents it (whole binades): the three slices of a binade that a cast
    treats unlike the rest of its binade are moved back to their binade's class, from the values."""
    x = torch.cat([g.double().flatten() for g in grads]) * 2.0 ** (k - LOG2_S0)
    x = x[(x != 0) & torch.isfinite(x)]
    h = x.to(torch.float16)
    a = x.abs()
    n = x.numel()
    tie_to_zero = a == 2.0**-25  # rounds to 0 (ties to even); its binade -25 is "subnormal"
    top = (a >= 65520) & (a < 65536)  # rounds to inf; its binade 15 is "finite"
    up_to_normal = (a >= FP16_TINY - 2.0**-25) & (a < FP16_TINY)  # rounds to 2^-14; binade -15 is "subnormal"
    assert int(((h == 0) & ~tie_to_zero).sum()) == int((a < 2.0**-25).sum())  # the cast agrees otherwise
    return {
        "underflow_frac": ((h == 0) & ~tie_to_zero).sum().item() / n,
        "overflow_frac": (torch.isinf(h) & ~top).sum().item() / n,
        "subnormal_frac": (((h != 0) & (h.abs() < FP16_TINY)) | tie_to_zero | up_to_normal).sum().item() / n,
        "tie_frac": tie_to_zero.sum().item() / n,
    }


def test_loss_scale_slider_predicts_the_fp16_cast(tanh_run, tanh_explorer):
    run, cap = tanh_run
    e = tanh_explorer
    e.role.value = "activation_grad"
    assert e.scale.value == LOG2_S0  # the slider starts at the recorded scale
    seen = {"underflow_frac": 0.0, "overflow_frac": 0.0}
    for k in (-4, LOG2_S0, 12, 20, 30):
        e.scale.value = k
        pred = e.predictions.set_index("module")
        assert f"2^{k}" in e.prediction.chart.to_dict()["title"]["text"] if isinstance(
            e.prediction.chart.to_dict()["title"], dict) else f"2^{k}" in e.prediction.chart.to_dict()["title"]
        for name in ("0", "6", "12"):
            want = oracle_fates(cap.grad[name], k)
            for col in ("underflow_frac", "overflow_frac", "subnormal_frac"):
                assert pred.loc[name, col] == pytest.approx(want[col], abs=1e-12), (name, k, col)
            for col in seen:
                seen[col] = max(seen[col], want[col])
    assert seen["underflow_frac"] > 0.05 and seen["overflow_frac"] > 0.05  # the test can fail


def test_slider_shifts_the_gradient_histogram(tanh_run, tanh_explorer):
    run, cap = tanh_run
    e = tanh_explorer
    e.role.value = "activation_grad"
    e.select("2", 1)
    for k in (LOG2_S0, 16):
        e.scale.value = k
        g = cap.grad["2"][1].double().flatten() / 2.0**LOG2_S0  # unscaled, as the histograms store it
        g = g[(g != 0) & torch.isfinite(g)]
        want = pd.Series((torch.frexp(g)[1] - 1 + k).numpy()).value_counts().sort_index()
        got = e.histogram_data.set_index("exponent")["count"]
        pd.testing.assert_series_equal(got, want, check_names=False, check_index_type=False, check_dtype=False)
        assert f"2^{k}" in e.histogram.chart.to_dict()["title"]["text"] if isinstance(
            e.histogram.chart.to_dict()["title"], dict) else True


def test_recorded_scale_prediction_matches_recorded_fractions(tanh_run, tanh_explorer):
    """At the recorded scale, the what-if must agree with what the recorder measured by casting."""
    run, _ = tanh_run
    e = tanh_explorer
    e.role.value = "activation_grad"
    e.scale.value = LOG2_S0
    t = run.tensors[run.tensors["role"] == "activation_grad"]
    pred = e.predictions.set_index("module")
    for module, rows in t.groupby(t["module"].astype(str), observed=True):
        nonzero = (rows["numel"] * (1 - rows["zero_frac"]) - rows["nan_count"] - rows["inf_count"]).sum()
        sub = (rows["fp16_subnormal_frac"] * rows["numel"]).sum() / nonzero
        assert pred.loc[module, "subnormal_frac"] == pytest.approx(sub, abs=2e-3), module


def test_timeline_marks_the_skipped_steps():
    """A GradScaler starting at 2^24 on large targets skips its first steps; the timeline shows them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 8, generator=g), 100 * torch.randn(16, 1, generator=g)) for _ in range(8)]
    run = record_fp16(model, opt, scaler, batches)
    e = explore(run, advice=mpscope.advise(run))
    tl = e.timeline_data.set_index("step_lo")
    skipped = run.steps.set_index("step")["skipped"]
    assert skipped.sum() >= 1  # precondition from GradScaler's own behaviour
    assert (tl["skipped"] > 0).to_dict() == skipped.to_dict()
    assert np.allclose(tl["loss_scale_min"], run.steps.set_index("step")["loss_scale"])
    spec = e.timeline.spec
    assert "skipped" in json.dumps(spec)


def test_long_runs_are_aggregated_below_the_row_limit(tanh_run):
    """3,000 steps x 18 modules: every chart's data stays <= 5,000 rows and a cell shows its bin's
    worst step."""
    run, _ = tanh_run
    t, s, h = run.tensors, run.steps, run.histograms
    reps = 750  # 4 steps x 750 = 3,000 steps
    rng = np.random.default_rng(0)
    tt = pd.concat([t.assign(step=t["step"] + 4 * i) for i in range(reps)], ignore_index=True)
    tt["absmax"] = tt["absmax"] * np.exp2(rng.integers(-3, 4, len(tt)))  # make bins differ
    ss = pd.concat([s.assign(step=s["step"] + 4 * i) for i in range(reps)], ignore_index=True)
    ss["skipped"] = ss["step"] % 97 == 0
    long_run = mpscope.Run.from_frames(tt, ss, h, run.meta)
    e = explore(long_run, advice=mpscope.advise(run))  # the short run's advice: only the views are timed here
    # it opens on the most severe finding's role and statistic
    e.role.value, e.statistic.value = "activation", "log2_absmax"
    assert len(e.cells) <= charts.MAX_ROWS
    width = int((e.cells["step_hi"] - e.cells["step_lo"]).iloc[0])
    assert width > 1 and e.cells["step_lo"].nunique() * e.cells["module"].nunique() <= charts.MAX_ROWS
    # oracle: the frame itself, one (module, bin) at a time
    act = tt[tt["role"] == "activation"]
    for _, c in e.cells.sample(20, random_state=0).iterrows():
        rows = act[(act["module"] == c["module"]) & (act["step"] >= c["step_lo"]) & (act["step"] < c["step_hi"])]
        assert c["value"] == pytest.approx(math.log2(rows["absmax"].max()))
        assert rows.loc[rows["absmax"].idxmax(), "step"] == c["step"] or \
            rows[rows["step"] == c["step"]]["absmax"].max() == rows["absmax"].max()
    e.select("0", 1234)
    for jc in (e.heatmap, e.band, e.histogram, e.prediction, e.timeline):
        assert all(n <= charts.MAX_ROWS for n in datasets_rows(jc.spec))
    assert int(e.timeline_data["skipped"].sum()) == int(ss["skipped"].sum())
    assert len(e.timeline_data) <= charts.MAX_ROWS and len(e.band_data) <= charts.MAX_ROWS


def test_findings_export_and_advisor_unavailable(tanh_run, tmp_path, monkeypatch):
    run, _ = tanh_run
    advice = mpscope.advise(run)
    e = explore(run, advice=advice)
    named = [f for f in advice.findings if f.module is not None and f.role in set(charts.roles_present(run.tensors))]
    assert named, "precondition: at scale 1 the advisor names underflowing layers"
    f = named[0]
    e.role.value = f.role
    e.select(str(f.module), None)
    codes = {x.code for x in advice.findings if x.module == f.module}
    assert all(c in e.detail_info.value for c in codes)
    assert e.detail_info.value.count("<li>") == sum(x.module == f.module for x in advice.findings)
    # export through the button writes what advice.export writes
    e.export_format.value = "json"
    assert e.export_path.value.endswith(".json")
    e.export_path.value = str(tmp_path / "cfg.json")
    e.export_button.click()
    assert (tmp_path / "cfg.json").exists(), e.export_status.value
    advice.export(tmp_path / "direct.json", format="json")
    assert (tmp_path / "cfg.json").read_text() == (tmp_path / "direct.json").read_text()
    assert "wrote" in e.export_status.value

    # the advisor fails on this run: the explorer still opens, and says why there is no advice
    def broken(*args, **kwargs):
        raise RuntimeError("advisor bug")

    import mpscope.advisor.recommendation as recommendation
    import mpscope.widgets.explorer as explorer_module

    monkeypatch.setattr(recommendation, "advise", broken)
    monkeypatch.setattr(explorer_module, "scale_whatif", broken)
    e2 = explore(run)
    assert e2.advice is None and "advisor unavailable" in e2.recommendation.value
    assert e2.export_button.disabled and "advisor unavailable" in e2.prediction_note.value
    assert e2.heatmap.spec is not None


def test_explore_opens_a_saved_run_directory(tanh_run, tmp_path):
    run, _ = tanh_run
    run.save(tmp_path / "run")
    e = explore(str(tmp_path / "run"), advice=mpscope.advise(run))
    pd.testing.assert_frame_equal(e.cells, explore(run, advice=e.advice).cells)


def test_explore_rejects_what_is_not_a_run():
    with pytest.raises(TypeError, match="mpscope.Run"):
        explore(pd.DataFrame())
    with pytest.raises(ValueError, match="unknown statistic"):
        charts.cell_frame(pd.DataFrame({"step": [], "module": [], "role": [], "numel": []}), "activation", "p99")


def test_explorer_opens_on_the_most_severe_finding(tanh_run):
    run, _ = tanh_run
    advice = mpscope.advise(run)
    e = explore(run, advice=advice)
    f = vm.most_severe(advice.findings)
    named = [x for x in advice.findings if x.module is not None]
    rank = {"info": 0, "warning": 1, "error": 2}
    assert f is not None and rank[f.severity] == max(rank[x.severity] for x in named)
    assert e.role.value == f.role and e.selected == (str(f.module), f.step) and e.module.value == str(f.module)
    assert e.statistic.value == vm.finding_statistic(f)  # the heatmap shows what the finding is about
    assert e.detail_charts.layout.display == "flex" and f.code in e.detail_info.value
    assert not e.band_data.empty and not e.histogram_data.empty
    # the heatmap's x axis spans the recorded steps (0 .. 3, cells [step, step + 1)) and no more
    x = e.heatmap.chart.to_dict()["encoding"]["x"]
    assert x["type"] == "ordinal" and x["scale"]["domain"] == [0, 1, 2, 3]
    # the filter narrows every module chart: the what-if too
    e.module_filter.value = "1"
    assert len(e.predictions) and all("1" in m for m in e.predictions["module"])
    assert set(e.predictions["module"]) <= set(e.cells["module"])


def test_finding_figures_first_and_worst_from_the_real_gradients(tanh_run):
    """A finding's "first at step / worst at step" figures: first = the advisor's own step and
    value, worst = the real captured gradients cast to fp16 (subnormal or flushed)."""
    run, cap = tanh_run
    advice = mpscope.advise(run)
    under = [f for f in advice.findings if f.code == "grad_underflow" and f.role == "activation_grad"]
    assert under, "precondition: at scale 1 the advisor finds flushed gradients"
    for f in under:
        fig = vm.finding_figures(run.tensors, f, "float16")
        assert fig["first_step"] == f.step and fig["first"] == pytest.approx(f.value, abs=1e-9)
        lost = [((g != 0) & (g.to(torch.float16).abs() < FP16_TINY)).double().mean().item()
                for g in cap.grad[f.module]]
        assert fig["worst"] == pytest.approx(max(lost), abs=1e-12)
        assert fig["worst_step"] == int(np.argmax(lost))
        text = vm.figures_text(fig)
        assert f"first at step {f.step}: {100 * f.value:.1f} %" in text
        assert f"worst at step {int(np.argmax(lost))}: {100 * max(lost):.1f} %" in text
    e = explore(run, advice=advice)
    e.role.value = under[0].role
    e.select(str(under[0].module), None)
    assert "first at step" in e.detail_info.value and "worst at step" in e.detail_info.value


# ----------------------------------------------------------------------------- reported glitches
def layer_data(spec: dict, layer: dict) -> list[dict]:
    """The rows a layer of a chart's ``to_dict()`` draws (its named dataset, else the chart's)."""
    return spec["datasets"][(layer.get("data") or spec["data"])["name"]]


def test_every_2_heatmap_has_a_column_per_recorded_step_only():
    """every=2 records steps 0, 2, ..., 10: those are the heatmap's columns (an ordinal axis), with
    no blank stripe for the steps in between."""
    run = record_fp16_mlp(steps=12, every=2)
    recorded = sorted(int(s) for s in run.tensors["step"].unique())
    assert recorded == [0, 2, 4, 6, 8, 10]  # precondition: the recorder skipped the odd steps
    e = explore(run, advice=mpscope.advise(run))
    e.role.value, e.statistic.value = "activation", "log2_absmax"
    x = e.heatmap.chart.to_dict()["encoding"]["x"]
    assert x["type"] == "ordinal" and x["field"] == "step_lo"
    assert x["scale"]["domain"] == recorded and x["sort"] == recorded
    assert "x2" not in e.heatmap.chart.to_dict()["encoding"]
    # every column is filled: each module has a cell at every recorded step
    per_column = e.cells.groupby("step_lo")["module"].nunique()
    assert per_column.index.tolist() == recorded
    assert (per_column == e.cells["module"].nunique()).all()
    assert "6 step columns (recorded steps only)" in e.heatmap_note.value


def test_step_axes_span_exactly_the_run_steps():
    """Steps 0..11: the heatmap's columns are 0..11 (not 0..12), the line charts' domains [0, 11]
    with no nice rounding."""
    run = record_fp16_mlp(steps=12)
    assert run.steps["step"].tolist() == list(range(12))
    e = explore(run, advice=mpscope.advise(run))
    e.role.value, e.statistic.value = "activation", "log2_absmax"
    x = e.heatmap.chart.to_dict()["encoding"]["x"]
    assert x["scale"]["domain"] == list(range(12))
    e.select(e.cells["module"].iloc[0], 3)
    band_x = e.band.chart.to_dict()["layer"][0]["encoding"]["x"]
    assert band_x["scale"] == {"domain": [0, 11], "nice": False, "zero": False}
    for panel in e.timeline.chart.to_dict()["vconcat"]:
        for layer in panel["layer"]:
            if "x" in layer["encoding"]:
                assert layer["encoding"]["x"]["scale"] == {"domain": [0, 11], "nice": False, "zero": False}


def _nan_loss_run(bad: dict[int, float], steps: int = 5):
    """A real fp16 run whose targets hold NaN / inf at the steps of ``bad``, so its loss does too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batches = []
    for step in range(steps):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        if step in bad:
            y[0] = bad[step]
        batches.append((x, y))
    return record_fp16(model, opt, torch.amp.GradScaler("cpu"), batches)


def test_nan_loss_draws_the_finite_losses_and_names_the_bad_steps():
    run = _nan_loss_run({1: float("nan"), 3: float("inf"), 4: float("nan")})
    loss = run.steps.set_index("step")["loss"]
    assert np.isnan(loss[1]) and np.isnan(loss[4]) and np.isinf(loss[3])  # precondition
    e = explore(run, advice=mpscope.advise(run))
    assert "loss NaN at steps 1, 4; inf at step 3 (not drawn)" in e.timeline_note.value
    spec = e.timeline.chart.to_dict()
    panel = spec["vconcat"][1]
    assert panel["title"]["subtitle"] == ["loss NaN at steps 1, 4; inf at step 3 (not drawn)"]
    line = next(layer for layer in panel["layer"] if layer["mark"]["type"] == "line")
    assert line["mark"]["point"] is True
    assert {"filter": "isValid(datum.loss) && isFinite(datum.loss)"} in line["transform"]
    drawn = {r["step_lo"]: r["loss"] for r in layer_data(spec, panel) if r["loss"] is not None}
    assert drawn == pytest.approx({s: float(v) for s, v in loss.items() if np.isfinite(v)})
    rules = next(layer for layer in panel["layer"] if layer["mark"]["type"] == "rule")
    assert rules["transform"] == [{"filter": "(datum.loss_nonfinite > 0)"}]
    assert e.timeline_data.set_index("step_lo")["loss_nonfinite"].to_dict() == {0: 0, 1: 1, 2: 0, 3: 1, 4: 1}
    assert not list(jsonschema.Draft7Validator(vl_schema()).iter_errors(e.timeline.spec))
    # every loss NaN: nothing to draw, and the note says so
    run = _nan_loss_run({s: float("nan") for s in range(4)}, steps=4)
    assert run.steps["loss"].isna().all()
    e = explore(run, advice=mpscope.advise(run))
    assert "loss NaN at steps 0–3 (not drawn): no step has a finite loss" in e.timeline_note.value
    # a run whose losses are all finite has no note
    ok = record_fp16_mlp(steps=3)
    assert explore(ok, advice=mpscope.advise(ok)).timeline_note.value == ""


def test_rank_wording_for_one_and_several_ranks(tanh_run):
    run, _ = tanh_run
    assert run.ranks == [0]
    e = explore(run, advice=mpscope.advise(run))
    assert e.rank_note.value == "showing the rows of its one rank."
    assert vm.shown_rows_text(1) == "showing the rows of its one rank"
    assert vm.shown_rows_text(2) == "showing the rows merged over both ranks"
    assert vm.shown_rows_text(4) == "showing the rows merged over all 4 ranks"
    assert vm.shown_rows_text(4, 3) == "showing rank 3's own rows"
    assert [vm.n_ranks(n) for n in (1, 2, 8)] == ["1 rank", "2 ranks", "8 ranks"]

    class Meta:  # the meta of a rank's own rows in a job of world_size 1 and 4
        def __init__(self, world):
            self.meta = {"ranks": [0], "distributed": {"world_size": world}}

    assert vm.ranks_text(Meta(1)) == "rank 0's own rows (of 1 rank)"
    assert vm.ranks_text(Meta(4)) == "rank 0's own rows (of 4 ranks)"


def test_finding_messages_are_left_aligned(tanh_run):
    run, _ = tanh_run
    advice = mpscope.advise(run)
    e = explore(run, advice=advice)
    f = next(x for x in advice.findings if x.module is not None and x.role in e.role.options)
    e.role.value = f.role
    e.select(str(f.module), None)
    import html as _html
    for widget in (e.detail_info, e.recommendation):
        value = widget.value
        assert value.startswith("<style>") and "text-align: left !important" in value
        assert ".mpscope-explorer .mpscope-text td" in value  # notebook CSS right-aligns table cells
        body = value[value.index("<div class='mpscope-text' style='text-align:left'>"):]
        assert _html.escape(f.message) in body and body.endswith("</div>")
    assert "mpscope-explorer" in e._dom_classes


def _rule_layer(chart) -> tuple[list[dict], dict]:
    spec = chart.to_dict()
    layer = next(x for x in spec["layer"] if x["mark"]["type"] == "rule")
    return layer_data(spec, layer), layer["encoding"]["color"]


def _record_cpu(autocast=None, cast=None, steps=3):
    """A real run without GradScaler: CPU autocast in ``autocast`` (None: off), parameters in ``cast``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if cast is not None:
        model = model.to(cast)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    if cast is not None:
        x = x.to(cast)
    with mpscope.record(model, optimizer=opt) as rec:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
    return rec.run


@pytest.mark.parametrize("kind", ["bf16_autocast", "bf16_params", "fp16_autocast", "float32"])
def test_band_limits_are_the_run_format(kind, tanh_run):
    if kind == "fp16_autocast":
        run = tanh_run[0]
    else:
        run = _record_cpu(autocast=torch.bfloat16) if kind == "bf16_autocast" else \
            _record_cpu(cast=torch.bfloat16) if kind == "bf16_params" else _record_cpu()
    e = explore(run, advice=mpscope.advise(run))
    e.select(e.cells["module"].iloc[0], 0)
    rows, colour = _rule_layer(e.band.chart)
    got = {r["limit"]: r["log2"] for r in rows}
    bf, fp = torch.finfo(torch.bfloat16), torch.finfo(torch.float16)

    def limits(fi, short, pre=""):
        return {f"{pre}{short} max {fi.max:.6g}": math.log2(fi.max),
                f"{pre}{short} min normal 2^{int(math.log2(fi.tiny))}": math.log2(fi.tiny),
                f"{pre}{short} min subnormal 2^{int(math.log2(fi.tiny * fi.eps))}": math.log2(fi.tiny * fi.eps)}

    if kind.startswith("bf16"):
        assert e.compute_format == "bfloat16"
        assert got == pytest.approx(limits(bf, "bf16"))
        assert colour["title"] == "bf16 limits (the run computes in bfloat16)"
    elif kind == "fp16_autocast":
        assert e.compute_format == "float16"
        assert got == pytest.approx(limits(fp, "fp16"))
        assert "fp16 max 65504" in got
        assert colour["title"] == "fp16 limits (the run computes in float16)"
    else:
        assert run.meta.get("autocast_dtype") in (None, "float32") and e.compute_format is None
        assert got == pytest.approx({**limits(fp, "fp16", "hypothetical "), **limits(bf, "bf16", "hypothetical ")})
        assert colour["title"] == "hypothetical fp16 / bf16 limits (the run computes in float32)"
    assert colour["scale"]["domain"] == list(got)  # every rule has its own legend entry
    assert not list(jsonschema.Draft7Validator(vl_schema()).iter_errors(e.band.spec))
