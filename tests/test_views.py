"""What the views judge: every alarm is a risk in the format a tensor really meets, colour classes
follow the casts, quoted figures name their step, and the widget and the report agree.

Oracles: ``Tensor.to(torch.float16 / torch.bfloat16)`` (what a cast really does), GradScaler's
own scale (the loss gradient it produces), the advisor's own finding values, and our own hooks'
copies of the real gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mpscope
from mpscope.formats import BF16, FP16
from mpscope.widgets import charts
from mpscope.widgets import viewmodel as vm


# ----------------------------------------------------------------------------- runs
class WithLoss(torch.nn.Module):
    """Returns (prediction, loss) like a Hugging Face model given labels: the root's second output
    is the fp32 loss, whose gradient is the loss scale itself."""

    def __init__(self, loss_child: bool = False):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
        self.criterion = torch.nn.MSELoss() if loss_child else None

    def forward(self, x, y):
        out = self.body(x)
        loss = self.criterion(out.float(), y) if self.criterion is not None else F.mse_loss(out.float(), y)
        return out, loss


def _train(model, steps=3, scale=2.0**16, x_scale=1.0):
    """fp16 autocast + GradScaler + AdamW (fp32 state), the loss taken from the model's output;
    inputs ~ N(0, x_scale^2)."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    g = torch.Generator().manual_seed(0)
    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        for _ in range(steps):
            x, y = x_scale * torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                _, loss = model(x, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return rec.run


@pytest.fixture(scope="module")
def loss_run():
    torch.manual_seed(0)
    return _train(WithLoss())


@pytest.fixture(scope="module")
def loss_child_run():
    torch.manual_seed(0)
    return _train(WithLoss(loss_child=True))


#: Colours of the classes that say "something is lost" (every class but 0 / normal / no value).
ALARM_COLOURS = {c.colour for c in vm.magnitude_classes(FP16) + vm.fraction_classes()
                 if c.key not in ("zero", "normal")}


def _colours(cells, statistic):
    """The colour each heatmap cell is drawn in (the chart's own label -> colour mapping)."""
    mapping = charts.class_colours(charts.colour_classes(statistic, cells.attrs.get("format")), cells["label"])
    return cells["label"].map(mapping).to_numpy()


def _cast_class(x: float, fmt) -> str:
    """The oracle: what ``Tensor.to(dtype)`` does to |x| held in an fp32 tensor."""
    r = abs(torch.tensor(x, dtype=torch.float32).to(fmt.dtype).item())
    if r == 0:
        return "flushed"
    if math.isinf(r):
        return "overflow"
    if r < torch.finfo(fmt.dtype).tiny:
        return "subnormal"
    if r >= 2.0 ** fmt.max_exponent:
        return "top"
    return "normal"


# ----------------------------------------------------------------------------- 1. judged format
@pytest.mark.parametrize("which", ["loss_run", "loss_child_run"])
def test_loss_gradient_and_fp32_optimizer_state_are_not_alarms(which, request):
    run = request.getfixturevalue(which)
    t = run.tensors
    scale = float(run.steps["loss_scale"].iloc[0])
    assert torch.isinf(torch.tensor(scale).to(torch.float16))  # 2^16 > 65504: fp16 would overflow
    loss_module = "" if which == "loss_run" else "criterion"
    lg = t[(t.role == "activation_grad") & (t.module == loss_module) & (t.numel == 1)]
    # precondition: the recorded loss gradient is the scale, in fp32, "100 % fp16 overflow"
    assert len(lg) and (lg.absmax == scale).all() and (lg.dtype == "float32").all()
    assert (lg.fp16_overflow_frac == 1.0).all()
    st = t[t.role == "optimizer_state"]
    assert (st.dtype == "float32").all() and st.fp16_underflow_frac.max() > 0.2  # exp_avg_sq is tiny
    target = vm.target_format(run)
    assert target == "float16"
    table = vm.risk_table(t, target, skipped_steps=run.steps.step[run.steps.skipped])
    row = table[(table.module == loss_module) & (table.role == "activation_grad")].iloc[0]
    assert row.overflow == 0 and not row.alarm
    states = table[table.role == "optimizer_state"]
    assert not states.alarm.any() and states.fp16_context.all() and (states.format == "float32").all()
    # ranking: no fp32 optimizer state above a tensor that really loses something
    if table.alarm.any():
        assert table.alarm.iloc[0]
    # heatmap: the loss gradient is not red, the optimizer state's fp16 fractions are context
    for stat in ("log2_absmax", "fp16_overflow_frac"):
        cells = charts.cell_frame(t, "activation_grad", stat, target=target)
        assert not set(_colours(cells, stat)[cells.module == loss_module]) & ALARM_COLOURS, stat
    cells = charts.cell_frame(t, "optimizer_state", "fp16_underflow_frac", target=target)
    assert cells.context.all() and (cells.value > 0.05).any()
    assert not set(_colours(cells, "fp16_underflow_frac")) & ALARM_COLOURS


def test_a_real_overflow_is_still_an_alarm():
    """The positive control: an fp32 activation above 65504 that the next Linear casts to fp16."""

    class Big(torch.nn.Module):
        def forward(self, x):
            return x.float() * 1e5

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Big(), torch.nn.Linear(8, 1))
    with mpscope.record(model) as rec:
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.randn(4, 8))
        rec.step()
    t = rec.run.tensors
    row = t[(t.module == "1") & (t.role == "activation")].iloc[0]
    assert row["dtype"] == "float32" and row.fp16_overflow_frac > 0
    table = vm.risk_table(t, vm.target_format(rec.run))
    # the fp32 overflow, and the inf it becomes in the fp16 Linear after it (and the root's
    # output, the same tensor), rank above everything that loses nothing
    alarms = table.alarm.to_numpy()
    assert alarms[:3].all() and not alarms[3:].any()
    assert ("1", "activation") in set(zip(table.module[:3], table.role[:3]))
    top = table[table.module == "1"].iloc[0]
    assert top.format == "float16" and top.overflow > 0 and top.alarm
    cells = charts.cell_frame(t, "activation", "log2_absmax", target="float16")
    assert set(cells.klass[cells.module == "1"]) == {"overflow"} and not cells.context.any()


