"""The fp32 shadow (record(..., shadow=True)): its numbers against a hand-run float32 forward, and
training left bitwise unchanged."""

from __future__ import annotations

import copy
import math
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import mpscope


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """The oracle: NumPy float64 on the two tensors."""
    r = ref.detach().double().numpy()
    d = x.detach().double().numpy() - r
    noise = float((d * d).sum())
    return math.inf if noise == 0 else 10 * math.log10(float((r * r).sum()) / noise)


def _outputs(model, x, autocast_dtype=None):
    """Each child's output in a plain forward (float32, or under CPU autocast), by module name."""
    outs, hooks = {}, []
    for name, mod in model.named_children():
        hooks.append(mod.register_forward_hook(lambda m, a, o, name=name: outs.__setitem__(name, o.detach().clone())))
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        outs[""] = model(x).detach().clone()
    for h in hooks:
        h.remove()
    return outs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_errors_equal_a_hand_run_fp32_forward(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 48), nn.Softmax(-1), nn.Linear(48, 8))
    x = torch.randn(16, 24) * 3
    ref = _outputs(model, x)
    real = _outputs(model, x, dtype)
    with mpscope.record(model, shadow=True) as rec:
        with torch.autocast("cpu", dtype=dtype):
            model(x)
        rec.step()
    p = rec.run.precision.set_index("module")
    assert sorted(p.index) == sorted(ref)
    assert (p.role == "activation").all() and (p.name == "output").all() and (p.step == 0).all()
    for name in ref:
        row = p.loc[name]
        d = (real[name].double() - ref[name].double()).abs()
        assert row["dtype"] == str(real[name].dtype).removeprefix("torch.")
        assert row.sqnr_db == pytest.approx(_sqnr(ref[name], real[name]), rel=1e-9)
        assert row.max_abs_err == pytest.approx(float(d.max()), rel=1e-12)
        assert row.ref_absmax == pytest.approx(float(ref[name].abs().max()), rel=1e-12)
        assert row.max_rel_err == pytest.approx(float(d.max() / ref[name].abs().max()), rel=1e-12)
    # own contribution of each child: that child alone, fed the reference's input rounded to the
    # dtype its real input had, under the same autocast
    children = dict(model.named_children())
    prev_ref, prev_real = x, x
    for name, mod in children.items():
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            own = mod(prev_ref.to(prev_real.dtype))
        assert p.loc[name].own_sqnr_db == pytest.approx(_sqnr(ref[name], own), rel=1e-9)
        prev_ref, prev_real = ref[name], real[name]
    # the root's inputs are the batch: its own contribution is its whole error
    assert p.loc[""].own_sqnr_db == p.loc[""].sqnr_db
    assert p.loc["0"].own_sqnr_db == p.loc["0"].sqnr_db  # the first layer inherits nothing
    assert p.loc["2"].own_sqnr_db > p.loc["2"].sqnr_db  # later ones inherit their input's error


