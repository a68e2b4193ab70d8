"""mpscope.apply proves the advice: record -> advise -> apply -> record again, on every case whose
fix is configurable. After applying, the error-level findings are gone and the loss is finite and
decreasing. Also: apply with the loop's own settings leaves training bitwise unchanged, and every
patch is removed on exit and on exception."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mpscope

from . import breadth as B
from . import scenarios as S

CPU = "cpu"


def _loop(model, opt, loss_fn, steps, scaler_cfg=None, clip_first=False, record=True, apply=None, **rec_kw):
    """A standard loop (autocast inside loss_fn, a GradScaler when scaler_cfg is not None); returns
    (losses, run). ``apply`` wraps everything, so the GradScaler is made inside it."""
    losses = []
    with contextlib.ExitStack() as st:
        if apply is not None:
            st.enter_context(mpscope.apply(model, apply))
        scaler = torch.amp.GradScaler(CPU, **scaler_cfg) if scaler_cfg is not None else None
        rec = st.enter_context(mpscope.record(model, optimizer=opt, scaler=scaler, **rec_kw)) if record else None
        for _ in range(steps):
            opt.zero_grad()
            loss = loss_fn()
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                if clip_first:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            losses.append(float(loss.detach()))
    return losses, (rec.run if rec else None)


def _c01(apply=None):
    torch.manual_seed(0)
    model = S.C01Model()
    ids, tgt = torch.randint(0, 100, (8, 32)), torch.randint(0, 100, (8, 32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_fn():
        with torch.autocast(CPU, dtype=torch.float16):
            logits = model(ids)
        return F.cross_entropy(logits.float().reshape(-1, 100), tgt.reshape(-1))

    return _loop(model, opt, loss_fn, 6, apply=apply)


def _c05(apply=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 1))
    x, y = torch.rand(16, 10) * 131070, torch.randn(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def loss_fn():
        with torch.autocast(CPU, dtype=torch.float16):
            out = model(x)
        return F.mse_loss(out.float(), y)

    return _loop(model, opt, loss_fn, 6, apply=apply)


def _c06(apply=None):
    model, x, y = S.c06_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return _loop(model, opt, lambda: S.c06_loss(model, x, y), 12, scaler_cfg={"init_scale": 1.0}, apply=apply,
                 roles=S.GRAD_ROLES)


def _c07(apply=None):
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    x = torch.randn(64, 16)
    y = x @ torch.randn(16, 1) * 0.5
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn():
        with torch.autocast(CPU, dtype=torch.float16):
            out = model(x)
        return F.mse_loss(out.float(), y)

    return _loop(model, opt, loss_fn, 20, scaler_cfg={"init_scale": 2.0**16}, clip_first=True, apply=apply)


def _c08(apply=None):
    model, x, y = S.c08_setup()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def loss_fn():
        with torch.autocast(CPU, dtype=torch.float16):
            out = model(x)
        return F.mse_loss(out.float(), y)

    return _loop(model, opt, loss_fn, 120, scaler_cfg=S.C08_SCALER, apply=apply, roles=S.GRAD_ROLES)


def _c09(apply=None):
    torch.manual_seed(0)
    model = nn.Embedding(10, 4).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    ids = torch.tensor([1, 2, 3])
    return _loop(model, opt, lambda: model(ids).float().pow(2).sum(), 5, apply=apply)


def _c10(apply=None):
    torch.manual_seed(0)
    model = S.C10Model(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=6e-4)
    return _loop(model, opt, lambda: model(), 20, apply=apply)


def _c13(apply=None):
    d = B.c13_train("mlp", apply=apply)
    return d.losses, d.run


def _c15(apply=None):
    d = B.c15_train(apply=apply)
    return d.losses, d.run


CASES = {"C01": _c01, "C05": _c05, "C06": _c06, "C07": _c07, "C08": _c08, "C09": _c09, "C10": _c10,
         "C13": _c13, "C15": _c15}
#: the finding each case is about (an error, or the warning the case is built around)
TARGET = {"C01": "forward_overflow", "C05": "forward_overflow", "C06": "grad_underflow",
          "C07": "clip_before_unscale", "C08": None, "C09": "optimizer_state_precision",
          "C10": "stagnant_low_precision_weights", "C13": "grad_norm_overflow", "C15": "pole"}
RESULTS: dict = {}


@pytest.mark.parametrize("case", list(CASES))
def test_apply_round_trip(case):
    train = CASES[case]
    before_losses, before_run = train()
    before = mpscope.advise(before_run)
    target = TARGET[case]
    if target is not None:
        assert target in {f.code for f in before.findings}, before.to_text()
    after_losses, after_run = train(apply=before)
    after = mpscope.advise(after_run)
    RESULTS[case] = {"before_errors": sorted({f.code for f in before.errors}),
                     "after_errors": sorted({f.code for f in after.errors}),
                     "loss_before": (before_losses[0], before_losses[-1]),
                     "loss_after": (after_losses[0], after_losses[-1]),
                     "skipped_before": int(before_run.steps.skipped.sum()),
                     "skipped_after": int(after_run.steps.skipped.sum())}
    print(case, RESULTS[case])
    assert not after.errors, after.to_text()
    if target is not None:
        assert target not in {f.code for f in after.findings}, after.to_text()
    assert all(math.isfinite(v) for v in after_losses) and after_losses[-1] < after_losses[0]


def test_apply_with_the_loops_own_settings_is_bitwise_unchanged():
    """C08's loop under apply(Recommendation = float16 + its own GradScaler settings, no fp32 modules)
    gives bitwise the same losses and weights as the plain loop."""
    own = mpscope.Recommendation(dtype="float16", device_type="cpu",
                                 grad_scaler={"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5,
                                              "growth_interval": 50})
    runs = []
    for apply in (None, own):
        model, x, y = S.c08_setup()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def loss_fn(model=model, x=x, y=y):
            with torch.autocast(CPU, dtype=torch.float16):
                out = model(x)
            return F.mse_loss(out.float(), y)

        losses, _ = _loop(model, opt, loss_fn, 60, scaler_cfg=S.C08_SCALER, record=False, apply=apply)
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (l0, w0), (l1, w1) = runs
    assert l0 == l1
    assert all(B.bitwise_equal(a, b) for a, b in zip(w0, w1))


def _patched_state(model):
    import torch.nn.utils.clip_grad as cg

    return (torch.amp.autocast_mode.autocast.__init__, torch.amp.GradScaler.__init__, cg._clip_grads_with_norm_,
            cg.clip_grad_norm_, len(model._forward_hooks), len(model._forward_pre_hooks),
            tuple("forward" in m.__dict__ for m in model.modules()))


def test_apply_removes_everything_on_exit_and_on_exception():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    rec = mpscope.Recommendation(dtype="bfloat16", fp32_modules=["1"], device_type="cpu")
    clean = _patched_state(model)
    with mpscope.apply(model, rec) as applied:
        assert _patched_state(model) != clean
        with torch.autocast(CPU, dtype=torch.float16):  # the loop's dtype is overridden
            assert torch.get_autocast_dtype(CPU) == torch.bfloat16
            out = model(torch.randn(2, 4))
        assert out.dtype == torch.bfloat16
        scaler = torch.amp.GradScaler(CPU)
        assert not scaler.is_enabled() and applied.scalers == [scaler]  # bf16: no loss scaling
    assert _patched_state(model) == clean
    with pytest.raises(RuntimeError, match="boom"):
        with mpscope.apply(model, rec):
            model(torch.randn(2, 4))
            raise RuntimeError("boom")
    assert _patched_state(model) == clean and not torch.is_autocast_enabled(CPU)
    with pytest.raises(ValueError, match="not modules of this model"):
        mpscope.apply(model, mpscope.Recommendation(dtype="float16", fp32_modules=["nope"]))


def test_fp32_module_runs_in_fp32_and_casts_back():
    seen = {}

    class Probe(nn.Linear):
        def forward(self, x):
            out = super().forward(x)
            seen.update(inp=x.dtype, out=out.dtype)
            return out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Probe(8, 8), nn.Linear(8, 1))
    outside = {}
    model[1].register_forward_hook(lambda m, i, o: outside.update(inp=i[0].dtype, out=o.dtype))
    rec = mpscope.Recommendation(dtype="float16", fp32_modules=["1"], device_type="cpu",
                                 grad_scaler={"init_scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.5,
                                              "growth_interval": 100})
    with mpscope.apply(model, rec):
        out = model(torch.randn(2, 4))  # no autocast in the loop: apply enters it per forward
        scaler = torch.amp.GradScaler(CPU)
    assert seen == {"inp": torch.float32, "out": torch.float32}  # inside: fp32, autocast off
    assert outside == {"inp": torch.float16, "out": torch.float16} and out.dtype == torch.float16  # cast back
    assert scaler.get_scale() == 2.0**10 and scaler.get_growth_interval() == 100
