"""Op-level recording (``record(ops=True)``): names and attribution, the autocast audit on a real
``transformers`` model, device-policy judgement, bitwise-unchanged training, mode/hook hygiene."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pandas.testing as pd_testing
import pytest
import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import mpscope
from mpscope.ops import audit, op_findings

H = torch.float16


def _global_hook_counts():
    return (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks),
            len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks))


@pytest.fixture(autouse=True)
def no_mode_left():
    """After every test: no dispatch mode and no global module/optimizer hook left behind."""
    before = _global_hook_counts()
    yield
    assert _get_current_dispatch_mode_stack() == []
    assert _global_hook_counts() == before


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h + h * 2.0


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.inner(x)
        h = self.inner(h) + x  # the module runs twice: call indices #0 and #1
        return self.head(h)


def _op_tables(run):
    """(the op rows sorted by step, module, name, with text columns, the audit, the op facts)."""
    t = run.tensors
    t = t[t.role == "op_output"]
    t = t.astype({c: str for c in t.select_dtypes("category")}).sort_values(["step", "module", "name"])
    return t.reset_index(drop=True), run.tables["ops"], run.tables["op_facts"]


def _ops(run, step=0):
    t = run.tensors
    return t[(t.role == "op_output") & (t.step == step)]


def test_names_innermost_module_and_call_index():
    torch.manual_seed(0)
    model, x = Outer(), torch.randn(4, 8)
    with torch.no_grad():  # oracle: the same arithmetic without mpscope
        h1 = model.inner.lin(x)
        h2 = model.inner.lin(h1 + h1 * 2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mpscope.record(model, optimizer=opt, ops=True) as rec:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    ops = _ops(rec.run).set_index(["module", "name"])
    assert ops.loc[("inner.lin", "aten.addmm.default#0"), "absmax"] == float(h1.abs().max())
    assert ops.loc[("inner.lin", "aten.addmm.default#1"), "absmax"] == float(h2.abs().max())
    for name in ("aten.mul.Tensor#0", "aten.add.Tensor#0", "aten.mul.Tensor#1", "aten.add.Tensor#1"):
        assert ("inner", name) in ops.index
    assert ("", "aten.add.Tensor#0") in ops.index  # the residual, run by the root module
    assert ("", "aten.pow.Tensor_Scalar#0") in ops.index  # the loss, outside every module: root
    # views are not recorded; neither are mpscope's own stats ops nor the optimizer's update
    names = set(ops.index.get_level_values("name"))
    assert not {n for n in names if n.split("#")[0] in ("aten.t.default", "aten.view.default", "aten.bucketize.Tensor",
                                                         "aten.bincount.default", "aten.nan_to_num.default")}
    assert not {n for n in names if "foreach" in n or n.startswith("aten.add_.Tensor")}


def test_backward_ops_belong_to_the_module_that_made_them():
    torch.manual_seed(0)
    model, x = Outer(), torch.randn(4, 8)
    with mpscope.record(model, ops=True) as rec:
        model(x).pow(2).mean().backward()
        rec.step()
    a = rec.run.tables["ops"]
    bw = a[a.phase == "backward"]
    # Linear's weight gradient is an mm in backward: attributed to the Linear, shaped like its weight
    head_mm = bw[(bw.module == "head") & (bw.op == "aten.mm.default")]
    assert len(head_mm) and int(head_mm.calls.sum()) == 2  # grad input and grad weight
    ops = _ops(rec.run).set_index(["module", "name"])
    grad_w = model.head.weight.grad
    mm_rows = [ops.loc[("head", f"aten.mm.default#{k}")] for k in range(2)]
    assert any(int(r.numel) == grad_w.numel() and r.absmax == float(grad_w.abs().max()) for r in mm_rows)
    assert set(bw.module) >= {"head", "inner.lin", "inner", ""}


class _EndsInASubmodule(nn.Module):
    """A block whose own ops (tanh, mul) run before the submodule that makes its output."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 8)
        self.lin2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.lin2(torch.tanh(self.lin1(x)) * 3.0)


def test_backward_ops_of_a_forward_that_ends_in_a_submodule_stay_with_its_module():
    """The kind: a module's own autograd nodes sit behind those of the submodule its forward ends
    with, so the graph walk from its output meets the submodule's nodes first and goes on past them
    (stopping there would file the module's backward ops under the root ""). Here the block's tanh
    and mul gradients: the rows under "block", and their values against autograd's own gradients of
    the same step."""
    torch.manual_seed(0)
    model, x = nn.Sequential(), torch.randn(3, 4)
    model.add_module("block", _EndsInASubmodule())
    with torch.enable_grad():  # oracle: the gradients the two backward ops compute, by autograd
        a = model.block.lin1(x)
        t = torch.tanh(a)
        ga, gt = torch.autograd.grad(model.block.lin2(t * 3.0).pow(2).sum(), [a, t])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mpscope.record(model, opt, ops=True) as rec:
        model(x).pow(2).sum().backward()
        opt.step()
    ops = _ops(rec.run).set_index(["module", "name"])
    block = ops.loc["block"]
    assert set(block.index) == {"aten.tanh.default#0", "aten.mul.Tensor#0",  # forward
                                "aten.mul.Tensor#1", "aten.tanh_backward.default#0"}  # backward
    for name, want in (("aten.mul.Tensor#1", gt), ("aten.tanh_backward.default#0", ga)):
        r = block.loc[name]
        assert (r.numel, r["min"], r["max"], r.absmax) == \
            (want.numel(), float(want.min()), float(want.max()), float(want.abs().max())), name
    assert set(ops.loc[""].index) == {"aten.pow.Tensor_Scalar#0", "aten.sum.default#0", "aten.ones_like.default#0",
                                      "aten.pow.Tensor_Scalar#1", "aten.mul.Scalar#0", "aten.mul.Tensor#0"}


