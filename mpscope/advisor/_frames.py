"""Small read-only views of a Run's frames that the advisor's parts share.

Nothing here writes to the Run. Categorical columns are turned into plain strings so that
comparisons (``role == "activation"``) behave the same for recorded and loaded runs.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from mpscope.run import check_run as _check_run
from mpscope.run import str_values
from mpscope.schema import LOW_PRECISION

_TENSOR_COLUMNS = ("step", "module", "role", "name", "dtype", "numel", "absmax", "nan_count", "inf_count")
_STEP_COLUMNS = ("step", "loss", "loss_scale", "found_inf", "skipped")
_HIST_COLUMNS = ("step", "module", "role", "name", "exponent", "count")


def _require(frame: pd.DataFrame, columns: tuple[str, ...], what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing and len(frame):
        raise ValueError(f"run.{what} lacks columns {missing}; was this Run written by mpscope?")


def tensors(run: Any) -> pd.DataFrame:
    """``run.tensors`` with string module/role/name/dtype and a ``_order`` column (recording order)."""
    _check_run(run)
    t = run.tensors
    _require(t, _TENSOR_COLUMNS, "tensors")
    t = t.copy()
    for c in ("module", "role", "name", "dtype"):
        if c in t.columns:
            t[c] = str_values(t[c])
    t["_order"] = np.arange(len(t))
    # min/max/absmax are over finite elements: NaN when there is none (some recordings carry the
    # reduction's sentinel, +-3.4e38 or inf, instead).
    none_finite = (t.nan_count + t.inf_count) >= t.numel
    for c in ("min", "max", "absmax", "absmin_nonzero"):
        if c in t.columns:
            v = t[c].astype(float)
            t[c] = v.where(~none_finite & np.isfinite(v))
    if "loss_scale" not in t.columns:
        t["loss_scale"] = 1.0
    return t


def steps(run: Any) -> pd.DataFrame:
    """``run.steps`` sorted by step, with bool found_inf/skipped and a float loss_scale."""
    _check_run(run)
    s = run.steps
    _require(s, _STEP_COLUMNS, "steps")
    s = s.sort_values("step").reset_index(drop=True).copy()
    if len(s):
        s["found_inf"] = s["found_inf"].fillna(False).astype(bool)
        s["skipped"] = s["skipped"].fillna(False).astype(bool)
        s["loss_scale"] = s["loss_scale"].astype(float).fillna(1.0)
    return s


def histograms(run: Any) -> pd.DataFrame:
    _check_run(run)
    h = run.histograms
    _require(h, _HIST_COLUMNS, "histograms")
    h = h.copy()
    for c in ("module", "role", "name"):
        if c in h.columns:
            h[c] = str_values(h[c])
    return h


def meta(run: Any) -> dict:
    _check_run(run)
    return dict(run.meta or {})


def autocast_dtype(run: Any) -> str | None:
    """The low-precision dtype the run computed in: meta autocast dtype, else the parameters' dtype."""
    m = meta(run)
    if m.get("autocast_dtype"):
        return str(m["autocast_dtype"])
    pd_ = m.get("param_dtypes") or {}
    for d in LOW_PRECISION:
        if pd_.get(d):
            return d
    t = tensors(run)
    w = t[t.role == "weight"]
    for d in LOW_PRECISION:
        if (w.dtype == d).any():
            return d
    return None


def device_type(run: Any) -> str:
    """"cuda" or "cpu" (the device the advice is for): meta autocast_device_type, else device."""
    m = meta(run)
    dev = m.get("autocast_device_type") or m.get("device") or "cpu"
    return "cuda" if str(dev).startswith("cuda") else "cpu"


# Module classes whose outputs are normalisation statistics. Used when meta has no module types.
_NORM_NAME = re.compile(r"(^|[._])(norm|ln|bn|layernorm|rmsnorm|batchnorm|groupnorm)[_\d]*($|[.])", re.I)
_NORM_CLASS = re.compile(r"norm", re.I)


def module_types(run: Any) -> dict[str, str]:
    """Qualified module name -> class name, when the recorder stored it in meta (else {})."""
    m = meta(run)
    mt = m.get("module_types") or m.get("modules") or {}
    return {str(k): str(v) for k, v in mt.items()} if isinstance(mt, dict) else {}


def is_norm_module(run: Any, module: str, types: dict[str, str] | None = None) -> bool:
    """True when the module is a normalisation layer: by class name (meta), else by its name."""
    types = module_types(run) if types is None else types
    if module in types:
        return bool(_NORM_CLASS.search(types[module]))
    return bool(_NORM_NAME.search(module))


def finite_or_none(x: Any) -> float | None:
    """A float for findings/evidence: None for missing or NaN (so that equality round-trips)."""
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if np.isnan(v) else v
