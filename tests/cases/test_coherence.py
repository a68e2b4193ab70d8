"""Recommendation coherence, as a property over every case in tests/cases: the exported config,
applied by itself, addresses every error-level finding, and the recommendation never contradicts
its own findings. The rules are checked from the run's own rows and PyTorch casts, not from the
advisor's code."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import mpscope

from . import accumulation as A
from . import breadth as B
from . import scenarios as S

LOOP_FIX = {  # finding code -> what the torch export's train_step() must contain
    "clip_before_unscale": ["scaler.unscale_(optimizer)\n        torch.nn.utils.clip_grad_norm_"],
    "amp_misuse": ["scaler.step(optimizer)", "scaler.update()"],
    "stale_forward": ["    with autocast():\n        output = model("],  # the forward runs every step
    "stale_grad": ["optimizer.zero_grad("],
}
CONSEQUENCES = ("first_nonfinite", "scale_collapse")
PARAM_CODES = ("optimizer_state_precision", "stagnant_low_precision_weights", "grad_norm_overflow")
RANGE_OP_CODES = ("forward_overflow", "mask_overflow", "log_of_zero", "norm_statistics")
#: precision forensics' mechanisms (mpscope.recording.root_cause.MECHANISMS; lost_constant has its rule above)
ENGINE_CODES = ("overflow", "underflow", "swamping", "cancellation", "saturation", "domain", "resolution",
                "decision_flip", "loss_scale")


def _runs():
    from .test_c02_mask_overflow import Attention, _inputs, _record
    from .test_c03_layernorm_eps import _scenario as c03
    from .test_c04_rmsnorm_variance import _scenario as c04
    from .test_c11_rotary_positions import _scenario as c11
    from .test_c12_log_softmax import _train as c12

    scores, mask, _, _ = _inputs()
    yield "C01", S.c01().run
    yield "C02", _record(Attention(), scores, mask)[0]
    yield "C03", c03(1e-12)[0]
    yield "C04", c04()[0]
    yield "C05", S.c05().run
    yield "C06@1", S.c06(1.0).run
    yield "C06@2^16", S.c06(2.0**16).run
    yield "C07", S.c07().bad.run
    yield "C08", S.c08().run
    yield "C09", S.c09().bad.run
    yield "C10", S.c10().bad.run
    yield "C11", c11(torch.float16)
    yield "C12", c12(fixed=False)
    yield "C13", B.c13("mlp").run
    yield "C13-conv", B.c13("conv").run
    yield "C14", B.c14().run
    yield "C14-fp16", B.c14(torch.float16).run
    yield "C14-rotary", B.c14_rotary().run
    yield "C15", B.c15().run
    yield "C15-atanh", B.c15_hyperbolic().run
    yield "C16", B.c16().run
    yield "C16-unscale", B.c16("unscale_then_step").run
    yield "C17", B.c17().run
    yield "C17-fp16", B.c17("fp16_conv").run
    yield "ACC-grad", A.grad_accum().run
    yield "ACC-ema", A.ema().run


def _covered(module, fp32_modules):
    return module is not None and any(m == module or m == "" or module.startswith(m + ".") for m in fp32_modules)


def _lost_in_bf16(value, boundary) -> bool:
    return float(torch.tensor(value, dtype=torch.float64).to(torch.bfloat16)) == boundary


def _grad_max(run) -> float:
    """Largest finite unscaled |gradient| in the run's own rows (absmax / loss_scale); on steps with
    a clip, parameter gradients as the clip received them (steps.clip_grad_absmax), not after it."""
    t, s = run.tensors, run.steps
    clipped = set(s.step[s.clip_norm.notna()])
    g = t[t.role.astype(str).isin(["activation_grad", "param_grad"])]
    g = g[~((g.role.astype(str) == "param_grad") & g.step.isin(clipped))]
    v = (g.absmax.astype(float) / g.loss_scale.astype(float)).to_numpy()
    raw = (s.clip_grad_absmax / np.where(s.clipped_before_unscale, s.loss_scale, 1.0)).to_numpy()
    v = np.concatenate([v, raw])
    v = v[np.isfinite(v) & (v > 0)]
    return float(v.max()) if len(v) else math.nan


def test_recommendations_are_coherent_over_every_case(tmp_path):
    problems, checked = [], 0
    engine = os.environ.get("MPSCOPE_CASES_ENGINE") == "1"
    for case, run in _runs():
        assert not engine or "forensics" in run.tables, case  # (the engine ran where it was asked to)
        rec = mpscope.advise(run)
        cfg = mpscope.Recommendation.from_dict(rec.to_dict())  # what the exported config holds
        path = tmp_path / f"{case}.py"
        rec.export(path, format="torch")
        export = path.read_text()

        def bad(rule, why):
            problems.append(f"{case}: {rule}: {why}")

        # rule: fp16 always gets a GradScaler; other dtypes none; never over float16 parameters
        if (cfg.dtype == "float16") != (cfg.grad_scaler is not None):
            bad("scaler", f"dtype {cfg.dtype} with grad_scaler {cfg.grad_scaler}")
        if cfg.grad_scaler is not None and cfg.param_dtype != "float32":
            bad("fp16 params", f"GradScaler over {cfg.param_dtype} parameters")
        # rule: init_scale = the largest scale keeping the largest recorded gradient a binade below 65504,
        # unless the run's own settings are kept: then GradScaler's replay with them skips no more steps
        # (with a loss-scale bookkeeping finding the recorded gradients carry a wrong factor: kept as they are)
        gmax = _grad_max(run)
        own = (run.meta.get("scaler") or {})
        if any("own GradScaler settings are kept" in r for r in cfg.reasons):
            from mpscope.advisor.scaler import predict

            mine = {k: own[k] for k in cfg.grad_scaler}
            binade = dict(cfg.grad_scaler, init_scale=2.0 ** (14 - math.floor(math.log2(gmax))))
            bookkeeping = any(f.code == "loss_scale" for f in cfg.findings)  # (its skips advise nothing)
            if mine != cfg.grad_scaler or (not bookkeeping and
                                           predict(run, mine)["skipped"] > predict(run, binade)["skipped"]):
                bad("init_scale", f"kept {mine} against {cfg.grad_scaler}, or it skips more than 2^14/gmax")
        elif cfg.grad_scaler is not None and math.isfinite(gmax) and not run.histograms.empty:
            s = cfg.grad_scaler["init_scale"]
            if not (2.0**14 <= gmax * s < 2.0**15):
                bad("init_scale", f"2^{math.log2(s):g} puts the largest gradient {gmax:.3g} at {gmax * s:.3g}")
            p = rec.predictions  # at or above PyTorch's 2^16, never more subnormals than its default
            if s >= 2.0**16 and p.get("recommended") and \
                    p["recommended"]["subnormal_frac"] > p["pytorch_default"]["subnormal_frac"] + 1e-9:
                bad("init_scale", "predicts more subnormal gradients than PyTorch's default")
        pole_in_bf16 = [f for f in cfg.findings if f.code == "lost_constant" and _lost_in_bf16(f.value, f.threshold)]
        for f in cfg.findings:
            if f.code == "accumulation_precision" and f.role == "param_grad" and cfg.param_dtype != "float32":
                bad(f.code, "gradients accumulate in a 16-bit .grad and the parameters are not kept in float32")
            if f.severity != "error":
                continue
            checked += 1
            if f.code in LOOP_FIX:
                if not all(x in export for x in LOOP_FIX[f.code]):
                    bad(f.code, "the torch export's train_step() does not show the loop fix")
            elif f.code in PARAM_CODES:
                if cfg.param_dtype != "float32":
                    bad(f.code, "parameters not kept in float32")
            elif f.code in ("pole", "lost_constant") and f.role == "optimizer_update":  # (the engine: the
                if cfg.param_dtype != "float32":  # optimizer's 16-bit state loses the constant)
                    bad(f.code, "a constant the optimizer's 16-bit state loses needs float32 master weights")
            elif f.code in ("pole", "lost_constant"):
                if not (_covered(f.module, cfg.fp32_modules) or cfg.dtype == "float32"):
                    bad(f.code, f"module {f.module!r} not in fp32_modules {cfg.fp32_modules}")
                if f.code == "lost_constant" and cfg.dtype == "bfloat16" and _lost_in_bf16(f.value, f.threshold) \
                        and not _covered(f.module, cfg.fp32_modules):
                    bad(f.code, "bf16 offered although the constant rounds the same way in bf16")
            elif f.code in ENGINE_CODES:  # precision forensics: its module in float32, never the root
                if f.role == "optimizer_update":
                    if cfg.param_dtype != "float32":
                        bad(f.code, "the optimizer step's lost updates need float32 master weights")
                elif f.code == "loss_scale":
                    if f.module is not None:
                        bad(f.code, "loss-scale bookkeeping is a loop fix, no module's")
                elif f.module and cfg.dtype != "float32" and not _covered(f.module, cfg.fp32_modules) \
                        and "No config fixes this" not in f.fix:
                    bad(f.code, f"module {f.module!r} not in fp32_modules {cfg.fp32_modules}")
                if "" in cfg.fp32_modules:
                    bad(f.code, "the root in float32 (no mixed precision at all)")
            elif f.code in RANGE_OP_CODES or f.code == "activation_headroom":
                if cfg.dtype == "float16" and not _covered(f.module, cfg.fp32_modules):
                    bad(f.code, f"fp16 kept but module {f.module!r} not in fp32_modules {cfg.fp32_modules}")
                if cfg.dtype == "bfloat16" and f.value is not None and math.isfinite(f.value) \
                        and abs(f.value) >= torch.finfo(torch.bfloat16).max:
                    bad(f.code, "bf16 cannot hold the value either")
            elif f.code in CONSEQUENCES:
                others = [g for g in cfg.findings if g.severity == "error" and g.code not in CONSEQUENCES]
                if not others and cfg.dtype == "float16" and not _covered(f.module, cfg.fp32_modules) \
                        and f.role not in ("param_grad", "activation_grad", "weight", "optimizer_state", None):
                    bad(f.code, "a non-finite forward with nothing in the config to address it")
            else:
                bad(f.code, "error code without a coherence rule")
            # rule: no "train in bfloat16" / "raise the loss scale" where bf16 loses the same constant
            if pole_in_bf16 and re.search(r"[Tt]rain in bfloat16|or bfloat16|[Rr]aise the loss scale", f.fix):
                bad(f.code, f"fix offers what the pole's own data rule out: {f.fix!r}")
    assert checked >= 20  # the property is exercised, not vacuous
    assert not problems, "\n".join(problems)


def test_recommendations_stay_coherent_with_precision_forensics_on_in_every_case():
    """The same rules over every case recorded with ``ops=True, shadow=True`` (a fresh process: the
    case builders cache their runs)."""
    env = dict(os.environ, MPSCOPE_CASES_ENGINE="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"{__file__}::test_recommendations_are_coherent_over_every_case"],
                       capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, r.stdout[-4000:]
