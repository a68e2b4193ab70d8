"""Findings of precision forensics (``record(..., ops=True, shadow=True)``): views of the engine's rows.

Each row of ``run.tables["forensics"]`` (:mod:`mpscope.recording.root_cause`) is a bad spot walked back
to its root op, its mechanism named in the closed vocabulary
(:data:`~mpscope.recording.root_cause.MECHANISMS`), with the fix the replay verified (or the code
change no config expresses). The finding's code is the mechanism; the same (mechanism, module, op) on
later steps is one finding, at its first step, whose ``value`` counts the steps.
"""

from __future__ import annotations

import dataclasses

from mpscope.advisor.finding import Finding, make_finding
from mpscope.recording.root_cause import MASTER_WEIGHTS

#: Finding codes of the engine: its mechanisms.
CODES = ("overflow", "underflow", "swamping", "cancellation", "saturation", "domain", "lost_constant", "resolution",
         "decision_flip", "loss_scale")


def forensic_rows(run):
    """``run.tables["forensics"]`` or None when the run was recorded without the engine."""
    t = getattr(run, "tables", {}).get("forensics")
    return t if t is not None else None


def _common_owner(t):
    """State updates of one mechanism in several submodules of one module (an EMA copy's layers) are
    that module's: their rows take the deepest module containing them all (never the root)."""
    state = t[(t.spot == "update") & (t.phase == "state") & (t.module != "")]
    if state.empty:
        return t
    t = t.copy()
    for mech, g in state.groupby("mechanism", sort=False):
        parts = [m.split(".") for m in g.module.astype(str)]
        common = []
        for level in zip(*parts):
            if len(set(level)) != 1:
                break
            common.append(level[0])
        if common and len(set(g.module)) > 1:
            t.loc[g.index, "module"] = ".".join(common)
            t.loc[g.index, "fix"] = g.fix.str.replace(r"Keep '[^']*' in float32", f"Keep '{'.'.join(common)}' in float32",
                                                      regex=True)
    return t


def forensic_findings(run) -> list[Finding]:
    """One finding per (mechanism, module, op) of the engine's rows, at its first step."""
    t = forensic_rows(run)
    if t is None or not len(t):
        return []
    out = []
    opt = t[(t.spot == "update") & (t.phase == "optimizer")]
    if len(opt):  # the optimizer step losing updates: one finding for the run's 16-bit parameters and state,
        # at the module of the tensor that loses the most (the fix is the run's: float32 master weights)
        t = t.drop(opt.index)
        for mech, g in opt.groupby("mechanism", sort=False):
            r = g.sort_values(["step", "value"], ascending=[True, False]).iloc[0]
            names = sorted(set(g.spot_name))
            out.append(make_finding(str(mech), module=str(r.module) or None, role="optimizer_update", name=str(r.op),
                                    step=int(r.step), value=float(g.value.max()),
                                    message=f"{r.message} The optimizer step loses updates of {len(names)} tensors "
                                            f"in all ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}).",
                                    fix=str(r.fix)))
    t = _common_owner(t)
    for (mech, module, op), g in t.groupby(["mechanism", "module", "op"], sort=False):
        r = g.sort_values("step").iloc[0]
        steps = int(g.step.nunique())
        msg = str(r.message) + (f" Seen on {steps} recorded steps." if steps > 1 else "")
        role = f"{r.phase}_update" if r.spot == "update" or (r.phase == "optimizer" and r.fix_dtype == MASTER_WEIGHTS) \
            else ("op_output" if op else None)
        out.append(make_finding(str(mech), module=str(module) if mech != "loss_scale" else None,
                                role=role, name=str(op) or None,
                                step=int(r.step), value=float(r.value), message=msg, fix=str(r.fix)))
    return out


#: Op-level detectors (mpscope.advisor.op_findings, op_precision) whose finding on an op the engine
#: also explains is the engine's: its mechanism comes from walking the graph, theirs from one pattern.
SUPERSEDED = frozenset({"mask_overflow", "forward_overflow", "log_of_zero", "pole", "float_precision",
                        "integer_precision", "norm_statistics"})


def superseded_by_the_engine(findings: list[Finding]) -> list[Finding]:
    """``findings`` less those the engine's own findings replace: an op-level detector's finding on an
    op the engine named (its amplifier), and ``amp_misuse``'s unremoved scale where the engine's
    ``loss_scale`` finding reports the same factor."""
    engine = [f for f in findings if f.code in CODES]
    if not engine:
        return findings
    ops = {f.name for f in engine if f.name}
    factors = {f.value for f in engine if f.code == "loss_scale"}  # (amp_misuse's value: the scale it saw)
    return [f for f in findings if not (
        (f.code in SUPERSEDED and f.name and f.name.split("#")[0] in ops) or
        (f.code == "amp_misuse" and f.value in factors))]


#: The fix text of an op-level ``first_nonfinite`` (mpscope.advisor.op_findings) that defers to a finding on its op.
_DEFERS = "See the finding for the same op below"
#: What a finding whose cause needs the engine says when the run was recorded without it.
ENGINE_HINT = ("Record again with mpscope.record(..., ops=True, shadow=True): precision forensics walks this value "
               "back to the op where it went wrong, names the mechanism and tries the fixes by replaying the step.")


def point_to_causes(findings: list[Finding], run) -> list[Finding]:
    """``first_nonfinite`` findings whose fix defers to a finding on the same op that does not exist:
    pointed at the engine's finding in the same module, or told which ``record(...)`` options find the
    cause."""
    engine = [f for f in findings if f.code in CODES]
    out = []
    for f in findings:
        if f.code == "first_nonfinite" and f.fix.startswith(_DEFERS) and not any(
                g is not f and g.module == f.module and g.name == f.name for g in findings):
            same = [g for g in engine if g.module == f.module] or engine
            if same:
                fix = f"The cause is the {same[0].code} finding at '{same[0].module or ''}': {same[0].fix}"
            elif forensic_rows(run) is None:
                fix = ENGINE_HINT
            else:
                fix = f.fix
            f = dataclasses.replace(f, fix=fix)
        out.append(f)
    return out


def verified_fixes(run) -> list[dict]:
    """The engine's fixes, one per (mechanism, module, op): ``{"code", "module", "op", "phase" (the
    amplifier's), "fp32_modules", "dtype", "init_scale", "verified"}``; ``verified``: a replay of the step under that fix made the spot
    good; ``init_scale``: a GradScaler scale (None for none)."""
    t = forensic_rows(run)
    if t is None or not len(t):
        return []
    out = []
    for (mech, module, op), g in t.groupby(["mechanism", "module", "op"], sort=False):
        r = g.sort_values("step").iloc[0]
        out.append({"code": str(mech), "module": str(module), "op": str(op), "phase": str(r.phase),
                    "fp32_modules": [m for m in str(r.fix_modules).split(",") if m],
                    "dtype": str(r.fix_dtype) or None,
                    "init_scale": float(r.fix_init_scale) if "fix_init_scale" in r and r.fix_init_scale == r.fix_init_scale
                    else None, "verified": bool(g.verified.any())})
    return out


__all__ = ["CODES", "ENGINE_HINT", "SUPERSEDED", "forensic_findings", "verified_fixes", "forensic_rows",
           "point_to_causes", "superseded_by_the_engine"]
