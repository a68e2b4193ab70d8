"""Recommendation exports: JSON/YAML round-trip, the torch snippet runs, framework key names."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import runpy
import subprocess
import sys

import pytest
import torch
import yaml

import mpscope
from mpscope.export import FORMATS, load, render
from mpscope.schema import GRAD_SCALER_DEFAULTS

from cases import scenarios as S


@pytest.fixture(scope="module")
def recs():
    """Recommendations from real cases: fp16 + scaler (C08), bf16 (C01), fp16 + fp32 modules."""
    c08 = mpscope.advise(S.c08().run)
    c01 = mpscope.advise(S.c01().run)
    fp16_islands = mpscope.Recommendation(
        dtype="float16", grad_scaler=dict(c08.grad_scaler), fp32_modules=["blocks.0.down"], device_type="cpu",
        findings=c01.findings, reasons=["test"], evidence={"x": float("nan"), "y": [1, 2.5]})
    fp32 = mpscope.Recommendation(dtype="float32", device_type="cuda")
    return {"c08": c08, "c01": c01, "islands": fp16_islands, "fp32": fp32}


@pytest.mark.parametrize("fmt", ["json", "yaml"])
@pytest.mark.parametrize("key", ["c08", "c01", "islands", "fp32"])
def test_round_trip_is_equal(recs, tmp_path, fmt, key):
    rec = recs[key]
    path = rec.export(tmp_path / f"rec.{fmt}", format=fmt)
    back = load(path)
    assert back == rec
    assert back.findings == rec.findings and back.to_text() == rec.to_text()


def test_json_is_strict_enough_for_other_readers(recs, tmp_path):
    path = recs["c08"].export(tmp_path / "r.json", format="json")
    data = json.loads(path.read_text())
    assert data["dtype"] == "float16" and set(data["grad_scaler"]) == {
        "init_scale", "growth_factor", "backoff_factor", "growth_interval"}
    assert isinstance(data["grad_scaler"]["growth_interval"], int)


def test_torch_snippet_runs_as_a_script(recs, tmp_path):
    path = recs["c08"].export(tmp_path / "amp.py", format="torch")
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_torch_snippet_settings_and_fp32_wrapping(recs, tmp_path):
    rec = recs["islands"]
    ns = runpy.run_path(str(rec.export(tmp_path / "amp.py", format="torch")))
    scaler = ns["make_scaler"]("cpu")
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    assert scaler.get_scale() == rec.grad_scaler["init_scale"]
    assert scaler.get_growth_interval() == rec.grad_scaler["growth_interval"]
    model = S.C01Model()
    ns["keep_in_fp32"](model)
    seen = {}
    model.blocks[0].down.register_forward_hook(lambda m, i, o: seen.__setitem__("down", o.dtype))
    model.blocks[0].up.register_forward_hook(lambda m, i, o: seen.__setitem__("up", o.dtype))
    with ns["autocast"]("cpu"):
        model(torch.randint(0, 100, (2, 8)))
    assert seen == {"down": torch.float32, "up": torch.float16}


def test_torch_snippet_without_scaler_is_disabled(recs, tmp_path):
    ns = runpy.run_path(str(recs["c01"].export(tmp_path / "amp.py", format="torch")))
    assert not ns["make_scaler"]("cpu").is_enabled()
    assert ns["AMP_DTYPE"] is torch.bfloat16
    ns32 = runpy.run_path(str(recs["fp32"].export(tmp_path / "amp32.py", format="torch")))
    with ns32["autocast"]("cpu"):
        assert not torch.is_autocast_enabled("cpu")


def test_deepspeed_blocks(recs, tmp_path):
    fp16 = json.loads(recs["c08"].export(tmp_path / "ds.json", format="deepspeed").read_text())
    assert list(fp16) == ["fp16"]
    block = fp16["fp16"]
    assert set(block) == {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                          "min_loss_scale"}
    g = recs["c08"].grad_scaler
    assert block["enabled"] is True and block["loss_scale"] == 0  # 0 = dynamic scaling
    assert 2 ** block["initial_scale_power"] == g["init_scale"]
    assert block["loss_scale_window"] == g["growth_interval"] and block["hysteresis"] >= 1
    assert block["min_loss_scale"] > 0
    bf16 = json.loads(render(recs["c01"], "deepspeed"))
    assert bf16 == {"bf16": {"enabled": True}}
    off = json.loads(render(recs["fp32"], "deepspeed"))
    assert not any(v["enabled"] for v in off.values())


def test_accelerate_config_loads_in_accelerate(recs, tmp_path):
    gpu = dataclasses.replace(recs["c08"], device_type="cuda")
    text = render(gpu, "accelerate")
    assert yaml.safe_load(text)["mixed_precision"] == "fp16"
    assert yaml.safe_load(render(recs["c01"], "accelerate"))["mixed_precision"] == "bf16"
    assert yaml.safe_load(render(recs["fp32"], "accelerate"))["mixed_precision"] == "no"
    accelerate = pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import GradScalerKwargs

    path = gpu.export(tmp_path / "accelerate.yaml", format="accelerate")
    cfg = ClusterConfig.from_yaml_file(str(path))  # rejects unknown keys
    assert cfg.mixed_precision == "fp16"
    kw = GradScalerKwargs(**recs["c08"].grad_scaler)
    assert kw.to_kwargs() == {k: v for k, v in recs["c08"].grad_scaler.items()
                              if v != getattr(GradScalerKwargs(), k)}
    assert "GradScalerKwargs(" in text and repr(recs["c08"].grad_scaler["init_scale"]) in text


def test_accelerate_fp16_on_cpu_is_exported_as_bf16_and_says_so(recs, tmp_path):
    """Accelerate on a CPU-only machine trains an fp16 config silently in fp32: the export is
    checked against the device it is for. Oracle: Accelerate's own Accelerator on the CPU."""
    accelerate = pytest.importorskip("accelerate")
    cpu = recs["c08"]
    assert cpu.dtype == "float16" and cpu.device_type == "cpu"  # precondition
    from accelerate.state import AcceleratorState

    def native_amp(**kw):  # Accelerate keeps one process-wide state: reset it around each use
        AcceleratorState._reset_state(True)
        try:
            return accelerate.Accelerator(**kw).native_amp
        finally:
            AcceleratorState._reset_state(True)

    # the kind: Accelerate itself does not run fp16 AMP on the CPU
    assert not native_amp(cpu=True, mixed_precision="fp16")
    with pytest.warns(UserWarning, match="silently trains in fp32"):
        path = cpu.export(tmp_path / "accelerate.yaml", format="accelerate")
    text = path.read_text()
    cfg = yaml.safe_load(text)
    assert cfg["mixed_precision"] == "bf16" and cfg["use_cpu"] is True
    assert "# The recommendation is float16 on the CPU" in text
    # the exported config really trains in mixed precision on this device
    assert native_amp(cpu=cfg["use_cpu"], mixed_precision=cfg["mixed_precision"])