class _Cast(nn.Module):
    """Casts to the autocast dtype while autocast is on (what 'activations in bf16' means)."""

    def forward(self, x):
        return x.to(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else x


def test_exact_layers_report_infinite_sqnr():
    torch.manual_seed(0)
    up, down = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        up.weight.copy_(2.0 * torch.eye(8))  # powers of two: exact in bfloat16
        down.weight.copy_(0.25 * torch.eye(8))
    model = nn.Sequential(_Cast(), up, nn.Identity(), nn.ReLU(), down)
    x = torch.randn(4, 8).to(torch.bfloat16).float()  # values bfloat16 holds exactly
    with mpscope.record(model, shadow=True) as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
        rec.step()
    p = rec.run.precision
    assert len(p) == 6 and (p.dtype == "bfloat16").all()
    assert np.isposinf(p.sqnr_db).all() and np.isposinf(p.own_sqnr_db).all()
    assert (p.max_abs_err == 0).all() and (p.own_max_abs_err == 0).all()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(32, 32)
        self.bn2 = nn.BatchNorm1d(32, momentum=None)  # cumulative average: num_batches_tracked matters
        self.drop2 = nn.Dropout(0.5)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        x = self.drop(torch.relu(self.bn(self.fc1(x))))
        return self.head(self.drop2(torch.tanh(self.bn2(self.fc2(x)))))


def _train(shadow: bool | None, steps: int = 6):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = [(torch.randn(32, 16), torch.randn(32, 1)) for _ in range(steps)]
    losses = []

    def loop():
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = ((out.float() - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    if shadow is None:
        loop()
        run = None
    else:
        with mpscope.record(model, opt, shadow=shadow, every=2) as rec:
            loop()
        run = rec.run
    return model, losses, torch.rand(3), run


def test_training_bitwise_unchanged_with_dropout_and_batchnorm():
    plain, losses0, rng0, _ = _train(None)
    shadowed, losses1, rng1, run = _train(True)
    assert torch.equal(torch.stack(losses0), torch.stack(losses1))
    state0, state1 = plain.state_dict(), shadowed.state_dict()
    for k in state0:  # weights and BatchNorm running statistics, num_batches_tracked included
        assert torch.equal(state0[k], state1[k]), k
    assert int(state1["bn2.num_batches_tracked"]) == 6
    assert torch.equal(rng0, rng1)  # the RNG stream after training is the same
    p = run.precision
    assert sorted(set(p.step)) == [0, 2, 4]
    # the reference drew the same dropout masks: dropout's error is its input's, and finite
    drop = p[p.module == "drop"].set_index("step")
    relu_in = p[p.module == "bn"].set_index("step")
    assert np.isfinite(drop.sqnr_db).all() and (drop.sqnr_db > 30).all()
    assert (drop.sqnr_db > relu_in.sqnr_db - 10).all()


def test_no_rows_without_shadow_and_saved_with_the_run(tmp_path):
    _, _, _, run = _train(False, steps=2)
    assert run.precision.empty and list(run.precision.columns) == list(mpscope.run.PRECISION_COLUMNS)
    _, _, _, run = _train(True, steps=2)
    loaded = mpscope.Run.load(run.save(tmp_path / "r"))
    assert loaded.precision.equals(run.precision)


def test_recording_unchanged_by_the_shadow_with_ops():
    def go(shadow, ops=True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2), nn.ReLU(inplace=True), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with mpscope.record(model, opt, shadow=shadow, ops=ops) as rec:
            for _ in range(2):
                for _ in range(2):  # two micro-batches per step
                    with torch.autocast("cpu", dtype=torch.float16):
                        out = model(torch.randn(8, 16))
                    out.float().sum().backward()
                opt.step()
                opt.zero_grad()
        return rec.run

    plain, shadowed = go(False), go(True)
    assert plain.tensors.equals(shadowed.tensors)  # no row from the extra passes or the comparisons
    assert plain.tables["ops"].equals(shadowed.tables["ops"])
    assert plain.tables["op_facts"].equals(shadowed.tables["op_facts"])
    p = shadowed.precision
    ops = p[p.role == "op_output"]
    p = p[p.role == "activation"]
    assert len(p) == 2 * 5 and np.isfinite(p.sqnr_db).all()  # micro-batches merged: one row per module
    # op rows: the forward's ops but casts, with the recorder's op names (k counted per forward)
    rows = shadowed.tensors[shadowed.tensors.role == "op_output"]
    assert set(zip(ops.step, ops.module.astype(str), ops.name)) <= set(zip(rows.step, rows.module.astype(str),
                                                                             rows.name.astype(str)))
    assert {n.split("#")[0] for n in ops.name} == {"aten.addmm.default", "aten.bernoulli_.float", "aten.div_.Scalar",
                                                   "aten.mul.Tensor", "aten.relu_.default"}
    # with ops=True the reference is precision forensics' shadow: no extra pass, so no own contribution
    # but the root's (its inputs are the batch: its own error is its error)
    assert ops.own_sqnr_db.isna().all() and p[p.module != ""].own_sqnr_db.isna().all()
    assert (p[p.module == ""].own_sqnr_db == p[p.module == ""].sqnr_db).all()
    # without ops, the reference pass: ReLU(inplace=True) overwrites its input, and the reference kept a
    # copy per version, so the first Linear's own contribution is its whole error (its input is the
    # batch), and ReLU's is only the rounding of its (exact) input to float16: about one ideal rounding
    # (66 dB), not less
    p = go(True, ops=False).precision
    assert (p[p.module == "0"].own_sqnr_db == p[p.module == "0"].sqnr_db).all()
    assert (p[p.module == "2"].own_sqnr_db > 66).all()


class _Periodic(nn.Module):
    def forward(self, h):  # two ops in one module: the product, then a periodic function of it
        return torch.sin(h * 100.0)


def test_op_outputs_equal_a_hand_run_fp32_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), _Periodic(), nn.Linear(32, 4))
    x = torch.randn(64, 16)
    with mpscope.record(model, shadow=True, ops=True) as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
        rec.step()
    p = rec.run.precision.set_index(["module", "name"])
    with torch.no_grad():  # by hand: the same ops in bf16 (autocast's Linear, then bf16 mul and sin) and in fp32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = model[0](x)
        a, h32 = h * 100.0, model[0](x)
        a32 = h32 * 100.0
    for name, low, ref in (("aten.mul.Tensor#0", a, a32), ("aten.sin.default#0", torch.sin(a), torch.sin(a32))):
        r = p.loc[("1", name)]
        assert r["role"] == "op_output" and r["dtype"] == "bfloat16"
        lo, rf = low.double().numpy(), ref.double().numpy()
        # (the engine's float32 shadow: sums in float32, 1e-8 relative)
        assert r.sqnr_db == pytest.approx(10 * np.log10(np.sum(rf ** 2) / np.sum((lo - rf) ** 2)), abs=1e-4)
        assert r.max_abs_err == np.abs(lo - rf).max() and r.ref_absmax == np.abs(rf).max()
    # the sin of a rounded product loses more than the product itself, and is the module's output
    assert p.loc[("1", "aten.sin.default#0")].sqnr_db < p.loc[("1", "aten.mul.Tensor#0")].sqnr_db - 10
    assert p.loc[("1", "aten.sin.default#0")].sqnr_db == pytest.approx(p.loc[("1", "output")].sqnr_db)


# ---------------------------------------------------------------- side effects of the model's forward happen once
class _OwnGenerator(nn.Module):
    """Noise from the module's own torch.Generator."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x):
        h = self.fc(x)
        return h + 0.1 * torch.randn(h.shape, generator=self.gen)


class _StochasticDepth(nn.Module):
    """A residual branch dropped with probability 1/2 by Python's random."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        if self.training and random.random() < 0.5:
            return x
        return x + self.fc(x)


class _NumpyMask(nn.Module):
    """A feature mask drawn from NumPy's global RNG."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        h = self.fc(x)
        return h * torch.from_numpy(np.random.rand(h.shape[-1]) > 0.3).to(h.dtype)


class _WarmUp(nn.Module):
    """A warm-up ramp driven by a Python counter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * 2.0 ** -self.calls


class _TensorCounter(nn.Module):
    """A ramp driven by a tensor held as a plain attribute (not a buffer), counted in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.seen = torch.zeros(())

    def forward(self, x):
        self.seen += 1
        return self.fc(x) * (self.seen / 8).clamp(max=1)


class _FirstCallCache(nn.Module):
    """A position table built on the first call in the input's dtype, cached by length only."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.cache = {}

    def forward(self, x):
        h = self.fc(x)
        n = h.shape[-1]
        if n not in self.cache:
            self.cache[n] = torch.sin(torch.arange(n, dtype=h.dtype) * 0.37)
        return h + self.cache[n]


class _ClassGenerator(nn.Module):
    """Noise from a torch.Generator held by the class, read as ``self.gen``."""

    gen = torch.Generator()

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        type(self).gen.manual_seed(7)  # (each training run starts from the same state)

    def forward(self, x):
        h = self.fc(x)
        return h + 0.1 * torch.randn(h.shape, generator=self.gen).to(h.dtype)


class _MaxNorm(nn.Module):
    """A max-norm rule applied in forward: the weight's rows renormalised in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        with torch.no_grad():
            self.fc.weight.mul_((0.5 / self.fc.weight.norm(dim=1, keepdim=True)).clamp(max=1))
        return self.fc(x)


_MEMBERS = {"generator": _OwnGenerator, "class_generator": _ClassGenerator, "python_random": _StochasticDepth, "numpy_random": _NumpyMask,
            "counter": _WarmUp, "tensor_counter": _TensorCounter, "first_call_cache": _FirstCallCache,
            "hook_features": lambda: nn.Linear(32, 32)}


def _train_member(member: str, shadow: bool | None, steps: int = 4, hook=None, inside=None):
    """A few Adam steps of Linear -> member -> ReLU -> Linear under CPU autocast(bfloat16), the
    same seeds and data; with ``member="hook_features"`` a user forward hook collects the member's
    outputs in a list that the loss sums (a distillation-style term). Returns the model, the losses,
    what the RNGs draw after training, the Run (None without mpscope) and mpscope's warnings."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(16, 32), _MEMBERS[member](), nn.ReLU(), nn.Linear(32, 1))
    if inside is not None:
        model = inside(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(steps)]
    feats: list = []
    if member == "hook_features":
        model[1].register_forward_hook(lambda m, a, out: feats.append(out))
    if hook is not None:
        model[1].register_forward_hook(hook)
    losses = []

    def loop():
        for x, y in data:
            feats.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = ((out.float() - y) ** 2).mean() + sum(0.1 * f.float().square().mean() for f in feats)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())

    run = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if shadow is None:
            loop()
        else:
            with mpscope.record(model, opt, shadow=shadow) as rec:
                loop()
            run = rec.run
    ours = [w for w in caught if "mpscope" in str(w.message)]
    draws = (torch.rand(3), random.random(), np.random.rand())
    return model, torch.stack(losses), draws, run, ours


