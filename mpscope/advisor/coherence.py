"""Rules that keep a Recommendation consistent with its own findings.

The exported config, applied by itself, must address every error-level finding. Each finding code
has the remedies that remove its cause (:data:`REMEDIES`):

* ``bf16`` / ``fp32``: training in that dtype removes it (range problems: bf16 has fp32's exponent
  range);
* ``fp32_module``: the finding's module kept in float32 inside autocast;
* ``scaler``: a GradScaler (fp16 gradient underflow);
* ``fp32_params``: parameters (and so ``.grad`` and optimizer state) kept in float32 under autocast;
* ``loop``: a change to the training loop itself (the torch export's ``train_step()`` shows it);
* ``cause``: addressed when the finding it is a consequence of is.

:func:`make_coherent` enforces, after the dtype choice:

1. parameters are kept in float32 (``param_dtype``), never a GradScaler over float16 parameters
   (PyTorch refuses to unscale float16 gradients); when the run's parameters were 16-bit a reason
   says so;
2. an error finding whose remedies do not include the chosen dtype gets its module into
   ``fp32_modules`` when ``fp32_module`` is a remedy (a pole, a lost constant, an op-level overflow
   in an fp16 run);
3. fp16 always gets a GradScaler; other dtypes none;
4. no fix offers bfloat16 or a different loss scale when a pole or a lost constant that bfloat16
   also loses is the cause (the recorded data say bf16 fails the same way).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mpscope.advisor.context import Context
from mpscope.advisor.finding import Finding, is_ancestor
from mpscope.advisor.op_precision import lost_in
from mpscope.advisor.scaler import InitExponent
from mpscope.schema import GRAD_SCALER_DEFAULTS

_RANGE = frozenset({"bf16", "fp32", "fp32_module"})
#: finding code -> remedies that address it (see the module docstring).
REMEDIES: dict[str, frozenset] = {
    "first_nonfinite": frozenset({"cause", "bf16", "fp32", "fp32_module"}),
    "forward_overflow": _RANGE,
    "activation_headroom": _RANGE,
    "mask_overflow": _RANGE,
    "log_of_zero": _RANGE,
    "norm_statistics": _RANGE,
    "reduction_precision": frozenset({"fp32", "fp32_module"}),
    "grad_underflow": frozenset({"scaler", "bf16", "fp32", "fp32_module"}),
    "frozen_layer": frozenset({"scaler", "bf16", "fp32", "cause"}),
    "scale_collapse": frozenset({"cause"}),
    "init_scale_too_high": frozenset({"scaler"}),
    "periodic_probe": frozenset(),
    "pole": frozenset({"fp32", "fp32_module"}),
    "lost_constant": frozenset({"fp32", "fp32_module"}),
    "integer_precision": frozenset({"fp32", "fp32_module"}),
    "float_precision": frozenset({"fp32", "fp32_module"}),
    "optimizer_state_precision": frozenset({"fp32_params"}),
    "stagnant_low_precision_weights": frozenset({"fp32_params"}),
    "grad_norm_overflow": frozenset({"fp32_params"}),
    "clip_before_unscale": frozenset({"loop"}),
    "grads_changed_before_unscale": frozenset({"loop"}),
    "amp_misuse": frozenset({"loop"}),
    "stale_forward": frozenset({"loop"}),
    "stale_grad": frozenset({"loop"}),
    "accumulation_precision": frozenset({"fp32_params", "fp32_module"}),
    "precision_loss": frozenset({"fp32", "fp32_module"}),
    # precision forensics: the mechanisms (a module in float32 is the fix the engine replays)
    "overflow": frozenset({"fp32", "fp32_module"}),
    "underflow": frozenset({"fp32", "fp32_module"}),
    "swamping": frozenset({"fp32", "fp32_module"}),
    "cancellation": frozenset({"fp32", "fp32_module"}),
    "saturation": frozenset({"fp32", "fp32_module"}),
    "domain": frozenset({"fp32", "fp32_module"}),
    "resolution": frozenset({"fp32", "fp32_module"}),
    "decision_flip": frozenset({"fp32", "fp32_module"}),
    "loss_scale": frozenset({"loop"}),
}
#: The precision-forensics engine's finding codes (its mechanisms).
ENGINE_CODES = frozenset({"overflow", "underflow", "swamping", "cancellation", "saturation", "domain", "resolution",
                          "decision_flip", "loss_scale", "lost_constant"})
_DTYPE_REMEDY = {"bfloat16": "bf16", "float32": "fp32"}
_POLE_CODES = ("pole", "lost_constant")


def remedies(f: Finding) -> frozenset:
    """The remedies of one finding; a lost constant that bfloat16 holds is also fixed by bf16."""
    r = REMEDIES.get(f.code, _RANGE)
    if f.role == "optimizer_update":  # (the engine: 16-bit parameters or state that the optimizer step swamps)
        return frozenset({"fp32_params"})
    if f.code == "lost_constant" and f.value is not None and lost_in(float(f.value), "bfloat16") is None:
        r = r | {"bf16"}
    return r


def covered(module: str | None, fp32_modules: list[str]) -> bool:
    """True when ``module`` is kept in float32 by ``fp32_modules`` (itself or an ancestor)."""
    return module is not None and any(m == module or is_ancestor(m, module) for m in fp32_modules)


def addressed(f: Finding, dtype: str, fp32_modules: list[str], grad_scaler: dict | None,
              param_dtype: str = "float32") -> bool:
    """Whether a config (dtype, fp32_modules, grad_scaler, param_dtype) removes finding ``f``'s
    cause by itself ("cause" and "loop" count as addressed: by the cause's own remedy, and by the
    export's train_step())."""
    r = remedies(f)
    if r & {"loop", "cause"}:
        return True
    if _DTYPE_REMEDY.get(dtype) in r:
        return True
    if "fp32_module" in r and covered(f.module, fp32_modules):
        return True
    if "scaler" in r and dtype == "float16" and grad_scaler is not None:
        return True
    return "fp32_params" in r and param_dtype == "float32"


def _lowp_params(c: Context) -> str | None:
    pd_ = c.meta.get("param_dtypes") or {}
    total = sum(pd_.values()) or 0
    for d in ("float16", "bfloat16"):
        if total and pd_.get(d, 0) * 2 > total:
            return d
    return None


@dataclass(frozen=True)
class Coherent:
    """A recommendation's parts after :func:`make_coherent` (the fields of ``Recommendation``)."""

    dtype: str
    fp32_modules: list
    grad_scaler: dict | None
    param_dtype: str
    findings: list
    reasons: list


def make_coherent(c: Context, findings: list[Finding], dtype: str, fp32_modules: list[str],
                  grad_scaler: dict | None, init: InitExponent | None, reasons: list[str]) -> Coherent:
    """Apply the rules of the module docstring; returns the :class:`Coherent` parts (findings with
    their fix texts adjusted)."""
    fp32_modules = list(fp32_modules)
    reasons = list(reasons)
    param_dtype = "float32"
    low = _lowp_params(c)
    if low:
        reasons.append(f"the parameters were {low} (cast with .half()/.to()): keep them, their .grad and the "
                       f"optimizer state in float32 and let autocast compute in {dtype if dtype != 'float32' else low} "
                       f"(a GradScaler cannot unscale {low} gradients)")
    added = []
    # the engine explained a cause outside every submodule (the loop's own ops, the root's own tensors):
    # the root in float32 - no mixed precision at all - is no fix it proposes
    engine_root = any(g.code in ENGINE_CODES and g.module == "" for g in findings)
    for f in findings:
        if f.severity != "error" or f.module is None or (engine_root and f.module == ""):
            continue
        if addressed(f, dtype, fp32_modules, grad_scaler, param_dtype):
            continue
        if "fp32_module" in remedies(f) and dtype != "float32" and not (f.module == "" and f.code in ENGINE_CODES):
            fp32_modules.append(f.module)
            added.append(f)
    fp32_modules = [m for i, m in enumerate(fp32_modules)
                    if m not in fp32_modules[:i] and not any(is_ancestor(o, m) for o in fp32_modules)]
    if added:
        shown = ", ".join(sorted({repr(f.module) for f in added}))
        reasons.append(f"kept in float32 because {dtype} alone does not remove their error findings "
                       f"({', '.join(sorted({f.code for f in added}))}): {shown}")
    if dtype == "float16" and grad_scaler is None:
        k = init.k if init else None
        grad_scaler = dict(GRAD_SCALER_DEFAULTS, init_scale=math.ldexp(1.0, k) if k is not None else GRAD_SCALER_DEFAULTS["init_scale"])
    if dtype != "float16":
        grad_scaler = None
    poles = [f for f in findings
             if f.code in _POLE_CODES and "bf16" not in remedies(f) and "fp32_module" in remedies(f)]
    if poles:
        where = ", ".join(sorted({repr(f.module) for f in poles}))
        note = (f"Fix the pole first (see pole / lost_constant in {where}): it makes these values non-finite "
                "whatever the loss scale, and bfloat16 loses the same constant; keep that module in float32.")
        findings = [dataclasses.replace(f, fix=note) if f.code in ("scale_collapse", "first_nonfinite", "frozen_layer",
                                                                  "forward_overflow", "norm_statistics")
                    and f.severity != "info" else f for f in findings]
    return Coherent(dtype=dtype, fp32_modules=fp32_modules, grad_scaler=grad_scaler, param_dtype=param_dtype,
                    findings=findings, reasons=reasons)
