"""Compare two runs of the same model and data (e.g. float32 and float16 autocast, same seed).

:func:`compare` aligns the rows of two :class:`~mpscope.run.Run` objects by (step, module, role,
name) and reports, per tensor, how far the runs have parted: the relative difference of ``absmax``
(in unscaled units: each row's ``absmax / loss_scale``), the differences of ``zero_frac`` and
``fp16_underflow_frac``, and whether one run holds inf/NaN where the other does not; plus the two loss
curves. The first step where any of these exceeds the tolerance, and the first module in execution
order within that step (the row order of ``run_a``'s step), is where the runs diverge.

:func:`compare_precision` runs a training function twice, in float32 and under autocast, from the
same seed, records both and returns their :class:`Comparison`.
"""

from __future__ import annotations

import contextlib
import html
import math
import numbers
import textwrap
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd
import torch

from mpscope.recorder import record
from mpscope.run import Run, check_run, select_rank
from mpscope.schema import fmt_number

#: Columns of :attr:`Comparison.divergence`.
DIVERGENCE_COLUMNS = [
    "step", "order", "module", "role", "name", "dtype_a", "dtype_b", "absmax_a", "absmax_b", "absmax_rel",
    "zero_frac_a", "zero_frac_b", "zero_diff", "underflow_a", "underflow_b", "underflow_diff",
    "nonfinite_a", "nonfinite_b", "diverged",
]
_KEY = ["step", "module", "role", "name"]


