"""Saved data is never mixed or lost: atomic saves, one run per directory, one spill folder per recorder."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import mpscope
from loops import record_fp16
from mpscope.run import RunFileError


def train(seed: int, steps: int = 6, **record_kw):
    """A Linear-Tanh-Linear fp16 run whose numbers depend on ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(16, 8, generator=g) * (seed + 1), torch.randn(16, 1, generator=g)) for _ in range(steps)]
    return record_fp16(model, opt, torch.amp.GradScaler("cpu"), data, **record_kw)


@pytest.fixture(scope="module")
def runs():
    return train(0), train(1)


def assert_same_run(a, b):
    pd.testing.assert_frame_equal(a.tensors, b.tensors)
    pd.testing.assert_frame_equal(a.steps, b.steps)
    pd.testing.assert_frame_equal(a.histograms, b.histograms)
    assert a.meta == b.meta
    assert sorted(a.tables) == sorted(b.tables)


def test_a_resave_that_fails_half_way_leaves_the_earlier_run_whole(runs, tmp_path, monkeypatch):
    old, new = runs
    d = old.save(tmp_path / "run")
    calls = []
    real = pd.DataFrame.to_parquet

    def fail_on_histograms(frame, path, *a, **kw):
        calls.append(str(path))
        if str(path).endswith("histograms.parquet"):
            raise OSError(28, "No space left on device")
        return real(frame, path, *a, **kw)

    monkeypatch.setattr(pd.DataFrame, "to_parquet", fail_on_histograms)
    with pytest.raises(OSError, match="No space left"):
        new.save(d)
    monkeypatch.undo()
    assert any(c.endswith("tensors.parquet") for c in calls)  # the new tensors were written before the failure
    assert_same_run(mpscope.Run.load(d), old)
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no half-written folder left beside it


def test_a_resave_replaces_the_whole_run_and_never_keeps_an_old_table(runs, tmp_path):
    old, new = runs
    old.tables["ops"] = pd.DataFrame({"op": ["aten.mm"], "dtype": ["float16"]})
    try:
        d = old.save(tmp_path / "run")
    finally:
        del old.tables["ops"]
    new.save(d)
    back = mpscope.Run.load(d)
    assert "ops" not in back.tables  # the old run's table would otherwise load as the new run's
    assert_same_run(back, new)


def test_a_directory_holds_one_run_or_the_save_is_refused(runs, tmp_path):
    run = runs[0]
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('my script')\n")
    with pytest.raises(RunFileError, match="holds other files .*train.py.*one run only"):
        run.save(project)
    assert [p.name for p in project.iterdir()] == ["train.py"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(RunFileError, match="is a file"):
        run.save(tmp_path / "afile")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_same_run(mpscope.Run.load(run.save(empty)), run)


def test_two_recorders_sharing_a_spill_dir_keep_their_own_rows(runs, tmp_path):
    plain_a, plain_b = runs
    shared = tmp_path / "spill"
    a = train(0, spill_dir=shared, spill_rows=20)
    b = train(1, spill_dir=shared, spill_rows=20)  # the same part names would overwrite a's parts
    assert a.nbytes()["spilled_parts"] >= 2 and b.nbytes()["spilled_parts"] >= 2
    assert a.spill_path != b.spill_path and a.spill_path.parent == b.spill_path.parent == shared
    pd.testing.assert_frame_equal(a.tensors, plain_a.tensors)
    pd.testing.assert_frame_equal(b.tensors, plain_b.tensors)
    pd.testing.assert_frame_equal(a.histograms, plain_a.histograms)


def test_parts_left_in_a_spill_dir_by_an_earlier_process_are_never_read(runs, tmp_path):
    plain = runs[0]
    shared = tmp_path / "spill"
    shared.mkdir()
    stale = train(1).tensors  # another run's rows, under the names a spill writes
    stale.to_parquet(shared / "tensors-part00000.parquet", index=False)
    run = train(0, spill_dir=shared, spill_rows=20)
    pd.testing.assert_frame_equal(run.tensors, plain.tensors)


def test_a_spill_dir_that_stops_working_keeps_the_rows_in_memory(tmp_path):
    """Spilling fails (the folder's parent became a file): warn, keep every row, train on."""
    blocker = tmp_path / "gone"
    with pytest.warns(RuntimeWarning, match="cannot spill rows"):
        with mpscope.record(torch.nn.Linear(1, 1), spill_dir=blocker / "spill", spill_rows=1) as rec:
            blocker.write_text("now a file")  # from here on the spill folder cannot be created
            rec.model(torch.ones(2, 1)).sum().backward()
            rec.step()
            rec.model(torch.ones(2, 1)).sum().backward()
            rec.step()
    assert list(rec.run.steps.step) == [0, 1]
    assert set(rec.run.tensors.step) == {0, 1} and set(rec.run.tensors.role) >= {"activation", "weight"}
