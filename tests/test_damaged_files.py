"""Saved runs and recommendation files: empty tables round-trip with their schema; a damaged or
hostile file is refused with one error naming the file and the field."""

from __future__ import annotations

import json
import math
import shutil

import pandas as pd
import pytest
import torch
import yaml

import mpscope
from loops import record_fp16_mlp
from mpscope.datafile import MAX_DEPTH
from mpscope.run import HIST_COLUMNS, STEP_COLUMNS, TENSOR_COLUMNS, RunFileError
from mpscope.schema import GRAD_SCALER_DEFAULTS


@pytest.fixture(scope="module")
def run():
    return record_fp16_mlp(2, shadow=True)


@pytest.fixture(scope="module")
def run_dir(run, tmp_path_factory):
    return run.save(tmp_path_factory.mktemp("damaged") / "run")


def copy(run_dir, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(run_dir, d)
    return d


def edit_meta(d, change):
    meta = json.loads((d / "meta.json").read_text())
    change(meta)
    (d / "meta.json").write_text(json.dumps(meta))


def assert_same_schema(a: pd.DataFrame, b: pd.DataFrame):
    assert list(a.columns) == list(b.columns)
    assert [str(t) for t in a.dtypes] == [str(t) for t in b.dtypes]


# ---------------------------------------------------------------- empty tables
def test_a_run_from_frames_without_histograms_round_trips(run, tmp_path):
    built = mpscope.Run.from_frames(run.tensors, run.steps)
    back = mpscope.Run.load(built.save(tmp_path / "r"))
    assert len(back.histograms) == 0 and len(back.tensors) == len(run.tensors)
    assert_same_schema(back.histograms, run.histograms)
    pd.testing.assert_frame_equal(back.tensors, built.tensors)


@pytest.mark.parametrize("kind", ["no rows at all", "a recording ended before its first step",
                                  "frames with no rows of any dtype"])
def test_a_run_with_no_rows_round_trips_with_every_schema(run, tmp_path, kind):
    if kind == "no rows at all":
        empty = mpscope.Run()
    elif kind == "a recording ended before its first step":
        model = torch.nn.Linear(4, 2)
        with mpscope.record(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as rec:
            pass
        empty = rec.run
    else:
        empty = mpscope.Run.from_frames(pd.DataFrame({c: [] for c in TENSOR_COLUMNS}),
                                        pd.DataFrame({c: [] for c in STEP_COLUMNS}),
                                        pd.DataFrame({c: [] for c in HIST_COLUMNS}))
    back = mpscope.Run.load(empty.save(tmp_path / "r"))
    for table in ("tensors", "steps", "histograms"):
        assert len(getattr(back, table)) == 0
        assert_same_schema(getattr(back, table), getattr(run, table))  # a recorded run's schema


def test_an_empty_precision_table_round_trips(run, tmp_path):
    r = mpscope.Run.from_frames(run.tensors, run.steps, run.histograms, dict(run.meta),
                                {"precision": run.precision.iloc[:0]})
    back = mpscope.Run.load(r.save(tmp_path / "r"))
    assert len(back.precision) == 0 and list(back.precision.columns) == list(run.precision.columns)


# ---------------------------------------------------------------- damaged run files
@pytest.mark.parametrize("field, value, says", [
    ("optimizer_hparams", {"lr": "0.01"}, "field 'optimizer_hparams.lr' must be a number"),
    ("optimizer_hparams", {"eps": [1e-8]}, "field 'optimizer_hparams.eps' must be a number"),
    ("ranks", "01", "field 'ranks' must be list"),
    ("ranks", [0, "1"], "field 'ranks' must be a list of rank numbers"),
    ("rank", -1, "field 'rank' must be a rank number"),
    ("param_dtypes", {"float32": "1000"}, "field 'param_dtypes' must be a dict of dtype name -> parameter count"),
    ("param_dtypes", "float32", "field 'param_dtypes' must be dict"),
    ("module_types", {"0": 5}, "field 'module_types' must be a dict of module name -> class name"),
    ("every", 0, "field 'every' must be >= 1"),
    ("cuda_capability", [8, "0"], r"field 'cuda_capability' must be \[major, minor\]"),
])
def test_a_meta_field_of_the_wrong_type_or_range_names_file_and_field(run_dir, tmp_path, field, value, says):
    d = copy(run_dir, tmp_path)
    edit_meta(d, lambda m: m.__setitem__(field, value))
    with pytest.raises(RunFileError, match=rf"meta.json: {says}"):
        mpscope.Run.load(d)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1)])
