"""The notebooks in notebooks/ execute top to bottom on the CPU (nbclient, kernel ``python3``), and a
cell appended by the test checks what they claim against PyTorch's own behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

CHECKS = {
    "quickstart.ipynb": """
import json, torch
run = _mpscope
assert len(run.steps) == 12 and run.steps.recorded.all()
assert run.meta["autocast_dtype"] == "float16" and run.meta["scaler"]["init_scale"] == 2.0**16
# the loop's own scaler agrees with the recorded scale after the last update
assert scaler.get_scale() == run.steps.scale_after.iloc[-1]
cfg = json.load(open("mpscope-out/mpscope_config.json"))  # outputs go to the ignored folder
assert cfg["dtype"] in ("float16", "bfloat16", "float32") and "findings" in cfg
assert open("mpscope-out/report.html", encoding="utf-8").read().startswith("<!DOCTYPE html>")
""",
    "case_study_fp16_overflow.ipynb": """
import torch
s = failing.steps
# GradScaler's own behaviour: inf grads every step -> every step skipped, scale halved (backoff 0.5)
assert s.found_inf.all() and s.skipped.all(), s
assert list(s.loss_scale) == [2.0**16 * 0.5**i for i in range(len(s))]
assert first_bad == "blocks.0.down"
fo = [f for f in advice.findings if f.code == "forward_overflow"]
assert fo and fo[0].module == first_bad and fo[0].role == "activation"
assert advice.dtype == "bfloat16"
# the oracle for the fix: the same forward in bf16 is finite, and it exceeds fp16's max
m, _, g = setup()
x, _ = data.batch(8, g)
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    out = m(x)
assert torch.isfinite(out).all()
assert fixed.tensors[fixed.tensors.role == "activation"].absmax.max() > torch.finfo(torch.float16).max
f = fixed.steps
assert not f.skipped.any() and f.loss.notna().all() and f.loss.iloc[-1] < f.loss.iloc[0]
""",
    "hf_trainer.ipynb": """
import math
s = run.steps
# one row per optimizer step of the Trainer, two micro-batches each
assert len(s) == trainer.state.global_step == 24 and (s.backward_count == 2).all()
assert s.recorded.tolist() == [i % 2 == 0 for i in range(24)]
assert run.meta["autocast_dtype"] == "bfloat16" and run.meta["scaler"] is None
# the Trainer logs the mean loss over its last 6 steps: the recorded losses agree
logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
assert all(math.isclose(x, float(s.loss[i:i + 6].mean()), rel_tol=1e-5) for x, i in zip(logged, range(0, 24, 6)))
assert logged[-1] < logged[0]
# the Run on disk
assert len(mpscope.Run.load("runs/hf_trainer").steps) == 24
assert "mixed_precision: " + {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}[advice.dtype] in open("mpscope_accelerate.yaml").read()
""",
}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_notebook_executes(name, tmp_path, monkeypatch):
    # one BLAS/OpenMP thread: small CPU models on a shared 2-core box are much slower with two
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        f"{name} is committed with outputs; clear them (Kernel > Restart and Clear Outputs) before committing"
    nb.cells.append(nbformat.v4.new_code_cell(CHECKS[name]))
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=120,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError with the failing cell and its traceback
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # the layer explorer was displayed as a widget
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