def test_torch_train_step_runs_a_transformers_model(recs, tmp_path):
    """The exported train_step with a Hugging Face model built from a config (random weights): the
    model returns a ModelOutput; its loss (labels passed) or its logits with a loss_fn are used."""
    transformers = pytest.importorskip("transformers")
    ns = runpy.run_path(str(recs["c08"].export(tmp_path / "amp.py", format="torch")))
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ns["make_scaler"]("cpu")
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    before = model.lm_head.weight.detach().clone()
    loss = ns["train_step"](model, opt, scaler, None, {"input_ids": ids, "labels": ids}, max_grad_norm=1.0)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    # the step ran (weights moved) unless GradScaler skipped it (then it backed off)
    assert not torch.equal(before, model.lm_head.weight) or scaler.get_scale() < recs["c08"].grad_scaler["init_scale"]

    def lm_loss(logits, target):
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), target[:, 1:].reshape(-1))

    loss2 = ns["train_step"](model, opt, scaler, lm_loss, ids, ids)
    assert torch.isfinite(loss2)
    with pytest.raises(ValueError, match="returned no loss"):
        ns["train_step"](model, opt, scaler, None, ids)


def test_lightning_snippet(recs):
    fp16 = render(recs["c08"], "lightning")
    compile(fp16, "lightning.py", "exec")
    assert "'16-mixed'" in fp16 and "MixedPrecision(" in fp16 and "GradScaler(" in fp16
    bf16 = render(recs["c01"], "lightning")
    compile(bf16, "lightning.py", "exec")
    assert "precision=PRECISION" in bf16 and "'bf16-mixed'" in bf16
    assert "'32-true'" in render(recs["fp32"], "lightning")


