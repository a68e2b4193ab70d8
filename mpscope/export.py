"""Recommendation -> config files for torch, Accelerate, Lightning, DeepSpeed, JSON and YAML.

Key names follow each framework's documentation:

* torch: ``torch.autocast(device_type, dtype)`` and ``torch.amp.GradScaler(device, init_scale,
  growth_factor, backoff_factor, growth_interval)``; the snippet is a runnable Python module.
* Accelerate: config YAML ``mixed_precision: no | fp16 | bf16`` (a float16 recommendation for the
  CPU is written as bf16, with a comment and a warning: Accelerate runs fp16 on GPUs only, and on
  the CPU silently in fp32); the GradScaler settings go in code
  as ``accelerate.utils.GradScalerKwargs(init_scale, growth_factor, backoff_factor,
  growth_interval)`` (the config file has no key for them, and Accelerate rejects unknown keys),
  so they are written as a comment with that code.
* Hugging Face ``transformers.Trainer`` (``hf``): ``TrainingArguments(fp16=True | bf16=True,
  fp16_full_eval / bf16_full_eval=False)``; ``TrainingArguments`` has no field for the GradScaler
  settings (the Trainer builds Accelerate's GradScaler with PyTorch's defaults), so the snippet
  defines a ``Trainer`` subclass that replaces ``accelerator.scaler`` after the Trainer builds its
  Accelerator (the prepared optimizer and ``accelerator.backward`` use it from then on).
* Lightning: ``precision="16-mixed" | "bf16-mixed" | "32-true"``; a custom scaler goes through
  ``lightning.pytorch.plugins.precision.MixedPrecision(precision, device, scaler=...)``.
* DeepSpeed: ``fp16 = {enabled, loss_scale (0 = dynamic), initial_scale_power,
  loss_scale_window, hysteresis, min_loss_scale}`` or ``bf16 = {enabled}``, never both.
  ``hysteresis`` is 1 so that DeepSpeed backs off on every overflow like GradScaler (DeepSpeed's
  default 2 tolerates one overflow first); ``loss_scale_window`` = growth_interval.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pprint
import textwrap
import warnings
from pathlib import Path

import yaml

from mpscope.advisor.recommendation import Recommendation
from mpscope.run import as_path
from mpscope.schema import EXPORT_FORMATS, GRAD_SCALER_DEFAULTS, ExportFormat

#: Why an fp16 recommendation for the CPU is exported to Accelerate as bf16.
ACCELERATE_CPU_FP16 = (
    "The recommendation is float16 on the CPU, but Accelerate runs fp16 mixed precision only on GPUs and "
    "other accelerators: with use_cpu it silently trains in fp32 (Accelerator.native_amp stays False). "
    "mixed_precision: bf16 is written instead, which Accelerate runs natively on the CPU; on a GPU machine "
    "use mixed_precision: fp16 with the GradScaler settings of mpscope's torch export.")

#: The formats :func:`export` writes (:class:`mpscope.schema.ExportFormat`).
FORMATS = EXPORT_FORMATS
_ACCEL = {"float16": "fp16", "bfloat16": "bf16", "float32": "no"}
_LIGHTNING = {"float16": "16-mixed", "bfloat16": "bf16-mixed", "float32": "32-true"}


def _comment(lines: list[str], prefix: str = "# ") -> str:
    """``lines`` as comment lines of a Python or YAML file: each prefixed, characters that are not
    printable (line breaks of either format, NUL, ...) written as their Python escape, so that no
    text can end the comment."""
    return "\n".join(prefix + "".join(c if c.isprintable() else ascii(c)[1:-1] for c in line) for line in lines)


def _fp32_assignment(rec: "Recommendation") -> str:
    """``FP32_MODULES = [...]``, a Python literal (names written by ``repr``)."""
    return (f"FP32_MODULES = {pprint.pformat(list(rec.fp32_modules), width=88)}  "
            "# keep in fp32: mpscope's torch export, keep_in_fp32(model, FP32_MODULES)")


def _log2_int(x: float) -> int:
    k = math.log2(x)
    return int(round(k))


def to_torch(rec: "Recommendation") -> str:
    """A runnable Python module: autocast + GradScaler + fp32 modules + a train_step()."""
    dtype = None if rec.dtype == "float32" else f"torch.{rec.dtype}"
    gs = None if rec.grad_scaler is None else dict(rec.grad_scaler)
    header = _comment(rec.to_text().splitlines()[:8], "#   ")
    return f'''"""Mixed-precision setup recommended by mpscope.