# ----------------------------------------------------------------------------- 2. colour classes
@pytest.mark.parametrize("fmt", [FP16, BF16], ids=["float16", "bfloat16"])
def test_magnitude_classes_match_the_cast_on_each_side_of_each_limit(fmt):
    classes = vm.magnitude_classes(fmt)
    limits = [fmt.underflow_threshold, fmt.normal_threshold, 2.0 ** fmt.max_exponent, fmt.overflow_threshold]
    checked = set()
    for b in limits:
        b32 = np.float32(b)  # training tensors are fp32: the neighbours of each limit in fp32
        for x in (float(np.nextafter(b32, np.float32(0))), float(b32), float(np.nextafter(b32, np.float32(np.inf)))):
            if math.isinf(x):
                continue
            got = vm.classify([math.log2(x)], classes)[0]
            assert got == _cast_class(x, fmt), (fmt.name, x)
            checked.add(got)
    assert checked == {"flushed", "subnormal", "normal", "top", "overflow"}
    labels = " ".join(c.label for c in classes)
    if fmt is FP16:  # the legend names the limits
        for limit in ("2^-25", "2^-14", "2^15", "65520", "65504"):
            assert limit in labels


def test_fraction_classes_have_hard_boundaries():
    classes = vm.fraction_classes()
    got = vm.classify([0.0, 1e-300, 9.99e-4, 1e-3, 0.0099, 0.01, 0.0999, 0.1, 0.4999, 0.5, 1.0, math.nan], classes)
    assert list(got) == ["zero", "lt0.1", "lt0.1", "lt1", "lt1", "lt10", "lt10", "lt50", "lt50", "ge50", "ge50",
                         "none"]