def test_export_paths_and_errors(recs, tmp_path):
    p = recs["c08"].export(tmp_path, format="deepspeed")
    assert p.name == "mpscope_deepspeed.json" and p.exists()
    p = recs["c08"].export(tmp_path / "new" / "dir" / "x.yaml", format="yaml")
    assert p.exists()
    with pytest.raises(ValueError, match="format must be one of"):
        recs["c08"].export(tmp_path / "x", format="toml")
    assert set(FORMATS) == {"torch", "accelerate", "hf", "lightning", "deepspeed", "json", "yaml"}
    with pytest.raises(ValueError, match="dtype"):
        mpscope.Recommendation.from_dict({"grad_scaler": None})


@pytest.mark.parametrize("name, fmt", [("amp_config.py", "torch"), ("rec.json", "json"), ("rec.yaml", "yaml"),
                                       ("rec.yml", "yaml"), ("REC.JSON", "json"), ("a.b/rec.Yaml", "yaml")])
@pytest.mark.parametrize("key", ["c08", "c01"])
def test_the_suffix_decides_the_format(recs, tmp_path, name, fmt, key):
    rec = recs[key]
    path = rec.export(tmp_path / name)
    assert path == tmp_path / name
    text = path.read_text()
    assert text == render(rec, fmt)
    if fmt == "torch":
        compile(text, name, "exec")
        assert "GradScaler" in text or rec.grad_scaler is None
    else:
        data = json.loads(text) if fmt == "json" else yaml.safe_load(text)
        assert data["dtype"] == rec.dtype and load(path) == rec
    if fmt == "yaml":
        assert not text.lstrip().startswith("{")  # YAML's block style, not JSON


def test_an_explicit_format_wins_over_the_suffix(recs, tmp_path):
    ds = json.loads(recs["c08"].export(tmp_path / "ds_config.json", format="deepspeed").read_text())
    assert ds["fp16"]["enabled"] is True and "dtype" not in ds
    acc = yaml.safe_load(recs["c01"].export(tmp_path / "accelerate.yml", format="accelerate").read_text())
    assert acc["mixed_precision"] == "bf16"
    py = recs["c08"].export(tmp_path / "snippet.txt", format="torch").read_text()
    assert py == render(recs["c08"], "torch")


@pytest.mark.parametrize("name", ["amp_config", "amp.toml", "amp.txt", "amp.py.bak"])
def test_an_unknown_suffix_without_format_is_a_clear_error(recs, tmp_path, name):
    with pytest.raises(ValueError) as e:
        recs["c08"].export(tmp_path / name)
    msg = str(e.value)
    assert name in msg and ".py" in msg and ".json" in msg and ".yaml" in msg
    assert all(f in msg for f in FORMATS)  # the explicit formats too
    assert not (tmp_path / name).exists()


def test_a_directory_without_format_gets_the_torch_file(recs, tmp_path):
    p = recs["c08"].export(tmp_path)
    assert p == tmp_path / "mpscope_torch.py" and p.read_text() == render(recs["c08"], "torch")


def test_text_and_html(recs):
    rec = recs["c08"]
    text = rec.to_text()
    assert "float16" in text and "recommended" in text and "pytorch default" in text
    assert str(rec.predictions["pytorch_default"]["skipped"]) in text
    evil = mpscope.Recommendation(dtype="bfloat16", fp32_modules=["<b>x</b>"], findings=[mpscope.Finding(
        "first_nonfinite", "error", "<script>alert(1)</script>", "activation", "output", 0, 1.0, 0.0,
        "msg <i>", "fix & go")])
    html = evil._repr_html_()
    assert "<script>" not in html and "&lt;script&gt;" in html and "&amp; go" in html
    assert "<b>x</b>" not in html
    assert math.isinf(mpscope.Recommendation.from_dict(json.loads(json.dumps(
        recs["c01"].to_dict()))).findings[1].value)


