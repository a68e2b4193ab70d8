"""advise(run) -> Recommendation: dtype, GradScaler settings, fp32 modules, findings, evidence."""

from __future__ import annotations

import dataclasses
import html
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from mpscope.advisor.accumulation import accumulation_precision
from mpscope.advisor.coherence import make_coherent
from mpscope.advisor.context import Context
from mpscope.advisor.dtype import choose_dtype
from mpscope.advisor.finding import Finding
from mpscope.advisor.findings import module_findings, recording_flushed_gradients
from mpscope.advisor.loop_findings import loop_findings
from mpscope.advisor.op_findings import op_findings
from mpscope.advisor.op_precision import op_precision_findings
from mpscope.advisor.forensic_findings import (forensic_findings, point_to_causes, superseded_by_the_engine,
                                               verified_fixes)
from mpscope.advisor.precision import db_text, precision_findings, shadow_fp32_modules
from mpscope.advisor.scaler import (UNDERFLOW_TOL, below_normal, choose_init_exponent, choose_scaler, predict,
                                    scaler_agreement)
from mpscope.datafile import read_data
from mpscope.run import Run, select_rank
from mpscope.schema import (
    GRAD_ROLES,
    GRAD_SCALER_DEFAULTS,
    SEVERITIES,
    check_grad_scaler,
    check_module_names,
    fmt_scale,
    module_label,
)

DTYPES = ("bfloat16", "float16", "float32")
_DEVICE_TYPE = re.compile(r"[a-z_][a-z0-9_]*")


def _clean(x: Any) -> Any:
    """JSON/YAML-safe plain data: numpy -> python, tuples -> lists, NaN -> None (inf kept).

    Raises:
        ValueError: ``x`` holds something else than dicts, lists, tuples, text, numbers, booleans
            and None (a set, bytes, a date from a YAML file), or an int past float64's range.
    """
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer, int)):
        if abs(int(x)) > 2**1023:
            raise ValueError(f"an integer past float64's range ({str(x)[:20]}...)")
        return int(x)
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return None if math.isnan(v) else v
    if x is None or isinstance(x, str):
        return x
    raise ValueError(f"a {type(x).__name__} ({str(x)[:40]!r}) where only text, numbers, lists and dicts go")


#: Fields of ``predictions`` and ``evidence`` that :meth:`Recommendation.to_text` reads: name -> test.
_NUMBER = (int, float)
_READ_FIELDS = {
    "predictions": {"steps": (int, type(None))},
    "predictions.recommended": {"skipped": (int,), "skip_rate": _NUMBER, "final_scale": _NUMBER,
                                "underflow_frac": (*_NUMBER, type(None)), "subnormal_frac": (*_NUMBER, type(None))},
    "evidence": {"run_dtype": (str, type(None)), "simulation_agreement": (dict, type(None)),
                 "fp16_fp32_modules": (list, type(None))},
    "evidence.simulation_agreement": {"agree_frac": _NUMBER, "steps": (int,), "real_skipped": (int,),
                                      "sim_skipped": (int,)},
}
_READ_FIELDS["predictions.pytorch_default"] = _READ_FIELDS["predictions.recommended"]


def _check_read_fields(rec: "Recommendation") -> None:
    """The fields of ``predictions`` / ``evidence`` that the text report reads have their types
    (a part that is absent is not read; ``recommended`` and ``pytorch_default`` are read together)."""
    parts = {"predictions": rec.predictions, "evidence": rec.evidence}
    pair = [rec.predictions.get(k) for k in ("recommended", "pytorch_default")]
    if all(pair):
        parts["predictions.recommended"], parts["predictions.pytorch_default"] = pair
    if rec.evidence.get("simulation_agreement"):
        parts["evidence.simulation_agreement"] = rec.evidence["simulation_agreement"]
    for part, spec in _READ_FIELDS.items():
        data = parts.get(part)
        if data is None:
            continue
        if not isinstance(data, dict):
            raise ValueError(f"{part} must be a dict; got {type(data).__name__}")
        for key, types in spec.items():
            required = not any(t is type(None) for t in types) and part not in ("predictions", "evidence")
            v = data.get(key)
            if (key in data or required) and (not isinstance(v, types) or isinstance(v, bool)):
                raise ValueError(f"{part}.{key} must be {' or '.join(t.__name__ for t in types)}; got {str(v)[:40]!r}")
    if not all(isinstance(m, str) for m in rec.evidence.get("fp16_fp32_modules") or []):
        raise ValueError("evidence.fp16_fp32_modules must be a list of module names")


