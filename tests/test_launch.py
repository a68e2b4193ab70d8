"""``mpscope run`` (:mod:`mpscope.launch`): a training script profiled unchanged, in the same process.

Oracles: what the scripts under ``tests/scripts/`` write themselves (each step's loss, the final
weights), run with and without mpscope; the Trainer's ``log_history``; each rank's own losses under
torchrun. The first optimizer step finds the model and is not recorded: the Run's step k is the
script's step k + 1.

End-to-end runs go through ``python -m mpscope run`` (``mpscope/__main__.py``) in a subprocess;
the quick cases call :func:`mpscope.launch.main` in this process, and check that nothing of
mpscope's stays installed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks

import mpscope
from mpscope import launch
from mpscope.launch import main

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[1]
LOOP = SCRIPTS / "plain_loop.py"
_CALL = torch.nn.Module.__call__
_DESTROY = dist.destroy_process_group if dist.is_available() else None


def _env(**extra) -> dict:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return dict(os.environ, PYTHONPATH=path, **extra)


def _run(*cmd, cwd, env=None, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, cmd)], cwd=cwd, env=env or _env(), capture_output=True,
                          text=True, timeout=timeout)


def _mpscope_run(*args, cwd, **kwargs) -> subprocess.CompletedProcess:
    return _run("-m", "mpscope", "run", *args, cwd=cwd, **kwargs)


def _ok(proc: subprocess.CompletedProcess, code: int = 0) -> None:
    assert proc.returncode == code, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def _losses(path: Path) -> list[float]:
    return json.loads(path.read_text())


def _assert_clean() -> None:
    """Nothing of mpscope.launch is left installed in this process."""
    assert torch.nn.Module.__call__ is _CALL
    for hooks in (module_hooks._global_forward_pre_hooks, module_hooks._global_module_registration_hooks,
                  optimizer_hooks._global_optimizer_pre_hooks, optimizer_hooks._global_optimizer_post_hooks):
        left = [h for h in hooks.values() if "mpscope" in (getattr(h, "__module__", "") or "")]
        assert not left, f"hooks left installed: {left}"
    if _DESTROY is not None:
        assert dist.destroy_process_group is _DESTROY


# --------------------------------------------------------------------------- a plain loop
def test_plain_loop_trains_bitwise_the_same_and_records_its_losses(tmp_path):
    base = _run(LOOP, tmp_path / "base", cwd=tmp_path)
    _ok(base)
    proc = _mpscope_run("--out", "run", LOOP, tmp_path / "with", cwd=tmp_path)
    _ok(proc)

    a, b = torch.load(tmp_path / "base" / "weights.pt"), torch.load(tmp_path / "with" / "weights.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = _losses(tmp_path / "with" / "losses.json")
    assert losses == _losses(tmp_path / "base" / "losses.json")
    assert proc.stdout.startswith(base.stdout)  # the script's own output, unchanged

    run = mpscope.Run.load(tmp_path / "run")
    assert run.steps.step.tolist() == list(range(len(losses) - 1))
    assert run.steps.loss.tolist() == losses[1:]  # step 0 (the script's first) finds the model
    assert run.steps.recorded.all() and not run.steps.skipped.any()
    assert run.meta["model"] == "MLP" and run.meta["optimizer"] == "AdamW"
    assert run.meta["scaler"]["init_scale"] == 2.0**10  # the script's GradScaler, adopted
    assert run.meta["autocast_dtype"] == "float16"
    assert run.meta["launch"]["optimizer_steps_before"] == 1
    assert set(run.tensors.module) >= {"fc1", "act", "fc2"}
    # saved, reported and printed as `mpscope demo` does
    for name in ("report.html", "recommended_torch.py", "recommendation.json"):
        assert (tmp_path / "run" / name).is_file(), name
    assert "mpscope: MLP on cpu, autocast float16" in proc.stdout
    assert "mpscope recommendation" in proc.stdout and "recommended config written to" in proc.stdout
    assert "recording model (MLP, 676 parameters), stepped by AdamW" in proc.stderr


def test_raising_script_exits_1_with_its_traceback_after_saving_its_steps(tmp_path):
    proc = _mpscope_run("-q", "--no-report", "--out", "run", LOOP, tmp_path / "s", "--raise-at", "4", cwd=tmp_path)
    _ok(proc, 1)
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().endswith("RuntimeError: boom at step 4")
    tb = proc.stderr[proc.stderr.index("Traceback"):]
    assert "runpy" not in tb and "launch.py" not in tb  # the script's frames only, as python prints them
    losses = _losses(tmp_path / "s" / "losses.json")
    run = mpscope.Run.load(tmp_path / "run")
    assert run.steps.loss.tolist() == losses[1:] and len(losses) == 4


# --------------------------------------------------------------------------- in this process
def test_exit_code_and_an_out_that_holds_a_recording(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["-q", "--no-report", "--out", "run", str(LOOP), "s", "--steps", "3", "--exit-code", "7"]
    assert main(args) == 7
    _assert_clean()
    assert main(args) == 7
    _assert_clean()
    err = capsys.readouterr().err
    assert "run holds an earlier recording (or is a file); this run goes to run-1" in err
    first, second = mpscope.Run.load("run"), mpscope.Run.load("run-1")
    assert first.steps.loss.tolist() == second.steps.loss.tolist() == _losses(tmp_path / "s" / "losses.json")[1:]


def test_interrupted_script_exits_130_and_keeps_its_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["-q", "--no-report", "--out", "run", str(LOOP), "s", "--interrupt-at", "3"]) == launch.INTERRUPTED
    _assert_clean()
    assert "KeyboardInterrupt" in capsys.readouterr().err
    assert mpscope.Run.load("run").steps.loss.tolist() == _losses(tmp_path / "s" / "losses.json")[1:]


def test_options_reach_the_recorder_and_python_m_runs_a_module(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    shutil.copy(LOOP, tmp_path / "tinytrain.py")
    code = main(["-q", "--no-report", "--every", "2", "--max-steps", "3", "--modules", "^fc", "--roles",
                 "activation,param_grad", "--out", "run", "--", "python", "-m", "tinytrain", "s", "--steps", "6"])
    assert code == 0
    _assert_clean()
    run = mpscope.Run.load("run")
    assert run.steps.step.tolist() == [0, 1, 2]  # --max-steps 3
    assert run.steps.recorded.tolist() == [True, False, True]  # --every 2
    assert set(run.tensors.role) == {"activation", "param_grad"}
    assert set(run.tensors.module) == {"fc1", "fc2"}
    assert run.steps.loss.tolist() == _losses(tmp_path / "s" / "losses.json")[1:4]


def test_a_script_that_trains_nothing_keeps_its_exit_code(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--out", "run", str(SCRIPTS / "no_train.py"), "5"]) == 5
    _assert_clean()
    out = capsys.readouterr()
    assert "output" in out.out
    assert "no optimizer stepped while" in out.err and "nothing was recorded" in out.err
    assert not (tmp_path / "run").exists()


def test_one_optimizer_over_two_unrelated_models_names_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--out", "run", str(SCRIPTS / "two_models.py"), "shared"]) == 0
    _assert_clean()
    err = capsys.readouterr().err
    assert "several unrelated models: generator (Generator, 94 parameters), critic (Critic, 65 parameters)" in err
    assert "--model-class" in err and "--model-attr" in err
    assert not (tmp_path / "run").exists()
    # chosen by name
    assert main(["-q", "--no-report", "--out", "run", "--model-attr", "generator",
                 str(SCRIPTS / "two_models.py"), "shared"]) == 0
    assert mpscope.Run.load("run").meta["model"] == "Generator"


def test_several_optimizers_record_the_first_and_name_the_others(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    script = str(SCRIPTS / "two_models.py")
    assert main(["-q", "--no-report", "--out", "first", script, "separate"]) == 0
    err = capsys.readouterr().err
    assert "recording critic (Critic" in err
    assert "this script also trains generator (Generator, 94 parameters)" in err and "--model-class" in err
    first = mpscope.Run.load("first")
    # (3 critic steps after the first; the generator's last backward, through the critic, may open a 4th)
    assert first.meta["model"] == "Critic" and len(first.steps) >= 3
    assert main(["-q", "--no-report", "--out", "chosen", "--model-class", "^Gen", script, "separate"]) == 0
    _assert_clean()
    assert mpscope.Run.load("chosen").meta["model"] == "Generator"
    assert main(["-q", "--no-report", "--out", "none", "--model-class", "Nothing", script, "separate"]) == 0
    assert "no optimizer of" in capsys.readouterr().err and not (tmp_path / "none").exists()


@pytest.mark.parametrize("argv, message", [
    ([], "name the script"),
    (["--every", "0", "x.py"], "every must be a positive int"),
    (["--roles", "activation,bogus", "x.py"], "bogus"),
    (["--model-class", "(", "x.py"], "not a regular expression"),
    (["missing.py"], "can't open file 'missing.py'"),
    (["--", "python", "-X", "dev", "x.py"], "python -X -m mpscope run"),
])
def test_usage_errors_exit_2_with_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    _assert_clean()


@pytest.mark.parametrize("command, expected", [
    (["train.py", "--lr", "3"], ("path", "train.py", ["--lr", "3"])),
    (["--", "python", "train.py", "--every", "5"], ("path", "train.py", ["--every", "5"])),
    (["--", "python3.11", "-u", "train.py"], ("path", "train.py", [])),
    (["--", sys.executable, "-m", "pkg.train", "a"], ("module", "pkg.train", ["a"])),
    (["--", "-m", "pkg.train"], ("module", "pkg.train", [])),
])
def test_command_forms(command, expected):
    t = launch._target(command)
    assert (t.kind, t.name, t.args) == expected


# --------------------------------------------------------------------------- frameworks
def _same_training(tmp_path, script) -> None:
    """The script run without mpscope trains bitwise the same: its losses and final weights."""
    _ok(_run(script, tmp_path / "base", cwd=tmp_path))
    a, b = torch.load(tmp_path / "base" / "weights.pt"), torch.load(tmp_path / "s" / "weights.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    name = "log_history.json" if (tmp_path / "s" / "log_history.json").exists() else "losses.json"
    assert _losses(tmp_path / "base" / name) == _losses(tmp_path / "s" / name)


def test_hf_trainer_steps_and_losses_match_its_log(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    proc = _mpscope_run("-q", "--out", "run", SCRIPTS / "hf_trainer.py", tmp_path / "s", cwd=tmp_path)
    _ok(proc)
    _same_training(tmp_path, SCRIPTS / "hf_trainer.py")
    assert (tmp_path / "run" / "report.html").stat().st_size > 0 and (tmp_path / "run" / "recommendation.json").exists()
    logged = _losses(tmp_path / "s" / "log_history.json")  # logging_steps=1: one per optimizer step
    run = mpscope.Run.load(tmp_path / "run")
    assert len(logged) == 4 and run.steps.step.tolist() == [0, 1, 2]
    assert run.steps.loss.tolist() == pytest.approx(logged[1:], rel=1e-6)
    assert run.steps.backward_count.tolist() == [2, 2, 2]  # gradient_accumulation_steps=2
    assert run.meta["model"] == "GPT2LMHeadModel" and run.meta["autocast_dtype"] == "bfloat16"
    assert "transformer.h.1.mlp.c_fc" in set(run.tensors.module)


def test_lightning_fit_records_the_lightning_module(tmp_path):
    pytest.importorskip("lightning")
    proc = _mpscope_run("-q", "--no-report", "--out", "run", SCRIPTS / "lightning_fit.py", tmp_path / "s",
                        cwd=tmp_path)
    _ok(proc)
    _same_training(tmp_path, SCRIPTS / "lightning_fit.py")
    assert (tmp_path / "run" / "recommendation.json").exists()
    losses = _losses(tmp_path / "s" / "losses.json")
    run = mpscope.Run.load(tmp_path / "run")
    assert len(losses) == 5 and run.steps.step.tolist() == [0, 1, 2, 3]
    assert run.steps.loss.tolist() == pytest.approx(losses[1:], rel=1e-6)
    # training_step calls self.net, never self(...): the module recorded is the LightningModule around it
    assert run.meta["model"] == "Regressor" and run.meta["autocast_dtype"] == "bfloat16"
    assert {"net.0", "net.2"} <= set(run.tensors.module)


# --------------------------------------------------------------------------- torchrun
@pytest.mark.distributed
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
def test_torchrun_two_ranks_merge_on_rank_0(tmp_path):
    env = _env(MPSCOPE_DIST_TIMEOUT="20", OMP_NUM_THREADS="1")
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    script = SCRIPTS / "ddp_loop.py"
    _ok(_run(*torchrun, script, tmp_path / "base", cwd=tmp_path, env=env))
    proc = _run(*torchrun, "-m", "mpscope", "run", "-q", "--no-report", "--out", "run", script, tmp_path / "with",
                cwd=tmp_path, env=env)
    _ok(proc)
    a, b = torch.load(tmp_path / "base" / "weights.pt"), torch.load(tmp_path / "with" / "weights.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert proc.stdout.count("run saved to run") == 1  # rank 0 reports

    run = mpscope.Run.load(tmp_path / "run")
    assert (tmp_path / "run" / "merged").is_dir()  # written before the script's destroy_process_group()
    assert run.meta["distributed"]["world_size"] == 2 and run.meta["ranks"] == [0, 1]
    assert run.meta["model"] == "Sequential"  # DDP's wrapper left out
    per_rank = [_losses(tmp_path / "with" / f"losses_rank{r}.json") for r in (0, 1)]
    assert per_rank == [_losses(tmp_path / "base" / f"losses_rank{r}.json") for r in (0, 1)]
    for r in (0, 1):
        assert mpscope.Run.load(tmp_path / "run", rank=r).steps.loss.tolist() == per_rank[r][1:]
    mean = [(x + y) / 2 for x, y in zip(per_rank[0][1:], per_rank[1][1:])]
    assert run.steps.loss.tolist() == pytest.approx(mean, rel=1e-6)
