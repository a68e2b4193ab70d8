"""Precision findings from the fp32 shadow (``record(..., shadow=True)``, :func:`shadow_check`).

``run.precision`` holds, per recorded step and module output, the SQNR against a float32 reference
of the same batch (``sqnr_db``) and the module's own contribution (``own_sqnr_db``: the module fed
the reference's inputs). Rules, with ``ideal`` = the low-precision format's
:attr:`~mpscope.formats.Format.ideal_sqnr_db` (6.02 dB per significand bit: bfloat16 48.2 dB,
float16 66.2 dB) and each module's own SQNR taken as its median over the recorded steps:

* ``precision_loss`` (warning): a module whose own SQNR is below ``ideal - PRECISION_LOSS_MARGIN_DB``
  (its own error at least 10x, in amplitude, that of the format's ideal rounding) and at least
  ``NEIGHBOUR_MARGIN_DB`` below the median own SQNR of all shadowed modules (its neighbours), and
  none of whose descendants is named already (a container holding a culprit inherits its low own
  SQNR). The root module is never named: its inputs are the batch itself, so its own contribution
  is the network output's whole error (reported as the output SQNR). value = the module's own
  SQNR (dB), threshold = ``ideal - PRECISION_LOSS_MARGIN_DB``.
* fp32 modules (:func:`shadow_fp32_modules`): the culprits, worst first, until the network output's
  predicted SQNR reaches ``ideal - OUTPUT_TARGET_MARGIN_DB``. Prediction: each module's own error
  adds to the output as independent noise of the same relative size (noise-to-signal ratios add);
  keeping a culprit in float32 removes its share. :func:`shadow_check` replaces the prediction by a
  measurement (it re-runs the model with the chosen modules in float32).
"""

from __future__ import annotations

import contextlib
import html
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.utils._pytree import tree_flatten, tree_map

from mpscope.advisor.finding import Finding, is_ancestor
from mpscope.formats import FORMATS, Format
from mpscope.recorder import record
from mpscope.recording.outputs import flatten_outputs
from mpscope.recording.shadow import compare, sqnr_db

#: A module's own SQNR this far (dB) below the format's ideal is a precision loss: 20 dB = its own
#: error is 10x (in amplitude) the error of one ideal rounding of the format.
PRECISION_LOSS_MARGIN_DB = 20.0
#: ... and this far below the median own SQNR of the shadowed modules (3.2x in amplitude).
NEIGHBOUR_MARGIN_DB = 10.0
#: Target of the fp32-module choice: network output SQNR within this of the format's ideal.
OUTPUT_TARGET_MARGIN_DB = 20.0


def shadow_format(run: Any) -> Format | None:
    """The low-precision format the shadowed run computed in: the run's autocast dtype, else the
    lowest-precision dtype of its precision rows; None without precision rows."""
    p = run.precision if hasattr(run, "precision") else None
    if p is None or p.empty:
        return None
    ac = (run.meta or {}).get("autocast_dtype")
    if ac in FORMATS:
        return FORMATS[ac]
    fmts = [FORMATS[d] for d in set(p["dtype"].astype(str)) if d in FORMATS]
    return min(fmts, key=lambda f: f.mantissa_bits) if fmts else None


def module_precision(run: Any) -> pd.DataFrame:
    """Per module output (module, name): median ``sqnr_db`` / ``own_sqnr_db`` over the recorded steps,
    the first step, ``numel`` of rows; sorted by own SQNR, worst first. Empty without a shadow."""
    p = run.precision
    if p.empty:
        return pd.DataFrame(columns=["module", "name", "sqnr_db", "own_sqnr_db", "first_step"])
    p = p[p.role == "activation"].astype({"module": str, "name": str})
    g = p.groupby(["module", "name"], sort=False)
    out = g.agg(sqnr_db=("sqnr_db", "median"), own_sqnr_db=("own_sqnr_db", "median"),
                first_step=("step", "min")).reset_index()
    return out.sort_values("own_sqnr_db", kind="stable").reset_index(drop=True)


