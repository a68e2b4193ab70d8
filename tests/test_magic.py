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
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)),
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


def test_apply_restarts_from_the_last_runs_start_bit_for_bit_when_the_advice_is_a_no_op(session):
    """A cell that re-creates its data each run (a DataLoader shuffled by torch's RNG, dropout,
    NumPy and Python noise) and steps an Adam and a StepLR made before it, re-run with
    `--apply`: the recommendation changes nothing for this loop, so the re-run starts from the
    weights and optimizer state the test copied before the first cell and repeats the first run's
    losses and end state bit for bit."""
    noop = session["noop"]
    assert noop["advice"] == ["bfloat16", "float32", None, []]  # the loop's own settings: a no-op
    assert noop["first_started_at_oracle"] and noop["again_started_at_oracle"]
    before, after = noop["losses"]
    assert len(before) == 4 and after == before
    assert noop["first_loss_table"][0] == noop["first_loss_table"][1] == before[0]
    assert before[-1] != before[0]  # training moved: a re-run from the trained weights would differ
    assert noop["same_end"]
    assert "restored the model's weights" in noop["said"] and "`net_opt`" in noop["said"]
    assert "`net_sched`" in noop["said"] and "not restored" not in noop["said"]
    assert noop["left"] == [0, []]


def test_apply_restores_a_grad_scaler_then_applies_its_settings_and_leaves_what_training_did(session):
    """A float16 loop whose SGD (momentum) and GradScaler (init_scale 2^20, growth_interval 3) are
    made before the cell, re-run with `--apply`: the scaler's state is restored, then the
    recommended init_scale wins; step 0's forward is unchanged by the recommendation (same dtype,
    same restored weights, same batch), so its loss is bitwise the first run's. Afterwards model,
    optimizer and scaler equal the same loop replayed under mpscope.apply from the test's own
    copies of the start, and the scaler has its own growth_interval back."""
    amp = session["amp"]
    assert amp["scales"] == [2.0**20, amp["advice_init_scale"]] and amp["advice_init_scale"] < 2.0**20
    assert amp["first_losses"][0] == amp["first_losses"][1]
    assert amp["skipped"][0] > amp["skipped"][1]  # the recommendation did change the training
    assert amp["model_as_replayed"] and amp["optimizer_as_replayed"]
    mine, replayed = amp["scaler"]
    assert mine == replayed and mine["growth_interval"] == 3 and mine["growth_factor"] == 2.0
    assert amp["left"] == [0, []]


def test_apply_names_what_it_cannot_restore_once_and_how_to_recreate_it(session):
    """A cell reading batches from a generator made outside it, and stepping an optimizer kept in a
    dict: the model still restarts from the test's copy of its start, and one message names the
    iterator (and how to re-create it) and the optimizer not found (and --optimizer); the first
    losses differ, since the data do, and the table shows it."""
    it = session["iterator"]
    said = it["said"]
    assert it["started_at_oracle"]
    assert said.count("mpscope: --apply") == 1 and said.count("`stream`") == 1, said
    assert "`stream` is an iterator made outside the cell" in said and "cannot be rewound" in said
    assert "re-create it as the cell's first line (`stream = ...`" in said and "re-run the cell that makes it" in said
    assert "the optimizer the cell used (SGD) was not among the notebook's names" in said and "--optimizer EXPR" in said
    before, after = it["first_losses"]
    assert before != after


def test_apply_over_the_size_limit_keeps_nothing_and_says_so(session):
    big = session["over_limit"]
    said = big["said"]
    assert "over the 1 KiB limit" in said and "KiB" in said.split("take ")[1] and "not restored" in said
    assert "record the cell once without --apply, then --apply" in big["said"]
    assert big["started_where_left"]  # nothing was put back: the re-run starts from the trained weights


def test_apply_after_attach_says_the_start_was_not_kept(session):
    said = session["after_attach"]
    assert said.count("mpscope: --apply") == 1 and "recorded with `%mpscope attach`" in said, said
    assert "goes on from the current weights" in said
