"""A finding (one diagnosis with its evidence) and the helpers every detector uses to make one."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from mpscope.advisor._frames import finite_or_none
from mpscope.schema import SEVERITIES

if TYPE_CHECKING:  # pragma: no cover
    from mpscope.advisor.context import Context

#: The severity of each finding code.
SEVERITY = {
    "first_nonfinite": "error",
    "forward_overflow": "error",
    "activation_headroom": "warning",
    "grad_underflow": "warning",
    "frozen_layer": "warning",
    "scale_collapse": "error",
    "init_scale_too_high": "warning",
    "periodic_probe": "info",
    "stale_grad": "error",
    "clip_before_unscale": "error",
    "grads_changed_before_unscale": "warning",
    "optimizer_state_precision": "error",
    "stagnant_low_precision_weights": "warning",
    "norm_statistics": "warning",
    "missing_evidence": "warning",
    "scaler_desync": "error",
    # op level (mpscope.advisor.op_findings)
    "reduction_precision": "warning",
    "mask_overflow": "error",
    "integer_precision": "warning",
    "log_of_zero": "error",
    # training-loop findings (mpscope.advisor.loop_findings)
    "grad_norm_overflow": "error",
    "amp_misuse": "error",
    "stale_forward": "error",
    # op level, precision and poles (mpscope.advisor.op_precision)
    "float_precision": "warning",
    "lost_constant": "error",
    "pole": "error",
    "accumulation_precision": "warning",
    # fp32 shadow (mpscope.advisor.precision)
    "precision_loss": "warning",
    # precision forensics (mpscope.advisor.forensic_findings): the mechanisms
    "overflow": "error",
    "underflow": "warning",
    "swamping": "error",
    "cancellation": "error",
    "saturation": "error",
    "domain": "error",
    "resolution": "error",
    "decision_flip": "warning",
    "loss_scale": "error",
}


@dataclass
class Finding:
    """One diagnosis, with the evidence that triggered it.

    Attributes:
        code: a finding code, a key of :data:`SEVERITY` (e.g. ``"forward_overflow"``); docs/advisor.md lists them.
        severity: ``"info" | "warning" | "error"``.
        module: qualified module name (``""`` = root), or None for run-level findings.
        role: the tensor role (``activation``, ``activation_grad``, ...), or None.
        name: tensor name within the module (``output``, ``weight``, ...), or None.
        step: first step it was seen (0-based), or None.
        value: the number that triggered it (units in ``message``), or None.
        threshold: the limit it was compared with, or None.
        message: what happened, in plain words.
        fix: what to change.
        rank: in a multi-rank run, the rank whose data the finding rests on (the lowest rank that
            saw a non-finite value, for ``first_nonfinite`` and ``stale_grad``), else None.
    """

    code: str
    severity: str
    module: str | None
    role: str | None
    name: str | None
    step: int | None
    value: float | None
    threshold: float | None
    message: str
    fix: str
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}; got {self.severity!r}")
        self.value = finite_or_none(self.value) if not _is_inf(self.value) else float(self.value)
        self.threshold = finite_or_none(self.threshold) if not _is_inf(self.threshold) else float(self.threshold)
        self.step = None if self.step is None else int(self.step)
        self.rank = None if self.rank is None else int(self.rank)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Finding":
        """Inverse of :meth:`to_dict` (``rank`` may be absent).

        Raises:
            ValueError: ``d`` is no dict, lacks a key, or a field has the wrong type (text fields
                hold strings, ``step`` and ``rank`` whole numbers, ``value`` and ``threshold`` numbers).
        """
        if not isinstance(d, dict):
            raise ValueError(f"a finding must be a dict (as Finding.to_dict() writes); got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        missing = names - set(d) - {"rank"}  # written before findings carried the rank
        if missing:
            raise ValueError(f"a Finding dict needs the keys {sorted(names)}; missing {sorted(missing)}")
        for key, types in _FIELD_TYPES.items():
            v = d.get(key)
            if not isinstance(v, types) or isinstance(v, bool) and bool not in types or not _fits_float(v):
                raise ValueError(f"finding field {key!r} must be {' or '.join(t.__name__ for t in types)} "
                                 f"(numbers within float64's range); got {str(v)[:40]}")
        return cls(**{k: d[k] for k in names if k in d})


_TEXT, _OPT_TEXT = (str,), (str, type(None))
_FIELD_TYPES = {"code": _TEXT, "severity": _TEXT, "module": _OPT_TEXT, "role": _OPT_TEXT, "name": _OPT_TEXT,
                "step": (int, type(None)), "value": (int, float, type(None)), "threshold": (int, float, type(None)),
                "message": _TEXT, "fix": _TEXT, "rank": (int, type(None))}


def _fits_float(x: Any) -> bool:
    """False for an int past float64's range (``float()`` would raise OverflowError)."""
    try:
        float(x) if isinstance(x, int) else None
    except OverflowError:
        return False
    return True


def _is_inf(x: Any) -> bool:
    try:
        return x is not None and math.isinf(float(x))
    except (TypeError, ValueError):
        return False


def make_finding(code: str, row: Any = None, *, module=None, role=None, name=None, step=None, value=None,
        threshold=None, message: str, fix: str, severity: str | None = None, rank: int | None = None) -> Finding:
    if row is not None:
        module = row.module if module is None else module
        role = row.role if role is None else role
        name = row["name"] if name is None else name
        step = row.step if step is None else step
    return Finding(code, severity or SEVERITY[code], module, role, name, step, value, threshold, message, fix, rank)


def rank_of(c: "Context", row: Any) -> int | None:
    """The rank a non-finite row comes from: in a merged multi-rank Run the lowest rank that saw
    NaN / inf in that tensor at that step (``run.tables["nonfinite_ranks"]``); in one rank's own
    rows of a multi-rank run, that rank; else None."""
    nf = getattr(c.run, "tables", {}).get("nonfinite_ranks")
    if nf is not None and len(nf):
        hit = nf[(nf.step == row.step) & (nf.module.astype(str) == row.module) & (nf.role.astype(str) == row.role)
                 & (nf["name"].astype(str) == row["name"])]
        if len(hit):
            return int(hit.first_rank.min())
    ranks = c.meta.get("ranks") or []
    if c.meta.get("distributed") and len(ranks) == 1:
        return int(ranks[0])
    return None


def on_rank(rank: int | None) -> str:
    return "" if rank is None else f" on rank {rank}"


def is_ancestor(a: str, b: str) -> bool:
    """True when module ``a`` contains module ``b`` (qualified names; "" is the root)."""
    return a != b and (a == "" or b.startswith(a + "."))