def test_a_meta_json_nested_too_deep_is_one_error(run_dir, tmp_path, text):
    d = copy(run_dir, tmp_path)
    (d / "meta.json").write_text(text)
    with pytest.raises(RunFileError, match=rf"meta.json nests lists or objects deeper than {MAX_DEPTH} levels"):
        mpscope.Run.load(d)


@pytest.mark.parametrize("table, column", [
    ("steps.parquet", "loss"), ("steps.parquet", "skipped"), ("histograms.parquet", "exponent"),
    ("tensors.parquet", "fp16_underflow_frac"), ("tables/precision.parquet", "sqnr_db"),
])
@pytest.mark.parametrize("how", ["missing", "renamed"])
def test_a_missing_or_renamed_column_names_the_file_and_column(run_dir, tmp_path, table, column, how):
    d = copy(run_dir, tmp_path)
    frame = pd.read_parquet(d / table)
    frame = frame.drop(columns=column) if how == "missing" else frame.rename(columns={column: column + "_old"})
    frame.to_parquet(d / table)
    with pytest.raises(RunFileError, match=rf"{table}: the \w+ table lacks the columns \['{column}'\]"):
        mpscope.Run.load(d)


@pytest.mark.parametrize("rank", ["1", -1, 1.5, True])
def test_load_refuses_a_rank_that_is_not_a_rank_number(run_dir, rank):
    with pytest.raises(TypeError, match=r"rank must be None \(the merged run\) or a rank number, an int >= 0; got"):
        mpscope.Run.load(run_dir, rank=rank)


def test_load_of_a_rank_a_single_process_run_lacks_says_so(run_dir):
    with pytest.raises(RunFileError, match="holds no per-rank rows"):
        mpscope.Run.load(run_dir, rank=5)


# ---------------------------------------------------------------- recommendation files
def write_rec(tmp_path, change, suffix=".json"):
    rec = mpscope.Recommendation(dtype="float16", grad_scaler=dict(GRAD_SCALER_DEFAULTS), device_type="cpu")
    data = rec.to_dict()
    change(data)
    p = tmp_path / f"rec{suffix}"
    p.write_text(yaml.safe_dump(data) if suffix == ".yaml" else json.dumps(data))
    return p


@pytest.mark.parametrize("key, value", [
    ("init_scale", math.inf), ("init_scale", math.nan), ("init_scale", -65536.0), ("init_scale", 0.0),
    ("init_scale", "65536"), ("init_scale", 1e39), ("growth_factor", 0.0), ("growth_factor", 1.0),
    ("backoff_factor", 2.0), ("backoff_factor", 1.0), ("backoff_factor", 0.0), ("growth_interval", 1e30),
    ("growth_interval", 0), ("growth_interval", 2000.5), ("growth_interval", 2**31), ("growth_interval", True),
])
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_grad_scaler_setting_that_cannot_train_is_refused_naming_file_and_field(tmp_path, key, value, suffix):
    p = write_rec(tmp_path, lambda d: d["grad_scaler"].__setitem__(key, value), suffix)
    with pytest.raises(ValueError, match=rf"rec{suffix}: grad_scaler.{key} must be a finite number"):
        mpscope.Recommendation.from_file(p)
    with pytest.raises(ValueError, match=rf"grad_scaler.{key}"):
        mpscope.apply(torch.nn.Linear(2, 2), mpscope.Recommendation(dtype="float16").to_dict()
                      | {"grad_scaler": dict(GRAD_SCALER_DEFAULTS, **{key: value})})