Use it as a module (``from this_file import autocast, make_scaler, keep_in_fp32, train_step``) or copy
the pieces into your training script.
"""
# mpscope's summary:
{header}

import torch

DEVICE_TYPE = {rec.device_type!r}  # the device the advice is for; change to match your model's device
AMP_DTYPE = {dtype}  # None = plain fp32, no autocast
FP32_MODULES = {pprint.pformat(list(rec.fp32_modules), width=88)}
GRAD_SCALER = {pprint.pformat(gs, width=88, sort_dicts=False)}
PARAM_DTYPE = torch.{rec.param_dtype}  # parameters, their .grad and the optimizer state


def master_weights(model):
    """Parameters in PARAM_DTYPE (undo a .half()/.bfloat16() of the model); autocast computes in
    AMP_DTYPE over them. Call it before building the optimizer. Returns the model."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != PARAM_DTYPE:
            p.data = p.data.to(PARAM_DTYPE)
    return model


def autocast(device_type=None):
    """torch.autocast with the recommended dtype (disabled for fp32)."""
    return torch.autocast(device_type=device_type or DEVICE_TYPE, dtype=AMP_DTYPE or torch.float32,
                          enabled=AMP_DTYPE is not None)


def make_scaler(device_type=None):
    """torch.amp.GradScaler with the recommended settings (disabled when no scaling is needed)."""
    if GRAD_SCALER is None:
        return torch.amp.GradScaler(device_type or DEVICE_TYPE, enabled=False)
    return torch.amp.GradScaler(device_type or DEVICE_TYPE, **GRAD_SCALER)


def _to_fp32(x):
    if torch.is_tensor(x) and x.is_floating_point():
        return x.float()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_fp32(v) for v in x)
    if isinstance(x, dict):
        return {{k: _to_fp32(v) for k, v in x.items()}}
    return x


def keep_in_fp32(model, names=None):
    """Run the listed submodules in fp32: autocast off inside them, floating inputs cast to fp32.

    Their parameters must be fp32 (they are when the model is fp32 and autocast does the casting).
    Returns the model.
    """
    for name in FP32_MODULES if names is None else names:
        module = model.get_submodule(name)
        forward = module.forward

        def fp32_forward(*args, __forward=forward, **kwargs):
            with torch.autocast(device_type=DEVICE_TYPE, enabled=False):
                return __forward(*_to_fp32(args), **_to_fp32(kwargs))

        module.forward = fp32_forward
    return model


def _prediction_and_loss(output):
    """(prediction, loss or None) of a model's output: a tensor; a ``transformers`` ModelOutput or
    a dict (``logits``, ``loss``); or a tuple (its first element)."""
    if torch.is_tensor(output):
        return output, None
    if isinstance(output, dict):  # ModelOutput is a dict too
        return output.get("logits"), output.get("loss")
    if isinstance(output, (tuple, list)) and output:
        return output[0], None
    raise TypeError(f"cannot find the prediction in a model output of type {{type(output).__name__}}")


def train_step(model, optimizer, scaler, loss_fn, inputs, target=None, max_grad_norm=None):
    """One training step in the recommended precision; returns the (unscaled) loss.

    ``inputs``: a tensor (``model(inputs)``) or a dict of keyword arguments (``model(**inputs)``,
    e.g. a Hugging Face batch). The model may return a tensor, a ``transformers`` ModelOutput or
    dict (its ``logits`` go to ``loss_fn``), or a tuple (its first element). ``loss_fn=None`` uses
    the loss the model returns (a ModelOutput's ``loss``, computed when ``labels`` are passed).
    Gradients are unscaled before clipping (scaler.unscale_), as GradScaler requires.

    Raises:
        ValueError: ``loss_fn`` is None and the model returned no loss.
    """
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        output = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    prediction, model_loss = _prediction_and_loss(output)
    if loss_fn is None:
        if model_loss is None:
            raise ValueError("loss_fn is None and the model returned no loss: pass a loss_fn, or labels in inputs")
        loss = model_loss.float()
    else:
        loss = loss_fn(prediction.float(), target)
    scaler.scale(loss).backward()
    if max_grad_norm is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