def precision_findings(run: Any) -> list[Finding]:
    """``precision_loss`` findings of a shadowed run (rules in the module docstring); [] without one."""
    fmt = shadow_format(run)
    if fmt is None:
        return []
    m = module_precision(run)
    out_sqnr = _output_sqnr(m)
    m = m[m.own_sqnr_db.notna() & (m.module != "")]
    if m.empty:
        return []
    ideal = fmt.ideal_sqnr_db
    threshold = ideal - PRECISION_LOSS_MARGIN_DB
    neighbours = float(np.median(m.own_sqnr_db.to_numpy()))
    bad = m[(m.own_sqnr_db < threshold) & (m.own_sqnr_db < neighbours - NEIGHBOUR_MARGIN_DB)]
    names = list(dict.fromkeys(bad.module))
    culprits = [n for n in names if not any(is_ancestor(n, o) for o in names)]
    p = run.precision
    found = []
    for r in bad[bad.module.isin(culprits)].drop_duplicates("module").itertuples(index=False):
        rows = p[(p.module.astype(str) == r.module) & (p.own_sqnr_db < threshold)]
        step = int(rows.step.min()) if len(rows) else int(r.first_step)
        found.append(Finding(
            code="precision_loss", severity="warning", module=r.module, role="activation", name=r.name,
            step=step, value=float(r.own_sqnr_db), threshold=threshold,
            message=(f"Module '{r.module}' loses precision of its own: fed the float32 reference's inputs, its "
                     f"output is at {r.own_sqnr_db:.1f} dB SQNR against the float32 reference ({fmt.name}'s ideal "
                     f"is {ideal:.1f} dB; the shadowed modules' median is {neighbours:.1f} dB). With its inherited "
                     f"error the output is at {r.sqnr_db:.1f} dB"
                     + (f"; the network output at {out_sqnr:.1f} dB." if out_sqnr is not None else ".")),
            fix=(f"Keep '{r.module}' in float32 (autocast disabled inside it, inputs cast to float32), or find "
                 "the computation inside it that rounds (positions, timesteps, angles, running sums, "
                 "differences of large values) and do that part in float32.")))
    return found


def _output_sqnr(m: pd.DataFrame) -> float | None:
    root = m[m.module == ""]
    return float(root.sqnr_db.min()) if len(root) else None


def shadow_fp32_modules(run: Any, findings: list[Finding] | None = None) -> dict | None:
    """fp32 modules chosen from the shadow's measured contributions (rule in the module docstring).

    Returns None without a shadow, else dict ``modules`` (list[str], worst first), ``output_sqnr_db``
    (the recorded network output's SQNR, None if the root was not shadowed),
    ``predicted_output_sqnr_db``, ``target_db``, ``ideal_sqnr_db`` and ``format``.
    """
    fmt = shadow_format(run)
    if fmt is None:
        return None
    if findings is None:
        findings = precision_findings(run)
    culprits = [f for f in findings if f.code == "precision_loss"]
    m = module_precision(run)
    target = fmt.ideal_sqnr_db - OUTPUT_TARGET_MARGIN_DB
    out = _output_sqnr(m)
    nsr = (lambda db: 10.0 ** (-db / 10.0))
    culprits.sort(key=lambda f: f.value)
    if out is None or not math.isfinite(out):
        return {"modules": [f.module for f in culprits], "output_sqnr_db": out, "predicted_output_sqnr_db": None,
                "target_db": target, "ideal_sqnr_db": fmt.ideal_sqnr_db, "format": fmt.name}
    names = set(m.module)
    leaves = m[[not any(is_ancestor(a, b) for b in names) for a in m.module]]
    named = {f.module for f in culprits}
    floor = float(sum(nsr(v) for mod, v in zip(leaves.module, leaves.own_sqnr_db)
                      if math.isfinite(v) and not any(mod == c or is_ancestor(c, mod) for c in named)))
    left, chosen = nsr(out), []
    for f in culprits:
        if left <= nsr(target):
            break
        chosen.append(f.module)
        left = max(left - nsr(f.value), floor)
    predicted = math.inf if left == 0 else -10.0 * math.log10(left)
    return {"modules": chosen, "output_sqnr_db": out, "predicted_output_sqnr_db": predicted, "target_db": target,
            "ideal_sqnr_db": fmt.ideal_sqnr_db, "format": fmt.name}