@pytest.mark.parametrize("key, value", [("growth_factor", 1.0), ("growth_factor", 0.5), ("backoff_factor", 1.0),
                                        ("backoff_factor", 2.0)])
def test_factors_refused_are_the_ones_grad_scaler_itself_refuses(tmp_path, key, value):
    settings = dict(GRAD_SCALER_DEFAULTS, **{key: value})
    with pytest.raises(AssertionError):
        torch.amp.GradScaler("cpu", **settings)
    with pytest.raises(ValueError, match=key):
        mpscope.Recommendation(dtype="float16", grad_scaler=settings)


def test_settings_at_the_edges_are_accepted_and_train(tmp_path):
    edge = {"init_scale": 2.0**-10, "growth_factor": 1.001, "backoff_factor": 0.999, "growth_interval": 1}
    p = write_rec(tmp_path, lambda d: d.__setitem__("grad_scaler", edge))
    rec = mpscope.Recommendation.from_file(p)
    assert rec.grad_scaler == edge
    scaler = torch.amp.GradScaler("cpu", **rec.grad_scaler)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(before, model.weight) and scaler.get_scale() == pytest.approx(2.0**-10 * 1.001, rel=1e-6)


@pytest.mark.parametrize("modules, says", [
    ("encoder", r"fp32_modules must be a list of module names"),
    (["encoder..attn"], r"fp32_modules\[0\] = 'encoder..attn' is not a module name"),
    (["ok", 3], r"fp32_modules\[1\] = 3 is not a module name"),
])
def test_fp32_modules_must_be_module_names(tmp_path, modules, says):
    p = write_rec(tmp_path, lambda d: d.__setitem__("fp32_modules", modules))
    with pytest.raises(ValueError, match=says):
        mpscope.Recommendation.from_file(p)


@pytest.mark.parametrize("text, says", [
    ("[" * 100_000 + "]" * 100_000, "nests lists or objects deeper than"),
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "needs at least 'dtype'"),
    ('{"dtype": "float16", "findings": [{"code": 1}]}', "a Finding dict needs the keys"),
    ('{"dtype": "float16", "device_type": "cuda\\nx"}', "device_type must be a torch device type"),
])
def test_a_damaged_recommendation_file_is_one_value_error_naming_it(tmp_path, text, says):
    p = tmp_path / "rec.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=says) as e:
        mpscope.Recommendation.from_file(p)
    assert str(p) in str(e.value)


def test_a_yaml_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    lines, prev = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]'], "a"
    for name in "bcdefghi":  # 9**9 strings once expanded
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
        prev = name
    p = tmp_path / "rec.yaml"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"rec.yaml holds more than 1,000,000 values"):
        mpscope.Recommendation.from_file(p)


# ---------------------------------------------------------------- per-rank files (a recording with out=)
@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks") / "out"
    record_fp16_mlp(3, out=out)
    return out


def rank_copy(out_dir, tmp_path):
    d = tmp_path / "out"
    shutil.copytree(out_dir, d)
    shutil.rmtree(d / "merged")  # Run.load(d) merges the per-rank files itself
    return d


def edit_part(d, table, change, part=0):
    path = d / "ranks" / table / "rank=0" / f"part-{part:05d}.parquet"
    change(pd.read_parquet(path)).to_parquet(path)
    return path