def test_widget_and_report_draw_the_same_colour_scale(loss_run, tmp_path):
    pytest.importorskip("altair")
    pytest.importorskip("ipywidgets")
    pytest.importorskip("vl_convert")
    from mpscope.report import embedded_specs, write_report
    from mpscope.widgets.explorer import explore

    advice = mpscope.advise(loss_run)
    e = explore(loss_run, advice=advice)
    e.role.value, e.statistic.value = "activation_grad", "log2_absmax"
    widget_scale = e.heatmap.chart.to_dict()["encoding"]["color"]["scale"]
    html = write_report(loss_run, tmp_path / "r.html", advice=advice).read_text(encoding="utf-8")
    specs = embedded_specs(html)
    report_scales = [s["encoding"]["color"]["scale"] for s in specs
                     if "encoding" in s and s["encoding"].get("color", {}).get("field") == "label"]
    assert widget_scale in report_scales
    assert widget_scale["domain"][:5] == [c.label for c in vm.magnitude_classes(FP16)]
    # no gradient legend anywhere: nothing for another chart's SVG id to shadow
    assert all(s["encoding"]["color"].get("type") != "quantitative" for s in specs
               if "encoding" in s and "color" in s["encoding"])


# ----------------------------------------------------------------------------- 3. first / worst
def test_figures_text_names_first_and_worst_step():
    class F:
        code, severity, module, role, name, step, value, threshold = (
            "grad_underflow", "warning", "m", "activation_grad", "output", 1, 0.2, 0.1)

    import pandas as pd

    t = pd.DataFrame({"step": [0, 1, 2, 3], "module": "m", "role": "activation_grad", "name": "output",
                      "dtype": "float16", "numel": 100, "fp16_underflow_frac": [0.0, 0.1, 0.3, 0.05],
                      "fp16_subnormal_frac": [0.05, 0.1, 0.1, 0.0], "nan_count": 0, "inf_count": 0,
                      "loss_scale": 2.0**16})
    fig = vm.finding_figures(t, F(), "float16")
    assert (fig["first_step"], fig["worst_step"]) == (1, 2)
    assert fig["first"] == pytest.approx(0.2) and fig["worst"] == pytest.approx(0.4)
    text = vm.figures_text(fig)
    assert text.startswith("first at step 1: 20.0 %, worst at step 2: 40.0 %") and "scaled ×2^16" in text


def test_gradient_units_are_named(loss_run):
    t = loss_run.tensors
    assert vm.grad_units(t, "activation_grad") == "scaled (× loss scale 2^16)"
    assert vm.grad_units(t, "param_grad") == "unscaled"  # recorded after GradScaler.unscale_
    assert vm.grad_units(t, "activation") == ""
    assert vm.fmt_scale(65536.0) == "2^16" and vm.module_label("") == "(root)"


# ----------------------------------------------------------------------------- what-if vs heatmap
def test_whatif_and_param_grad_heatmap_agree():
    """Same role, same scale: the what-if's predicted fp16 underflow equals what the heatmap shows
    (the recorded casts), summed over the steps, per module. Inputs of size ~1e-6 give first-layer
    weight gradients that flush in fp16 once unscaled."""
    pytest.importorskip("altair")
    pytest.importorskip("ipywidgets")
    from mpscope.widgets.explorer import explore

    torch.manual_seed(0)
    run = _train(WithLoss(), x_scale=1e-6)
    e = explore(run, advice=mpscope.advise(run))
    e.role.value, e.statistic.value = "param_grad", "fp16_underflow_frac"
    assert e.scale.value == 0  # param grads are recorded after unscale_: the slider follows
    assert "unscaled" in e.heatmap_note.value and "unscaled" in e.prediction_note.value
    t = run.tensors[run.tensors.role == "param_grad"]
    numel = t.groupby(["module", "step"], observed=True)["numel"].sum()
    nonzero = (t.numel * (1 - t.zero_frac) - t.nan_count - t.inf_count).groupby(t.module, observed=True).sum()
    cells = e.cells.set_index(["module", "step"])["value"]
    pred = e.predictions.set_index("module")["underflow_frac"]
    seen = 0.0
    for module in nonzero.index:
        flushed = sum(cells[(module, s)] * numel[(module, s)] for s in numel[module].index)
        # binade granularity (documented in scale_whatif): a value of exactly 2^-25 flushes in the
        # cast but sits in the what-if's subnormal binade; fp16-quantized gradients hit it rarely
        assert pred[module] == pytest.approx(flushed / nonzero[module], rel=0.01, abs=1e-9), module
        seen = max(seen, pred[module])
    assert seen > 0  # something does flush: the comparison can fail
    # and at the activation gradients' scale, the what-if says so
    e.role.value = "activation_grad"
    assert e.scale.value == 16 and "2^16" in e.heatmap_note.value