# --------------------------------------------------------------------------- one-shot check
@dataclass
class ShadowCheck:
    """Result of :func:`shadow_check`.

    Attributes:
        table: one row per module output: ``module, name, dtype, sqnr_db, max_abs_err, max_rel_err,
            ref_absmax, own_sqnr_db, own_max_abs_err, own_max_rel_err`` in execution order.
        culprits: ``module, name, own_sqnr_db, sqnr_db`` of every module but the root, ranked by own
            SQNR, worst first, with ``flagged`` (named by a ``precision_loss`` finding).
        findings: the ``precision_loss`` findings.
        output_sqnr_db: SQNR of the model's output (root module) against float32.
        ideal_sqnr_db: the format's ideal SQNR (:attr:`~mpscope.formats.Format.ideal_sqnr_db`).
        fp32_modules: the culprits, worst first, that brought the output to ``target_db`` when re-run
            with them in float32 (measured, not predicted).
        fixed_output_sqnr_db: the output's SQNR with ``fp32_modules`` in float32 (None if none chosen).
        target_db: ``ideal_sqnr_db - OUTPUT_TARGET_MARGIN_DB``.
        run: the one-step :class:`~mpscope.run.Run` it was computed from.
    """

    table: pd.DataFrame
    culprits: pd.DataFrame
    findings: list
    output_sqnr_db: float | None
    ideal_sqnr_db: float
    target_db: float
    fp32_modules: list = field(default_factory=list)
    fixed_output_sqnr_db: float | None = None
    run: Any = None

    def __str__(self) -> str:
        lines = [f"mpscope shadow check: output {db_text(self.output_sqnr_db)} SQNR against float32 "
                 f"(ideal {self.ideal_sqnr_db:.1f} dB, target {self.target_db:.1f} dB)"]
        for r in self.culprits.head(8).itertuples(index=False):
            lines.append(f"  {'!' if r.flagged else ' '} {r.module or '(root)':30s} own {db_text(r.own_sqnr_db):>9s}"
                         f"   total {db_text(r.sqnr_db):>9s}")
        if self.fp32_modules:
            lines.append(f"  fp32_modules {self.fp32_modules}: output {db_text(self.fixed_output_sqnr_db)}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(str(self))}</pre>"


def db_text(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return "inf dB" if math.isinf(x) and x > 0 else f"{x:.1f} dB"


def shadow_check(model: torch.nn.Module, batch, dtype: torch.dtype = torch.bfloat16, *,
                 device_type: str | None = None, modules=None) -> ShadowCheck:
    """One forward of ``model`` on ``batch`` under autocast(``dtype``) next to a float32 reference,
    without training: the per-module SQNR table, the ranked culprits and a measured fp32-module set.

    The model, its buffers (BatchNorm statistics) and the RNG stream are left as they were (buffers
    are restored, the RNG is forked); everything runs under ``torch.no_grad()`` in the model's
    current train/eval mode.

    Args:
        model: an ``nn.Module`` with float32 parameters.
        batch: the forward's input: a tensor, a tuple/list of positional arguments or a dict of
            keyword arguments.
        dtype: ``torch.bfloat16`` or ``torch.float16``: the autocast dtype to check.
        device_type: autocast device type; default: the model's parameters' device type.
        modules: which modules to compare (as in :func:`mpscope.record`); default all.

    Returns:
        :class:`ShadowCheck`.

    Raises:
        ValueError: ``dtype`` is not float16/bfloat16.
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"shadow_check compares float16 or bfloat16 with float32; got dtype={dtype}. "
                         "Pass dtype=torch.bfloat16 or dtype=torch.float16.")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"shadow_check needs an nn.Module; got {type(model).__name__}.")
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    device_type = device_type or dev.type
    args, kwargs = _split(batch)
    with _preserved(model, dev):
        with record(model, roles=["activation"], modules=modules, hist_every=1 << 30, shadow=True) as rec:
            with torch.no_grad(), torch.autocast(device_type, dtype=dtype):
                model(*args, **kwargs)
            rec.step()
    run = rec.run
    p = run.precision
    table = p.drop(columns=["step", "role"]).reset_index(drop=True)
    findings = precision_findings(run)
    ranked = module_precision(run)
    ranked["flagged"] = ranked.module.isin({f.module for f in findings})
    fmt = FORMATS[str(dtype).removeprefix("torch.")]
    target = fmt.ideal_sqnr_db - OUTPUT_TARGET_MARGIN_DB
    out = _output_sqnr(ranked)
    chosen, fixed = [], None
    if out is not None and out < target:
        for f in sorted(findings, key=lambda f: f.value):
            chosen.append(f.module)
            fixed = _output_sqnr_with_fp32(model, args, kwargs, dtype, device_type, chosen, dev)
            if fixed >= target:
                break
    ranked = ranked[ranked.module != ""].reset_index(drop=True)
    return ShadowCheck(table=table, culprits=ranked[["module", "name", "own_sqnr_db", "sqnr_db", "flagged"]],
                       findings=findings, output_sqnr_db=out, ideal_sqnr_db=fmt.ideal_sqnr_db, target_db=target,
                       fp32_modules=chosen, fixed_output_sqnr_db=fixed, run=run)


def _split(batch):
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


@contextlib.contextmanager
def _preserved(model, dev):
    """Buffers restored and the RNG forked around a check (no autograd graph holds them)."""
    saved = [(b, b.clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [], device_type=dev.type):
            yield
    finally:
        with torch.no_grad():
            for b, c in saved:
                b.copy_(c)


def _output_sqnr_with_fp32(model, args, kwargs, dtype, device_type, names, dev) -> float:
    """Output SQNR of a forward with ``names`` kept in float32, against the float32 forward."""
    outs = []
    for lowp in (False, True):
        with _preserved(model, dev), torch.no_grad():
            with fp32_modules(model, names if lowp else [], device_type), \
                    torch.autocast(device_type, dtype=dtype, enabled=lowp):
                outs.append(model(*args, **kwargs))
    ref = dict(flatten_outputs(outs[0], "output"))
    vals = [compare(t, ref[n]) for n, t in flatten_outputs(outs[1], "output") if n in ref and t.is_floating_point()]
    v = torch.stack(vals).sum(0)
    return float(sqnr_db(float(v[0]), float(v[1])))


@contextlib.contextmanager
def fp32_modules(model: torch.nn.Module, names, device_type: str):
    """Inside the block, the named submodules run as ``mpscope.apply`` runs a recommendation's
    ``fp32_modules``: when autocast is on at their call, with autocast disabled, floating inputs
    cast to float32 and floating outputs cast back to the dtype of the first floating input when
    that was float16/bfloat16. Hooks removed on exit.

    Raises:
        ValueError: a name that is not one of ``model.named_modules()``.
    """
    mods = dict(model.named_modules())
    unknown = [n for n in names if n not in mods]
    if unknown:
        raise ValueError(f"no modules named {unknown} in the model; names come from model.named_modules().")
    stack: list = []

    def pre(module, args, kwargs):
        if not torch.is_autocast_enabled(device_type):
            stack.append(None)
            return None
        leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
        ctx = torch.autocast(device_type, enabled=False)
        ctx.__enter__()
        stack.append((ctx, leaves[0].dtype if leaves else None))
        return tree_map(lambda x: _cast(x, torch.float32), (args, kwargs))

    def post(module, args, output):
        entry = stack.pop()
        if entry is None:
            return None
        ctx, back = entry
        ctx.__exit__(None, None, None)
        return tree_map(lambda x: _cast(x, back), output) if back in (torch.float16, torch.bfloat16) else None

    handles = []
    try:
        for n in names:
            handles.append(mods[n].register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mods[n].register_forward_hook(post, always_call=True))
        yield
    finally:
        for h in handles:
            h.remove()


def _cast(x, dtype):
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x
