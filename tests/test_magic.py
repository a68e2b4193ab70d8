"""``%load_ext mpscope`` and the magics in a real IPython shell (in a subprocess: IPython changes
global state, as pyinstrument's tests also found)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("IPython")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def session():
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("magic_session.py"))],
        capture_output=True, text=True, timeout=240,
        # this checkout's mpscope, whichever one is installed (the script's own folder comes first on sys.path)
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cell_records_the_loop(session):
    assert session["cell_steps"] == 4
    assert {"activation", "activation_grad", "param_grad", "weight", "loss"} <= set(session["cell_roles"])
    assert session["cell_scale"][0] == 2.0**10  # the scaler created inside the cell was adopted
    assert session["hooks_left"] == 0


def test_bad_arguments_raise_usage_errors_that_say_what_to_type(session):
    assert "'modle' is not defined" in session["bad_model"] and "%%mpscope model" in session["bad_model"]
    assert "not a torch.nn.Module" in session["not_module"]
    assert "--every must be >= 1" in session["bad_every"]
    assert "unrecognized arguments" in session["bad_option"]
    assert "%%mpscope MODEL" in session["bad_sub"]


def test_a_raising_cell_keeps_data_and_detaches(session):
    assert session["raised_steps"] == 4
    assert session["hooks_left_after_raise"] == 0


def test_skipped_steps_with_an_optimizer_that_never_steps(session):
    assert session["all_found_inf"] == [True] * 4
    assert session["all_skipped"] == [True] * 4


def test_attach_detach(session):
    assert session["attach_steps"] == 4
    assert session["hooks_left_after_detach"] == 0


def test_help_prints_usage(session):
    for key in ("help_h", "help_word"):
        text = session[key]
        assert "%%mpscope MODEL" in text and "--hist-every" in text and "--ops" in text, key
        assert "%mpscope status" in text and "UsageError" not in text and "Traceback" not in text
    assert "usage: %mpscope attach" in session["help_attach"] and "--every" in session["help_attach"]
    assert "usage: %%mpscope" in session["help_cell"] and "UsageError" not in session["help_cell"]


@pytest.mark.parametrize("key, words", [
    ("err_sub", ["'stauts'", "did you mean `%mpscope status`"]),
    ("err_modules", ["selects none of the model's", "modules"]),
    ("err_regex", ["not a valid regular expression"]),
    ("err_export_line", ["cfg.toml", "--format", "torch", "accelerate", "deepspeed"]),
    ("err_export_cell", ["cfg.toml", "--format"]),
    ("err_option", ["unrecognized arguments: --evry", "usage: %%mpscope"]),
    ("err_run", ["'x' is a Tensor, not a mpscope.Run"]),
])
def test_user_errors_are_one_line_without_traceback(session, key, words):
    text = session[key].strip()
    assert text.startswith("UsageError: "), text
    assert "\n" not in text and "Traceback" not in text, text
    for w in words:
        assert w in text, (w, text)


def test_bad_export_suffix_writes_nothing_and_runs_nothing(session):
    assert not session["toml_written"] and not session["run5_made"]


def test_status_names_the_last_run(session):
    text = session["status_last"]
    assert "nothing attached" in text and "run4" in text and "4 steps" in text


def test_import_does_not_load_notebook_stack():
    code = "import sys, mpscope; print(sorted(m for m in sys.modules if m.split('.')[0] in ('IPython','ipywidgets','altair','anywidget')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_apply_reruns_the_cell_with_the_recommendation(session):
    """`%%mpscope model --apply` re-runs a cell that clips before unscale_ with the last recommendation
    applied: in the re-run the clip sees unscaled gradients and the error is reported cleared."""
    assert session["apply_before_clip_scaled"] and not session["apply_after_clip_scaled"]
    assert "clip_before_unscale" in session["apply_cleared"]
    assert session["apply_steps"] == [4, 4]


def test_an_interrupted_cell_keeps_its_steps_and_leaves_nothing_attached(session):
    assert session["interrupted_steps"] == 2
    assert session["interrupted_left"] == [0, []]


def test_two_models_in_one_cell_each_get_their_own_grad_scaler(session):
    assert session["two_models_scales"] == [[2.0**10], [2.0**5]]
    assert session["two_models_steps"] == [3, 3]


def test_apply_after_another_models_run_is_one_usage_error_and_patches_nothing(session):
    assert "recorded another model than 'model'" in session["apply_other_model"]
    assert session["apply_other_model_left"] == [0, 0, []]


def test_a_cell_raising_under_apply_undoes_it_and_keeps_the_previous_run(session):
    assert session["apply_raised"] == [True, 4, False, 0, []]


def test_the_run_variable_must_be_a_python_name(session):
    for msg, name in zip(session["bad_var"], ("1run", "import", "a.b")):
        assert msg is not None and f"{name!r} is not a Python variable name" in msg


def test_magic_tensorboard_option(session):
    from test_tensorboard import _read, _same
    accumulator_class = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator").EventAccumulator
    tb = Path(session["tb_dir"])
    for where, losses in (("cell", session["tb_cell_losses"]), ("attached", session["tb_attached_losses"])):
        scalars, hists = _read(accumulator_class, tb / where)
        assert len(losses) == 4 and sorted(scalars["mpscope/loss"]) == [0, 1, 2, 3], where
        assert all(_same(scalars["mpscope/loss"][s], v) for s, v in enumerate(losses)), where
        assert any(t.endswith("/fp16_underflow_frac") for t in scalars) and hists, where
    assert "TensorBoard" not in session["tb_cell_out"]  # -q
    assert f"wrote TensorBoard events to {tb / 'attached'}" in session["tb_detach_out"]
    text = session["tb_missing"]
    assert text is not None and "\n" not in text.strip(), text
    assert "--tensorboard" in text and "pip install 'mpscope[tensorboard]'" in text, text
    assert not session["tb_run3_made"] and not (tb / "missing").exists()  # nothing ran
