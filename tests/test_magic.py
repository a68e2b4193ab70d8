"""``%load_ext mpscope`` and the magics in a real IPython shell (in a subprocess: IPython changes
global state, as pyinstrument's tests also found)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("IPython")


@pytest.fixture(scope="module")
def session():
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("magic_session.py"))],
        capture_output=True, text=True, timeout=240,
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


def test_import_does_not_load_notebook_stack():
    code = "import sys, mpscope; print(sorted(m for m in sys.modules if m.split('.')[0] in ('IPython','ipywidgets','altair','anywidget')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