def _backward_owners(model, step) -> dict:
    """Oracle for the module a backward op belongs to, by autograd sequence numbers alone: the
    innermost module call whose forward ran while the node being executed was created (``""``
    outside every call). Returns ``{(module, op): calls}`` over the backward ops of ``step()`` with a
    floating, non-empty output (AccumulateGrad's left out, as in the audit)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls, open_ = [], {}  # (start seq, end seq, name), in order of the call's start

    def pre(name):
        def hook(module, args):
            open_.setdefault(name, []).append(len(calls))
            calls.append([torch._C._autograd._get_sequence_nr(), None, name])
        return hook

    def post(name):
        def hook(module, args, output):
            calls[open_[name].pop()][1] = torch._C._autograd._get_sequence_nr()
        return hook

    def owner(seq):  # the innermost: the last call started (a child may start at its parent's seq)
        inside = [c for c in calls if c[0] <= seq < c[1]]
        return inside[-1][2] if inside else ""

    counts: dict = {}

    class Owners(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            node = torch._C._current_autograd_node()
            outs = out if isinstance(out, (tuple, list)) else [out]
            if torch._C._current_graph_task_id() != -1 and not (node and node.name().endswith("AccumulateGrad")) \
                    and any(isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel() for o in outs):
                key = (owner(node._sequence_nr()) if node is not None else "", str(func))
                counts[key] = counts.get(key, 0) + 1
            return out

    handles = [h for n, m in model.named_modules()
               for h in (m.register_forward_pre_hook(pre(n)), m.register_forward_hook(post(n)))]
    try:
        with Owners():
            step()
    finally:
        for h in handles:
            h.remove()
    return counts


def test_backward_ops_of_gpt2_attention_belong_to_the_modules_that_made_their_nodes():
    """The same kind in a real model: GPT-2's attention ends in ``c_proj`` and ``resid_dropout``, so
    its own matmuls, softmax and head reshapes sit behind them. Every backward op's module (the
    audit's calls per module and op) equals the sequence-number oracle's (views are not recorded:
    the comparison covers the recorded ops), and the attention's four backward bmm are its own."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, attn_implementation="eager")

    def make():
        torch.manual_seed(0)
        return GPT2LMHeadModel(cfg), torch.randint(0, 64, (2, 16))

    model, ids = make()
    want = _backward_owners(model, lambda: model(ids, labels=ids).loss.backward())
    model, ids = make()
    with mpscope.record(model, ops=True) as rec:
        model(ids, labels=ids).loss.backward()
        rec.step()
    a = rec.run.tables["ops"]
    bw = a[a.phase == "backward"].groupby(["module", "op"]).calls.sum().to_dict()
    want = {k: v for k, v in want.items() if k[1] in {op for _, op in bw}}
    assert bw == want
    for i in range(2):
        assert bw[(f"transformer.h.{i}.attn", "aten.bmm.default")] == 4


def test_training_bitwise_unchanged_with_ops_and_gradscaler():
    from transformers import GPT2Config, GPT2LMHeadModel

    def train(record: bool):
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
        model = GPT2LMHeadModel(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        g = torch.Generator().manual_seed(1)
        data = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(2)]
        losses = []

        def loop():
            for ids in data:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=H):
                    loss = model(ids, labels=ids).loss
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                losses.append(loss.detach().clone())

        rec = None
        if record:
            with mpscope.record(model, optimizer=opt, scaler=scaler, ops=True, hist_every=100) as rec:
                loop()
        else:
            loop()
        return losses, [p.detach().clone() for p in model.parameters()], rec

    l0, p0, _ = train(False)
    l1, p1, rec = train(True)
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    t = rec.run.tensors
    assert (t.role == "op_output").sum() > 100 and sorted(set(t.step)) == [0, 1]
    # backward op outputs are gradients as they flow: scaled, like activation_grad rows
    a = rec.run.tables["ops"]
    assert set(a.phase) == {"forward", "backward"}
    scale = rec.run.steps.loss_scale.iloc[0]
    assert scale == 2.0**10
    grads = t[(t.step == 0) & (t.role == "activation_grad")]
    assert set(grads.loss_scale) == {scale}


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.lin(x) * 2  # some recorded ops, then the forward fails
        raise RuntimeError("boom")


def test_mode_and_hooks_removed_on_exception():
    model = Boom()
    with pytest.raises(RuntimeError, match="boom"):
        with mpscope.record(model, ops=True):
            model(torch.randn(2, 4))
    assert _get_current_dispatch_mode_stack() == []
    # the model still runs plainly afterwards, unobserved
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(2, 4))


def test_every_is_respected():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    modes, hooks = [], []
    with mpscope.record(model, optimizer=opt, ops=True, every=2) as rec:
        for _ in range(4):
            # the dispatch mode and the global module hooks exist during recorded steps only
            modes.append(len(_get_current_dispatch_mode_stack()))
            hooks.append(_global_hook_counts()[:2])
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
    assert modes == [1, 0, 1, 0] and hooks[1] == hooks[3] and hooks[0] == hooks[2] != hooks[1]
    t = rec.run.tensors
    assert sorted(set(t[t.role == "op_output"].step)) == [0, 2]
    assert sorted(set(rec.run.tables["ops"].step)) == [0, 2]



def test_mode_off_the_stack_during_optimizer_step_and_back_for_the_next_recorded_step():
    """optimizer.step() runs without the dispatch mode (its ops take PyTorch's plain path) and the
    mode is back for the forward of the next recorded step, also with a GradScaler ending the step
    after the optimizer and with two optimizers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.01), torch.optim.AdamW(model[2].parameters())]
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    inside = []
    with mpscope.record(model, optimizer=opts[1], scaler=scaler, ops=True) as rec:
        # registered after mpscope's: runs inside optimizer.step(), after its pre-hook
        handle = optim_module.register_optimizer_step_pre_hook(
            lambda *a: inside.append(len(_get_current_dispatch_mode_stack())))
        try:
            for _ in range(3):
                for o in opts:
                    o.zero_grad()
                scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
                for o in opts:
                    scaler.step(o)
                scaler.update()
        finally:
            handle.remove()
    assert inside == [0] * 6
    t = rec.run.tensors
    ops = t[t.role == "op_output"]
    assert sorted(set(ops.step)) == [0, 1, 2]
    # the same forward/backward ops every step: none lost after the mode came back
    per_step = [sorted(ops[ops.step == s].name) for s in range(3)]
    assert per_step[0] == per_step[1] == per_step[2] and len(per_step[0]) > 0
    assert not any("addcdiv" in n or "lerp" in n for n in ops.name)  # AdamW's own ops get no row


def _gpt2_run():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, attn_implementation="eager")
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 16))
    out_dtypes = {}  # oracle: the dtype of every leaf module's output, seen by a plain forward hook
    def keep(name):
        def hook(module, args, output):
            out_dtypes.setdefault(name, output.dtype)
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if not list(m.children())]
    with mpscope.record(model, ops=True) as rec:
        with torch.autocast("cpu", dtype=H):
            loss = model(ids, labels=ids).loss
        loss.backward()
        rec.step()
    for h in handles:
        h.remove()
    return rec.run, out_dtypes


def test_autocast_audit_on_a_transformers_model():
    run, out_dtypes = _gpt2_run()
    a = audit(run)
    fwd = a[a.phase == "forward"]
    c_attn = fwd[fwd.module == "transformer.h.0.attn.c_attn"].set_index("op")
    # autocast casts the float32 weights to float16 and runs the matmul in float16
    assert c_attn.loc["aten._to_copy.default", "in_dtypes"] == "float32"
    assert c_attn.loc["aten._to_copy.default", "out_dtype"] == "float16"
    assert c_attn.loc["aten.addmm.default", "in_dtypes"] == "float16,float16,float16"
    assert bool(c_attn.loc["aten.addmm.default", "reduction_lowp"])
    # every leaf module's last forward op has the dtype PyTorch gave the module's output
    table = run.tables["ops"]
    last = table[(table.phase == "forward") & (table.step == 0)].groupby("module", sort=False).tail(1)
    last = last.set_index("module").out_dtype
    checked = 0
    for name, dtype in out_dtypes.items():
        if name in last.index and name != "transformer.wte":
            assert last[name] == str(dtype).removeprefix("torch."), name
            checked += 1
    assert checked >= 8
    # dropout's empty_like is uninitialised memory: not recorded; its bernoulli_ fill is
    assert not [o for o in a.op if o.startswith("aten.empty")] and "aten.bernoulli_.float" in set(fwd.op)
    ln = fwd[(fwd.module == "transformer.h.0.ln_1") & (fwd.op == "aten.native_layer_norm.default")]
    assert list(ln.out_dtype) == ["float32"]  # the residual stream stays float32
    # reductions that ran in float16: the matmuls forward, the bias-gradient sums backward
    low = a[a.reduction_lowp]
    assert {"aten.addmm.default", "aten.bmm.default", "aten.mm.default"} <= set(low[low.phase == "forward"].op)
    assert "aten.sum.dim_IntList" in set(low[low.phase == "backward"].op)
    # GPT-2's eager attention adds a float32 mask, so its softmax runs in float32: not flagged
    sm = fwd[fwd.op == "aten._softmax.default"]
    assert len(sm) and set(sm.out_dtype) == {"float32"} and not sm.reduction_lowp.any()
    assert not [f for f in op_findings(run) if f.severity == "error"]


class HalfAttention(nn.Module):
    """A hand-written attention whose softmax, row sums and means see float16 scores under autocast."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.k = nn.Linear(16, 16)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        p = torch.softmax(s, -1)
        return p.sum(-1) + s.mean(-1)