def _assert_same_training(a, b):
    model0, losses0, draws0, *_ = a
    model1, losses1, draws1, *_ = b
    assert torch.equal(losses0, losses1)
    state0, state1 = model0.state_dict(), model1.state_dict()
    for k in state0:
        assert torch.equal(state0[k], state1[k]), k
    assert torch.equal(draws0[0], draws1[0]) and draws0[1:] == draws1[1:]  # every RNG stream goes on the same


@pytest.mark.parametrize("member", list(_MEMBERS))
def test_side_effects_of_the_forward_happen_once(member):
    plain = _train_member(member, None)
    shadowed = _train_member(member, True)
    _assert_same_training(plain, shadowed)
    run, ours = shadowed[3], shadowed[4]
    assert not ours, [str(w.message) for w in ours]
    p = run.precision
    assert sorted(set(p.step)) == [0, 1, 2, 3] and {"", "0", "1", "2", "3"} <= set(p.module)
    m0, m1 = plain[0][1], shadowed[0][1]
    if member == "counter":  # each real call counted once
        assert m0.calls == m1.calls == 4
        # the own contribution ran with the ramp its real call saw: only the input's rounding, no factor 2
        own = p[p.module == "1"].own_sqnr_db
        assert (own > 30).all(), own
    if member == "tensor_counter":  # the extra passes counted on clones
        assert float(m0.seen) == float(m1.seen) == 4
    if member == "first_call_cache":  # built once, by the real forward, in its dtype
        assert list(m1.cache) == [32] and m1.cache[32].dtype == m0.cache[32].dtype == torch.bfloat16
        assert torch.equal(m0.cache[32], m1.cache[32])
    if member == "generator":
        assert torch.equal(m0.gen.get_state(), m1.gen.get_state())


