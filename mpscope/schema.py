"""mpscope's vocabulary: roles, severities, export formats, table columns, GradScaler defaults and the
two number formatters every text output uses.

Every other module imports these names from here instead of keeping its own copy. The enums are
:class:`enum.StrEnum`, so a member equals its string (``Role.ACTIVATION == "activation"``) and user
strings are parsed once at the boundary (``Role("activation")`` raises ``ValueError`` on a typo).
"""

from __future__ import annotations

import inspect
import math
import numbers
from enum import StrEnum

import torch


class Role(StrEnum):
    """What a recorded tensor is (the ``role`` column of ``Run.tensors``)."""

    ACTIVATION = "activation"  # a module's forward output
    ACTIVATION_GRAD = "activation_grad"  # gradient w.r.t. a module's output, as it flows in backward (scaled)
    PARAM_GRAD = "param_grad"  # param.grad when the step ends
    WEIGHT = "weight"  # a parameter's value
    OPTIMIZER_STATE = "optimizer_state"  # a tensor of optimizer.state (exp_avg, exp_avg_sq, ...)
    LOSS = "loss"  # the loss passed to GradScaler.scale / backward()
    OP_OUTPUT = "op_output"  # an ATen op's floating output (record(..., ops=True))
    PARAM_GRAD_LOCAL = "param_grad_local"  # one rank's own param.grad before the all-reduce (DDP)


#: Every role, as plain strings, in the order above.
ROLES: tuple[str, ...] = tuple(r.value for r in Role)
#: Roles recorded by default (``op_output`` needs ``ops=True``, ``param_grad_local`` a DDP model).
DEFAULT_ROLES: tuple[str, ...] = tuple(r.value for r in Role if r not in (Role.OP_OUTPUT, Role.PARAM_GRAD_LOCAL))
#: Gradient roles: recorded as seen, i.e. multiplied by the loss scale in effect.
GRAD_ROLES: tuple[str, ...] = (Role.ACTIVATION_GRAD.value, Role.PARAM_GRAD.value)
#: The float16/bfloat16 dtype names, as ``Run.tensors.dtype`` holds them.
LOW_PRECISION: tuple[str, ...] = ("float16", "bfloat16")
#: The 16-bit formats' short names (column prefixes ``fp16_`` / ``bf16_``, tags, legends).
SHORT_NAMES: dict[str, str] = {"float16": "fp16", "bfloat16": "bf16"}