def test_reductions_judged_against_the_target_devices_policy():
    torch.manual_seed(0)
    model = HalfAttention()
    with mpscope.record(model, ops=True) as rec:
        with torch.autocast("cpu", dtype=H):
            model(torch.randn(2, 8, 16))
        rec.step()
    assert rec.run.meta["autocast_device_type"] == "cpu"

    def flagged(fs):
        return {f.name.split("#")[0] for f in fs if f.code == "reduction_precision"}

    cpu = flagged(op_findings(rec.run))
    assert {"aten._softmax.default", "aten.sum.dim_IntList", "aten.mean.dim"} <= cpu
    cuda = flagged(op_findings(rec.run, target_device="cuda"))
    # CUDA autocast runs softmax and sum in float32, but not mean
    assert "aten._softmax.default" not in cuda and "aten.sum.dim_IntList" not in cuda
    assert "aten.mean.dim" in cuda
    msg = [f for f in op_findings(rec.run) if f.name.startswith("aten._softmax")][0].message
    assert "CPU autocast" in msg and "float32" in msg


def test_out_variant_bypass_and_hand_cast_parameters_are_flagged():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))
            self.half_lin = nn.Linear(8, 8).half()

        def forward(self, x):
            buf = torch.empty(4, 8)
            torch.mm(x, self.w.detach(), out=buf)  # out=: autocast does not apply, runs in float32
            return self.half_lin(buf)

    model = M()
    with mpscope.record(model, ops=True) as rec:
        with torch.autocast("cpu", dtype=H):
            model(torch.randn(4, 8))
        rec.step()
    a = audit(rec.run).set_index(["module", "op"])
    mm = a.loc[("", "aten.mm.out")]
    assert bool(mm.bypass) and mm.out_dtype == "float32"
    lin = a.loc[("half_lin", "aten.addmm.default")]
    assert bool(lin.param_lowp) and not bool(lin.bypass)
    assert not a.loc[("", "aten.mm.out")].param_lowp


def test_long_reductions_that_overflow():
    """A matmul summing 100,000 ones and a sum of 100,000 ones both exceed 65504 in float16."""

    class M(nn.Module):
        def forward(self, a, b):
            return (a @ b).sum() + a.sum()

    a = torch.ones(1, 100_000, dtype=H)
    b = torch.ones(100_000, 1, dtype=H)
    assert 100_000 > torch.finfo(H).max
    model = M()
    with mpscope.record(model, ops=True) as rec:
        model(a, b)
        rec.step()
    fs = {f.name: f for f in op_findings(rec.run) if f.code == "reduction_precision"}
    assert fs["aten.mm.default#0"].value == 100_000 and fs["aten.mm.default#0"].threshold == 65504
    assert fs["aten.sum.default#1"].value == 100_000
    assert "Scale before the long sum" in fs["aten.mm.default#0"].fix


def test_tables_survive_save_and_load(tmp_path):
    scores = (torch.randn(1, 4, 4) * 20).to(H)
    mask = torch.full((1, 4, 4), torch.finfo(H).min, dtype=H).triu(1)

    class M(nn.Module):
        def forward(self, s, m):
            return torch.softmax(s + m, -1)

    model = M()
    with mpscope.record(model, ops=True) as rec:
        model(scores, mask)
        rec.step()
    rec.run.save(tmp_path / "run")
    back = mpscope.Run.load(tmp_path / "run")
    for name in ("ops", "op_facts"):
        assert len(back.tables[name]) == len(rec.run.tables[name]) > 0
    a = [(f.code, f.module, f.name, f.value) for f in op_findings(rec.run)]
    b = [(f.code, f.module, f.name, f.value) for f in op_findings(back)]
    assert a == b and a


def test_run_without_op_tables():
    model = nn.Linear(4, 4)
    with mpscope.record(model) as rec:  # ops=False: module rows only
        model(torch.randn(2, 4))
        rec.step()
    assert "ops" not in rec.run.tables and op_findings(rec.run) == []
    with pytest.raises(ValueError, match="ops=True"):
        audit(rec.run)


def test_integer_facts_of_casts_match_pytorch():
    class M(nn.Module):
        def forward(self, n):
            pos = torch.arange(n)
            return pos.to(torch.bfloat16), pos.float().to(H)

    model = M()
    with mpscope.record(model, ops=True) as rec:
        model(5000)
        rec.step()
    facts = rec.run.tables["op_facts"].set_index("name")
    ref = torch.arange(5000)
    bf = facts.loc["aten._to_copy.default#0"]
    assert int(bf.distinct_out) == ref.to(torch.bfloat16).unique().numel()
    assert int(bf.changed) == int((ref.to(torch.bfloat16).long() != ref).sum())
    f16 = facts.loc["aten._to_copy.default#2"]  # #1 is the float32 cast, not low precision
    assert f16.int_valued == 1 and f16.in_absmax == 4999
    assert int(f16.distinct_out) == ref.float().to(H).unique().numel()
    assert not math.isnan(f16.changed) and np.isclose(f16.changed, int((ref.float().to(H).float() != ref.float()).sum()))


def test_an_intentional_minus_inf_causal_mask_is_not_an_error():
    """nn.Transformer-style masks hold -inf on purpose; softmax handles them (every row keeps a key)."""

    class Attn(nn.Module):
        def forward(self, q, k):
            t = q.shape[1]
            mask = torch.full((t, t), float("-inf")).triu(1)
            return torch.softmax(q @ k.transpose(-1, -2) + mask, -1)

    model = Attn()
    q, k = torch.randn(2, 8, 16, requires_grad=True), torch.randn(2, 8, 16)
    with mpscope.record(model, ops=True) as rec:
        with torch.autocast("cpu", dtype=H):
            out = model(q, k)
        out.sum().backward()
        rec.step()
    assert not out.isnan().any()
    ops = _ops(rec.run).set_index("name")
    assert int(ops.loc["aten.full.default#0", "inf_count"]) == 8 * 8  # recorded, with its -inf
    assert not [f for f in op_findings(rec.run) if f.severity == "error"]