def test_a_forward_that_changes_a_parameter_in_place_stops_the_shadow_before_it_changes_anything():
    _MEMBERS["max_norm"] = _MaxNorm
    try:
        plain = _train_member("max_norm", None)
        shadowed = _train_member("max_norm", True)
    finally:
        del _MEMBERS["max_norm"]
    _assert_same_training(plain, shadowed)
    run, ours = shadowed[3], shadowed[4]
    assert len(ours) == 1 and "changes its parameter '1.fc.weight' in place" in str(ours[0].message)
    assert len(run.precision) == 0 and len(run.steps) == 4


def test_a_hook_that_changes_outputs_stops_the_shadow_and_training_is_unchanged():
    def halve(module, args, out):  # changes what the model computes: the reference (hooks skipped) cannot follow
        return out * 0.5

    plain = _train_member("generator", None, hook=halve)
    shadowed = _train_member("generator", True, hook=halve)
    _assert_same_training(plain, shadowed)
    ours = shadowed[4]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    msg = str(ours[0].message)
    assert "module '1'" in msg and "halve" in msg and "changes its output" in msg
    run = shadowed[3]
    assert run.precision.empty  # the step it was found in is dropped; none after it
    assert "halve" in run.meta["shadow"]["stopped"]
    assert len(run.steps) == 4 and run.steps.recorded.all()  # recording went on


