"""``run.to_tensorboard(logdir)``: real recorded runs written as TensorBoard events, read back with
TensorBoard's own reader (``EventAccumulator``) and compared with the Run's own frames."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mpscope
from mpscope.run import Run

ROOT = Path(__file__).resolve().parents[1]
TINY = {torch.float16: 1e-9, torch.bfloat16: 1e-42, None: 1e-9}  # flushed to 0 by a cast to the run's format


def _train(dtype, steps=6, every=2, blow_up_at=None, scaler=True):
    """A real loop: Linear(8,16) -> ReLU -> Linear(16,1), SGD, CPU autocast ``dtype`` (None: float32),
    a GradScaler (init 2^8) when ``scaler``. Input column 0 is always 0 and first-layer weights from
    it are ``TINY[dtype]`` (their gradient is 0, so they keep that value): 16 of the module's 144
    parameters flush to 0 in the run's format. At step ``blow_up_at`` the loss is multiplied by 1e6
    (finite in fp32, inf in fp16): the scaled gradients overflow and the scaler skips the step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight[:, 0] = TINY[dtype]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler else None
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    x[:, 0] = 0
    with mpscope.record(model, optimizer=opt, scaler=gs, every=every) as rec:
        for i in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = F.mse_loss(model(x).float(), y)
            if i == blow_up_at:
                loss = loss * 1e6
            if gs is None:
                loss.backward()
                opt.step()
            else:
                gs.scale(loss).backward()
                gs.step(opt)
                gs.update()
    assert model[0].weight[0, 0].item() == pytest.approx(TINY[dtype], rel=1e-2)  # kept: no gradient reached it
    return rec.run


@pytest.fixture(scope="module")
def fp16_run():
    return _train(torch.float16, blow_up_at=2)


@pytest.fixture(scope="module")
def accumulator_class():
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator


def _read(accumulator_class, logdir):
    """``(scalars, histograms)`` of the events in ``logdir``: tag -> {step: value} and tag -> {step:
    HistogramValue}; each step at most once per tag."""
    acc = accumulator_class(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    assert not tags["tensors"], tags["tensors"]  # everything is a classic scalar or histogram
    scalars, hists = {}, {}
    for tag in tags["scalars"]:
        events = acc.Scalars(tag)
        scalars[tag] = {e.step: e.value for e in events}
        assert len(scalars[tag]) == len(events), f"{tag}: a step written twice"
    for tag in tags["histograms"]:
        events = acc.Histograms(tag)
        hists[tag] = {e.step: e.histogram_value for e in events}
        assert len(hists[tag]) == len(events), f"{tag}: a step written twice"
    return scalars, hists


def _same(a, b):
    """TensorBoard keeps scalars as float32."""
    return (math.isnan(a) and math.isnan(b)) or a == np.float32(b)


def _module_fractions(run, column):
    """{(step, role, module): sum(frac * numel) / sum(numel)} from ``run.tensors``."""
    t = run.tensors.astype({"module": str, "role": str})
    t = t.assign(count=t[column] * t["numel"])
    g = t.groupby(["step", "role", "module"])[["count", "numel"]].sum()
    return {k: row["count"] / row["numel"] for k, row in g.iterrows() if row["numel"] > 0}


def _label(module):
    return module or "(root)"


# ----------------------------------------------------------------------------------------- fp16
def test_the_run_itself_has_what_the_export_must_show(fp16_run):
    """The loop did what the other tests rely on (so they compare something that can differ)."""
    steps = fp16_run.steps
    assert list(steps.step) == list(range(6))
    assert list(steps.recorded) == [True, False, True, False, True, False]
    assert list(steps.skipped) == [False, False, True, False, False, False]
    assert list(steps.loss_scale) == [256.0, 256.0, 256.0, 128.0, 128.0, 128.0]
    assert steps.loss[2] > 1e5 and steps.loss.drop(2).max() < 10
    assert fp16_run.meta["autocast_dtype"] == "float16"


def test_step_scalars_equal_run_steps(fp16_run, accumulator_class, tmp_path):
    out = fp16_run.to_tensorboard(tmp_path / "tb")
    assert out == tmp_path / "tb"
    scalars, _ = _read(accumulator_class, out)
    steps = fp16_run.steps
    for column, tag in (("loss", "mpscope/loss"), ("loss_scale", "mpscope/loss_scale"), ("skipped", "mpscope/skipped")):
        written = scalars[tag]
        assert sorted(written) == list(steps.step), tag  # every step, the unrecorded ones too
        for step, value in zip(steps.step, steps[column].astype(float)):
            assert _same(written[step], value), (tag, step, written[step], value)
    assert [scalars["mpscope/skipped"][s] for s in range(6)] == [0, 0, 1, 0, 0, 0]
    assert [scalars["mpscope/loss_scale"][s] for s in range(6)] == [256, 256, 256, 128, 128, 128]
    assert scalars["mpscope/loss"][2] == np.float32(steps.loss[2]) > 1e5


def test_module_fractions_are_the_runs_fp16_fractions_weighted_by_numel(fp16_run, accumulator_class, tmp_path):
    scalars, _ = _read(accumulator_class, fp16_run.to_tensorboard(tmp_path))
    frac_tags = {t for t in scalars if "_frac" in t}
    assert frac_tags and all(t.rsplit("/", 1)[1] in ("fp16_underflow_frac", "fp16_overflow_frac") for t in frac_tags)
    expected_tags = set()
    for column in ("fp16_underflow_frac", "fp16_overflow_frac"):
        fractions = _module_fractions(fp16_run, column)
        for (step, role, module), value in fractions.items():
            tag = f"mpscope/{role}/{_label(module)}/{column}"
            expected_tags.add(tag)
            assert scalars[tag][step] == pytest.approx(value, rel=1e-6, abs=1e-12), (tag, step)
    assert frac_tags == expected_tags
    for tag in frac_tags:
        assert sorted(scalars[tag]) == [0, 2, 4], tag  # recorded steps only
    # by hand: 16 of module 0's 144 parameters (128 weights + 16 biases) flush to 0 in fp16 at every
    # recorded step (the weight row alone has 16/128: a plain mean of the rows would say 1/16)
    rows = fp16_run.tensors[(fp16_run.tensors.module == "0") & (fp16_run.tensors.role == "weight")]
    assert set(rows.loc[rows.name == "weight", "fp16_underflow_frac"]) == {16 / 128}
    assert [scalars["mpscope/weight/0/fp16_underflow_frac"][s] for s in (0, 2, 4)] == [np.float32(16 / 144)] * 3
    assert [scalars["mpscope/weight/2/fp16_underflow_frac"][s] for s in (0, 2, 4)] == [0, 0, 0]
    # the loss of 1e6 at step 2 overflows fp16; the root module's loss row is that one value
    assert [scalars["mpscope/loss/(root)/fp16_overflow_frac"][s] for s in (0, 2, 4)] == [0, 1, 0]


def test_histograms_hold_run_histograms_counts_on_a_log2_axis(fp16_run, accumulator_class, tmp_path):
    _, hists = _read(accumulator_class, fp16_run.to_tensorboard(tmp_path))
    h = fp16_run.histograms.astype({"module": str, "role": str, "name": str})
    groups = h.groupby(["step", "role", "module", "name"])
    assert len(groups) > 20
    assert sum(len(v) for v in hists.values()) == len(groups)
    for (step, role, module, name), g in groups:
        value = hists[f"mpscope/{role}/{_label(module)}/{name}/exponent"][step]
        counts = g.groupby("exponent")["count"].sum()
        lo, hi = int(counts.index.min()), int(counts.index.max())
        assert (value.min, value.max) == (lo, hi + 1)
        assert value.bucket_limit == [float(e + 1) for e in range(lo, hi + 1)]  # bucket [e, e+1) per exponent
        assert value.bucket == [float(counts.get(e, 0)) for e in range(lo, hi + 1)]
        assert value.num == counts.sum()
        assert value.sum == pytest.approx(float((counts.index * counts).sum()))
    # by hand: the 16 weights of 1e-9 have exponent floor(log2 1e-9) = -30, at every recorded step
    for step in (0, 2, 4):
        w = hists["mpscope/weight/0/weight/exponent"][step]
        assert w.min == -30 and w.bucket[0] == 16 and sum(w.bucket) == 128


def test_histogram_reads_back_as_tensorboard_shows_it(fp16_run, accumulator_class, tmp_path):
    """TensorBoard's own conversion for its charts (data_compat): buckets [left, right, count] with
    left/right the exponents."""
    from tensorboard import data_compat
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.util import tensor_util

    fp16_run.to_tensorboard(tmp_path)
    acc = accumulator_class(str(tmp_path), size_guidance={"histograms": 0})
    acc.Reload()
    v = acc.Histograms("mpscope/weight/0/weight/exponent")[0].histogram_value
    proto = summary_pb2.Summary.Value(tag="t", histo=summary_pb2.HistogramProto(
        min=v.min, max=v.max, num=v.num, sum=v.sum, sum_squares=v.sum_squares, bucket_limit=v.bucket_limit,
        bucket=v.bucket))
    buckets = tensor_util.make_ndarray(data_compat.migrate_value(proto).tensor)
    assert buckets[0].tolist() == [-30.0, -29.0, 16.0]
    assert buckets[:, 1].tolist()[:-1] == buckets[:, 0].tolist()[1:]  # contiguous
    h = fp16_run.histograms
    own = h[(h.step == 0) & (h.module == "0") & (h.role == "weight") & (h.name == "weight")]
    assert dict(zip(buckets[:, 0].astype(int), buckets[:, 2].astype(int))) == \
        {**{e: 0 for e in range(-30, int(own.exponent.max()) + 1)}, **dict(zip(own.exponent, own["count"]))}


def test_a_saved_run_and_its_directory_write_the_same_events(fp16_run, accumulator_class, tmp_path):
    from mpscope.tensorboard import write_tensorboard

    saved = fp16_run.save(tmp_path / "run")
    direct = _read(accumulator_class, fp16_run.to_tensorboard(tmp_path / "a"))
    loaded = _read(accumulator_class, Run.load(saved).to_tensorboard(tmp_path / "b"))
    by_path = _read(accumulator_class, write_tensorboard(saved, tmp_path / "c"))
    assert direct[0].keys() == loaded[0].keys() == by_path[0].keys()
    for tag, values in direct[0].items():
        for other in (loaded[0], by_path[0]):
            assert values.keys() == other[tag].keys()
            assert all(_same(values[s], other[tag][s]) for s in values), tag
    assert {t: {s: v.bucket for s, v in d.items()} for t, d in direct[1].items()} == \
        {t: {s: v.bucket for s, v in d.items()} for t, d in loaded[1].items()}


# ----------------------------------------------------------------------------------------- bf16 / fp32
def test_a_bf16_run_writes_bf16_fractions(accumulator_class, tmp_path):
    run = _train(torch.bfloat16, steps=2, every=1)
    scalars, _ = _read(accumulator_class, run.to_tensorboard(tmp_path))
    kinds = {t.rsplit("/", 1)[1] for t in scalars if "_frac" in t}
    assert kinds == {"bf16_underflow_frac", "bf16_overflow_frac"}
    for (step, role, module), value in _module_fractions(run, "bf16_underflow_frac").items():
        assert scalars[f"mpscope/{role}/{_label(module)}/bf16_underflow_frac"][step] == pytest.approx(value, rel=1e-6)
    assert [scalars["mpscope/weight/0/bf16_underflow_frac"][s] for s in (0, 1)] == [np.float32(16 / 144)] * 2


def test_a_float32_run_writes_both_formats_as_what_ifs(accumulator_class, tmp_path):
    run = _train(None, steps=2, every=1, scaler=False)
    assert run.meta["autocast_dtype"] is None and list(run.steps.loss_scale) == [1.0, 1.0]
    scalars, _ = _read(accumulator_class, run.to_tensorboard(tmp_path))
    kinds = {t.rsplit("/", 1)[1] for t in scalars if "_frac" in t}
    assert kinds == {"hypothetical_fp16_underflow_frac", "hypothetical_fp16_overflow_frac",
                     "hypothetical_bf16_underflow_frac", "hypothetical_bf16_overflow_frac"}
    # 1e-9 flushes in fp16, not in bf16
    assert [scalars["mpscope/weight/0/hypothetical_fp16_underflow_frac"][s] for s in (0, 1)] == [np.float32(16 / 144)] * 2
    assert [scalars["mpscope/weight/0/hypothetical_bf16_underflow_frac"][s] for s in (0, 1)] == [0, 0]
    for column in ("fp16_underflow_frac", "bf16_overflow_frac"):
        for (step, role, module), value in _module_fractions(run, column).items():
            assert scalars[f"mpscope/{role}/{_label(module)}/hypothetical_{column}"][step] == pytest.approx(value, rel=1e-6)
    assert [scalars["mpscope/loss_scale"][s] for s in (0, 1)] == [1, 1]
    assert [scalars["mpscope/skipped"][s] for s in (0, 1)] == [0, 0]


def test_run_format_rules():
    from mpscope.tensorboard import fraction_tags, run_format

    run = _frames_run({"autocast_dtype": "bfloat16", "param_dtypes": {"float16": 10}})
    assert run_format(run) == "bfloat16"
    assert run_format(_frames_run({"autocast_dtype": None, "param_dtypes": {"float32": 5, "float16": 10}})) == "float16"
    assert run_format(_frames_run({"param_dtypes": {"float16": 3, "bfloat16": 10}}, dtype="float16")) == "bfloat16"
    assert run_format(_frames_run({}, dtype="bfloat16")) == "bfloat16"
    assert run_format(_frames_run({"param_dtypes": {"float32": 5}})) is None
    assert fraction_tags("float16") == {"fp16_underflow_frac": "fp16_underflow_frac",
                                        "fp16_overflow_frac": "fp16_overflow_frac"}
    with pytest.raises(ValueError, match="float32"):
        fraction_tags("float32")


def test_exponent_histogram_adds_repeated_exponents_and_fills_the_gaps():
    from mpscope.tensorboard import exponent_histogram

    h = exponent_histogram([3, -1, 3, 0, 7], [2, 5, 1, 0, 0])  # exponent 3 twice (two dtypes), zero counts left out
    assert h == {"min": -1.0, "max": 4.0, "num": 8, "sum": 4.0, "sum_squares": 32.0,
                 "bucket_limits": [0.0, 1.0, 2.0, 3.0, 4.0], "bucket_counts": [5, 0, 0, 0, 3]}
    with pytest.raises(ValueError):
        exponent_histogram([1], [0])


def _frames_run(meta, dtype="float32"):
    import pandas as pd

    tensors = pd.DataFrame({"step": [0], "module": [""], "role": ["activation"], "name": ["output"], "dtype": [dtype],
                            "numel": [4], "min": [1.0], "max": [1.0], "absmax": [1.0], "absmin_nonzero": [1.0],
                            "zero_frac": [0.0], "subnormal_frac": [0.0], "fp16_underflow_frac": [0.0],
                            "fp16_subnormal_frac": [0.0], "fp16_overflow_frac": [0.0], "bf16_underflow_frac": [0.0],
                            "bf16_subnormal_frac": [0.0], "nan_count": [0], "inf_count": [0]})
    steps = pd.DataFrame({"step": [0], "loss": [1.0], "loss_scale": [1.0], "found_inf": [False], "skipped": [False],
                          "scale_after": [1.0]})
    return Run.from_frames(tensors, steps, meta=meta)


# ----------------------------------------------------------------------------------------- errors, imports
def test_a_missing_tensorboard_package_says_what_to_install(fp16_run, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'mpscope\[tensorboard\]'"):
        fp16_run.to_tensorboard(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()


def test_a_rank_the_run_does_not_hold_writes_nothing(fp16_run, accumulator_class, tmp_path):
    with pytest.raises(ValueError, match="rank 1"):
        fp16_run.to_tensorboard(tmp_path / "tb", rank=1)
    assert not (tmp_path / "tb").exists()
    scalars, _ = _read(accumulator_class, fp16_run.to_tensorboard(tmp_path / "r0", rank=0))  # its own rank
    assert len(scalars["mpscope/loss"]) == 6


def test_importing_mpscope_and_the_module_loads_no_tensorboard():
    code = ("import sys, mpscope, mpscope.tensorboard; from mpscope.run import Run; "
            "print([m for m in ('tensorboard', 'torch.utils.tensorboard') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


