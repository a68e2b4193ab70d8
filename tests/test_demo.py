"""``mpscope demo``: the embedded GPT, its stdlib-text data, ``run_demo`` and the real CLI."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

import mpscope
from mpscope.demo import GPT, GPTConfig, CharDataset, load_text, run_demo
from mpscope.demo.data import STDLIB_FILES, stdlib_dir

ROLES = {"activation", "activation_grad", "param_grad", "weight", "optimizer_state", "loss"}


@pytest.fixture(scope="module")
def data():
    return CharDataset.from_stdlib(32)


# ----------------------------------------------------------------------------- data


def test_corpus_is_the_stdlib_source(data):
    textwrap_src = (stdlib_dir() / "textwrap.py").read_text(encoding="utf-8")
    assert textwrap_src in data.text
    assert data.vocab == sorted(set(data.text))
    assert data.decode(data.data[:200]) == data.text[:200]


def test_batches_are_windows_of_the_text_and_deterministic(data):
    x, y = data.batch(8, data.generator(3))
    x2, y2 = data.batch(8, data.generator(3))
    assert x.shape == y.shape == (8, 32) and x.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, data.batch(8, data.generator(4))[0])
    for row_x, row_y in zip(x, y):
        window = data.decode(row_x) + data.decode(row_y[-1:])
        assert window in data.text  # a contiguous slice of the corpus
        assert torch.equal(row_x[1:], row_y[:-1])  # targets are the next characters


def test_missing_stdlib_sources_raise_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_text(root=tmp_path)
    assert str(tmp_path) in str(err.value) and "textwrap.py" in str(err.value)
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "decoder.py").write_text("x = 1\n")
    assert load_text(STDLIB_FILES, root=tmp_path) == "x = 1\n"


# ----------------------------------------------------------------------------- model


def test_gpt_is_causal_and_starts_near_uniform(data):
    torch.manual_seed(0)
    model = GPT(GPTConfig(data.vocab_size, d_model=32, n_layer=2, n_head=4, seq_len=32)).eval()
    x, y = data.batch(2, data.generator(0))
    logits, loss = model(x, y)
    assert logits.shape == (2, 32, data.vocab_size)
    # GPT-2 init (std 0.02): near-uniform predictions, loss close to ln(vocab)
    assert abs(loss.item() - math.log(data.vocab_size)) < 0.1
    changed = x.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % data.vocab_size
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[:, :20], b[:, :20])  # the future does not leak into the past
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_gpt_config_and_input_errors(data):
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(100, d_model=30, n_head=4)
    with pytest.raises(ValueError, match="vocab_size"):
        GPTConfig(0)
    model = GPT(GPTConfig(data.vocab_size, d_model=16, n_layer=1, n_head=2, seq_len=8))
    with pytest.raises(ValueError, match="seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.int64))


# ----------------------------------------------------------------------------- run_demo


def test_run_demo_float16_records_every_role_and_writes_outputs(tmp_path, capsys):
    run = run_demo(steps=5, out=tmp_path, device="cpu", seed=1, batch_size=4)
    printed = capsys.readouterr().out
    loaded = mpscope.Run.load(tmp_path / "run")
    assert len(loaded.steps) == 5 and list(loaded.steps.step) == [0, 1, 2, 3, 4]
    assert set(loaded.tensors.role.unique()) >= ROLES
    assert len(loaded.tensors) == len(run.tensors)
    assert loaded.meta["autocast_dtype"] == "float16"
    # GradScaler at its defaults (torch.amp.GradScaler's own attributes are the oracle)
    ref = torch.amp.GradScaler("cpu")
    assert loaded.steps.loss_scale.iloc[0] == ref.get_scale()
    assert loaded.meta["scaler"]["init_scale"] == ref.get_scale()
    # a Linear under CPU autocast(float16) outputs what torch.autocast makes of it
    with torch.autocast("cpu", dtype=torch.float16):
        linear_dtype = torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype
    q = loaded.tensors[(loaded.tensors.module == "blocks.0.attn.q") & (loaded.tensors.role == "activation")]
    assert len(q) == 5 and set(q.dtype.astype(str)) == {str(linear_dtype).removeprefix("torch.")}
    # the first loss is the untrained model's: close to ln(vocab)
    vocab = len(set(load_text()))
    assert abs(loaded.steps.loss.iloc[0] - math.log(vocab)) < 0.1
    # recommended config written, and what was printed says where
    compile((tmp_path / "recommended_torch.py").read_text(), "recommended_torch.py", "exec")
    rec = json.loads((tmp_path / "recommendation.json").read_text())
    assert rec["dtype"] in ("float16", "bfloat16", "float32")
    assert str(tmp_path / "run") in printed and "recommend" in printed.lower()


def test_run_demo_bfloat16_without_scaler_records_every_other_step(tmp_path):
    run = run_demo(steps=4, dtype="bfloat16", out=tmp_path, device="cpu", every=2, quiet=True,
                   batch_size=4)
    assert run.meta["autocast_dtype"] == "bfloat16"
    assert run.meta["scaler"] is None
    assert not run.steps.skipped.any() and (run.steps.loss_scale == 1.0).all()
    assert list(run.steps.recorded) == [True, False, True, False]
    assert sorted(run.tensors.step.unique()) == [0, 2]
    assert mpscope.Run.load(tmp_path / "run").steps.recorded.tolist() == [True, False, True, False]


def test_run_demo_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="bfloat16"):
        run_demo(steps=1, dtype="fp8", out=tmp_path)
    with pytest.raises(ValueError, match="steps"):
        run_demo(steps=0, out=tmp_path)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            run_demo(steps=1, device="cuda", out=tmp_path)


def test_cli_demo_subprocess(tmp_path):
    if importlib.util.find_spec("mpscope.cli") is None:
        pytest.skip("mpscope.cli (the lead's CLI) does not exist yet")
    exe = shutil.which("mpscope")
    cmd = [exe] if exe else [sys.executable, "-c", "import sys; from mpscope.cli import main; sys.exit(main())"]
    out = tmp_path / "demo"
    proc = subprocess.run(
        cmd + ["demo", "--steps", "5", "--out", str(out), "--device", "cpu"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = mpscope.Run.load(out / "run")
    assert len(run.steps) == 5 and set(run.tensors.role.unique()) >= ROLES
    assert "recommend" in proc.stdout.lower()
