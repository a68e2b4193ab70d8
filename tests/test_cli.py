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
from mpscope.export import render


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


@pytest.mark.parametrize("suffix, fmt", [("json", "json"), ("JSON", "json"), ("yaml", "yaml"), ("yml", "yaml"),
                                         ("py", "torch"), ("txt", "text")])
def test_advise_output_suffix_picks_the_format(run_dir, tmp_path, capsys, suffix, fmt):
    path = tmp_path / f"rec.{suffix}"
    assert main(["advise", str(run_dir), "-o", str(path)]) == 0
    advice = mpscope.advise(mpscope.Run.load(run_dir))
    text = path.read_text()
    if fmt == "text":
        assert text.strip() == advice.to_text().strip()
    else:
        assert text == render(advice, fmt)
    if fmt == "json":
        assert json.loads(text)["dtype"] == advice.dtype


def test_advise_explicit_format_wins_over_the_suffix(run_dir, tmp_path):
    path = tmp_path / "ds.json"
    assert main(["advise", str(run_dir), "--format", "deepspeed", "-o", str(path)]) == 0
    assert set(json.loads(path.read_text())) & {"fp16", "bf16"}  # DeepSpeed's blocks, not to_dict()


def test_advise_unknown_suffix_exits_2_naming_the_choices(run_dir, tmp_path, capsys):
    path = tmp_path / "rec.toml"
    assert main(["advise", str(run_dir), "-o", str(path)]) == 2
    err = capsys.readouterr().err
    assert "rec.toml" in err and ".json" in err and "--format" in err and "accelerate" in err
    assert not path.exists()


def _record_fp32_mlp(steps: int):
    """record_fp16_mlp's model, seed and batch trained in float32 (no autocast, no scaler)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with mpscope.record(model, optimizer=opt) as rec:
        for _ in range(steps):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    return rec.run


def test_compare_prints_the_api_comparison_and_its_warnings(run_dir, tmp_path, capsys):
    fp32_dir = _record_fp32_mlp(4).save(tmp_path / "fp32")  # one step more than run_dir: a difference
    assert main(["compare", str(fp32_dir), str(run_dir)]) == 0
    captured = capsys.readouterr()
    with pytest.warns(UserWarning, match="different step counts") as warned:
        expected = mpscope.compare(mpscope.Run.load(fp32_dir), mpscope.Run.load(run_dir),
                                   labels=(str(fp32_dir), str(run_dir)))
    assert captured.out.strip() == expected.to_text().strip()
    assert f"{fp32_dir} vs {run_dir}" in captured.out and "different step counts" in captured.out
    assert [l for l in captured.err.splitlines() if l] == [f"mpscope: warning: {w.message}" for w in warned]
    assert "different step counts: " in captured.err and f"{fp32_dir} 4, {run_dir} 3" in captured.err


def test_compare_of_a_run_with_itself_finds_no_divergence(run_dir, capsys):
    assert main(["compare", str(run_dir), str(run_dir), "--tol", "0.01"]) == 0
    captured = capsys.readouterr()
    assert "no divergence beyond tolerance" in captured.out and "tol 0.01" in captured.out
    assert captured.err == ""


def test_compare_missing_dir_exits_2_with_a_message(run_dir, tmp_path):
    missing = tmp_path / "missing"
    for argv in ([str(run_dir), str(missing)], [str(missing), str(run_dir)]):
        proc = subprocess.run([sys.executable, "-m", "mpscope.cli", "compare", *argv],
                              capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
        assert "not a run directory" in proc.stderr and str(missing) in proc.stderr