@dataclass
class Recommendation:
    """What to train in, and why.

    Attributes:
        dtype: ``"bfloat16" | "float16" | "float32"``: the autocast dtype to use (float32 = no autocast).
        grad_scaler: None, or dict ``init_scale`` (float, a power of two), ``growth_factor``,
            ``backoff_factor``, ``growth_interval`` (int) for ``torch.amp.GradScaler`` (fp16 only).
        fp32_modules: qualified module names to run in fp32 inside autocast.
        findings: list of :class:`Finding`.
        reasons: sentences explaining the dtype choice.
        predictions: for fp16, ``{"recommended": {...}, "pytorch_default": {...}}`` with skipped,
            skip_rate, underflow_frac, subnormal_frac, final_scale (a replay on this run).
        evidence: numbers the choice rests on (device, forward peak, what-if exponents,
            simulation agreement with the run's own scaler, ...).
        device_type: ``"cuda" | "cpu"``: the device the advice is for (used by exports).
        param_dtype: ``"float32"``: the dtype to keep parameters (and so ``.grad`` and optimizer
            state) in; autocast computes in ``dtype`` over them. A GradScaler is only ever
            recommended over float32 parameters (PyTorch refuses to unscale float16 gradients).
    """

    dtype: str
    grad_scaler: dict | None = None
    fp32_modules: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    predictions: dict = field(default_factory=dict)
    evidence: dict = field(default_factory=dict)
    device_type: str = "cuda"
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}; got {self.dtype!r}")
        if self.param_dtype not in DTYPES:
            raise ValueError(f"param_dtype must be one of {DTYPES}; got {self.param_dtype!r}")
        if self.grad_scaler is not None:
            self.grad_scaler = check_grad_scaler(self.grad_scaler)
        if not isinstance(self.device_type, str) or not _DEVICE_TYPE.fullmatch(self.device_type):
            raise ValueError(f"device_type must be a torch device type such as 'cuda' or 'cpu'; got {self.device_type!r}")
        self.fp32_modules = check_module_names(self.fp32_modules)
        for name in ("findings", "reasons"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(f"{name} must be a list; got {type(getattr(self, name)).__name__}")
        for name in ("predictions", "evidence"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict; got {type(getattr(self, name)).__name__}")
        self.findings = [f if isinstance(f, Finding) else Finding.from_dict(f) for f in self.findings]
        self.reasons = [str(r) for r in self.reasons]
        self.predictions = _clean(self.predictions)
        self.evidence = _clean(self.evidence)
        _check_read_fields(self)

    # ---------------------------------------------------------------- data
    def to_dict(self) -> dict:
        """Plain data (JSON/YAML-safe); :meth:`from_dict` rebuilds an equal Recommendation."""
        return {
            "dtype": self.dtype,
            "grad_scaler": None if self.grad_scaler is None else dict(self.grad_scaler),
            "fp32_modules": list(self.fp32_modules),
            "findings": [f.to_dict() for f in self.findings],
            "reasons": list(self.reasons),
            "predictions": self.predictions,
            "evidence": self.evidence,
            "device_type": self.device_type,
            "param_dtype": self.param_dtype,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Recommendation":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: ``d`` lacks ``dtype``, or a field breaks its rule (dtypes in :data:`DTYPES`;
                ``grad_scaler`` per :func:`mpscope.schema.check_grad_scaler`; ``fp32_modules`` per
                :func:`mpscope.schema.check_module_names`); the message names the field.
        """
        if not isinstance(d, dict) or "dtype" not in d:
            raise ValueError("a Recommendation dict needs at least 'dtype' (as written by Recommendation.to_dict())")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_file(cls, path: "str | os.PathLike") -> "Recommendation":
        """Read a recommendation written by :meth:`export` with format ``json`` or ``yaml`` (by the
        file's suffix: ``.yaml`` / ``.yml`` is YAML, anything else JSON; see
        :func:`mpscope.datafile.read_data` for the limits on size and nesting).

        Raises:
            OSError: the file cannot be read.
            ValueError: naming the file: it is not valid JSON/YAML, or its content is not a valid
                recommendation (see :meth:`from_dict`; GradScaler settings must pass
                :func:`mpscope.schema.check_grad_scaler`).
        """
        data = read_data(path)
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None

    def export(self, path, format: str | None = None):
        """Write this recommendation as a config: see :func:`mpscope.export.export`. Without
        ``format`` the file's suffix decides: ``.py`` torch, ``.json`` json, ``.yaml`` / ``.yml``
        yaml; any other suffix is a ValueError."""
        from mpscope.export import export  # the one documented facade on a lower layer

        return export(self, path, format=format)

    # ---------------------------------------------------------------- views
    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    def _scaler_line(self) -> str:
        if self.grad_scaler is None:
            return "none" + (" (bfloat16 needs no loss scaling)" if self.dtype == "bfloat16" else "")
        g = self.grad_scaler
        return (f"torch.amp.GradScaler(init_scale={fmt_scale(g['init_scale'], code=True)}, growth_factor={g['growth_factor']:g}, "
                f"backoff_factor={g['backoff_factor']:g}, growth_interval={g['growth_interval']})")

    def _prediction_rows(self) -> list[tuple[str, str, str]]:
        rec, dft = self.predictions.get("recommended"), self.predictions.get("pytorch_default")
        if not rec or not dft:
            return []
        n = self.predictions.get("steps") or 0

        def pct(x):
            return "n/a" if x is None else f"{100 * x:.2f} %"

        return [
            ("skipped steps", f"{rec['skipped']} of {n} ({100 * rec['skip_rate']:.1f} %)",
             f"{dft['skipped']} of {n} ({100 * dft['skip_rate']:.1f} %)"),
            ("grads flushed to zero", pct(rec.get("underflow_frac")), pct(dft.get("underflow_frac"))),
            ("grads subnormal", pct(rec.get("subnormal_frac")), pct(dft.get("subnormal_frac"))),
            ("final scale", fmt_scale(rec["final_scale"], code=True), fmt_scale(dft["final_scale"], code=True)),
        ]

    def to_text(self, max_per_code: int = 3) -> str:
        """Plain-text report (used by ``mpscope advise`` and the demo)."""
        ev = self.evidence
        lines = ["mpscope recommendation",
                 f"  dtype:        {self.dtype}   (advice for {self.device_type}; run computed in "
                 f"{ev.get('run_dtype') or 'float32'})"]
        for r in self.reasons:
            lines.append(f"    - {r}")
        lines.append(f"  parameters:   {self.param_dtype} (autocast computes in {self.dtype} over them)"
                     if self.dtype != "float32" else f"  parameters:   {self.param_dtype}")
        lines.append(f"  grad_scaler:  {self._scaler_line()}")
        rows = self._prediction_rows()
        if rows:
            lines.append(f"  predicted on this run ({'replay of GradScaler'}):")
            lines.append(f"    {'':24s}{'recommended':>20s}{'pytorch default':>20s}")
            for a, b, c in rows:
                lines.append(f"    {a:24s}{b:>20s}{c:>20s}")
        agree = ev.get("simulation_agreement")
        if agree:
            lines.append(f"  scaler replay vs this run's GradScaler: skipped agree on {100 * agree['agree_frac']:.1f} % of "
                         f"{agree['steps']} steps (real {agree['real_skipped']}, simulated {agree['sim_skipped']})")
        lines.append(f"  fp32_modules: {', '.join(repr(m) for m in self.fp32_modules) if self.fp32_modules else 'none'}")
        if self.dtype != "float16" and ev.get("fp16_fp32_modules"):
            lines.append(f"    (to stay in fp16 instead, keep in fp32: "
                         f"{', '.join(repr(m) for m in ev['fp16_fp32_modules'])})")
        counts = {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}
        lines.append(f"  findings: {counts['error']} error, {counts['warning']} warning, {counts['info']} info")
        by_code: dict[str, list[Finding]] = {}
        for f in sorted(self.findings, key=lambda f: -SEVERITIES.index(f.severity)):
            by_code.setdefault(f.code, []).append(f)
        for code, fs in by_code.items():
            for f in fs[:max_per_code]:
                where = ", ".join(x for x in (
                    f"module '{module_label(f.module)}'" if f.module is not None else "",
                    f"{f.role} '{f.name}'" if f.role else "",
                    f"step {f.step}" if f.step is not None else "") if x)
                lines.append(f"  [{f.severity}] {f.code}" + (f" ({where})" if where else ""))
                lines.append(f"      {f.message}")
                lines.append(f"      fix: {f.fix}")
            if len(fs) > max_per_code:
                more = [f.module for f in fs[max_per_code:]]
                lines.append(f"  ... and {len(more)} more {code}: " + ", ".join(repr(m) for m in more[:12])
                             + (" ..." if len(more) > 12 else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        e = html.escape
        parts = ["<div class='mpscope-recommendation'>",
                 f"<h4>mpscope recommendation: <code>{e(self.dtype)}</code></h4><ul>"]
        parts += [f"<li>{e(r)}</li>" for r in self.reasons]
        parts.append("</ul>")
        parts.append(f"<p><b>grad_scaler</b>: <code>{e(self._scaler_line())}</code></p>")
        rows = self._prediction_rows()
        if rows:
            parts.append("<table><tr><th></th><th>recommended</th><th>pytorch default</th></tr>")
            parts += [f"<tr><td>{e(a)}</td><td>{e(b)}</td><td>{e(c)}</td></tr>" for a, b, c in rows]
            parts.append("</table>")
        mods = ", ".join(self.fp32_modules) or "none"
        parts.append(f"<p><b>fp32_modules</b>: {e(mods)}</p>")
        if self.findings:
            parts.append("<table><tr><th>severity</th><th>code</th><th>module</th><th>step</th><th>message</th><th>fix</th></tr>")
            for f in self.findings:
                parts.append(
                    f"<tr><td>{e(f.severity)}</td><td>{e(f.code)}</td><td>{e(str(f.module))}</td>"
                    f"<td>{e(str(f.step))}</td><td>{e(f.message)}</td><td>{e(f.fix)}</td></tr>")
            parts.append("</table>")
        else:
            parts.append("<p>No findings.</p>")
        parts.append("</div>")
        return "".join(parts)


def _op_findings(run: Any, t) -> list[Finding]:
    """Op-level findings (:func:`mpscope.advisor.op_findings.op_findings`) when the run holds
    ``op_output`` rows or op tables (``record(..., ops=True)``)."""
    tables = getattr(run, "tables", None) or {}
    if not ((t.role == "op_output").any() or "op_facts" in tables or "ops" in tables):
        return []
    return op_findings(run)


def _grad_underflow_fix(f, k_max: int, scale: float | None):
    """A grad_underflow seen at a loss scale (``scale``, the step's) that the gradients' own maximum
    forbids raising: say so, and point to bf16 instead of a larger loss scale (the largest safe
    scale is 2^k_max, from the what-if)."""
    if f.code != "grad_underflow" or f.severity == "info" or scale is None or not math.isfinite(scale) or scale <= 0:
        return f
    if scale < math.ldexp(1.0, k_max):
        return f
    return dataclasses.replace(f, fix=(
        f"A larger loss scale cannot help: it was already 2^{int(round(math.log2(scale)))} and the largest "
        f"gradients allow at most 2^{k_max} (one binade below 65504), so this gradient's range is wider than "
        "fp16 holds at any single scale. Train in bfloat16 (8 exponent bits), or keep this module in fp32."))


def _missing_evidence(c: Context, init: dict | None) -> list[Finding]:
    """What the advice cannot rest on: gradient evidence (no gradient roles recorded, or none with a
    finite non-zero value: the what-if has nothing to shift) and forward evidence (no finite
    activation value). One ``missing_evidence`` finding per gap, naming the roles and what to do."""
    t = c.t
    out = []
    if init is None and not _inference_only(c):  # (a run that trains nothing needs no loss scale)
        recorded = sorted(set(t.role) & set(GRAD_ROLES))
        if not recorded:
            what = ("the gradient roles activation_grad and param_grad were not recorded (roles="
                    f"{sorted(set(t.role))})")
            fix = "record again with the default roles, or roles including 'activation_grad' and 'param_grad'"
        else:
            what = f"the recorded gradients ({', '.join(recorded)}) hold no finite non-zero value"
            fix = "fix the first non-finite value (see first_nonfinite) or the all-zero gradients, then record again"
        out.append(Finding("missing_evidence", "warning", None, None, None, None, None, None,
                           f"cannot tell whether fp16 gradients fit a loss scale: {what}; PyTorch's GradScaler "
                           "defaults are kept as the safe choice", fix))
    act = t[t.role == "activation"]
    if not act.absmax.notna().any():
        what = ("no activation was recorded" if act.empty else
                "no recorded activation holds a finite value")
        out.append(Finding("missing_evidence", "warning", None, None, None, None, None, None,
                           f"cannot tell whether the forward pass fits fp16: {what}",
                           "record with roles including 'activation', after fixing any non-finite forward pass"))
    return out


def _shadow_choice(run: Run, findings: list[Finding], dtype: str, fp32_modules: list[str],
                  evidence: dict) -> tuple[list[str], list[str]]:
    """(fp32_modules, reasons to add) when the run has an fp32 shadow: the range-based modules (if
    any) plus the modules whose measured own contribution restores the output's SQNR
    (:func:`~mpscope.advisor.precision.shadow_fp32_modules`), when the advice keeps the dtype the
    shadow measured; ``evidence`` records which evidence was used."""
    choice = shadow_fp32_modules(run, findings)
    evidence["shadow"] = choice
    if not choice or choice["format"] != dtype:
        if choice and choice["modules"]:
            return fp32_modules, [f"the fp32 shadow measured {choice['format']}, not the advised {dtype}: its "
                                  f"culprits ({', '.join(repr(m) for m in choice['modules'])}) are not applied"]
        return fp32_modules, []
    added = [m for m in choice["modules"] if m not in fp32_modules]
    if not added:
        return fp32_modules, []
    evidence["fp32_modules_from"] = "fp32 shadow" + (" and activation ranges" if fp32_modules else "")
    return fp32_modules + added, [
        f"fp32 shadow: keeping {', '.join(repr(m) for m in added)} in float32 removes the largest measured own "
        f"contributions to error; network output at {db_text(choice['output_sqnr_db'])} SQNR, predicted "
        f"{db_text(choice['predicted_output_sqnr_db'])} after (target {choice['target_db']:.1f} dB)"]


def advise(run: Run, rank: int | None = None) -> Recommendation:
    """Turn a recorded run into a :class:`Recommendation`.

    Steps: module-level findings (:mod:`mpscope.advisor.findings`) and op-level findings
    (:func:`mpscope.ops.op_findings` when ``op_output`` rows exist); the loss-scale what-if
    (:func:`~mpscope.advisor.scaler.choose_init_exponent`); the dtype choice
    (:func:`~mpscope.advisor.dtype.choose_dtype`); with an fp32 shadow (``record(..., shadow=True)``)
    ``precision_loss`` findings and fp32 modules chosen by measured own contribution
    (:mod:`mpscope.advisor.precision`; ``evidence["fp32_modules_from"]`` says which evidence chose
    them); for fp16 the GradScaler settings and the replayed
    prediction next to PyTorch's defaults (:func:`~mpscope.advisor.scaler.choose_scaler`).

    Args:
        run: the recorded :class:`~mpscope.run.Run` (a merged multi-rank Run: findings that rest on
            one rank's data, first non-finite and stale gradients, name it in ``Finding.rank``).
        rank: advise on rank ``rank``'s own rows of a multi-rank run (``run.for_rank(rank)``);
            None: the run as given.

    Raises:
        TypeError: ``run`` is not an mpscope Run, or ``rank`` is not an int.
        ValueError: the run holds no recorded tensors; ``rank`` is not one of ``run.ranks`` or its
            rows are not at hand (see :meth:`mpscope.Run.for_rank`).
    """
    run = select_rank(run, rank)
    c = Context(run)
    if c.t.empty:
        raise ValueError("the run holds no recorded tensors: record at least one step inside "
                         "`with mpscope.record(model, ...)` before calling advise()")
    findings = module_findings(c)
    findings += loop_findings(c)
    findings += accumulation_precision(c)
    findings += _op_findings(run, c.t)
    findings += op_precision_findings(run)
    findings = superseded_by_the_engine(findings + forensic_findings(run))
    findings = point_to_causes(findings, run)
    shadowed = hasattr(run, "precision") and not run.precision.empty
    if shadowed:
        findings += precision_findings(run)
    lossy = recording_flushed_gradients(c)
    try:
        init = choose_init_exponent(run, lossy=lossy)
    except ValueError:
        init = None
    d = _engine_dtype(choose_dtype(c, findings, init), run, c)
    missing = _missing_evidence(c, init)
    findings += missing
    if lossy and init is not None:
        d.reasons.append(
            "this recording already flushed fp16 gradients to zero (see grad_underflow), so the what-if cannot "
            f"see the smallest ones: the largest safe scale 2^{init.k_max} is used; record again at that scale "
            "(or in bf16/fp32) for a sharper choice")
    evidence: dict = {
        "device": c.meta.get("device"),
        "cuda_capability": c.meta.get("cuda_capability"),
        "run_dtype": c.autocast,
        "steps": c.n_steps,
        "forward_absmax": d.forward_absmax,
        "forward_absmax_module": d.forward_absmax_module,
        "fp16_forward_ok": d.fp16_forward_ok,
        "fp16_grad_ok": d.fp16_grad_ok,
        "bf16_fast": d.bf16_fast,
        "fp16_fp32_modules": d.fp16_fp32_modules,
        "whatif": None if init is None else init.to_dict(),
    }
    if c.scaler and len(c.s):
        try:
            evidence["simulation_agreement"] = scaler_agreement(run)
        except ValueError:
            pass
    grad_scaler, predictions, scaler_reasons = None, {}, []
    if d.dtype == "float16" and init is not None and len(c.s):
        ch = choose_scaler(run, lossy=lossy)
        grad_scaler, predicted = ch.config, ch.predicted
        kept = _own_scaler(c, run, ch)
        if kept is not None:
            (grad_scaler, predicted), why = kept
            scaler_reasons.append(why)
        predictions = {"steps": c.n_steps, "recommended": predicted, "pytorch_default": ch.pytorch_default,
                       "candidates": ch.candidates}
    elif d.dtype == "float16" and init is not None:
        grad_scaler = dict(GRAD_SCALER_DEFAULTS, init_scale=math.ldexp(1.0, init.k))
    elif d.dtype == "float16":  # no gradient evidence: cannot tell, so the safe default stays
        grad_scaler = dict(GRAD_SCALER_DEFAULTS)
    if grad_scaler is not None and any(f.code == "loss_scale" for f in findings):
        grad_scaler, findings, why = _bookkeeping_first(c, findings)
        scaler_reasons.append(why)
        predictions = {}
    evidence["missing"] = [f.message for f in missing]
    evidence["fixes"] = verified_fixes(run)
    scales = [f["init_scale"] for f in evidence["fixes"] if f["verified"] and f["init_scale"]]
    if grad_scaler is not None and scales and max(scales) > grad_scaler["init_scale"]:  # (the engine's replay)
        grad_scaler = dict(grad_scaler, init_scale=max(scales))
        scaler_reasons.append(f"init_scale 2^{math.log2(max(scales)):g}: precision forensics replayed a recorded "
                              "step's backward at that scale and the gradients that underflowed to 0 do not")
    fp32_modules, shadow_reasons = d.fp32_modules, []
    evidence["fp32_modules_from"] = "activation ranges" if fp32_modules else None
    if shadowed:
        fp32_modules, shadow_reasons = _shadow_choice(run, findings, d.dtype, fp32_modules, evidence)
    if init is not None and len(c.s):
        scale_at = dict(zip(c.s.step.astype(int), c.s.loss_scale.astype(float)))
        findings = [_grad_underflow_fix(f, init.k_max, scale_at.get(f.step)) for f in findings]
    ok = make_coherent(c, findings, d.dtype, fp32_modules, grad_scaler, init, d.reasons + shadow_reasons + scaler_reasons)
    if _inference_only(c):  # nothing was trained: no loss scale to advise
        ok = dataclasses.replace(ok, grad_scaler=None)
    verified = [m for f in evidence["fixes"] if f["verified"] and not f["dtype"] for m in f["fp32_modules"]]
    if ok.dtype != "float32" and any(m not in ok.fp32_modules for m in verified):  # (the engine's replayed fixes)
        ok = dataclasses.replace(ok, fp32_modules=ok.fp32_modules + [m for i, m in enumerate(verified)
                                                                     if m not in ok.fp32_modules and m not in verified[:i]])
    return Recommendation(
        dtype=ok.dtype, grad_scaler=ok.grad_scaler, fp32_modules=ok.fp32_modules, findings=ok.findings,
        reasons=ok.reasons, predictions=predictions, evidence=evidence, device_type=c.device,
        param_dtype=ok.param_dtype,
    )


def _run_scaler(c: Context) -> dict | None:
    """The settings of the run's own GradScaler (``GRAD_SCALER_DEFAULTS``' keys), None without an enabled one."""
    own = c.meta.get("scaler") or {}
    if not own.get("enabled") or any(k not in own for k in GRAD_SCALER_DEFAULTS):
        return None
    return {k: own[k] for k in GRAD_SCALER_DEFAULTS}


def _bookkeeping_first(c: Context, findings: list):
    """A loss-scale bookkeeping finding makes the recorded gradients wrong by the scale, so the skips
    they caused advise no GradScaler setting: the run's own settings (else PyTorch's defaults) stay,
    and the findings about skipped steps point to it. Returns (settings, findings, reason)."""
    keep = _run_scaler(c) or dict(GRAD_SCALER_DEFAULTS)
    note = ("Fix the loss-scale bookkeeping first (see loss_scale): the gradients carry a wrong factor, so these "
            "skipped steps say nothing about the GradScaler's settings.")
    findings = [dataclasses.replace(f, fix=note) if f.code in ("init_scale_too_high", "scale_collapse") else f
                for f in findings]
    return keep, findings, ("the run's own GradScaler settings are kept: a loss-scale bookkeeping finding "
                            "(loss_scale) makes the recorded gradients wrong by the scale, so their skipped steps "
                            "advise no setting")


def _own_scaler(c: Context, run, ch):
    """((config, prediction), reason) of the run's own GradScaler settings when its fp16 run's replay
    with them skips no more steps than with the chosen ones and leaves no more gradient elements below
    fp16's normal range (within UNDERFLOW_TOL): a change needs evidence for it. None otherwise."""
    cfg = _run_scaler(c)
    if c.autocast != "float16" or cfg is None or cfg == ch.config:
        return None
    p = predict(run, cfg)
    if p["skipped"] > ch.predicted["skipped"] or not below_normal(p) <= below_normal(ch.predicted) + UNDERFLOW_TOL:
        return None
    return (cfg, p), (f"the run's own GradScaler settings are kept: replayed on this run they skip {p['skipped']} "
                      f"step(s) (the what-if's choice: {ch.predicted['skipped']}) and leave no more gradients below "
                      "fp16's normal range")


def _engine_dtype(d, run, c):
    """float16 chosen while precision forensics verified, by replaying a step, that bfloat16 repairs an
    error no float32 module does: bfloat16, and the reason. And the other way: bfloat16 chosen for an
    fp16 run only because its gradients fit no loss scale (or none was finite), while the engine verified float32 modules
    that repair an error of the forward, whose values every gradient is computed from: float16 with
    those modules in float32 (the gradients measured are those of the error)."""
    fixes = verified_fixes(run)
    mods = [m for f in fixes if f["verified"] and not f["dtype"] and f["phase"] in ("forward", "eval", "loss")
            for m in f["fp32_modules"]]
    if d.dtype == "bfloat16" and c.autocast == "float16" and d.fp16_forward_ok and d.fp16_grad_ok is not True and mods:
        keep = list(dict.fromkeys(d.fp16_fp32_modules + mods))
        return dataclasses.replace(d, dtype="float16", fp32_modules=keep, reasons=d.reasons + [
            f"float16 kept: precision forensics verified {', '.join(repr(m) for m in dict.fromkeys(mods))} in float32 "
            "as the repair of an error in the forward, and the gradients that fit no loss scale are computed from "
            "it; record again with that fix to check the GradScaler settings"])
    if d.dtype != "float16" or not any(f["verified"] and f["dtype"] == "bfloat16" for f in fixes):
        return d
    which = sorted({f"{f['code']} at {f['op']} in '{f['module']}'" for f in fixes if f["dtype"] == "bfloat16"})
    return dataclasses.replace(d, dtype="bfloat16", fp32_modules=[], reasons=d.reasons + [
        f"bfloat16: precision forensics replayed a recorded step in it and it repairs {', '.join(which)}, which "
        "float16 with any module in float32 does not"])


def _inference_only(c: Context) -> bool:
    """The run trained nothing: no optimizer and no gradient rows (a sampler, an evaluation)."""
    roles = set(c.t.role.astype(str)) if len(c.t) else set()
    if c.meta.get("optimizer") is not None or roles & {"param_grad", "activation_grad"}:
        return False
    ops = getattr(c.run, "tables", {}).get("ops")  # (op recording tells a no_grad pass: phase "eval")
    return ops is not None and len(ops) > 0 and set(ops.phase.astype(str)) == {"eval"}


def try_advise(run: Run) -> tuple[Recommendation | None, Exception | None]:
    """``(advise(run), None)``, or ``(None, the exception)`` when advising raises.

    For the places that must keep a run whatever the advisor makes of it (the explorer, the report,
    the magic and the framework callbacks): they show or save the run and say why there is no
    recommendation.
    """
    try:
        return advise(run), None
    except Exception as exc:  # any failure of the advisor on this run: the caller keeps the run
        return None, exc