def test_no_host_sync_in_op_recording():
    """A dispatch mode under ours sees every op, the training step's (forwarded by our mode) and the
    ones the op recorder issues; ``benchmarks/common.py``'s ``is_host_sync`` (the oracle shared with
    tests/test_sync.py) tells which ones read a device value on the host."""
    import importlib.util
    import sys
    from pathlib import Path

    from torch.utils._python_dispatch import TorchDispatchMode

    from mpscope.demo import GPT, CharDataset, GPTConfig

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "common.py"
    spec = importlib.util.spec_from_file_location("mpscope_bench_common_ops", path)
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    ours = {"_on_op", "_facts", "_inputs_nonfinite", "_flush", "_drain", "_process", "_observe", "device_stats"}

    class SyncCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reset()

        def reset(self):
            self.ops = {"mpscope": 0, "step": 0}
            self.syncs = {"mpscope": [], "step": []}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            f, who = sys._getframe(1), "step"
            while f is not None:
                if f.f_code.co_name in ours and f.f_globals.get("__name__", "").startswith("mpscope."):
                    who = "mpscope"
                    break
                f = f.f_back
            self.ops[who] += 1
            if common.is_host_sync(func, args, kwargs):
                self.syncs[who].append(str(func))
            return func(*args, **kwargs)

    data = CharDataset.from_stdlib(16)
    torch.manual_seed(0)
    model = GPT(GPTConfig(data.vocab_size, d_model=16, n_layer=1, n_head=2, seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x, y = data.batch(2, data.generator(0))
    counter = SyncCounter()
    with counter:  # entered first: our mode sits above it, so every op reaches it
        with mpscope.record(model, optimizer=opt, scaler=scaler, ops=True) as rec:
            for i in range(2):
                if i == 1:  # step 0 imports and builds mpscope's per-process tables: not steady state
                    counter.reset()
                with torch.autocast("cpu", dtype=H):
                    loss = model(x, y)[1]
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    t = rec.run.tensors
    assert (t.role == "op_output").sum() > 50
    # the counter sees mpscope's own ops: more than one per op output row of the step it counted
    assert counter.ops["mpscope"] > ((t.role == "op_output") & (t.step == 1)).sum() and counter.ops["step"] > 100
    assert "aten._local_scalar_dense.default" in counter.syncs["step"]  # GradScaler.step's found_inf.item()
    assert counter.syncs["mpscope"] == []


class _Flow(nn.Module):
    """A real little block whose values pass through copies, concatenations and gathers on the way
    to an overflow, a NaN and a log of zero (float16 by hand on the CPU)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        h = self.lin(x).half()
        h2 = torch.cat([h, h.clone()], dim=-1)  # preserving ops on recorded inputs
        g = h2.index_select(-1, torch.arange(15, -1, -1)).flip(0).contiguous()
        big = g * 3e4  # overflows float16 for |h| > ~2.2
        p = torch.softmax(big.float(), -1).half() * 0  # exact zeros ...
        z = torch.log(p[:, :4].clone())  # ... whose log is -inf
        return self.proj(big.float().nan_to_num(0.0, 1e4, -1e4)) + z.float().clamp(min=-1).sum()


def _flow_run(**kw):
    torch.manual_seed(0)
    model = _Flow()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    with mpscope.record(model, optimizer=opt, **kw) as rec:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(6, 8, generator=g) * 3).pow(2).mean().backward()
            opt.step()
    return rec


def test_preserving_ops_skipped_without_changing_a_finding(monkeypatch):
    """Copies, concatenations and gathers of recorded values get no row of their own; the findings
    (op-level and the advisor's) are the same as with every op recorded."""
    from mpscope.recording import op_recorder
    from mpscope.recording.autocast_policy import PRESERVING

    skipping = _flow_run(ops=True)
    monkeypatch.setattr(op_recorder, "SKIP_PRESERVING", False)
    full = _flow_run(ops=True)
    assert skipping._ops is None and skipping.run.tables["ops"].equals(full.run.tables["ops"])  # audit unchanged
    a, b = _ops(skipping.run, 0), _ops(full.run, 0)
    gone = set(b.name) - set(a.name)
    assert gone and all(n.split(".")[1] in PRESERVING for n in gone)
    assert {"aten.cat.default#0", "aten.clone.default#0", "aten.flip.default#0"} <= gone
    # every row kept is the same row
    key = ["step", "module", "name"]
    m = a.merge(b, on=key, suffixes=("", "_full"))
    assert len(m) == len(a)
    for c in ("absmax", "nan_count", "inf_count", "fp16_overflow_frac", "zero_frac"):
        assert np.array_equal(m[c].to_numpy(), m[c + "_full"].to_numpy(), equal_nan=True), c

    def codes(rec):
        return sorted((f.code, f.module, f.name, f.step) for f in op_findings(rec.run)), \
            sorted((f.code, f.module, f.role, f.name, f.step) for f in mpscope.advise(rec.run).findings)

    found = codes(skipping)
    assert found == codes(full)
    assert {"forward_overflow", "log_of_zero"} <= {c for c, *_ in found[0]}


def test_op_filter_and_module_regex_record_exactly_the_selected_rows():
    every = _flow_run(ops=True)
    picked = _flow_run(ops=["mul", "_softmax", "log"], modules=r"^$|^proj$")
    with pytest.raises(mpscope.recorder.RecorderError, match="not an ATen operator"):
        mpscope.record(nn.Linear(2, 2), ops=["softmaxx"])
    a, b = _ops(every.run, 0), _ops(picked.run, 0)
    short = b.name.str.split(".").str[1].str.strip("_")
    assert set(short) == {"mul", "softmax", "log"} and set(b.module) == {""}
    want = a[a.module.isin(["", "proj"]) & a.name.str.split(".").str[1].str.strip("_").isin(["mul", "softmax", "log"])]
    cols = ["module", "name", "numel", "absmax", "min", "max", "nan_count", "inf_count", "fp16_underflow_frac"]
    def norm(f):
        return f[cols].astype({"module": str, "name": str}).sort_values(["module", "name"]).reset_index(drop=True)

    pd_testing.assert_frame_equal(norm(want), norm(b))
    assert every.run.tables["ops"].equals(picked.run.tables["ops"])  # the audit still sees every op


def test_cast_facts_skipped_only_where_no_integer_can_collide():
    """The CPU shortcut skips the integer facts of a cast when every finite |x| <= 2 / eps of the
    target: there every integer is exact (oracle: the cast itself), so integer_precision cannot fire;
    above it the facts are taken and the finding appears."""
    for fmt, dt in ((2048, torch.float16), (256, torch.bfloat16)):
        n = torch.arange(fmt + 1, dtype=torch.float32)
        assert torch.equal(n.to(dt).float(), n)  # every integer up to 2 / eps survives the cast
        assert not torch.equal((n + fmt).to(dt).float(), n + fmt)  # above it some collide

    class Pos(nn.Module):
        def __init__(self, top):
            super().__init__()
            self.lin, self.top = nn.Linear(4, 4), top

        def forward(self, x):
            pos = torch.arange(self.top, dtype=torch.float32)
            return self.lin(x) + pos.to(torch.float16).float()[-x.shape[0]:, None]

    for top, expect in ((2048, False), (6000, True)):
        torch.manual_seed(0)
        model = Pos(top)
        with mpscope.record(model, ops=True) as rec:
            model(torch.randn(3, 4))
            rec.step()
        got = any(f.code == "integer_precision" for f in op_findings(rec.run))
        assert got == expect, top


def test_frame_rules_of_op_facts_against_finfo():
    """The fact filter's frame rules (evaluated on arrays at every recorded step's end) against
    torch.finfo: a forward summing reduction in float16/bfloat16 whose bound K * max|a| * max|b|
    reaches finfo.max, and a sin/cos/tan whose argument's spacing 2^floor(log2 |x|) * finfo.eps
    reaches 2^-3 (infinite at |x| = inf; NaN, zero and unmeasured inputs, float32 and unknown
    formats included)."""
    import pandas as pd

    from mpscope.recording.autocast_policy import PERIODIC_ULP, may_overflow, periodic_coarse

    rng = np.random.default_rng(0)
    n = 400
    dtypes = rng.choice(["float16", "bfloat16", "float32", "int64"], n)
    a0 = rng.choice([0.0, np.nan, np.inf, 1.0, 3.0, 255.0, 256.0, 1000.0, 2.0**14, 2.0**100, 0.1], n)
    a1 = rng.choice([np.nan, 0.5, 2.0, 300.0, 2.0**60, np.inf], n)
    frame = pd.DataFrame({
        "phase": rng.choice(["forward", "backward"], n), "reduction": rng.choice(["", "mm", "sum"], n),
        "out_dtype": dtypes, "reduction_len": rng.choice([0, 1, 64, 4096], n), "in_absmax0": a0, "in_absmax1": a1,
        "op": rng.choice(["aten.sin.default", "aten.cos.default", "aten.add.Tensor", "aten.mm.default"], n),
    })
    low = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    for i, r in frame.iterrows():
        fmt = low.get(r.out_dtype)
        bound = r.reduction_len * r.in_absmax0 * (1.0 if math.isnan(r.in_absmax1) else r.in_absmax1)
        expect = fmt is not None and r.phase == "forward" and r.reduction != "" and bound >= torch.finfo(fmt).max
        assert bool(may_overflow(frame).iloc[i]) == expect, r
        a = r.in_absmax0
        fmt = {**low, "float32": torch.float32}.get(r.out_dtype)
        spacing = 0.0 if fmt is None or not a > 0 else math.inf if a == math.inf \
            else 2.0 ** math.floor(math.log2(a)) * torch.finfo(fmt).eps
        assert bool(periodic_coarse(frame).iloc[i]) == (r.op.split(".")[1] in ("sin", "cos") and spacing >= PERIODIC_ULP), r
    assert may_overflow(frame).any() and periodic_coarse(frame).any() and not may_overflow(frame).all()


def test_an_internal_error_stops_op_recording_but_not_training(monkeypatch):
    """An exception inside the op recorder's dispatch path (here: looking up an op's facts) warns
    once and turns op recording off; the training step's losses and weights equal an unrecorded run's."""
    from mpscope.recording import op_recorder

    def train(record):
        torch.manual_seed(0)
        model, x = Outer(), torch.randn(4, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        with (mpscope.record(model, optimizer=opt, ops=True) if record else torch.enable_grad()):
            for _ in range(2):
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
        return losses, list(model.parameters())

    def broken(func):
        raise RuntimeError("op_info failed")

    monkeypatch.setattr(op_recorder, "op_info", broken)
    with pytest.warns(RuntimeWarning, match="op-level recording stopped"):
        got = train(True)
    want = train(False)
    assert all(torch.equal(a, b) for a, b in zip(got[0] + got[1], want[0] + want[1]))


class _PassThrough(torch.overrides.TorchFunctionMode):
    """A user's torch-function mode that changes nothing (as profilers and tracers install)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Marked(torch.Tensor):
    """A user's tensor subclass (its ops go through ``Tensor.__torch_function__``)."""


class _MarksItsOutput(nn.Module):
    def __init__(self, marked: bool):
        super().__init__()
        self.marked = marked

    def forward(self, x):
        return x.as_subclass(_Marked) if self.marked else x


@pytest.mark.parametrize("kind", ["device", "user mode", "subclass"])
def test_a_torch_function_override_adds_no_op_rows_of_mpscopes_own(kind, monkeypatch):
    """``with torch.device("cpu"):`` (as ``torch.set_default_device`` installs it) or a user's
    pass-through TorchFunctionMode around the loop, or a module output of a tensor subclass:
    mpscope's own stats ops (the torch-op path, here for module outputs that no op row holds: a
    view out of ``Flatten``, an in-place ReLU, the subclass's alias) reach the dispatch mode through
    a ``__torch_function__``, which is not their caller. The op rows equal those of the same run
    without the mode (inside the modules: without the subclass), and none is float64 (the stats'
    ``mm``/``round_``; the model trains in bfloat16/float32); the user's ops keep their call indices."""
    monkeypatch.setenv("MPSCOPE_KERNEL", "torch")

    def run(ctx, marked: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Unflatten(1, (4, 4)), nn.Flatten(),
                              _MarksItsOutput(marked), nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(2)]
        with mpscope.record(model, opt, ops=True) as rec:
            for x, y in data:
                with ctx():
                    opt.zero_grad()
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = torch.nn.functional.mse_loss(model(x).float(), y)
                    loss.backward()
                    opt.step()
        t = rec.run.tensors
        return t[t.role == "op_output"].reset_index(drop=True)

    plain = run(contextlib.nullcontext, False)
    ctx = {"device": lambda: torch.device("cpu"), "user mode": _PassThrough}.get(kind, contextlib.nullcontext)
    other = run(ctx, kind == "subclass")
    assert "float64" not in set(plain.dtype) and len(plain) > 20
    assert "float64" not in set(other.dtype)
    pd_testing.assert_frame_equal(other, plain)


class _Logged(torch.Tensor):
    """A tensor subclass whose ops, through its own ``__torch_function__``, return new objects of
    the subclass (Tensor's default re-wrapping): every loss op's input is a Python object that no
    op made."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("where", ["module", "loop"])
def test_the_loss_ops_on_a_subclass_of_the_models_output_keep_their_rows(where, monkeypatch):
    """The kind: the model's output reaches the loss as a tensor object the op recorder never saw
    made; the loss's forward ops still belong to the training step (under no pass their rows would
    be dropped from it). Two members: the model's last module returns ``x.as_subclass(_Marked)``, and
    the training loop wraps the model's output in ``_Logged``, whose every op returns a new
    subclass object. The loss's op rows (module "") equal those of the same run without the
    subclass, forward rows included."""
    monkeypatch.setenv("MPSCOPE_KERNEL", "torch")

    def run(wrapped: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1),
                              _MarksItsOutput(wrapped and where == "module"))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(2)]
        with mpscope.record(model, opt, ops=True) as rec:
            for x, y in data:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                if wrapped and where == "loop":
                    out = out.as_subclass(_Logged)
                loss = ((out.float() - y) ** 2).mean() * 0.5
                loss.backward()
                opt.step()
        t = rec.run.tensors
        return t[(t.role == "op_output") & (t.module == "")].reset_index(drop=True)

    plain = run(False)
    calls = _Logged.calls
    other = run(True)
    assert where == "module" or _Logged.calls > calls  # the loss ops did go through the subclass
    forward_ops = {n.split(".")[1] for n in plain[plain.module == ""].name}
    assert {"_to_copy", "sub", "pow", "mean", "mul"} <= forward_ops, forward_ops
    pd_testing.assert_frame_equal(other, plain)


class _Dequantized(torch.Tensor):
    """A storage-less ``__torch_dispatch__`` wrapper (``_make_wrapper_subclass``), as fake-quantized
    activations and quantized weights are: bfloat16 codes and a scale; every op computes with
    ``codes * scale`` in float32 and returns a plain tensor (``detach`` keeps the wrapper)."""

    @staticmethod
    def __new__(cls, codes, scale):
        t = torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32, device=codes.device)
        t.codes, t.scale = codes, scale
        return t

    def values(self) -> torch.Tensor:
        return self.codes.float() * self.scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return cls(args[0].codes, args[0].scale)
        plain = [a.values() if isinstance(a, cls) else a for a in args]
        return func(*plain, **{k: v.values() if isinstance(v, cls) else v for k, v in (kwargs or {}).items()})


def _quantize(x: torch.Tensor, wrapped: bool) -> torch.Tensor:
    codes = (x.detach() * 64).to(torch.bfloat16)
    return _Dequantized(codes, 1 / 64) if wrapped else codes.float() * (1 / 64)


class _FakeQuant(nn.Module):
    def __init__(self, wrapped: bool):
        super().__init__()
        self.wrapped = wrapped

    def forward(self, x):
        return _quantize(x, self.wrapped)


class _QuantConv1D(nn.Module):
    """GPT-2's ``Conv1D`` (``addmm(bias, x, weight)``, weight of shape (in, out)) with its weight
    kept quantized (not trained) and its bias trained."""

    def __init__(self, weight: torch.Tensor, wrapped: bool):
        super().__init__()
        self.weight = _quantize(weight, wrapped)
        self.bias = nn.Parameter(torch.zeros(weight.shape[1]))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


@pytest.mark.parametrize("where", ["activation", "weight"])
def test_a_wrapper_subclass_without_storage_gets_no_row_and_recording_goes_on(where, recwarn):
    """The kind: a ``__torch_dispatch__`` wrapper subclass without storage, which the op recorder
    does not read as an op's input (its stats would raise "data is not allocated" and stop op
    recording for the rest of the run). Two members: a fake-quantized activation (the first
    module's output) and a quantized weight in GPT-2's ``Conv1D`` form (``addmm(bias, x, W)``: no
    transpose view first). Over two steps, no warning, and every op row equals the same run's with
    the plain dequantized tensor (``codes.float() * scale``) in its place, except the plain run's
    own dequantizing ops; the first layer's ``addmm`` against ``F.linear`` on the dequantized
    values."""
    def run(wrapped: bool):
        torch.manual_seed(0)
        if where == "activation":
            model = nn.Sequential(_FakeQuant(wrapped), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        else:
            model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), _QuantConv1D(torch.randn(8, 2), wrapped))
        opt = torch.optim.SGD([p for p in model.parameters()], lr=0.1)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(2)]
        with mpscope.record(model, opt, ops=True) as rec:
            for x, y in data:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        t = rec.run.tensors
        t = t[t.role == "op_output"].reset_index(drop=True)
        return model, data, t.astype({c: str for c in t.select_dtypes("category")})

    model, data, got = run(True)
    assert not [w for w in recwarn if "mpscope" in str(w.message)]
    _, _, plain = run(False)
    if where == "activation":  # the plain run's dequantizing ops (the wrapper's run inside its dispatch)
        dequantize = {"aten._to_copy.default#1", "aten.mul.Tensor#1"}
        plain = plain[~((plain.module == "0") & plain.name.isin(dequantize))].reset_index(drop=True)
        assert set(got[got.module == "0"].name) == {"aten.mul.Tensor#0", "aten._to_copy.default#0"}
    pd_testing.assert_frame_equal(got, plain)
    assert set(got.step) == {0, 1} and len(got) > 20
    if where == "activation":  # the first step's addmm: the initial weights (seed 0, as in run)
        torch.manual_seed(0)
        lin = nn.Sequential(_FakeQuant(False), nn.Linear(8, 8))[1]
        want = torch.nn.functional.linear(_quantize(data[0][0], False), lin.weight, lin.bias)
        row = got[(got.step == 0) & (got.module == "1") & (got.name == "aten.addmm.default#0")].iloc[0]
    else:
        torch.manual_seed(0)
        lin = nn.Linear(8, 8)
        w = _quantize(torch.randn(8, 2), False)
        want = torch.relu(lin(data[0][0])) @ w
        row = got[(got.step == 0) & (got.module == "2") & (got.name == "aten.addmm.default#0")].iloc[0]
    assert (row["min"], row["max"], row.numel) == (float(want.min()), float(want.max()), want.numel())


class _CheckpointedBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x, checkpointed: bool = False):
        h = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False) if checkpointed else self.body(x)
        return self.head(h)


class _CheckpointsInside(nn.Module):
    """A block that checkpoints a function of its own (ops in no module of theirs) or a module
    without parameters (whose reentrant backward gives no parameter a gradient)."""

    def __init__(self, what: str):
        super().__init__()
        self.inp, self.act, self.out = nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8)
        self.what = what

    def core(self, t):
        return torch.tanh(t) * 2.0 + t

    def forward(self, x, checkpointed: bool = False):
        h = self.inp(x)
        f = self.core if self.what.startswith("function") else self.act
        h = torch.utils.checkpoint.checkpoint(f, h, use_reentrant=self.what.endswith("reentrant")) if checkpointed \
            else f(h)
        return self.out(h)


class _Holds(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block, self.head = block, nn.Linear(8, 2)

    def forward(self, x, checkpointed: bool = False):
        return self.head(self.block(x, checkpointed))


@pytest.mark.parametrize("model", ["body", "gpt2", "gpt2 reentrant", "function", "function reentrant",
                                   "parameterless reentrant"])
def test_a_checkpointed_forward_recomputed_in_backward_adds_no_forward_rows(model):
    """The kind: activation checkpointing re-runs a module's forward inside backward; the re-run is
    not recorded as a second forward call (no ``addmm#1`` rows with the first's values, no audit
    calls=2).
    Members: a checkpointed ``Sequential`` body (non-reentrant), and GPT-2's blocks with gradient
    checkpointing (non-reentrant and reentrant); a function checkpointed inside a block, whose
    re-run runs in no module (non-reentrant and reentrant: the backward through the re-run is a
    graph task of its own, which gives no parameter a gradient), and a checkpointed GELU (reentrant).
    The forward audit and every op row equal the same run's without checkpointing (values
    included). (GPT-2's blocks are re-run through their ``forward``, not ``__call__``: no module
    hook sees the re-run, whose own ops, the residual adds, get no backward rows.)"""
    def run(checkpointed: bool):
        torch.manual_seed(0)
        if model == "body" or not model.startswith("gpt2"):
            m, x = (_CheckpointedBody() if model == "body" else _Holds(_CheckpointsInside(model))), torch.randn(3, 4)
            step = lambda: m(x, checkpointed).pow(2).sum()  # noqa: E731
        else:
            from transformers import GPT2Config, GPT2LMHeadModel

            m = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                           attn_implementation="eager", use_cache=False))
            ids = torch.randint(0, 64, (2, 16))
            if checkpointed:
                m.activation_checkpointing_enable({"use_reentrant": model == "gpt2 reentrant"})
            step = lambda: m(ids, labels=ids).loss  # noqa: E731
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with mpscope.record(m, opt, ops=True) as rec:
            step().backward()
            opt.step()
        t = rec.run.tensors
        t = t[t.role == "op_output"].set_index(["module", "name"])
        return t.astype({c: str for c in t.select_dtypes("category")}), rec.run.tables["ops"]

    plain, plain_audit = run(False)
    got, audit = run(True)
    forward = lambda a: a[a.phase == "forward"].reset_index(drop=True)  # noqa: E731
    pd_testing.assert_frame_equal(forward(audit), forward(plain_audit))
    assert len(plain) > 15
    pd_testing.assert_frame_equal(got, plain)


@pytest.mark.parametrize("member", ["mlp", "gpt2"])
def test_the_backward_of_another_model_in_the_loss_adds_no_rows(member):
    """The kind: a second model that trains along (an unfrozen teacher in a distillation loss, not
    under no_grad) runs outside the recorded model's modules: its forward ops are of no pass
    (dropped), and its backward ops are not filed as the student's rows under "". Members: a
    teacher MLP with GELU and LayerNorm in an MSE term, and a GPT-2 teacher in a KL term on a GPT-2
    student. Against the same step with the teacher's output detached (the teacher's backward does
    not run): the student's module rows are equal, values included, and the rows under "" are the
    same plus the gradients the loss's own nodes compute for the teacher's side (MSE's second
    output; KL's product and accumulation on the teacher's log-probabilities) and nothing else."""
    def run(detach: bool):
        torch.manual_seed(0)
        if member == "mlp":
            student = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
            teacher = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3))
            x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))

            def loss():
                s, t = student(x), teacher(x)
                return nn.functional.cross_entropy(s, y) + nn.functional.mse_loss(s, t.detach() if detach else t)
        else:
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                             attn_implementation="eager", use_cache=False)
            student, teacher = GPT2LMHeadModel(cfg), GPT2LMHeadModel(cfg)
            ids = torch.randint(0, 64, (2, 16))

            def loss():
                out, t = student(ids, labels=ids), teacher(ids).logits
                t = t.detach() if detach else t
                return out.loss + nn.functional.kl_div(out.logits.log_softmax(-1), t.log_softmax(-1),
                                                       log_target=True, reduction="batchmean")
        opt = torch.optim.SGD(student.parameters(), lr=0.1)
        with mpscope.record(student, opt, ops=True) as rec:
            loss().backward()
            opt.step()
        assert all(p.grad is not None for p in teacher.parameters()) != detach
        t = rec.run.tensors
        t = t[t.role == "op_output"].reset_index(drop=True)
        return t.astype({c: str for c in t.select_dtypes("category")}).set_index(["module", "name"])

    joint, alone = run(False), run(True)
    in_model = lambda f: f[f.index.get_level_values("module") != ""]  # noqa: E731
    pd_testing.assert_frame_equal(in_model(joint), in_model(alone))
    root = set(joint.loc[""].index)
    teacher_side = {"mlp": {"aten.mse_loss_backward.default#1"},
                    "gpt2": {"aten.add.Tensor#2", "aten.mul.Tensor#2"}}[member]
    assert root == set(alone.loc[""].index) | teacher_side and not teacher_side & set(alone.loc[""].index)
    if member == "mlp":  # the loss's rows keep their names and values
        pd_testing.assert_frame_equal(joint.drop([("", n) for n in teacher_side]), alone)


@pytest.mark.parametrize("member", ["mlp", "mlp_cached", "mlp_no_grad_cached", "mlp_raising", "mlp_autograd_grad",
                                    "gpt2"])
def test_a_forward_never_backpropagated_leaves_the_training_ops_names(member):
    """The kind: a forward of the model with grad enabled whose output is never backpropagated (a
    validation loss logged without ``no_grad``) runs in a training step. Its rows are dropped at the
    step's end, and its calls do not shift the training pass's ``#k`` names (no ``addmm#1`` for
    ``addmm#0``). Members: an fp16 MLP (autocast, GradScaler) whose probe batch overflows float16
    and runs between the forward and the backward; the same with the probe before the training
    forward in the same autocast region, whose weight casts autocast caches and the training pass
    reuses (their rows stay, as training calls); the same under ``no_grad`` (autocast caches those
    casts too, with their autograd history: their backward rows keep their modules); a probe
    that raises in the first Linear after autocast cast its input (a batch of the wrong width,
    caught by the loop); the first trained by ``torch.autograd.grad(loss, params)`` and ``p.grad = g``
    (no backward is counted: the optimizer step and the gradients that reached the training pass
    tell the step trained); HF GPT-2 whose validation loss is computed before
    the training forward, in an autocast region of its own. The oracle is the same loop without the
    probe: the op rows are equal, names and values; the audit's forward and backward rows are equal
    (but for the casts the probe ran), and its ``eval`` rows are the probe's calls; the
    ``op_facts`` of the training ops are equal, and the probe's are ``eval`` facts numbered from
    ``#0``."""
    overflows = []

    def run(probe: bool):
        torch.manual_seed(0)
        if member != "gpt2":
            model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
            x, y = torch.randn(32, 8), torch.randn(32, 1)
            # Linear(8, 16) in float16: at least its first output is above 65504
            x_probe = 6e4 * model[0].weight[:1].detach().sign().expand(4, 8)
            with torch.no_grad(), torch.autocast("cpu", dtype=H):
                overflows.append(int(model[0](x_probe).isinf().sum()))  # the oracle: PyTorch's own output

            def step():
                with torch.autocast("cpu", dtype=H):
                    if probe and member == "mlp_cached":
                        model(x_probe)
                    if probe and member == "mlp_no_grad_cached":
                        with torch.no_grad():
                            model(x_probe)
                    if probe and member == "mlp_raising":
                        with pytest.raises(RuntimeError):
                            model(x_probe[:, :7])
                    out = model(x)
                    if probe and member in ("mlp", "mlp_autograd_grad"):
                        model(x_probe)
                loss = nn.functional.mse_loss(out.float(), y)
                if member != "mlp_autograd_grad":
                    scaler.scale(loss).backward()
                    return
                params = list(model.parameters())  # trained without a backward call: no .grad accumulates
                for p, g in zip(params, torch.autograd.grad(scaler.scale(loss), params)):
                    p.grad = g
        else:
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                             attn_implementation="eager", use_cache=False)
            model = GPT2LMHeadModel(cfg)
            model.eval()  # (no dropout: the two runs draw no different random numbers)
            ids, ids_val = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))

            def step():
                if probe:
                    with torch.autocast("cpu", dtype=H):
                        model(ids_val, labels=ids_val).loss.item()
                with torch.autocast("cpu", dtype=H):
                    loss = model(ids, labels=ids).loss
                scaler.scale(loss).backward()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        with mpscope.record(model, opt, scaler=scaler, ops=True) as rec:
            for _ in range(3):
                opt.zero_grad()
                step()
                scaler.step(opt)
                scaler.update()
        return _op_tables(rec.run)

    (got, audit, facts), (want, want_audit, want_facts) = run(True), run(False)
    assert len(want) > 30
    pd_testing.assert_frame_equal(got, want)
    trained = lambda a: a[a.phase != "eval"].sort_values(["step", "phase", "module", "op", "in_dtypes", "out_dtype"]).reset_index(drop=True)  # noqa: E731
    pd_testing.assert_frame_equal(trained(audit), trained(want_audit))
    assert "eval" not in set(want_audit.phase)
    probe = audit[audit.phase == "eval"].reset_index(drop=True)
    assert list(probe.step.unique()) == [0, 1, 2]
    fwd = want_audit[want_audit.phase == "forward"].reset_index(drop=True)
    if member == "mlp_raising":  # the probe's input cast ran, then its first op raised
        assert set(probe.op) == {"aten._to_copy.default"} and set(probe.numel) == {4 * 7}
    elif member == "gpt2":  # the same forward on a batch of the same shape: the same calls, but for
        # the loop's own (scaler.scale's product, backward's seed gradient: a number each, outside)
        both = probe.drop(columns="phase").merge(fwd.drop(columns="phase"), how="outer", indicator=True)
        assert (both._merge != "left_only").all() and len(probe) > 100
        loop = both[both._merge == "right_only"]
        assert set(loop.op) == {"aten.mul.Tensor", "aten.ones_like.default"} and (loop.numel == 1).all()
    else:  # the probe's batch of 4 through the same modules (the loss runs outside them), whose
        # weights autocast cast to float16 once for both forwards in its region (its cast cache)
        probe = probe[probe.op != "aten._to_copy.default"].reset_index(drop=True)
        inside = fwd[(fwd.module != "") & (fwd.op != "aten._to_copy.default")].reset_index(drop=True)
        assert list(probe.op) == list(inside.op) and list(probe.calls) == list(inside.calls)
        assert list(probe.numel * 32) == list(inside.numel * 4)
    cols = [c for c in facts.columns if c not in ("seq", "periodic_src")]
    train_facts = lambda f: f[f.phase != "eval"][cols].reset_index(drop=True)  # noqa: E731
    pd_testing.assert_frame_equal(train_facts(facts), train_facts(want_facts))
    if member not in ("gpt2", "mlp_raising"):
        over = facts[(facts.phase == "eval") & (facts.module == "0")]
        assert list(over.step) == [0, 1, 2] and set(over.name) == {"aten.addmm.default#0"}
        assert overflows[0] > 0 and list(over.out_inf) == [overflows[0]] * 3  # (the weights barely move)