def test_hf_trainer_form(recs, tmp_path):
    """The hf form: TrainingArguments keywords, and a Trainer subclass whose GradScaler has the
    recommended settings (checked on a real Trainer, with Accelerate's GPU fp16 path enabled on
    the CPU as the subclass would find it on a GPU)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ns = {}
    exec(compile(render(recs["c08"], "hf"), "hf.py", "exec"), ns)
    assert ns["MIXED_PRECISION"] == {"fp16": True, "fp16_full_eval": False}
    assert ns["GRAD_SCALER"] == recs["c08"].grad_scaler
    bf16 = {}
    exec(compile(render(recs["c01"], "hf"), "hf.py", "exec"), bf16)
    assert bf16["MIXED_PRECISION"] == {"bf16": True, "bf16_full_eval": False} and bf16["GRAD_SCALER"] is None
    assert "Keep in fp32" not in render(recs["fp32"], "hf") and "'fp16': False" in render(recs["fp32"], "hf")
    assert "blocks.0.down" in render(recs["islands"], "hf")

    class GPUPathOnCPU(transformers.Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            self.accelerator.native_amp, self.accelerator.scaler = True, torch.amp.GradScaler("cpu")

    ns["MPScopeTrainer"].__bases__ = (GPUPathOnCPU,)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64}] * 2
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[],
                                          save_strategy="no", disable_tqdm=True, per_device_train_batch_size=2,
                                          **ns["MIXED_PRECISION"])
    trainer = ns["MPScopeTrainer"](model=model, args=args, train_dataset=data)
    trainer.train()
    s, g = trainer.accelerator.scaler, recs["c08"].grad_scaler
    assert trainer.optimizer.scaler is s  # the prepared optimizer steps through it
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (
        g["growth_factor"], g["backoff_factor"], g["growth_interval"])


#: Module names PyTorch accepts (``add_module`` refuses only "" and dots) that break formats written
#: by string formatting: line breaks of Python and YAML, quotes, YAML's ": " and "#", backslashes, NUL.
HOSTILE = ["enc\nmain_process_ip: 10.0.0.1", "a'b\"c", "key: value", "x # y", "back\\slash",
           "cr\rline\u2028sep\x85", "nul\x00", "blocks.0.\n- dynamo_config: {}"]


@pytest.fixture(scope="module")
def hostile():
    model = torch.nn.Module()
    for name in HOSTILE:
        parent = model
        for part in name.split(".")[:-1]:
            parent.add_module(part, parent._modules.get(part) or torch.nn.Module())
            parent = parent._modules[part]
        parent.add_module(name.split(".")[-1], torch.nn.Linear(2, 2))
    assert set(HOSTILE) <= set(dict(model.named_modules()))  # PyTorch takes every one of them
    finding = mpscope.advisor.Finding("forward_overflow", "error", HOSTILE[0], "activation", "output\n# x: 1", 0,
                                      7e4, 65504.0, f"{HOSTILE[0]} overflows\nmixed_precision: no", "keep it\r\nin fp32")
    return mpscope.Recommendation(dtype="float16", grad_scaler=dict(GRAD_SCALER_DEFAULTS), fp32_modules=HOSTILE,
                                  device_type="cuda", findings=[finding], reasons=["because\nuse_cpu: true"])


def assigned_names(text):
    return {t.id for node in ast.parse(text).body if isinstance(node, ast.Assign) for t in node.targets}


def literal(text, name):
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.Assign) and n.targets[0].id == name)
    return ast.literal_eval(node.value)


@pytest.mark.parametrize("fmt", ["torch", "hf", "lightning"])
def test_python_exports_carry_hostile_names_as_data_only(hostile, recs, fmt):
    text = render(hostile, fmt)
    assert assigned_names(text) == assigned_names(render(recs["islands"], fmt)) | {"FP32_MODULES"}
    assert literal(text, "FP32_MODULES") == HOSTILE
    compile(text, "export.py", "exec")


def test_accelerate_export_carries_hostile_names_as_a_comment_only(hostile, recs):
    text = render(hostile, "accelerate")
    benign = dataclasses.replace(recs["islands"], device_type="cuda")
    assert set(yaml.safe_load(text)) == set(yaml.safe_load(render(benign, "accelerate")))
    line = next(x for x in text.splitlines() if x.startswith("# Keep in fp32"))
    assert json.loads(line.split("as a JSON list: ", 1)[1]) == HOSTILE


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_data_exports_of_hostile_names_round_trip(hostile, tmp_path, fmt):
    back = load(hostile.export(tmp_path / f"rec.{fmt}", format=fmt))
    assert back == hostile and back.fp32_modules == HOSTILE


def test_deepspeed_export_holds_only_its_block(hostile):
    assert set(json.loads(render(hostile, "deepspeed"))) == {"fp16"}