if __name__ == "__main__":
    torch.manual_seed(0)
    model = keep_in_fp32(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)), names=[])
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = make_scaler("cpu")
    for _ in range(3):
        loss = train_step(model, opt, scaler, torch.nn.functional.mse_loss, torch.randn(16, 8), torch.randn(16, 1))
    print("ok", float(loss))
'''


def to_accelerate(rec: "Recommendation") -> str:
    """Accelerate config YAML (``accelerate launch --config_file``), GradScalerKwargs as code comment."""

    mixed = _ACCEL[rec.dtype]
    lines = ["# Accelerate config written by mpscope."]
    if mixed == "fp16" and rec.device_type == "cpu":
        warnings.warn(ACCELERATE_CPU_FP16, UserWarning, stacklevel=3)
        mixed = "bf16"
        lines += [f"# {line}" for line in textwrap.wrap(ACCELERATE_CPU_FP16, 96)]
    cfg = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO",
           "mixed_precision": mixed, "num_processes": 1, "use_cpu": rec.device_type == "cpu"}
    if rec.grad_scaler is not None and mixed == "fp16":
        g = rec.grad_scaler
        lines += [
            "# The GradScaler settings have no config-file key; pass them in code:",
            "#   from accelerate import Accelerator",
            "#   from accelerate.utils import GradScalerKwargs",
            f"#   accelerator = Accelerator(mixed_precision={_ACCEL[rec.dtype]!r}, kwargs_handlers=[GradScalerKwargs(",
            f"#       init_scale={g['init_scale']!r}, growth_factor={g['growth_factor']!r}, "
            f"backoff_factor={g['backoff_factor']!r}, growth_interval={g['growth_interval']!r})])",
        ]
    if rec.fp32_modules:
        lines.append("# Keep in fp32 (see mpscope's torch export, keep_in_fp32), as a JSON list: "
                     + json.dumps(rec.fp32_modules))
    return "\n".join(lines) + "\n" + yaml.safe_dump(cfg, sort_keys=False)


def to_hf(rec: "Recommendation") -> str:
    """A Python snippet: ``TrainingArguments`` keyword arguments and, for fp16 with recommended
    GradScaler settings, a ``Trainer`` subclass that uses them."""
    kwargs = {"float16": {"fp16": True, "fp16_full_eval": False},
              "bfloat16": {"bf16": True, "bf16_full_eval": False}}.get(rec.dtype, {"fp16": False, "bf16": False})
    gs = None if rec.grad_scaler is None or rec.dtype != "float16" else dict(rec.grad_scaler)
    body = [
        "# Hugging Face Trainer precision settings written by mpscope.",
        "# Evaluation runs under autocast like training (*_full_eval=False): a whole-model cast to 16 bits",
        "# would drop the fp32 modules and the fp32 master weights.",
        "import torch",
        "from transformers import Trainer, TrainingArguments",
        "",
        f"MIXED_PRECISION = {kwargs!r}  # TrainingArguments(..., **MIXED_PRECISION)",
        f"GRAD_SCALER = {pprint.pformat(gs, width=88, sort_dicts=False)}",
        "",
        "",
        "class MPScopeTrainer(Trainer):",
        '    """A Trainer whose fp16 GradScaler uses GRAD_SCALER (TrainingArguments has no field for it)."""',
        "",
        "    def create_accelerator_and_postprocess(self):",
        "        super().create_accelerator_and_postprocess()",
        "        if GRAD_SCALER is not None and self.accelerator.scaler is not None:",
        "            self.accelerator.scaler = torch.amp.GradScaler(self.accelerator.device.type, **GRAD_SCALER)",
    ]
    if rec.fp32_modules:
        body += ["", _fp32_assignment(rec)]
    return "\n".join(body) + "\n"


def to_lightning(rec: "Recommendation") -> str:
    """A Python snippet building a Lightning Trainer with the recommended precision (and scaler)."""
    prec = _LIGHTNING[rec.dtype]
    dev = "cuda" if rec.device_type == "cuda" else "cpu"
    body = ["# Lightning precision settings written by mpscope.", "import torch",
            "from lightning.pytorch import Trainer"]
    if rec.grad_scaler is not None:
        g = rec.grad_scaler
        body += [
            "from lightning.pytorch.plugins.precision import MixedPrecision",
            "",
            f"PRECISION = {prec!r}",
            f"scaler = torch.amp.GradScaler({dev!r}, init_scale={g['init_scale']!r}, growth_factor={g['growth_factor']!r}, "
            f"backoff_factor={g['backoff_factor']!r}, growth_interval={g['growth_interval']!r})",
            f"trainer = Trainer(accelerator={dev!r}, plugins=[MixedPrecision(PRECISION, {dev!r}, scaler=scaler)])",
        ]
    else:
        body += ["", f"PRECISION = {prec!r}", f"trainer = Trainer(accelerator={dev!r}, precision=PRECISION)"]
    if rec.fp32_modules:
        body += ["", _fp32_assignment(rec)]
    return "\n".join(body) + "\n"


def to_deepspeed(rec: "Recommendation") -> dict:
    """DeepSpeed config fragment: an ``fp16`` block, a ``bf16`` block, or neither (fp32)."""
    if rec.dtype == "float16":
        g = rec.grad_scaler or GRAD_SCALER_DEFAULTS
        return {"fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": max(0, _log2_int(g["init_scale"])),
            "loss_scale_window": int(g["growth_interval"]),
            "hysteresis": 1,
            "min_loss_scale": 1,
        }}
    if rec.dtype == "bfloat16":
        return {"bf16": {"enabled": True}}
    return {"fp16": {"enabled": False}, "bf16": {"enabled": False}}


def render(rec: "Recommendation", format: str = "torch") -> str:
    """The text :func:`export` would write.

    Raises:
        ValueError: unknown format, or a field of ``rec`` that breaks :class:`Recommendation`'s
            rules (checked again here: ``rec.dtype = ...`` after construction is not checked).
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}; got {format!r}")
    rec = dataclasses.replace(rec)  # checked again: a field may have been assigned since it was built
    if format == "torch":
        return to_torch(rec)
    if format == "accelerate":
        return to_accelerate(rec)
    if format == "hf":
        return to_hf(rec)
    if format == "lightning":
        return to_lightning(rec)
    if format == "deepspeed":
        return json.dumps(to_deepspeed(rec), indent=2) + "\n"
    if format == "json":
        return json.dumps(rec.to_dict(), indent=2) + "\n"
    return yaml.safe_dump(rec.to_dict(), sort_keys=False)


def format_for_path(path) -> str:
    """The export format a file name asks for by its suffix, any case: ``.py`` torch, ``.json``
    json, ``.yaml`` / ``.yml`` yaml (:meth:`mpscope.schema.ExportFormat.from_path`, the mapping the
    magic's ``--export`` uses too).

    Raises:
        ValueError: any other suffix, naming the suffixes and the formats an explicit ``format=`` takes.
    """
    fmt = ExportFormat.from_path(str(path))
    if fmt is None:
        raise ValueError(
            f"cannot tell the export format from the file name {str(path)!r}: use a .py (torch), .json (json) or "
            f".yaml / .yml (yaml) file, or pass format= one of {', '.join(FORMATS)}")
    return fmt.value


def export(rec: "Recommendation", path, format: str | None = None) -> Path:
    """Write ``rec`` to ``path`` in ``format`` and return the path written.

    Args:
        rec: a :class:`mpscope.Recommendation`.
        path: file to write; an existing directory gets ``mpscope_<format><suffix>`` inside it.
            Parent directories are created.
        format: one of ``torch`` (.py), ``accelerate`` (.yaml), ``hf`` (.py), ``lightning`` (.py), ``deepspeed``
            (.json), ``json``, ``yaml``; it wins over the suffix. None (the default): the file's
            suffix decides (:func:`format_for_path`: ``.py`` torch, ``.json`` json, ``.yaml`` /
            ``.yml`` yaml); for an existing directory, torch.

    Raises:
        ValueError: unknown format, or (``format`` None) a suffix that names none.
        TypeError: ``path`` is no str or os.PathLike.
    """
    p = as_path(path, "export the recommendation to", "file")
    if format is None:
        format = "torch" if p.is_dir() else format_for_path(p)
    text = render(rec, format)
    if p.is_dir():
        p = p / f"mpscope_{format}{ExportFormat(format).suffix}"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def load(path) -> "Recommendation":
    """Read a Recommendation written with format ``json`` or ``yaml``: :meth:`Recommendation.from_file`."""
    return Recommendation.from_file(path)