@pytest.mark.parametrize("member", ["linear", "gpt2_inputs_embeds"])
def test_the_backward_of_a_model_that_feeds_the_recorded_one_adds_no_rows(member):
    """The kind: another model makes the recorded model's input (a GAN's generator feeding the
    recorded discriminator) and the model's loss backpropagates through it. That model's forward
    runs in none of the model's modules (its ops are of no pass), and its backward is not filed as
    the model's rows under "" (its weight gradient's ``mm``, its bias gradient's ``sum``). Members:
    a Linear generator feeding a Linear discriminator positionally, and one making the embeddings of
    HF GPT-2 (``inputs_embeds=``, a keyword). The oracle is the same loop with the generator's output
    detached into a leaf that requires grad (the model's ops are the same; the generator's backward
    does not run): the op rows are equal, and the generator still gets its gradient."""
    def run(detach: bool):
        torch.manual_seed(0)
        if member == "linear":
            gen, model = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
            z = torch.randn(16, 4)
            loss_of = lambda fake: model(fake).pow(2).mean()  # noqa: E731
        else:
            from transformers import GPT2Config, GPT2LMHeadModel

            model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                               attn_implementation="eager", use_cache=False))
            model.eval()
            gen, z, ids = nn.Linear(8, 32), torch.randn(2, 16, 8), torch.randint(0, 64, (2, 16))
            loss_of = lambda fake: model(inputs_embeds=fake, labels=ids).loss  # noqa: E731
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with mpscope.record(model, opt, ops=True) as rec:
            for _ in range(2):
                opt.zero_grad()
                gen.zero_grad()
                fake = gen(z)
                loss_of(fake.detach().requires_grad_(True) if detach else fake).backward()
                opt.step()
        assert (gen.weight.grad is None) == detach
        return _op_tables(rec.run)[0]

    got, want = run(False), run(True)
    assert len(want) > 10
    pd_testing.assert_frame_equal(got, want)