class Severity(StrEnum):
    """How bad a finding is; members are in increasing order of severity."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def rank(self) -> int:
        """0 for info, 1 for warning, 2 for error."""
        return SEVERITIES.index(self.value)


#: Severity names, least severe first.
SEVERITIES: tuple[str, ...] = tuple(s.value for s in Severity)


class ExportFormat(StrEnum):
    """Targets of ``Recommendation.export``; :attr:`suffix` is the file suffix each one writes."""

    TORCH = "torch"
    ACCELERATE = "accelerate"
    HF = "hf"
    LIGHTNING = "lightning"
    DEEPSPEED = "deepspeed"
    JSON = "json"
    YAML = "yaml"

    @property
    def suffix(self) -> str:
        """``.py`` (torch, hf, lightning), ``.yaml`` (accelerate, yaml) or ``.json`` (deepspeed, json)."""
        return _SUFFIX[self]

    @classmethod
    def from_path(cls, path: str) -> "ExportFormat | None":
        """The format a file name asks for by its suffix: ``.py`` torch, ``.json`` json, ``.yaml`` /
        ``.yml`` yaml; None for any other suffix (the caller asks for an explicit format)."""
        name = str(path).replace("\\", "/").rsplit("/", 1)[-1]
        suffix = name.rsplit(".", 1)[-1].lower() if "." in name else ""
        return {"py": cls.TORCH, "json": cls.JSON, "yaml": cls.YAML, "yml": cls.YAML}.get(suffix)


_SUFFIX = {
    ExportFormat.TORCH: ".py", ExportFormat.ACCELERATE: ".yaml", ExportFormat.HF: ".py", ExportFormat.LIGHTNING: ".py",
    ExportFormat.DEEPSPEED: ".json", ExportFormat.JSON: ".json", ExportFormat.YAML: ".yaml",
}
#: Export format names, as plain strings.
EXPORT_FORMATS: tuple[str, ...] = tuple(f.value for f in ExportFormat)

# --------------------------------------------------------------------------- table columns
#: Names of the per-element counts in a stats row, in order.
COUNT_NAMES: tuple[str, ...] = (
    "zero",
    "subnormal",
    "fp16_underflow",
    "fp16_subnormal",
    "fp16_overflow",
    "bf16_underflow",
    "bf16_subnormal",
    "bf16_overflow",
    "nan",
    "inf",
)
#: Column order of ``Run.tensors``.
TENSOR_COLUMNS: list[str] = [
    "step", "module", "role", "name", "dtype", "numel", "min", "max", "absmax", "absmin_nonzero",
    "zero_frac", "subnormal_frac", "fp16_underflow_frac", "fp16_subnormal_frac", "fp16_overflow_frac",
    "bf16_underflow_frac", "bf16_subnormal_frac", "bf16_overflow_frac", "nan_count", "inf_count", "loss_scale",
]
#: Column order of ``Run.steps``.
STEP_COLUMNS: list[str] = [
    "step", "loss", "loss_scale", "found_inf", "skipped", "scale_after", "recorded", "backward_count",
    "clip_norm", "clipped_before_unscale", "opt_scaled", "autocast_at_step", "clip_norm_fp32", "clip_grad_absmax",
    "grad_reset",
]
#: ``Run.steps`` columns that saved runs may hold under another name, read under the current one:
#: saved name -> current name.
RENAMED_STEP_COLUMNS: dict[str, str] = {"clip_scaled": "clipped_before_unscale"}
#: Column order of ``Run.histograms``.
HIST_COLUMNS: list[str] = ["step", "module", "role", "name", "dtype", "exponent", "count"]
#: Columns of ``Run.precision`` (``record(..., shadow=True)``): one row per (step, module, role, name,
#: dtype) comparing a recorded output with its float32 reference (see :mod:`mpscope.recording.shadow`).
#: ``sqnr_db`` = 10·log10(Σ ref² / Σ (x − ref)²) in dB (+inf when exact), ``max_abs_err`` =
#: max |x − ref|, ``ref_absmax`` = max |ref|, ``max_rel_err`` = max_abs_err / ref_absmax; ``own_*``
#: the same for the module's own contribution (its output when fed the reference's inputs). Role
#: ``activation`` for module outputs; with ``record(..., ops=True)`` also ``op_output`` rows (own_* NaN).
PRECISION_COLUMNS: list[str] = ["step", "module", "role", "name", "dtype", "sqnr_db", "max_abs_err", "max_rel_err",
                                "ref_absmax", "own_sqnr_db", "own_max_abs_err", "own_max_rel_err"]

#: Columns of ``run.tables["grad_accumulation"]``: one row per recorded step and float16/bfloat16
#: parameter whose ``.grad`` received more than one increment (gradient accumulation). ``increments``:
#: non-zero elements added into an existing ``.grad`` (every backward after the first of the step);
#: ``swamped``: those whose add left the running sum unchanged (``(acc + g) == acc`` with ``g != 0``,
#: in the gradient's dtype, exactly as PyTorch accumulates); ``increment_abs`` / ``swamped_abs``: the
#: sums of their |g| (float64); ``rounded_abs``: the sum over every increment of |(acc + g) - acc - g|
#: (the part of the increments the 16-bit add rounded away, swamped ones included); ``micro_batches``:
#: backward passes that added into the existing ``.grad``.
GRAD_ACCUMULATION_COLUMNS = ["step", "module", "name", "dtype", "micro_batches", "increments", "swamped",
                             "increment_abs", "swamped_abs", "rounded_abs"]

#: Columns of ``run.tables["ops"]`` (the autocast audit): one row per step, phase ("forward" /
#: "backward", or "eval" for a forward of the model under no_grad / inference_mode), module, op overload, input dtypes (comma-joined, floating tensor inputs in argument
#: order), output dtype, autocast (autocast was enabled for the op's device when its module was
#: entered), inplace, out_variant, param_lowp (a float16/bfloat16 ``nn.Parameter`` fed the op while
#: autocast was on: a parameter cast by hand), reduction (policy name or ""), with ``calls``, ``numel``
#: (output elements, summed) and ``max_reduction_len``.
AUDIT_COLUMNS = ["step", "phase", "module", "op", "in_dtypes", "out_dtype", "autocast", "inplace",
                 "out_variant", "param_lowp", "reduction", "calls", "numel", "max_reduction_len"]
#: Columns of ``run.tables["op_facts"]``: ``seq`` is the output's position in execution order within
#: the step; counts are over the output (``out_*``) or all floating tensor inputs (``in_*``; a
#: non-finite Python scalar argument counts as one); ``in_absmax0/1`` are the largest |x| of the first
#: two floating tensor inputs (NaN when not measured); ``in_zero`` counts exact zeros of a log's
#: input; for casts to float16/bfloat16 ``int_valued`` (every finite input is an integer),
#: ``in_absmax``, ``changed`` (elements whose value the cast changed) and ``distinct_in`` /
#: ``distinct_out`` (distinct values, NaN above the size limit); ``scalar_lost`` / ``scalar_overflow``
#: are Python scalar arguments that round to 0 / to inf in the op's dtype, ``scalar_rounded`` one that
#: rounds onto +-1 without being it (``1 - 1e-6`` is 1.0 in float16 and bfloat16), ``scalar`` the first
#: Python number argument (e.g. the exponent of ``pow``); NaN if none. ``in_pole`` counts input elements
#: at a pole of the op (:data:`mpscope.recording.autocast_policy.POLES`); ``cast_err`` is the largest |change| a cast to float16/bfloat16
#: made; ``periodic_src`` (on a sin/cos row) is the ``seq`` of the low-precision cast of non-integer
#: data (not weights or activations) whose values reach this op's input, NaN if none.
#: ``acc_increments`` / ``acc_swamped`` (in-place ``add_`` / ``sub_`` / ``lerp_`` on a float16/bfloat16
#: tensor that does not require grad: a running sum, average or EMA) count the elements whose exact
#: update (float64) changes the running value, and those of them the 16-bit update left unchanged.
FACT_COLUMNS = ["step", "seq", "phase", "module", "name", "op", "out_dtype", "numel", "reduction",
                "reduction_len", "out_nan", "out_inf", "in_nan", "in_inf", "in_absmax0", "in_absmax1",
                "in_zero", "int_valued", "in_absmax", "changed", "distinct_in", "distinct_out",
                "in_pole", "cast_err", "scalar", "scalar_lost", "scalar_overflow", "scalar_rounded",
                "periodic_src", "acc_increments", "acc_swamped"]

# --------------------------------------------------------------------------- GradScaler defaults
_GS_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


def _grad_scaler_defaults() -> dict[str, float | int]:
    params = inspect.signature(torch.amp.GradScaler.__init__).parameters
    return {k: params[k].default for k in _GS_KEYS}


#: ``torch.amp.GradScaler``'s own defaults, read from its signature (init_scale 2^16,
#: growth_factor 2.0, backoff_factor 0.5, growth_interval 2000 in torch 2.x).
GRAD_SCALER_DEFAULTS: dict[str, float | int] = _grad_scaler_defaults()

#: The largest ``growth_interval`` a GradScaler reaches: it counts unskipped steps in an int32
#: tensor (``_growth_tracker``), so a larger interval never grows the scale.
MAX_GROWTH_INTERVAL = 2**31 - 1


def check_grad_scaler(settings: object, where: str = "grad_scaler") -> dict[str, float | int]:
    """GradScaler settings checked against what ``torch.amp.GradScaler`` can run.

    ``settings``: a dict with the keys ``init_scale``, ``growth_factor``, ``backoff_factor`` and
    ``growth_interval``. Rules, on the values rounded to float32 (the scale and the factors are
    float32 tensors inside GradScaler): ``init_scale`` finite and > 0; ``growth_factor`` > 1 and
    ``backoff_factor`` in (0, 1) (GradScaler asserts both bounds; a factor of 0 zeroes the
    scale); ``growth_interval`` a whole number in [1, :data:`MAX_GROWTH_INTERVAL`]. Booleans and
    text are refused.

    Returns:
        the four settings: three floats and an int ``growth_interval``.

    Raises:
        ValueError: naming ``where`` and the first setting that breaks a rule, with its value.
    """
    if not isinstance(settings, dict):
        raise ValueError(f"{where} must be a dict of {list(_GS_KEYS)} (or null); got {type(settings).__name__}")
    missing = [k for k in _GS_KEYS if k not in settings]
    if missing:
        raise ValueError(f"{where} needs the keys {list(_GS_KEYS)}; missing {missing}")
    out: dict[str, float | int] = {}
    for key, ok, rule in (("init_scale", lambda v: v > 0, "> 0 as a float32"),
                          ("growth_factor", lambda v: v > 1, "> 1 as a float32"),
                          ("backoff_factor", lambda v: 0 < v < 1, "in (0, 1) as a float32"),
                          ("growth_interval", lambda v: v == int(v) and 1 <= v <= MAX_GROWTH_INTERVAL,
                           f"a whole number in [1, {MAX_GROWTH_INTERVAL}]")):
        v = settings[key]
        # the scale and the factors act as float32 tensors inside GradScaler: 1e-50 is 0 there
        as32 = _float32(v) if key != "growth_interval" else _float32(v) and float(v)
        if as32 is None or not ok(as32):
            raise ValueError(f"{where}.{key} must be a finite number {rule}; got {str(v)[:40]}")
        out[key] = int(v) if key == "growth_interval" else float(v)
    return out


def _float32(v: object) -> float | None:
    """``v`` as a finite float32 value, or None (not a number, a bool, NaN, inf, or past float32's range)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    try:
        x = float(v)
    except OverflowError:  # an int past float64's range
        return None
    if not math.isfinite(x) or abs(x) > torch.finfo(torch.float32).max:
        return None
    return float(torch.tensor(x, dtype=torch.float32))


def check_module_names(names: object, where: str = "fp32_modules") -> list[str]:
    """``names`` as a list of qualified module names, as ``model.named_modules()`` gives them.

    A name is ``""`` (the root module) or dot-separated parts, each a non-empty string
    (``torch.nn.Module.add_module`` refuses an empty name and one holding a dot). Any other character
    is allowed, as PyTorch allows it; exports write names through their format's serializer.

    Raises:
        ValueError: ``names`` is not a list or tuple of such names; the message names ``where`` and
            the first bad entry.
    """
    if not isinstance(names, (list, tuple)):
        raise ValueError(f"{where} must be a list of module names (as model.named_modules() gives them); "
                         f"got {type(names).__name__} {str(names)[:60]!r}")
    for i, name in enumerate(names):
        if not isinstance(name, str) or (name and not all(name.split("."))):
            raise ValueError(f"{where}[{i}] = {name!r} is not a module name: a name is dot-separated non-empty "
                             "parts, as model.named_modules() gives them")
    return list(names)


# --------------------------------------------------------------------------- formatting
def module_label(name: object) -> str:
    """A module's name for people: ``(root)`` for the root module (name ``""`` or None), else the name."""
    return "(root)" if name in ("", None) else str(name)


def fmt_number(x: float | None) -> str:
    """A number for a message: ``n/a`` for None/NaN, ``inf``/``-inf``, 3 significant digits at or above
    1e5 or below 1e-3 in magnitude, else 4."""
    if x is None:
        return "n/a"
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:.4g}"


def fmt_scale(s: float | None, code: bool = False) -> str:
    """A loss scale: ``2^16`` for a power of two (``2**16`` with ``code=True``, for generated
    Python), else :func:`fmt_number` (``%g`` with ``code=True``); ``str(s)`` for a non-number."""
    try:
        s = float(s)
    except (TypeError, ValueError):
        return str(s)
    if s > 0 and math.isfinite(s):
        k = math.log2(s)
        if k.is_integer():
            return f"2**{int(k)}" if code else f"2^{int(k)}"
    return fmt_number(s) if not code else f"{s:g}"