class _AutocastInside(nn.Module):
    """Enters autocast inside its forward, where the reference cannot turn it off."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(x)


def test_autocast_inside_the_forward_is_reported_not_measured():
    plain = _train_member("counter", None, inside=_AutocastInside)
    shadowed = _train_member("counter", True, inside=_AutocastInside)
    _assert_same_training(plain, shadowed)
    run, ours = shadowed[3], shadowed[4]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    msg = str(ours[0].message)
    assert "not float32" in msg and "autocast is enabled" in msg and "inside the model's forward" in msg
    assert run.precision.empty  # no SQNR of +inf (bf16 against bf16) reported
    assert "not float32" in run.meta["shadow"]["stopped"]


class _Residual(nn.Module):
    """x + LayerNorm(Linear(x)): a forward of this file's own (dynamo compiles it; it skips torch.nn's)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        return x + self.norm(self.fc(x))


class _CompiledRoot(nn.Sequential):
    def forward(self, x):  # (likewise: a root whose compiled call dynamo traces)
        return super().forward(x)


def _compiled_mlp(compile_root: bool = False):
    """A model with one submodule compiled in place (CompileCounter: dynamo's own frame count, graphs
    run as traced), or the whole model compiled in place."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    m = _CompiledRoot(nn.Linear(16, 32), nn.GELU(), _Residual(32), nn.Linear(32, 4))
    counter = CompileCounter()
    (m if compile_root else m[2]).compile(backend=counter)
    return m, counter


def _train_compiled(m, shadow: bool | None, steps: int = 3):
    """Three bf16 steps; ``shadow=None``: without mpscope. Returns (weights, recorder)."""
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    rec = mpscope.record(m, optimizer=opt, shadow=shadow) if shadow is not None else None
    with rec if rec is not None else warnings.catch_warnings():
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, rec


def test_a_compiled_submodule_compiles_as_often_with_the_shadow_and_stays_compiled():
    import torch._dynamo

    torch._dynamo.reset()
    plain, _ = _compiled_mlp()
    want, _ = _train_compiled(plain, None)
    frames = {}
    for shadow in (False, True):
        torch._dynamo.reset()
        m, counter = _compiled_mlp()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # the shadow does not stop
            got, rec = _train_compiled(m, shadow)
        assert all(torch.equal(got[k], want[k]) for k in want)
        frames[shadow] = counter.frame_count
        before = counter.frame_count
        m(torch.randn(3, 5, 16))  # after detach: a new input rank compiles the region again (not left eager)
        assert counter.frame_count == before + 1
    assert frames[True] == frames[False]  # the extra passes compile no graph of their own
    p = rec.run.precision
    # the region (module 2, compiled in place, runs its own hooks inside) and what it holds: not compared
    assert set(p.module) == {"", "0", "1", "3"}


def test_a_model_compiled_in_place_stops_the_shadow_before_the_first_step():
    import torch._dynamo

    torch._dynamo.reset()
    plain, _ = _compiled_mlp(compile_root=True)
    want, _ = _train_compiled(plain, None)
    torch._dynamo.reset()
    m, _ = _compiled_mlp(compile_root=True)
    with pytest.warns(RuntimeWarning, match=r"compiled in place \(model.compile\(\)\)"):
        got, rec = _train_compiled(m, True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert len(rec.run.precision) == 0 and "compiled in place" in rec.run.meta["shadow"]["stopped"]
    assert len(rec.run.steps) == 3 and (rec.run.tensors.role == "activation").any()


def test_a_half_model_with_batchnorm_gets_a_float32_reference_of_its_running_statistics():
    """A .half() Conv/BatchNorm model in eval mode: the reference runs on float32 copies of the
    parameters and of the fp16 running statistics (a float32 input beside fp16 buffers is refused by
    batch_norm). Oracle: a float32 copy of the model on the float32 input, NumPy's SQNR."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model.half().eval()
    x = torch.randn(2, 1, 8, 8).half()
    with torch.no_grad():
        ref = copy.deepcopy(model).float()(x.float())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the shadow stopping warns)
        with mpscope.record(model, shadow=True) as rec:
            with torch.no_grad():
                out = model(x)
            rec.step()
    p = rec.run.precision.set_index("module")
    assert p.loc["1"].sqnr_db == pytest.approx(_sqnr(ref, out), rel=1e-9)