@pytest.mark.parametrize("member", ["mlp", "gpt2"])
def test_a_probe_trained_beside_the_model_is_in_no_table(member):
    """The kind: a second learner made of plain tensors, not modules (a linear probe on the
    model's detached features, with its own backward and optimizer), trains in the same steps. Its
    forward ops take no input of the model's (no pass: they are not audited nor given op facts as
    the model's forward ops under ""), and its backward trains no parameter of the model (its calls
    are not audited as the model's backward). Members: an MLP's output and HF GPT-2's last hidden
    state. The oracle is the same loop without the probe: op rows, audit and op facts are equal."""
    def run(probe: bool):
        torch.manual_seed(0)
        if member == "mlp":
            model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
            x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
            forward = lambda: (model(x), model(x).pow(2).mean())  # noqa: E731
        else:
            from transformers import GPT2Config, GPT2Model

            model = GPT2Model(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                         attn_implementation="eager", use_cache=False))
            model.eval()
            ids, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 3, (2 * 16,))

            def forward():
                h = model(ids).last_hidden_state
                return h.reshape(-1, 32), h.pow(2).mean()
        w = torch.zeros(forward()[0].shape[1], 3, requires_grad=True)
        opt, opt_w = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD([w], lr=0.1)
        with mpscope.record(model, opt, ops=True) as rec:
            for _ in range(2):
                opt.zero_grad()
                feats, loss = forward()
                loss.backward()
                if probe:  # (big logits: op facts)
                    opt_w.zero_grad()
                    nn.functional.cross_entropy(feats.detach() @ w * 1e5, y).backward()
                    opt_w.step()
                opt.step()
        return _op_tables(rec.run)

    (got, audit, facts), (want, want_audit, want_facts) = run(True), run(False)
    assert len(want) > 10
    pd_testing.assert_frame_equal(got, want)
    pd_testing.assert_frame_equal(audit, want_audit)
    pd_testing.assert_frame_equal(facts, want_facts)