@pytest.mark.parametrize("table, change, says", [
    ("tensors", lambda f: f.drop(columns="zero_frac"), r"the tensors table lacks the columns \['zero_frac'\]"),
    ("tensors", lambda f: f.assign(role="banana"), r"column 'role' holds unknown roles \['banana'\]"),
    ("tensors", lambda f: f.assign(module=f.module.astype(str), dtype="banana"), "column 'dtype' holds names that are no torch dtype"),
    ("steps", lambda f: f.assign(opt_scaled="x"), "column 'opt_scaled' must hold booleans"),
    ("histograms", lambda f: f.assign(exponent=10**9), r"column 'exponent' must hold binary exponents"),
    ("steps", lambda f: f.assign(step=f.step + 2**40), r"column 'step' must hold step numbers in \[0, 2\^31\)"),
])
def test_a_damaged_part_is_one_error_naming_it_never_a_huge_allocation(out_dir, tmp_path, table, change, says):
    d = rank_copy(out_dir, tmp_path)
    path = edit_part(d, table, change)
    with pytest.raises(RunFileError, match=says) as e:
        mpscope.Run.load(d)
    assert str(path) in str(e.value)
    with pytest.raises(RunFileError, match=says):
        mpscope.Run.load(d, rank=0)


def test_an_empty_part_and_a_part_of_plain_text_columns_still_load(out_dir, tmp_path):
    d = rank_copy(out_dir, tmp_path)
    edit_part(d, "tensors", lambda f: f.astype({c: str for c in ("module", "role", "name", "dtype")}))
    folder = d / "ranks" / "tensors" / "rank=0"
    pd.read_parquet(folder / "part-00000.parquet").iloc[:0].to_parquet(folder / "part-00099.parquet")
    whole, got = mpscope.Run.load(out_dir), mpscope.Run.load(d)
    pd.testing.assert_frame_equal(got.steps, whole.steps)
    assert len(got.tensors) == len(whole.tensors)


@pytest.mark.parametrize("edit, says", [
    (lambda d: (d / "ranks" / "meta" / "rank=0.json").rename(d / "ranks" / "meta" / "rank=\u00b2.json"),
     r"is not a rank meta file"),
    (lambda d: edit_meta_file(d / "ranks" / "meta" / "rank=0.json", lambda m: m.__setitem__("distributed", {"replicated_roles": 5})),
     r"field 'distributed' must be a dict whose replicated_roles is a list of roles"),
    (lambda d: edit_part(d, "steps", lambda f: pd.concat([f, f.assign(step=f.step + 100)])),
     r"the step numbers are not consecutive"),
])
def test_damaged_rank_bookkeeping_is_one_error(out_dir, tmp_path, edit, says):
    d = rank_copy(out_dir, tmp_path)
    edit(d)
    with pytest.raises(RunFileError, match=says):
        mpscope.Run.load(d)


def edit_meta_file(path, change):
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


# ---------------------------------------------------------------- values a view would trip over later
@pytest.mark.parametrize("file, change, says", [
    ("tensors.parquet", lambda f: f.assign(step=f.step.astype("Int64").where(f.index > 0)), "column 'step' has missing values"),
    ("tensors.parquet", lambda f: f.assign(step=f.step - 100), r"column 'step' must hold step numbers"),
    ("tensors.parquet", lambda f: f.assign(loss_scale=0.0), "column 'loss_scale' must hold loss scales > 0"),
    ("tensors.parquet", lambda f: f.assign(zero_frac=1.5), r"column 'zero_frac' must hold fractions in \[0, 1\]"),
    ("steps.parquet", lambda f: f.assign(grad_reset="x"), "column 'grad_reset' must hold numbers"),
    ("tables/precision.parquet", lambda f: f.assign(sqnr_db="x"), "column 'sqnr_db' must hold numbers"),
    ("tables/precision.parquet", lambda f: f.assign(module=None), "column 'module' must hold text"),
])
def test_a_value_a_view_would_trip_over_is_refused_at_load(run_dir, tmp_path, file, change, says):
    d = copy(run_dir, tmp_path)
    change(pd.read_parquet(d / file)).to_parquet(d / file)
    with pytest.raises(RunFileError, match=rf"{file}: {says}"):
        mpscope.Run.load(d)