@dataclass
class Comparison:
    """Where two runs part.

    Attributes:
        divergence: one row per (step, module, role, name) present in both runs, ordered by step then
            execution order (``order``: the row's position within its step in ``run_a``). Columns
            :data:`DIVERGENCE_COLUMNS`: ``absmax_a/_b`` (unscaled: divided by the row's loss scale),
            ``absmax_rel = |a - b| / max(|a|, |b|)`` (0 when both are 0; inf when only one side has a
            finite element), ``zero_frac_a/_b`` and ``zero_diff = b - a``, ``underflow_a/_b``
            (``fp16_underflow_frac``) and ``underflow_diff = b - a``, ``nonfinite_a/_b`` (inf + NaN
            counts) and ``diverged``: ``absmax_rel > tol`` or ``|zero_diff| > frac_tol`` or
            ``|underflow_diff| > frac_tol`` or exactly one side holds a non-finite value.
        losses: one row per step in both runs: ``step, loss_a, loss_b, loss_rel, diverged``
            (``loss_rel`` as ``absmax_rel``; a loss that is finite in one run only diverges).
        first_step: first step with a diverged tensor or loss (None: no divergence beyond tolerance).
        first_module, first_role, first_name: the first diverged row of ``first_step`` in execution
            order (None when only the loss diverged, or nothing did).
        tol, frac_tol: the tolerances used.
        only_a, only_b: number of rows present in one run only (e.g. autocast's extra casts in op rows).
        labels: names of the two runs, for printing.
        run_a, run_b: the runs (set by :func:`compare_precision`; None from :func:`compare`).
        differences: how the two runs differ besides their numbers, one sentence each (see
            :func:`differences`); :func:`compare` warns of them, except the autocast dtype.
    """

    divergence: pd.DataFrame
    losses: pd.DataFrame
    first_step: int | None
    first_module: str | None
    first_role: str | None
    first_name: str | None
    tol: float
    frac_tol: float
    only_a: int = 0
    only_b: int = 0
    labels: tuple = field(default=("a", "b"))
    run_a: object = field(default=None, repr=False)
    run_b: object = field(default=None, repr=False)
    differences: list = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        """True when the runs part beyond the tolerance somewhere."""
        return self.first_step is not None

    def first_rows(self, n: int = 10) -> pd.DataFrame:
        """The diverged rows of :attr:`first_step`, in execution order (at most ``n``)."""
        if self.first_step is None:
            return self.divergence.iloc[0:0]
        d = self.divergence
        return d[(d.step == self.first_step) & d.diverged].head(n)

    def to_text(self) -> str:
        a, b = self.labels
        lines = [f"mpscope compare: {a} vs {b} (tol {self.tol:g} relative absmax, {self.frac_tol:g} on fractions)"]
        lines.append(f"  aligned tensor rows: {len(self.divergence)}; only in {a}: {self.only_a}, only in {b}: {self.only_b}")
        lines += [f"  {difference}" for difference in self.differences]
        if len(self.losses):
            l = self.losses
            lines.append(f"  loss: {a} {fmt_number(l.loss_a.iloc[0])} -> {fmt_number(l.loss_a.iloc[-1])}, "
                         f"{b} {fmt_number(l.loss_b.iloc[0])} -> {fmt_number(l.loss_b.iloc[-1])} over {len(l)} steps; "
                         f"largest relative gap {fmt_number(float(l.loss_rel.max()))}")
        if self.first_step is None:
            worst = self.divergence.absmax_rel.replace(np.inf, np.nan).max() if len(self.divergence) else math.nan
            lines.append(f"  no divergence beyond tolerance (largest relative absmax difference {fmt_number(worst)})")
            return "\n".join(lines)
        if self.first_module is None:
            lines.append(f"  first divergence: the loss at step {self.first_step}")
        else:
            lines.append(f"  first divergence: step {self.first_step}, module '{self.first_module or '(root)'}' "
                         f"({self.first_role} '{self.first_name}')")
        for r in self.first_rows(5).itertuples(index=False):
            lines.append(
                f"    {r.module or '(root)'} {r.role} {r.name}: absmax {fmt_number(r.absmax_a)} vs {fmt_number(r.absmax_b)}"
                f" (rel {fmt_number(r.absmax_rel)}), zero {r.zero_frac_a:.3f} vs {r.zero_frac_b:.3f}, "
                f"non-finite {int(r.nonfinite_a)} vs {int(r.nonfinite_b)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.wrapped()

    def wrapped(self, width: int = 100) -> str:
        """:meth:`to_text` with long lines wrapped between words (continuations indented)."""
        out = []
        for line in self.to_text().splitlines():
            indent = " " * (len(line) - len(line.lstrip()) + 4)
            out.append(textwrap.fill(line, width=width, subsequent_indent=indent, break_long_words=False,
                                     break_on_hyphens=False))
        return "\n".join(out)

    def _repr_html_(self) -> str:
        """Notebook display: the summary, then the first step's diverged rows as a table."""
        rows = self.first_rows(10)
        table = rows.to_html(index=False, float_format=lambda x: f"{x:.4g}") if len(rows) else ""
        return f"<pre style='white-space: pre-wrap'>{html.escape(self.wrapped())}</pre>{table}"


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    fa, fb = np.isfinite(a), np.isfinite(b)
    den = np.maximum(np.abs(np.where(fa, a, 0)), np.abs(np.where(fb, b, 0)))
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(den > 0, np.abs(np.where(fa, a, 0) - np.where(fb, b, 0)) / den, 0.0)
    rel = np.where(fa != fb, np.inf, rel)  # finite on one side only
    return np.where(~fa & ~fb, 0.0, rel)


def _side(run, roles) -> pd.DataFrame:
    t = run.tensors
    if roles is not None:
        t = t[t.role.isin(roles)]
    t = t.copy()
    for c in ("module", "role", "name", "dtype"):
        t[c] = t[c].astype(str)
    t["order"] = t.groupby("step").cumcount()
    scale = t.loss_scale.astype(float).where(t.loss_scale > 0, 1.0)
    t["absmax_u"] = t.absmax.astype(float) / scale
    t["nonfinite"] = t.nan_count + t.inf_count
    return t.drop_duplicates(_KEY, keep="first")


def differences(run_a: Run, run_b: Run, labels: tuple[str, str] = ("a", "b")) -> list[str]:
    """How two runs differ besides their numbers, one sentence each: the model class, the modules
    recorded in one run only (up to 5 named), the device, the autocast dtype, the number of steps,
    ``every`` and the roles recorded. A fact missing from either run's meta is not compared."""
    a, b = labels
    ma, mb = run_a.meta, run_b.meta
    out = []
    if "autocast_dtype" in ma and "autocast_dtype" in mb and ma["autocast_dtype"] != mb["autocast_dtype"]:
        out.append(f"different autocast dtypes: {a} {ma['autocast_dtype'] or 'none'}, {b} {mb['autocast_dtype'] or 'none'}")
    for key, what in (("model", "models"), ("device", "devices"), ("every", "every= settings"),
                      ("roles", "recorded roles")):
        if ma.get(key) is not None and mb.get(key) is not None and ma[key] != mb[key]:
            out.append(f"different {what}: {a} {ma[key]}, {b} {mb[key]}")
    mods_a, mods_b = (set(r.tensors.module.astype(str)) for r in (run_a, run_b))
    for name, only in ((a, mods_a - mods_b), (b, mods_b - mods_a)):
        if only:
            shown = ", ".join(repr(m) for m in sorted(only)[:5]) + (" ..." if len(only) > 5 else "")
            out.append(f"{len(only)} module(s) recorded in {name} only: {shown}")
    if len(run_a.steps) != len(run_b.steps):
        out.append(f"different step counts: {a} {len(run_a.steps)}, {b} {len(run_b.steps)}")
    return out


def compare(run_a: Run, run_b: Run, tol: float = 0.1, frac_tol: float | None = None,
            roles: Iterable[str] | None = None, labels: tuple[str, str] | None = None,
            rank: int | None = None) -> Comparison:
    """Align two runs and find where they part.

    Args:
        run_a, run_b: :class:`mpscope.Run` of the same model and data (e.g. float32 first, then the
            mixed-precision run), recorded with the same ``every``.
        tol: relative tolerance on ``absmax`` (unscaled) and on the loss. Default 0.1: float16
            keeps 11 significant bits (relative rounding 2^-11 ≈ 4.9e-4 per op), so a healthy
            float16 run's activations stay within 1 % of float32 over a few steps, while gradients
            summed with cancellation (a bias gradient over a batch) can differ by several percent;
            an overflow (inf), a flush to zero (rel 1) or a skipped step exceeds it.
        frac_tol: absolute tolerance on ``zero_frac`` and ``fp16_underflow_frac`` (default: ``tol``).
        roles: restrict to these roles (default: all rows present in both runs).
        labels: names used by :meth:`Comparison.to_text` (``%mpscope compare A B`` passes the
            notebook variables' names); default ``("a", "b")``.
        rank: compare rank ``rank``'s own rows of both runs (multi-rank runs, ``run.for_rank(rank)``);
            None: the runs as given (merged Runs compare their merged rows).

    Returns:
        :class:`Comparison`.

    Raises:
        TypeError: an argument is not a Run, or ``rank`` is not an int.
        ValueError: ``rank`` is not a rank of both runs or its rows are not at hand (see
            :meth:`mpscope.Run.for_rank`); a tolerance is not positive, or the runs share no (step, module, role, name)
            row (different models, or steps that were not recorded in both).
    """
    labels = ("a", "b") if labels is None else labels
    check_run(run_a, "run_a")
    check_run(run_b, "run_b")
    run_a, run_b = select_rank(run_a, rank), select_rank(run_b, rank)
    frac_tol = tol if frac_tol is None else frac_tol
    for name, value in (("tol", tol), ("frac_tol", frac_tol)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"{name} must be a number (a relative tolerance, e.g. 0.1); got {value!r}")
    if not (tol > 0 and frac_tol > 0):
        raise ValueError(f"tol and frac_tol must be positive; got tol={tol!r}, frac_tol={frac_tol!r}")
    if isinstance(labels, str) or len(labels) != 2:
        raise ValueError(f"labels must be two names, one per run, e.g. ('fp32', 'amp'); got {labels!r}")
    if roles is not None:
        roles = [roles] if isinstance(roles, str) else roles
        if not isinstance(roles, Iterable) or not all(isinstance(r, str) for r in roles):
            raise TypeError(f"roles must be role names, e.g. ['activation', 'activation_grad']; got {roles!r}")
    found = differences(run_a, run_b, labels)
    warned = [d for d in found if not d.startswith("different autocast dtypes")]  # what compare is for
    if warned:
        warnings.warn(f"mpscope.compare: the runs differ: {'; '.join(warned)}. Rows are aligned by "
                      "(step, module, role, name) where both runs have them.", UserWarning, stacklevel=2)
    a, b = _side(run_a, roles), _side(run_b, roles)
    m = a.merge(b, on=_KEY, suffixes=("_a", "_b"), how="inner")
    if m.empty and (len(a) or len(b)):
        raise ValueError(
            "the two runs share no (step, module, role, name) row: compare runs of the same model, "
            "recorded with the same `every` (and the same `ops` setting for op rows)")
    only_a, only_b = len(a) - len(m), len(b) - len(m)
    d = pd.DataFrame({
        "step": m.step.astype(int), "order": m.order_a.astype(int), "module": m.module, "role": m.role,
        "name": m["name"], "dtype_a": m.dtype_a, "dtype_b": m.dtype_b,
        "absmax_a": m.absmax_u_a, "absmax_b": m.absmax_u_b,
        "absmax_rel": _rel(m.absmax_u_a, m.absmax_u_b),
        "zero_frac_a": m.zero_frac_a.astype(float), "zero_frac_b": m.zero_frac_b.astype(float),
        "underflow_a": m.fp16_underflow_frac_a.astype(float), "underflow_b": m.fp16_underflow_frac_b.astype(float),
        "nonfinite_a": m.nonfinite_a.astype(int), "nonfinite_b": m.nonfinite_b.astype(int),
    })
    d["zero_diff"] = d.zero_frac_b - d.zero_frac_a
    d["underflow_diff"] = d.underflow_b - d.underflow_a
    d["diverged"] = ((d.absmax_rel > tol) | (d.zero_diff.abs() > frac_tol) | (d.underflow_diff.abs() > frac_tol)
                     | ((d.nonfinite_a > 0) != (d.nonfinite_b > 0)))
    d = d[DIVERGENCE_COLUMNS].sort_values(["step", "order"], kind="stable").reset_index(drop=True)

    sa, sb = run_a.steps, run_b.steps
    losses = sa[["step", "loss"]].merge(sb[["step", "loss"]], on="step", suffixes=("_a", "_b"))
    losses["loss_rel"] = _rel(losses.loss_a, losses.loss_b)
    both_nan = losses.loss_a.isna() & losses.loss_b.isna()
    losses["diverged"] = (losses.loss_rel > tol) & ~both_nan
    losses = losses.reset_index(drop=True)

    steps_t = set(d.step[d.diverged].tolist())
    steps_l = set(losses.step[losses.diverged].tolist())
    first_step = min(steps_t | steps_l) if (steps_t or steps_l) else None
    first_module = first_role = first_name = None
    if first_step is not None and first_step in steps_t:
        r = d[(d.step == first_step) & d.diverged].iloc[0]
        first_module, first_role, first_name = str(r.module), str(r.role), str(r["name"])
    return Comparison(d, losses, None if first_step is None else int(first_step), first_module, first_role,
                      first_name, float(tol), float(frac_tol), int(only_a), int(only_b), tuple(labels),
                      differences=found)


def compare_precision(build: Callable[[], Any], train_step: Callable[..., Any], *, steps: int = 5, dtype: str = "float16", device_type: str = "cpu",
                      seed: int = 0, grad_scaler: bool | dict | None = None, ops: bool = False, tol: float = 0.1,
                      frac_tol: float | None = None, roles: Iterable[str] | None = None,
                      **record_kwargs) -> Comparison:
    """Train twice from the same seed, in float32 and under ``torch.autocast(device_type, dtype)``,
    record both runs and compare them.

    Args:
        build: ``build() -> (model, optimizer)``, called after ``torch.manual_seed(seed)`` for each run,
            so both start from the same weights.
        train_step: ``train_step(model, optimizer, scaler, autocast, i)`` runs training step ``i``
            (0-based): it must do its forward inside ``with autocast():`` and step through the
            scaler (``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``). In the
            float32 run ``autocast()`` is disabled and the scaler is a disabled
            ``torch.amp.GradScaler`` (``scale`` returns the loss, ``step`` calls ``optimizer.step()``).
            Draw data from ``i`` or from torch's global RNG (reseeded before each run) so both runs
            see the same batches.
        steps: number of training steps per run (positive).
        dtype: ``"float16"`` or ``"bfloat16"``.
        device_type: the autocast device (``"cpu"`` or ``"cuda"``).
        grad_scaler: use an enabled GradScaler in the autocast run (default: True for float16,
            False for bfloat16), with PyTorch's defaults, or a dict of ``torch.amp.GradScaler``
            keyword arguments (``init_scale``, ``growth_interval``, ...).
        ops, roles, record_kwargs: passed to :func:`mpscope.record` for both runs.
        tol, frac_tol: passed to :func:`compare`.

    Returns:
        :class:`Comparison` with ``labels = ("float32", dtype)``; the two runs are on
        ``comparison.run_a`` / ``comparison.run_b``.

    Raises:
        ValueError: ``dtype`` is not float16/bfloat16, or ``steps`` < 1.
    """
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float16' or 'bfloat16'; got {dtype!r}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps!r}")
    use_scaler = (dtype == "float16") if grad_scaler is None else bool(grad_scaler)
    scaler_kwargs = grad_scaler if isinstance(grad_scaler, dict) else {}
    runs = []
    for lowp in (False, True):
        torch.manual_seed(seed)
        built = build()
        model, optimizer = built if isinstance(built, tuple) else (built, None)
        scaler = torch.amp.GradScaler(device_type, enabled=lowp and use_scaler, **scaler_kwargs)
        if lowp:
            def autocast(_d=getattr(torch, dtype)):
                return torch.autocast(device_type, dtype=_d)
        else:
            def autocast():
                return contextlib.nullcontext()
        torch.manual_seed(seed)
        with record(model, optimizer=optimizer, scaler=scaler, ops=ops, roles=roles,
                            **record_kwargs) as rec:
            for i in range(steps):
                train_step(model, optimizer, scaler, autocast, i)
        runs.append(rec.run)
    comp = compare(runs[0], runs[1], tol=tol, frac_tol=frac_tol, labels=("float32", dtype))
    comp.run_a, comp.run_b = runs
    return comp
