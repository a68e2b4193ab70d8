"""Run: frames, Parquet round trip, clear errors on bad files, spilling long runs, bytes per row."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import mpscope
from loops import record_fp16_mlp
from mpscope.run import HIST_COLUMNS, STEP_COLUMNS, TENSOR_COLUMNS, RunFileError


def record_mlp(steps=3, **kw):
    return record_fp16_mlp(steps, **kw)


def test_schemas_and_categoricals():
    run = record_mlp()
    assert list(run.tensors.columns) == TENSOR_COLUMNS
    assert list(run.steps.columns) == STEP_COLUMNS
    assert list(run.histograms.columns) == HIST_COLUMNS
    for c in ("module", "role", "name", "dtype"):
        assert isinstance(run.tensors[c].dtype, pd.CategoricalDtype)
    # histogram counts add up to the non-zero finite elements of each tensor row
    t = run.tensors
    nz = t.numel * (1 - t.zero_frac) - t.nan_count - t.inf_count
    h = run.histograms.groupby(["step", "module", "role", "name"], observed=True)["count"].sum()
    joined = t.set_index(["step", "module", "role", "name"]).assign(nz=nz.values).join(h)
    assert (joined["count"].fillna(0).round() == joined.nz.round()).all()


def test_save_load_round_trip(tmp_path):
    run = record_mlp()
    run.tables["extra"] = pd.DataFrame({"a": [1, 2]})
    run.save(tmp_path / "r")
    back = mpscope.Run.load(tmp_path / "r")
    pd.testing.assert_frame_equal(back.tensors, run.tensors)
    pd.testing.assert_frame_equal(back.steps, run.steps)
    pd.testing.assert_frame_equal(back.histograms, run.histograms)
    pd.testing.assert_frame_equal(back.tables["extra"], run.tables["extra"])
    assert back.meta == run.meta


def test_missing_and_corrupt_files_raise_clear_errors(tmp_path):
    with pytest.raises(RunFileError, match="not a run directory"):
        mpscope.Run.load(tmp_path / "nope")
    run = record_mlp(steps=1)
    d = run.save(tmp_path / "r")
    (d / "steps.parquet").write_bytes(b"not parquet")
    with pytest.raises(RunFileError, match="steps.parquet cannot be read"):
        mpscope.Run.load(d)
    (d / "steps.parquet").unlink()
    with pytest.raises(RunFileError, match="steps.parquet is missing"):
        mpscope.Run.load(d)


def test_spilling_keeps_every_row(tmp_path):
    plain = record_mlp(steps=40)
    spilled = record_mlp(steps=40, spill_dir=tmp_path / "spill", spill_rows=50)
    assert spilled.nbytes()["spilled_parts"] >= 10
    assert spilled.nbytes()["histogram_rows"] <= 100  # histograms are spilled too
    assert spilled.nbytes()["tensor_rows"] <= 100  # only the window stays in memory
    pd.testing.assert_frame_equal(spilled.tensors, plain.tensors)
    pd.testing.assert_frame_equal(spilled.steps, plain.steps)
    pd.testing.assert_frame_equal(spilled.histograms, plain.histograms)
    spilled._store.tensors.spill()  # everything on disk, nothing in memory: still every row
    spilled._store.frames.clear()
    pd.testing.assert_frame_equal(spilled.tensors, plain.tensors)
    spilled.save(tmp_path / "saved")
    pd.testing.assert_frame_equal(mpscope.Run.load(tmp_path / "saved").tensors, plain.tensors)


def test_memory_per_tensor_row_is_under_100_bytes():
    run = record_mlp(steps=20)
    assert run.nbytes()["bytes_per_row"] <= 100


def test_from_frames_validates_columns():
    with pytest.raises(ValueError, match="lacks columns"):
        mpscope.Run.from_frames(pd.DataFrame({"step": [0]}), pd.DataFrame({"step": [0]}))


def test_histograms_tell_apart_one_name_in_two_dtypes_and_old_frames_get_the_dtype():
    """A module run under fp16 autocast and in fp32 in the same step gives two tensor rows (dtype
    differs); its histogram rows carry the dtype too, each equal to frexp of that output. Frames
    saved without the column get it from the matching tensor rows."""
    import numpy as np

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    outs = []
    m[0].register_forward_hook(lambda mod, a, out: [outs.append(out.detach().clone())] and None)
    with mpscope.record(m, optimizer=opt, roles=["activation"]) as rec:
        with torch.autocast("cpu", dtype=torch.float16):
            first = m(torch.randn(64, 8))
        # both passes train the model (a pass whose output is never backpropagated is no training pass)
        (first.float().sum() + m(torch.randn(64, 8)).sum()).backward()
        opt.step()
    m[0]._forward_hooks.clear()
    h = rec.run.histograms.query("module == '0'")
    assert not h.duplicated(["step", "module", "role", "name", "dtype", "exponent"]).any()
    for out in outs:
        x = out.double().numpy()
        _, e = np.frexp(x[(x != 0) & np.isfinite(x)])
        want = dict(zip(*np.unique(e - 1, return_counts=True)))
        got = h[h.dtype == str(out.dtype).removeprefix("torch.")].set_index("exponent")["count"].to_dict()
        assert {int(k): int(v) for k, v in got.items()} == {int(k): int(v) for k, v in want.items()}
    old = rec.run.histograms.drop(columns="dtype").drop_duplicates(["step", "module", "role", "name", "exponent"])
    back = mpscope.Run.from_frames(rec.run.tensors, rec.run.steps, old)
    assert list(back.histograms.columns) == HIST_COLUMNS
    assert set(back.histograms.dtype) == {"float16"}  # the first tensor row of each name


def test_a_run_saved_with_the_old_clip_scaled_column_loads_it_as_clipped_before_unscale(tmp_path):
    run = record_fp16_mlp(3)
    run.save(tmp_path / "new")
    steps = pd.read_parquet(tmp_path / "new" / "steps.parquet")
    flags = [True, False, True][: len(steps)]
    old = steps.drop(columns="clipped_before_unscale").assign(clip_scaled=flags)
    old.to_parquet(tmp_path / "new" / "steps.parquet")  # as a run saved before the rename
    back = mpscope.Run.load(tmp_path / "new")
    assert "clip_scaled" not in back.steps.columns
    assert back.steps.clipped_before_unscale.tolist() == flags
    assert list(back.steps.columns) == STEP_COLUMNS
