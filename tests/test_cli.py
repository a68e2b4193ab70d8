"""The command line: advise / report on a saved run, and clear errors on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import mpscope
from loops import record_fp16_mlp
from mpscope.cli import main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = record_fp16_mlp(3, activation=torch.nn.Tanh, optimizer=torch.optim.SGD, lr=0.05)
    return run.save(tmp_path_factory.mktemp("cli") / "run")


def test_advise_prints_the_recommendation(run_dir, capsys):
    assert main(["advise", str(run_dir)]) == 0
    out = capsys.readouterr().out
    advice = mpscope.advise(mpscope.Run.load(run_dir))
    assert advice.dtype in out and out.strip() == advice.to_text().strip()


def test_advise_exports_json(run_dir, tmp_path):
    path = tmp_path / "rec.json"
    assert main(["advise", str(run_dir), "--format", "json", "-o", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["dtype"] == mpscope.advise(mpscope.Run.load(run_dir)).dtype


def test_report_writes_html(run_dir, tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", str(run_dir), "-o", str(out)]) == 0
    assert out.read_text().lstrip().lower().startswith("<!doctype html")


def test_bad_run_dir_exits_2_with_a_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mpscope.cli", "advise", str(tmp_path / "missing")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "not a run directory" in proc.stderr and "mpscope demo --out" in proc.stderr


def test_export_format_needs_a_path(run_dir, capsys):
    assert main(["advise", str(run_dir), "--format", "deepspeed"]) == 2
    assert "add -o PATH" in capsys.readouterr().err
