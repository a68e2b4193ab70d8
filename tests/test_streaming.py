"""A recording with ``out=`` reaches the disk as it goes: a process killed with SIGKILL leaves every
step written before the last write, which ``Run.load`` returns marked incomplete."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import mpscope
import mpscope.run as run_module
from mpscope.run import FLUSH_STEPS, RANKS_DIR, RunFileError

WRITER = Path(__file__).with_name("killed_writer.py")


def kill_after(entry: str, out: Path, k: int, steps: int = 200) -> int:
    """Start killed_writer.py, SIGKILL its whole process group once step ``k`` has ended; returns
    the last step it announced."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, str(WRITER), entry, str(out), str(steps)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    last = -1
    try:
        for line in proc.stdout:
            if line.startswith("step "):
                last = int(line.split()[1])
                if last >= k:
                    break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert last >= k, f"{entry} stopped at step {last} before step {k}"
    return last


def load_incomplete(out: Path, **kw):
    with pytest.warns(RuntimeWarning, match=r"did not finish: the writer of rank\(s\) .* stopped before closing"):
        run = mpscope.Run.load(out, **kw)
    assert run.meta["complete"] is False
    return run


def as_plain(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.astype({c: str for c in ("module", "role", "name", "dtype")}).reset_index(drop=True)


def test_a_killed_record_block_keeps_its_steps_as_they_were_recorded(tmp_path):
    k = 14
    last = kill_after("record", tmp_path / "killed", k)
    killed = load_incomplete(tmp_path / "killed")
    n = len(killed.steps)
    assert last + 1 - FLUSH_STEPS - 1 <= n <= last + 1
    assert list(killed.steps.step) == list(range(n))
    # the same loop run to its end: the killed run's rows are its rows of those steps, unchanged
    subprocess.run([sys.executable, str(WRITER), "record", str(tmp_path / "whole"), str(last + 2)], check=True,
                   capture_output=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    whole = mpscope.Run.load(tmp_path / "whole")
    assert "complete" not in whole.meta
    t = whole.tensors[whole.tensors.step.isin(killed.tensors.step.unique())]
    assert killed.tensors.step.nunique() >= n - 1  # rows of the last step may still have been waiting
    pd.testing.assert_frame_equal(as_plain(killed.tensors), as_plain(t))
    pd.testing.assert_frame_equal(killed.steps, whole.steps.iloc[:n])
    assert killed.meta["autocast_dtype"] == "float16" and killed.meta["scaler"] == whole.meta["scaler"]
    assert len(load_incomplete(tmp_path / "killed", rank=0).steps) == n


def test_a_killed_trainer_with_the_callback_keeps_its_steps(tmp_path):
    pytest.importorskip("transformers")
    k = 12
    last = kill_after("hf", tmp_path / "killed", k)
    run = load_incomplete(tmp_path / "killed")
    assert last + 1 - FLUSH_STEPS - 1 <= len(run.steps) <= last + 1
    assert run.tensors.step.nunique() >= len(run.steps) - 1
    assert "transformer.h.0.mlp.c_fc" in set(run.tensors.module.astype(str))


def test_a_killed_two_rank_job_keeps_both_ranks_steps(tmp_path):
    k = 12
    last = kill_after("ddp", tmp_path / "killed", k)
    run = load_incomplete(tmp_path / "killed")
    assert run.ranks == [0, 1]
    assert last + 1 - FLUSH_STEPS - 1 <= len(run.steps) <= last + 2  # rank 1 may be a step ahead
    for rank in (0, 1):
        own = load_incomplete(tmp_path / "killed", rank=rank)
        assert len(own.steps) >= last + 1 - FLUSH_STEPS - 1
        assert own.tensors.step.max() <= own.steps.step.max()  # no rows of a step without its step row


def record_mlp(out, steps, x_fill=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    on_disk = []
    with mpscope.record(model, optimizer=opt, out=out):
        for _ in range(steps):
            x = torch.randn(4, 4) if x_fill is None else torch.full((4, 4), x_fill)
            model(x).mean().backward()
            opt.step()
            opt.zero_grad()
            on_disk.append(disk_rows(out))
    return on_disk


def disk_rows(out) -> dict[str, int]:
    """Rows written so far per table (parts on disk, read with pandas)."""
    rows = {}
    for table in ("tensors", "steps"):
        parts = sorted((Path(out) / RANKS_DIR / table / "rank=0").glob("part-*.parquet"))
        rows[table] = sum(len(pd.read_parquet(p)) for p in parts)
    return rows


def test_steps_are_written_every_few_recorded_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "MIN_FLUSH_SECONDS", 0.0)  # the step count alone decides
    on_disk = record_mlp(tmp_path / "out", 3 * FLUSH_STEPS + 3)
    written = [d["steps"] for d in on_disk]
    assert written == [FLUSH_STEPS * ((i + 1) // FLUSH_STEPS) for i in range(len(on_disk))]


def test_a_fast_loop_is_written_at_most_once_a_second(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "FLUSH_SECONDS", 1e9)
    monkeypatch.setattr(run_module, "MIN_FLUSH_SECONDS", 1e9)  # a loop faster than any clock
    assert record_mlp(tmp_path / "out", 4 * FLUSH_STEPS)[-1] == {"tensors": 0, "steps": 0}
    monkeypatch.setattr(run_module, "FLUSH_SECONDS", 0.0)  # ... and one slower than FLUSH_SECONDS
    assert [d["steps"] for d in record_mlp(tmp_path / "out2", 3)] == [1, 2, 3]


def test_only_the_first_non_finite_value_is_written_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "FLUSH_SECONDS", 1e9)
    monkeypatch.setattr(run_module, "MIN_FLUSH_SECONDS", 1e9)
    on_disk = record_mlp(tmp_path / "out", 6, x_fill=float("inf"))  # every step holds inf
    first = next(i for i, d in enumerate(on_disk) if d["tensors"])
    assert all(d == on_disk[first] for d in on_disk[first:])  # one write, not one per step
    assert first <= 1
    parts = list((tmp_path / "out" / RANKS_DIR / "tensors" / "rank=0").glob("part-*.parquet"))
    assert len(parts) == 2  # that write and the one at the end


def test_a_missing_part_of_a_rank_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "MIN_FLUSH_SECONDS", 0.0)
    record_mlp(tmp_path / "out", 2 * FLUSH_STEPS)
    part = tmp_path / "out" / RANKS_DIR / "tensors" / "rank=0" / "part-00000.parquet"
    part.unlink()
    with pytest.raises(RunFileError, match=rf"{part} is missing: rank 0.s meta says \d+ tensors parts"):
        mpscope.Run.load(tmp_path / "out", rank=0)


def test_an_out_that_cannot_take_the_run_gets_one_beside_it_with_a_warning(tmp_path):
    taken = tmp_path / "run"
    record_mlp(taken, 2)  # rows of another recording
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for asked in (taken, a_file):
        with pytest.warns(RuntimeWarning, match=rf"out='{asked}' cannot take this recording .* written to '{asked}-1'"):
            record_mlp(asked, 3)
        assert len(mpscope.Run.load(Path(f"{asked}-1")).steps) == 3
    assert a_file.read_text() == "mine" and len(mpscope.Run.load(taken).steps) == 2


@pytest.mark.parametrize("loop_raises", [False, True])
def test_a_merged_run_that_cannot_be_written_warns_and_the_loops_own_error_wins(tmp_path, loop_raises):
    out = tmp_path / "out"
    out.mkdir()
    (out / "merged").write_text("in the way")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # (a block that raises writes no merged run: the per-rank files are the record)
    expect = pytest.raises(KeyError, match="the loop's own") if loop_raises else \
        pytest.warns(RuntimeWarning, match=r"could not write the merged run to .*merged .* merges them")
    with expect, mpscope.record(model, optimizer=opt, out=out):
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        if loop_raises:
            raise KeyError("the loop's own")
    assert len(mpscope.Run.load(out).steps) == 3  # merged from the per-rank files


def test_a_trainer_writing_checkpoints_into_out_records_as_usual(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mpscope.integrations.hf import MPScopeCallback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16,
                                                                 n_layer=1, n_head=2))
    ids = torch.arange(16) % 64
    data = [{"input_ids": ids, "labels": ids}] * 16
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4,
                                          use_cpu=True, report_to=[], save_strategy="steps", save_steps=2,
                                          disable_tqdm=True, dataloader_num_workers=0)
    cb = MPScopeCallback(show=False, log=False, out=tmp_path)
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    run = mpscope.Run.load(tmp_path)
    assert len(run.steps) == 4 and "complete" not in run.meta
