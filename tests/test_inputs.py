"""Inputs are checked where they enter: saved files against the schema, CLI errors in one line with
exit 2, public functions' argument types and ranges; missing evidence gives "cannot tell" advice."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest
import torch

import mpscope
from loops import record_fp16, record_fp16_mlp
from mpscope.run import RunFileError


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return record_fp16_mlp(2).save(tmp_path_factory.mktemp("inputs") / "run")


def corrupt(run_dir, tmp_path, edit):
    d = tmp_path / "bad"
    shutil.copytree(run_dir, d)
    edit(d)
    return d


def cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-m", "mpscope.cli", *args], capture_output=True, text=True, env=env)


def test_meta_json_holding_a_list_is_a_clear_error_and_one_cli_line(run_dir, tmp_path):
    d = corrupt(run_dir, tmp_path, lambda d: (d / "meta.json").write_text("[1, 2]"))
    with pytest.raises(RunFileError, match=r"meta.json must hold a JSON object .* holds a list"):
        mpscope.Run.load(d)
    proc = cli("advise", str(d))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "meta.json" in proc.stderr


def test_a_field_of_the_wrong_type_names_the_file_and_the_field(run_dir, tmp_path):
    def bad_scaler(d):
        meta = json.loads((d / "meta.json").read_text())
        meta["scaler"]["growth_interval"] = "2000"
        (d / "meta.json").write_text(json.dumps(meta))

    d = corrupt(run_dir, tmp_path, bad_scaler)
    with pytest.raises(RunFileError, match=r"meta.json: field 'scaler.growth_interval' must be a positive number"):
        mpscope.Run.load(d)
    d2 = tmp_path / "bad2"
    shutil.copytree(run_dir, d2)
    t = pd.read_parquet(d2 / "tensors.parquet")
    t["numel"] = t["numel"].astype(str)
    t.to_parquet(d2 / "tensors.parquet")
    with pytest.raises(RunFileError, match=r"tensors.parquet: column 'numel' must hold integers"):
        mpscope.Run.load(d2)
    proc = cli("report", str(d2), "-o", str(tmp_path / "r.html"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "column 'numel'" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_errors_that_escape_validation_are_still_one_line_exit_2(run_dir, tmp_path, monkeypatch, capsys):
    """An exception no check foresaw is one line and exit 2; MPSCOPE_TRACEBACK=1 shows the traceback."""
    import mpscope.cli
    from mpscope.cli import main

    def boom(run):
        raise KeyError("module_types")

    monkeypatch.setattr(mpscope.cli, "advise", boom)
    assert main(["advise", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "KeyError" in err and "MPSCOPE_TRACEBACK=1" in err
    monkeypatch.setenv("MPSCOPE_TRACEBACK", "1")
    with pytest.raises(KeyError):
        main(["advise", str(run_dir)])
    d = corrupt(run_dir, tmp_path, lambda d: None)
    h = pd.read_parquet(d / "histograms.parquet")
    h["exponent"] = h["exponent"].astype("float64") + 0.5  # not an integer exponent
    h.to_parquet(d / "histograms.parquet")
    with pytest.raises(RunFileError, match=r"histograms.parquet: column 'exponent' must hold integers"):
        mpscope.Run.load(d)


def test_scale_whatif_rejects_exponents_it_cannot_use():
    run = record_fp16_mlp(2)
    ok = mpscope.advisor.scaler.scale_whatif(run, ks=[0, 16])
    assert list(ok.scale) == [1.0, 65536.0]
    with pytest.raises(ValueError, match=r"ks must lie in \[-1074, 1023\]"):
        mpscope.advisor.scaler.scale_whatif(run, ks=[1024])  # 2.0**1024 overflows float64
    assert math.isinf(float(torch.tensor(2.0, dtype=torch.float64) ** 1024))
    with pytest.raises(TypeError, match="int exponents .* got 1.5"):
        mpscope.advisor.scaler.scale_whatif(run, ks=[1.5])  # refused, not truncated to 2**1
    with pytest.raises(TypeError, match="per_module must be True or False"):
        mpscope.advisor.scaler.scale_whatif(run, per_module="yes")
    with pytest.raises(TypeError, match="init_scale must be a float"):
        mpscope.simulate_scaler(run, init_scale="65536")
    with pytest.raises(TypeError, match="growth_interval must be an int"):
        mpscope.simulate_scaler(run, growth_interval=2000.5)


def fp16_run(x, roles=None, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    y = torch.randn(x.shape[0], 1)
    return record_fp16(model, opt, torch.amp.GradScaler("cpu"), [(x, y)] * steps, roles=roles)


def test_no_gradient_roles_recorded_is_cannot_tell_with_the_default_scaler_kept(tmp_path):
    advice = mpscope.advise(fp16_run(torch.randn(32, 8), roles=["activation", "weight"]))
    assert advice.dtype == "float16"
    assert advice.grad_scaler == {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5,
                                  "growth_interval": 2000}
    missing = [f for f in advice.findings if f.code == "missing_evidence"]
    assert len(missing) == 1 and "activation_grad and param_grad were not recorded" in missing[0].message
    assert not any("both fit" in r for r in advice.reasons)
    advice.export(tmp_path / "amp.py", format="torch")
    sys.path.insert(0, str(tmp_path))
    try:
        import amp  # the exported module's make_scaler() must scale, not return a disabled scaler
        scaler = amp.make_scaler("cpu")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("amp", None)
    defaults = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled() and scaler.get_scale() == defaults.get_scale()


def test_nan_from_step_0_is_cannot_tell_for_forward_and_gradients():
    advice = mpscope.advise(fp16_run(torch.full((32, 8), math.nan)))
    codes = [f.code for f in advice.findings]
    assert "first_nonfinite" in codes and codes.count("missing_evidence") == 2
    assert advice.grad_scaler is not None and advice.grad_scaler["init_scale"] == 2.0**16
    assert not any("both fit" in r for r in advice.reasons)
    assert len(advice.evidence["missing"]) == 2


@pytest.mark.parametrize("member", ["no_activation_role", "all_zero_gradients"])
def test_other_gaps_in_the_evidence_are_cannot_tell(member):
    """Two more members: no activation recorded (gradient roles only), and gradients recorded but
    all zero (a loss that does not depend on the model's output values: 0 * output). Each gap is
    one missing_evidence finding naming it; without gradient evidence the GradScaler keeps
    PyTorch's defaults."""
    x = torch.randn(32, 8)
    if member == "no_activation_role":
        advice = mpscope.advise(fp16_run(x, roles=["activation_grad", "param_grad", "weight", "loss"]))
        want = "cannot tell whether the forward pass fits fp16: no activation was recorded"
    else:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with mpscope.record(model, optimizer=opt, scaler=torch.amp.GradScaler("cpu")) as rec:
            for _ in range(3):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = (model(x).float() * 0.0).sum()
                rec.scaler.scale(loss).backward()
                rec.scaler.step(opt)
                rec.scaler.update()
        assert (rec.run.tensors.query("role == 'param_grad'")["absmax"] == 0).all()
        advice = mpscope.advise(rec.run)
        want = "cannot tell whether fp16 gradients fit a loss scale: the recorded gradients"
    missing = [f.message for f in advice.findings if f.code == "missing_evidence"]
    assert len(missing) == 1 and want in missing[0], missing
    assert advice.grad_scaler is not None
    if member == "all_zero_gradients":
        assert advice.grad_scaler["init_scale"] == torch.amp.GradScaler("cpu").get_scale()
    assert not any("both fit" in r for r in advice.reasons)


def test_public_functions_name_the_bad_argument():
    run = record_fp16_mlp(1)
    with pytest.raises(TypeError, match="cannot save the run to 123: pass a directory path"):
        run.save(123)
    with pytest.raises(TypeError, match="cannot load a run from None: pass a directory path"):
        mpscope.Run.load(None)
    with pytest.raises(mpscope.recorder.RecorderError, match="roles must be a role name or a list"):
        mpscope.record(torch.nn.Linear(1, 1), roles=5)


def test_views_and_exports_name_the_bad_argument(tmp_path):
    run = record_fp16_mlp(1)
    advice = mpscope.advise(run)
    with pytest.raises(TypeError, match="tol must be a number"):
        mpscope.compare(run, run, tol="0.1")
    with pytest.raises(TypeError, match="roles must be role names"):
        mpscope.compare(run, run, roles=5)
    with pytest.raises(ValueError, match="labels must be two names"):
        mpscope.compare(run, run, labels=("only one",))
    with pytest.raises(TypeError, match="cannot export the recommendation to None: pass a file path"):
        advice.export(None)
    with pytest.raises(TypeError, match="cannot write the report to 123: pass a file path"):
        run.report(123)
    with pytest.raises(mpscope.recorder.RecorderError, match=r"ops= takes True \(every op\) or op names"):
        mpscope.record(torch.nn.Linear(1, 1), ops=5)
    assert not list(tmp_path.iterdir())  # nothing was written by the refused calls