@pytest.mark.parametrize("change, says", [
    (lambda m: m["scaler"].__setitem__("init_scale", 10**400), "field 'scaler.init_scale' must be a positive number"),
    (lambda m: m.__setitem__("model", "\ud800"), "holds text that is not valid Unicode"),
])
def test_meta_values_past_floats_or_unicode_are_refused(run_dir, tmp_path, change, says):
    d = copy(run_dir, tmp_path)
    edit_meta(d, change)
    with pytest.raises(RunFileError, match=says):
        mpscope.Run.load(d)


@pytest.mark.parametrize("key, value", [("init_scale", 1e-50), ("backoff_factor", 1e-50), ("growth_factor", 1 + 1e-9),
                                        ("init_scale", 10**400), ("growth_interval", 10**400)])
def test_grad_scaler_settings_are_checked_as_the_float32_grad_scaler_holds_them(tmp_path, key, value):
    p = write_rec(tmp_path, lambda d: d["grad_scaler"].__setitem__(key, value))
    with pytest.raises(ValueError, match=rf"rec.json: grad_scaler.{key} must be a finite number"):
        mpscope.Recommendation.from_file(p)
    if key == "init_scale" and value == 1e-50:  # the oracle: GradScaler's own float32 scale
        assert float(torch.amp.GradScaler("cpu", init_scale=value).scale(torch.tensor(1.0))) == 0.0
    elif isinstance(value, float):  # a factor GradScaler accepts, which is 0 or 1 as the float32 it uses
        torch.amp.GradScaler("cpu", **dict(GRAD_SCALER_DEFAULTS, **{key: value}))
        assert float(torch.tensor(value, dtype=torch.float32)) in (0.0, 1.0)


@pytest.mark.parametrize("text, says", [
    ('{"dtype": "float16", "grad_scaler": {"init_scale": ' + "9" * 5000 + "}}", "rec.json is not valid JSON"),
    ('{"dtype": "float16", "findings": [{"code": "x", "severity": "info", "module": null, "role": null, "name": null, '
     '"step": null, "value": ' + "1" + "0" * 400 + ', "threshold": null, "message": "m", "fix": "f"}]}',
     "finding field 'value' must be"),
    ('{"dtype": "float16", "predictions": {"recommended": {"skip_rate": 0.1}, "pytorch_default": {"skipped": 1}}}',
     "predictions.recommended.skipped must be int"),
    ('{"dtype": "float16", "evidence": {"fp16_fp32_modules": 5}}', "evidence.fp16_fp32_modules must be list"),
])
def test_recommendation_content_the_text_report_would_trip_over_is_refused(tmp_path, text, says):
    p = tmp_path / "rec.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=says) as e:
        mpscope.Recommendation.from_file(p)
    assert str(p) in str(e.value)


def test_yaml_only_types_are_refused_and_the_yaml_suffix_is_read_in_any_case(tmp_path):
    p = tmp_path / "rec.yaml"
    p.write_text("dtype: bfloat16\nevidence: {when: 2026-12-07, tags: !!set {a: null}}\n")
    with pytest.raises(ValueError, match=r"rec.yaml: a (date|set) .* where only text, numbers, lists and dicts go"):
        mpscope.Recommendation.from_file(p)
    rec = mpscope.Recommendation(dtype="bfloat16", device_type="cpu")
    assert mpscope.Recommendation.from_file(rec.export(tmp_path / "REC.YAML", format="yaml")) == rec


def test_a_field_assigned_after_construction_is_checked_before_export(tmp_path):
    rec = mpscope.Recommendation(dtype="float16", grad_scaler=dict(GRAD_SCALER_DEFAULTS), device_type="cpu")
    rec.param_dtype = "float32\nimport os"
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        rec.export(tmp_path / "amp.py", format="torch")
    assert not (tmp_path / "amp.py").exists()
