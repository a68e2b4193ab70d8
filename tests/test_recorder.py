"""Recorder end to end on real training loops: roles, step boundaries, GradScaler bookkeeping,
gradient accumulation, bitwise-unchanged training, hook hygiene."""

from __future__ import annotations

import copy
import math
import warnings

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import mpscope
from mpscope.recording.passes import Pass, PassKind
from mpscope import kernel
from loops import ReturnsItsParameter, assert_rows_match_tap, record_fp16_mlp, train_with_tap
from mpscope.recorder import RecorderError
from mpscope.stats import tensor_stats
from test_stats import oracle

ALL_ROLES = {"activation", "activation_grad", "param_grad", "weight", "optimizer_state", "loss"}


def make_transformer(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True),
        torch.nn.Linear(32, 1),
    )


def batches(n, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 1, generator=g) * scale) for _ in range(n)]


def train_fp16(model, data, scaler, opt, record=False, **kw):
    """A plain CPU fp16 autocast + GradScaler loop; returns (losses, scale oracle per step)."""
    losses, oracle = [], []

    def loop():
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            w_before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            stepped = any(not torch.equal(a, p) for a, p in zip(w_before, model.parameters()))
            oracle.append((before, scaler.get_scale(), stepped))
            losses.append(loss.detach().clone())

    if record:
        with mpscope.record(model, optimizer=opt, scaler=scaler, **kw) as rec:
            loop()
        return losses, oracle, rec.run
    loop()
    return losses, oracle, None


def test_fp16_gradscaler_run_matches_what_the_scaler_did():
    model = make_transformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # init_scale 2^20 makes the first steps overflow fp16, so GradScaler backs off and skips them,
    # and growth_interval=3 makes it grow again and skip once more later
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    _, oracle, run = train_fp16(model, batches(10, scale=1.0), scaler, opt, record=True)
    steps = run.steps
    assert list(steps.step) == list(range(10))
    assert list(steps.loss_scale) == [o[0] for o in oracle]
    assert list(steps.scale_after) == [o[1] for o in oracle]
    assert list(steps.found_inf) == [o[1] < o[0] for o in oracle]
    assert list(steps.skipped) == [not o[2] for o in oracle]
    assert 2 <= steps.skipped.sum() <= 8
    t = run.tensors
    assert set(t.role) == ALL_ROLES
    # activation grads are recorded scaled: their loss_scale is the step's scale
    ag = t[t.role == "activation_grad"]
    merged = ag.merge(steps[["step", "loss_scale"]], on="step", suffixes=("", "_step"))
    assert (merged.loss_scale == merged.loss_scale_step).all()
    # param grads are seen after unscale_: loss_scale 1, and NaN/inf exactly on skipped steps
    pg = t[t.role == "param_grad"]
    assert (pg.loss_scale == 1.0).all()
    nonfinite = (pg.nan_count + pg.inf_count).groupby(pg.step).sum() > 0
    assert list(nonfinite.sort_index()) == list(steps.found_inf)
    # optimizer state only exists after the first step that ran
    first_run = int(steps.step[~steps.skipped].iloc[0])
    os_ = t[t.role == "optimizer_state"]
    assert os_.step.min() == first_run and set(os_.name.str.split(".").str[-1]) == {"exp_avg", "exp_avg_sq"}
    assert run.meta["autocast_dtype"] == "float16" and run.meta["scaler"]["init_scale"] == 2.0**20


def test_rows_equal_the_stats_of_the_real_tensors():
    """The activation row of a module equals tensor_stats of the output the module produced."""
    model = make_transformer()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    seen = {}
    model[0].register_forward_hook(lambda m, a, out: [seen.setdefault("out", out.detach().clone())] and None)
    x, y = batches(1)[0]
    with mpscope.record(model, optimizer=opt) as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        grad_oracle = model[0].weight.grad.detach().clone()
        opt.step()
    model[0]._forward_hooks.clear()
    t = rec.run.tensors
    row = t[(t.module == "0") & (t.role == "activation")].iloc[0]
    want = tensor_stats(seen["out"])
    assert row["dtype"] == "bfloat16" and row.numel == seen["out"].numel()
    for k in ("min", "max", "absmax", "zero_frac", "bf16_underflow_frac", "fp16_overflow_frac"):
        assert row[k] == want[k]
    g = t[(t.module == "0") & (t.role == "param_grad") & (t.name == "weight")].iloc[0]
    assert g["max"] == float(grad_oracle.max()) and g["min"] == float(grad_oracle.min())
    lossrow = t[t.role == "loss"].iloc[0]
    assert lossrow["max"] == float(loss.detach()) and rec.run.steps.loss[0] == float(loss.detach())


def test_hf_transformers_model_bf16():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=50)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    with mpscope.record(model, optimizer=opt) as rec:
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
    t = rec.run.tensors
    assert set(t.role) == ALL_ROLES
    assert len(rec.run.steps) == 2 and not rec.run.steps.skipped.any()
    # dict-like model outputs are flattened with their keys
    root = t[(t.module == "") & (t.role == "activation")]
    assert {"output.loss", "output.logits"} <= set(root.name)
    assert "bfloat16" in set(t[t.role == "activation"].dtype)
    assert rec.run.meta["model"] == "GPT2LMHeadModel"


def test_gradient_accumulation_merges_micro_batches():
    model = make_transformer()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    outs = []
    model[2].register_forward_hook(lambda m, a, out: outs.append(out.detach().clone()))
    data = batches(8)
    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        for step in range(2):
            opt.zero_grad()
            for x, y in data[step * 4 : step * 4 + 4]:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.mse_loss(model(x).float(), y) / 4
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    model[2]._forward_hooks.clear()
    run = rec.run
    assert list(run.steps.backward_count) == [4, 4]
    t = run.tensors
    assert not t.duplicated(["step", "module", "role", "name"]).any()
    for step in range(2):
        row = t[(t.step == step) & (t.module == "2") & (t.role == "activation")].iloc[0]
        cat = torch.cat([o.reshape(-1) for o in outs[step * 4 : step * 4 + 4]])
        want = tensor_stats(cat)
        assert row.numel == cat.numel() == 4 * outs[0].numel()
        assert row["min"] == want["min"] and row["max"] == want["max"] and row.zero_frac == want["zero_frac"]


def test_recording_leaves_training_bitwise_unchanged():
    def go(record):
        model = make_transformer(seed=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
        losses, _, _ = train_fp16(model, batches(6, scale=20.0), scaler, opt, record=record)
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()]

    l0, w0 = go(False)
    l1, w1 = go(True)
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_hooks_removed_and_data_kept_on_exception(exc):
    model = make_transformer()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    orig_update = scaler.update
    data = batches(3)
    with pytest.raises(exc):
        with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
            for i, (x, y) in enumerate(data):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                if i == 2:
                    raise exc("boom")
                scaler.scale(F.mse_loss(out.float(), y)).backward()
                scaler.step(opt)
                scaler.update()
    assert _hook_count(model) == 0
    assert not hasattr(model, "_mpscope_recorder")
    assert "update" not in vars(scaler) and scaler.update == orig_update
    run = rec.run
    assert list(run.steps.step) == [0, 1, 2]  # the interrupted step's forward is kept
    assert not run.steps.skipped.iloc[2]  # cut short, not skipped by the GradScaler
    t = run.tensors
    assert set(t[t.step == 2].role) == {"activation"}
    assert {"activation", "activation_grad", "param_grad", "weight"} <= set(t[t.step == 1].role)


@pytest.mark.parametrize("where", ["allocate", "kernel"])
def test_a_failure_late_in_attach_removes_every_hook(where, monkeypatch):
    """The last parts of attaching (the step buffer's device allocation, the kernel look-up) fail,
    as an out-of-memory accelerator would: the error reaches the caller, no hook or wrapper stays
    installed, and a second recorder then records the model as usual."""
    from mpscope import kernel
    from mpscope.recording.step_buffer import StepBuffer

    model = make_transformer()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    orig_update = scaler.update
    x, y = batches(1)[0]

    def boom(*args, **kwargs):
        raise RuntimeError("out of memory (injected)")

    with monkeypatch.context() as m:
        m.setattr(StepBuffer, "allocate", boom) if where == "allocate" else m.setattr(kernel, "current", boom)
        with pytest.raises(RuntimeError, match="injected"), mpscope.record(model, optimizer=opt, scaler=scaler):
            pass
    assert _hook_count(model) == 0
    assert not hasattr(model, "_mpscope_recorder")
    assert "update" not in vars(scaler) and scaler.update == orig_update
    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        scaler.scale(F.mse_loss(model(x).float(), y)).backward()
        scaler.step(opt)
        scaler.update()
    assert {"activation", "activation_grad", "param_grad"} <= set(rec.run.tensors.role)


def test_tensor_hooks_on_outputs_removed_on_exit():
    model = make_transformer()
    x, _ = batches(1)[0]
    with mpscope.record(model) as rec:
        out = model(x)  # forward without backward: the output keeps a pending grad hook
    assert not out._backward_hooks  # removed on exit
    assert len(rec.run.tensors) > 0


def test_every_and_max_steps_and_manual_steps():
    model = make_transformer()
    x, _ = batches(1)[0]
    hooks = []
    with torch.no_grad(), mpscope.record(model, every=3) as rec:
        for _ in range(7):
            hooks.append(_hook_count(model))
            model(x)
            rec.step()
    steps = rec.run.steps
    assert list(steps.recorded) == [s % 3 == 0 for s in range(7)]
    assert sorted(set(rec.run.tensors.step)) == [0, 3, 6]
    # module forward hooks only during recorded steps: the others run on PyTorch's plain call path
    n_modules = len(list(model.modules()))
    # + the root's pre-hook (always) and its forward hook ending a pass (recorded steps)
    assert hooks == [n_modules + 2 if s % 3 == 0 else 1 for s in range(7)]

    with torch.no_grad(), mpscope.record(model, max_steps=2) as rec:
        for _ in range(5):
            model(x)
            if rec.attached:
                rec.step()
    assert len(rec.run.steps) == 2 and _hook_count(model) == 0


def test_module_regex_and_roles_filter():
    model = make_transformer()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = batches(1)[0]
    with mpscope.record(model, optimizer=opt, modules=r"^1\.linear", roles=["activation", "weight"]) as rec:
        F.mse_loss(model(x), y).backward()
        opt.step()
    t = rec.run.tensors
    assert set(t.role) == {"activation", "weight"}
    assert set(t.module) == {"1.linear1", "1.linear2"}


def test_inplace_op_after_module_output_works():
    """register_full_backward_hook breaks on this; hooks on output tensors don't."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mpscope.record(model, optimizer=opt) as rec:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    assert {"activation_grad"} <= set(rec.run.tensors.role)


def test_aliased_outputs_share_a_row_and_inplace_changes_do_not():
    """Dropout(p=0), Identity and a parent returning its child's output hand back the same tensor:
    their rows are reused (one measurement) and equal the oracle; a ReLU(inplace=True) changes the
    tensor in place, so the Linear row keeps the values it had before (negatives) and the ReLU row
    is measured anew."""
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.0), torch.nn.Identity())
    model = torch.nn.Sequential(inner, torch.nn.Linear(16, 16), torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}
    inner[0].register_forward_hook(lambda m, a, out: [seen.setdefault("lin", out.detach().clone())] and None)
    model[1].register_forward_hook(lambda m, a, out: [seen.setdefault("pre", out.detach().clone())] and None)
    out_grads = {}
    calls = []
    from mpscope import kernel as kernel_mod
    from mpscope import stats as stats_mod

    real, real_into = stats_mod.device_stats, kernel_mod.fused_stats_into

    def counting(tensors, hist=True, fused=True):
        calls.append(len(tensors))
        return real(tensors, hist, fused)

    def counting_into(module, tensors, *args):  # the fused kernel writing into the step's rows
        calls.append(len(tensors))
        return real_into(module, tensors, *args)

    x = torch.randn(64, 8)
    with mpscope.record(model, optimizer=opt, roles=["activation", "activation_grad"]) as rec:
        stats_mod.device_stats, kernel_mod.fused_stats_into = counting, counting_into
        try:
            y = model(x)
            y.register_hook(lambda g: None)
            inner_out = seen["lin"]
            y.sum().backward()
            opt.step()
        finally:
            stats_mod.device_stats, kernel_mod.fused_stats_into = real, real_into
    inner[0]._forward_hooks.clear()
    model[1]._forward_hooks.clear()
    t = rec.run.tensors
    act = t[t.role == "activation"].set_index("module")
    want = tensor_stats(inner_out)
    for m in ("0.0", "0.1", "0.2", "0"):
        for k in ("min", "max", "zero_frac", "numel"):
            assert act.loc[m, k] == (want[k] if k != "numel" else inner_out.numel()), (m, k)
    assert act.loc["1", "min"] == float(seen["pre"].min()) < 0  # measured before ReLU changed it
    assert act.loc["2", "min"] == 0.0 and act.loc["2", "max"] == float(seen["pre"].max())
    grads = t[t.role == "activation_grad"].set_index("module")
    for k in ("min", "max"):
        assert grads.loc["0.0", k] == grads.loc["0.1", k] == grads.loc["0.2", k] == grads.loc["0", k]
    assert act.loc["", "max"] == act.loc["3", "max"] and grads.loc["", "max"] == grads.loc["3", "max"]
    # 8 modules, 8 activation and 8 gradient rows; measured: the inner block's output once, Linear 1,
    # the ReLU's in-place result (a new version), Linear 3 (the root returns it); the same for gradients
    assert len(act) == 8 and len(grads) == 8
    assert sum(calls) == 8


class ParallelBlock(torch.nn.Module):
    """A GPT-J / PaLM-style parallel block built from the demo GPT's attention and MLP:
    ``x + attn(norm(x)) + mlp(norm(x))``, the one ``norm`` module called twice on the same tensor."""

    def __init__(self, config, norm):
        super().__init__()
        from mpscope.demo.model import MLP, CausalSelfAttention

        self.norm, self.attn, self.mlp = norm, CausalSelfAttention(config), MLP(config)

    def forward(self, x):
        return x + self.attn(self.norm(x)) + self.mlp(self.norm(x))


@pytest.mark.parametrize("norm", ["identity", "dropout_p0", "dropout_eval"])
def test_a_pass_through_module_called_twice_on_one_tensor_counts_it_once_in_both_roles(norm):
    """``norm`` returns its input as it is (Identity; Dropout(p=0); Dropout(0.1) of a model trained
    in eval mode) and is called twice on the same tensor in each forward: its activation is
    recorded once (not twice the elements), as is its gradient, which autograd computes once for the
    tensor (the sum over both uses). The oracle (GradientTap: plain forward and tensor hooks):
    every module's activation rows hold its distinct outputs gradients reached, and its
    activation-gradient rows the gradients autograd gave them."""
    from mpscope.demo.model import GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=16, d_model=16, n_head=2, seq_len=8, dropout=0.1 if norm == "dropout_eval" else 0.0)
    shared = torch.nn.Identity() if norm == "identity" else torch.nn.Dropout(cfg.dropout)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), ParallelBlock(cfg, shared), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 1))
    if norm == "dropout_eval":
        model.eval()  # trained without dropout, as RL fine-tuning does
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 8, 16, generator=g) for _ in range(2)]
    t, taps = train_with_tap(model, model.parameters(), [[x] for x in batches], lambda x: model(x).float().square().mean())
    for step, got in enumerate(taps):
        assert_rows_match_tap(t, step, got)
    rows = t[(t.module == "1.norm") & (t.step == 0)].set_index("role")
    assert rows.loc["activation", "numel"] == rows.loc["activation_grad", "numel"] == batches[0].numel()


def test_a_module_returning_one_tensor_twice_in_a_forward_counts_it_once_per_forward():
    """A learned query table (a module returning its Parameter: the very same tensor object each
    call) used as keys and values, so called twice per forward, two micro-batches a step: one
    activation per forward and one gradient per backward (autograd's one gradient per tensor), not
    two activations per forward. The same oracle."""

    class TableAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.inp, self.out = ReturnsItsParameter(6, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)

        def forward(self, x):
            h = self.inp(x)
            keys, values = self.table(x), self.table(x)
            return self.out(torch.softmax(h @ keys.T, dim=-1) @ values)

    torch.manual_seed(0)
    model = TableAttention()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(5, 16, generator=g) for _ in range(4)]
    t, taps = train_with_tap(model, model.parameters(), [batches[:2], batches[2:]],
                             lambda x: model(x).float().square().mean())
    for step, got in enumerate(taps):
        assert len(got["table"][0]) == 2  # the oracle: one gradient per backward
        assert_rows_match_tap(t, step, got)


def test_forward_in_inference_mode_inside_the_block():
    """Inference tensors have no version counter; an eval pass under torch.inference_mode() in the
    recorded block must still record (and not raise)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Identity())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with mpscope.record(model, optimizer=opt) as rec:
        with torch.inference_mode():
            out = model(x)
        rec.step()
    act = rec.run.tensors.query("role == 'activation'")
    assert set(act.module) == {"", "0", "1"}
    assert (act["max"] == float(out.max())).all()


def test_modules_created_during_the_run_are_named_and_user_hooks_do_not_change_rows():
    """Forward hooks are re-installed for every recorded step (every=2): submodules created in the
    first forward get their own names (not '?', not merged), and mpscope keeps seeing each module's
    own output although a user hook that replaces it was registered after mpscope's."""
    torch.manual_seed(0)

    class Lazy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 8)

        def forward(self, x):
            if not hasattr(self, "a"):
                self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
            return self.b(self.a(self.l(x)) * 100)

    m = Lazy()
    own = {}
    m.l.register_forward_hook(lambda mod, a, out: [own.setdefault(len(own), out.detach().clone())] and None)
    with torch.no_grad(), mpscope.record(m, every=2) as rec:
        m(torch.randn(4, 8))
        rec.step()
        replace = m.l.register_forward_hook(lambda mod, a, out: out * 0 + 7)  # after mpscope's hook
        for _ in range(2):
            m(torch.randn(4, 8))
            rec.step()
    replace.remove()
    m.l._forward_hooks.clear()
    act = rec.run.tensors.query("role == 'activation'")
    assert set(act[act.step == 2].module) == {"", "l", "a", "b"} and "?" not in set(act.module)
    assert act.query("step == 2 and module == 'a'").numel.item() == 32
    lrows = act[act.module == "l"].set_index("step")
    assert lrows.loc[0, "max"] == float(own[0].max()) and lrows.loc[2, "max"] == float(own[2].max()) != 7.0


def test_module_returning_a_parameter_counts_each_gradient_once():
    """A leaf output keeps its tensor hooks across micro-batches; it is hooked once per step."""
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos, self.l = ReturnsItsParameter(4, 8), torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.l(x + self.pos(x))

    m = M()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    grads = []
    m.pos.weight.register_hook(lambda g: grads.append(g.detach().clone()))
    with mpscope.record(m, optimizer=opt) as rec:
        for _ in range(2):  # two micro-batches, one optimizer step
            m(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    row = rec.run.tensors.query("module == 'pos' and role == 'activation_grad'").iloc[0]
    both = torch.cat([g.reshape(-1) for g in grads])
    assert len(grads) == 2 and row.numel == 64
    assert row["max"] == float(both.max()) and row["min"] == float(both.min())


def test_activation_checkpointing_not_double_counted():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.head(checkpoint(self.inner, x, use_reentrant=False))

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with mpscope.record(model, optimizer=opt) as rec:
        model(x).sum().backward()
        opt.step()
    t = rec.run.tensors
    row = t[(t.module == "inner.0") & (t.role == "activation")]
    assert len(row) == 1 and row.numel.iloc[0] == 32  # one forward's worth, not two


def test_clip_before_unscale_is_flagged():
    model = make_transformer()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = batches(1)[0]
    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        for unscale_first in (False, True):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            scaler.step(opt)
            scaler.update()
    steps = rec.run.steps
    assert list(steps.clipped_before_unscale) == [True, False]
    assert steps.clip_norm[1] == pytest.approx(float(norm))
    # the scaled clip saw a norm about scale (2^10) times larger
    assert steps.clip_norm[0] / steps.clip_norm[1] == pytest.approx(2.0**10, rel=0.2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"model": "net"}, "torch.nn.Module"),
        ({"every": 0}, "positive int"),
        ({"roles": ["activations"]}, "unknown roles"),
        ({"roles": []}, r"roles=\[\] records nothing"),
        ({"roles": ()}, r"roles=\(\) records nothing"),
        ({"max_steps": 0}, "max_steps must be a positive int"),
        ({"hist_every": 0}, "hist_every must be a positive int"),
        ({"modules": "("}, "regular expression"),
        ({"optimizer": object()}, "torch.optim.Optimizer"),
        ({"modules": "nomatch"}, "selects none of the model's 1 modules"),
        ({"optimizer": torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)}, "holds none of this model's parameters"),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs, match):
    args = {"model": torch.nn.Linear(2, 2)} | kwargs
    model = args.pop("model")
    with pytest.raises(RecorderError, match=match):
        with mpscope.record(model, **args):
            pass
    if isinstance(model, torch.nn.Module):
        assert _hook_count(model) == 0


def test_one_recorder_per_model():
    model = torch.nn.Linear(2, 2)
    with mpscope.record(model):
        with pytest.raises(RecorderError, match="already being recorded"):
            with mpscope.record(model):
                pass
    assert _hook_count(model) == 0


def test_integer_and_bool_outputs_are_skipped():
    class M(torch.nn.Module):
        def forward(self, x):
            return {"ids": x.argmax(-1), "mask": x > 0, "x": x * 2, "empty": x[:0]}

    with mpscope.record(M()) as rec:
        M.__call__  # noqa: B018
        rec.model(torch.randn(3, 4))
    assert set(rec.run.tensors.name) == {"output.x"}


def test_optimizer_step_on_scaled_grads_ends_the_step():
    """A loop that scales the loss but calls optimizer.step() itself (never scaler.step / update):
    one step row per optimizer step, each marked opt_scaled; a proper loop marks none."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        for _ in range(5):
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            opt.step()
    s = rec.run.steps
    assert list(s.step) == [0, 1, 2, 3, 4] and s.opt_scaled.all() and not s.skipped.any()
    assert (s.loss_scale == 4.0).all() and s.loss.notna().all()
    proper = record_fp16_mlp(steps=3)
    assert len(proper.steps) == 3 and not proper.steps.opt_scaled.any()


def test_the_parameter_walk_of_the_grad_reset_check_finds_what_model_parameters_yields():
    """``_all_parameters`` (the grad-reset check's walk) against ``model.parameters()`` itself: the
    same parameters, each once, on the demo GPT, a Hugging Face GPT-2 with tied embeddings, and a
    model with a submodule shared by two parents, a ``None`` bias, a tied weight and a module
    registered inside itself."""
    from mpscope.demo.model import GPT, GPTConfig
    from mpscope.recording.observer import all_parameters as _all_parameters

    shared = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
    odd = torch.nn.ModuleDict({"a": torch.nn.Sequential(shared, torch.nn.LayerNorm(4)), "b": shared,
                               "c": torch.nn.Linear(4, 4)})
    odd["c"].weight = shared[0].weight
    odd["a"].add_module("loop", odd["a"])  # a cycle: parameters() visits each module once
    models = [odd, GPT(GPTConfig(vocab_size=50, d_model=16, n_layer=2, n_head=2, seq_len=8))]
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        models.append(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)))
    except ImportError:  # (transformers is a dev extra)
        pass
    for model in models:
        got = _all_parameters(model)
        want = list(model.parameters())
        assert len(got) == len(want) and {id(p) for p in got} == {id(p) for p in want}, type(model).__name__
    assert len(models) == 3  # the Hugging Face model was built


def test_grad_reset_and_clip_inputs_are_recorded():
    """grad_reset: 1 when every .grad was None/zero before the step's first backward, 0 when the
    loop forgot zero_grad; clip_norm_fp32 / clip_grad_absmax: the float32 norm and the largest |g|
    of the gradients handed to clip_grad_norm_ (oracle: torch.linalg.vector_norm in float64)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    norms, peaks = [], []
    with mpscope.record(model, optimizer=opt) as rec:
        for i in range(3):
            if i != 2:  # step 2 keeps step 1's gradients
                opt.zero_grad(set_to_none=(i == 0))
            F.mse_loss(model(x), y).backward()
            grads = [p.grad.double().reshape(-1) for p in model.parameters()]
            norms.append(float(torch.linalg.vector_norm(torch.cat(grads))))
            peaks.append(float(torch.cat(grads).abs().max()))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
    s = rec.run.steps
    assert list(s.grad_reset) == [1.0, 1.0, 0.0]
    assert s.clip_norm_fp32.to_numpy() == pytest.approx(norms, rel=1e-6)
    assert list(s.clip_grad_absmax) == pytest.approx(peaks, rel=1e-7)


def test_clip_inputs_are_nan_on_steps_not_recorded():
    """With every=2 the clip's float32 norm and largest |g| are measured on recorded steps only;
    the other steps' rows hold NaN (not whatever the step buffer held), grad_reset too."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with mpscope.record(model, optimizer=opt, every=2) as rec:
        for _ in range(4):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    s = rec.run.steps
    assert s.clip_norm.notna().all()
    assert s.clip_norm_fp32.notna().tolist() == [True, False, True, False]
    assert s.clip_grad_absmax.notna().tolist() == [True, False, True, False]
    assert s.grad_reset.notna().tolist() == [True, False, True, False]


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A one-process gloo group and its device mesh (destroyed after the test)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("staged", [False, True], ids=["host-rows", "staged-rows"])
def test_tensor_parallel_dtensor_activations_record_as_plain_tensors(one_rank_mesh, staged, monkeypatch):
    """Tensor parallelism (``parallelize_module``, ColwiseParallel(use_local_output=False) then
    RowwiseParallel): the first Linear's and the GELU's outputs, and the gradients arriving at
    them, are DTensors. Recorded through the host rows (the fused kernel) and the staged rows (the
    GPU path), the frames equal those of the same model and data without tensor parallelism (one
    rank: each DTensor's shard is the whole tensor; rows sorted) and the recording does not stop."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from mpscope.recording import step_buffer

    monkeypatch.setattr(step_buffer.StepBuffer, "stage_cpu", staged)
    monkeypatch.setattr(step_buffer, "STAGE_ELEMENTS", 300)  # several batched passes per step
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, 12, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(3)]

    def record(tp: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 5))
        if tp:
            parallelize_module(model, one_rank_mesh, {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()})
        seen = []
        model[1].register_forward_hook(lambda m, a, out: seen.append(type(out)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with mpscope.record(model, opt, roles=["activation", "activation_grad", "param_grad", "weight", "loss"]) as rec:
            for x, y in data:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                F.cross_entropy(out.float(), y).backward()
                opt.step()
        assert seen == [DTensor if tp else torch.Tensor] * len(data)
        assert "recording_error" not in rec.run.meta, rec.run.meta["recording_error"]
        # (RowwiseParallel's own output hook turns its DTensor output local: the gradients at the
        # root and at that module arrive in the other order)
        return rec.run.tensors.sort_values(["step", "module", "role", "name"]).reset_index(drop=True)

    tp, plain = record(True), record(False)
    assert {"0", "1"} <= set(tp[tp.role == "activation_grad"].module)
    pd.testing.assert_frame_equal(tp, plain)


def _per_sample_training(model, data, transform: str, **record):
    """Train ``model`` (AdamW) on ``data`` as per-sample-gradient code does (Opacus-style DP-SGD
    without the noise): ``vmap(grad(loss))`` over ``functional_call`` (``transform="vmap"``), or
    ``grad`` of the batch loss alone (``"grad"``); the gradients are set on ``.grad`` by hand.
    Returns the recorder (``record``: more arguments of :func:`mpscope.record`)."""
    from torch.func import functional_call, grad, vmap

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def sample_loss(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x.unsqueeze(0),)).flatten(0, -2), y.reshape(-1))

    def batch_loss(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x,)).flatten(0, -2), y.reshape(-1))

    with mpscope.record(model, opt, **record) as rec:
        for x, y in data:
            params = {k: v.detach() for k, v in model.named_parameters()}
            if transform == "vmap":
                grads = {k: g.mean(0) for k, g in vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y).items()}
            else:
                grads = grad(batch_loss)(params, x, y)
            for k, p in model.named_parameters():
                p.grad = grads[k]
            opt.step()
            opt.zero_grad()
    return rec


@pytest.mark.parametrize("staged", [False, True], ids=["host-rows", "staged-rows"])
@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_a_model_run_inside_torch_func_transforms_records_its_activations(transform, staged, monkeypatch):
    """Per-sample gradients (``vmap(grad(...))``, an MLP) and ``grad`` of the batch loss (a
    Transformer encoder layer): the model's outputs inside the transforms are functorch's wrappers
    (``data_ptr()`` of one raises, and the grad transform refuses a staging copy of one): the
    recorder measures the plain tensors under them. Every step is recorded; step 0's activation rows
    (all samples at once) equal those of the same model's plain batched forward, recorded as usual;
    the gradients of the outputs, which functorch computes without autograd's tensor hooks, are
    listed as not measured; the step end's rows are there."""
    from mpscope.recording import step_buffer

    monkeypatch.setattr(step_buffer.StepBuffer, "stage_cpu", staged)
    g = torch.Generator().manual_seed(5)
    if transform == "vmap":
        def make():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        data = [(torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(3)]
    else:
        def make():
            torch.manual_seed(0)
            return torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        data = [(torch.randn(2, 6, 16, generator=g), torch.randint(0, 16, (2, 6), generator=g)) for _ in range(3)]
    rec = _per_sample_training(make(), data, transform)
    assert "recording_error" not in rec.run.meta, rec.run.meta["recording_error"]
    t = rec.run.tensors
    assert sorted(t.step.unique()) == [0, 1, 2]
    assert {"activation", "param_grad", "weight", "optimizer_state"} <= set(t[t.step == 2].role)
    notes = rec.run.meta["not_measured"]
    assert notes and all(k.startswith("activation_grad ") and v == "computed inside a torch.func transform"
                         for k, v in notes.items())

    plain = make()
    x, y = data[0]
    outputs = {}  # the plain forward's single-tensor module outputs, by module name
    for mname, m in plain.named_modules():
        m.register_forward_hook(lambda m, a, out, mname=mname: outputs.__setitem__(mname, out.detach().clone())
                                if isinstance(out, torch.Tensor) else None)
    with mpscope.record(plain, roles=["activation"]) as ref:
        plain(x)
        ref.step()
    cols = [c for c in ref.run.tensors.columns if c not in ("step", "role", "loss_scale")]
    got = t[(t.step == 0) & (t.role == "activation")][cols].sort_values(["module", "name"]).reset_index(drop=True)
    want = ref.run.tensors[cols].sort_values(["module", "name"]).reset_index(drop=True)
    assert len(want) >= 3
    pd.testing.assert_frame_equal(got, want, check_categorical=False)
    for _, row in got[got.name == "output"].iterrows():  # and against the cast oracle itself
        for k, v in oracle(outputs[row["module"]]).items():
            assert (math.isnan(v) and math.isnan(row[k])) or row[k] == v, (row["module"], k, row[k], v)


def test_op_recording_inside_torch_func_transforms_records_the_ops_of_every_sample():
    """``ops=True`` on per-sample gradients (``vmap(grad(...))`` over an MLP): the op recorder's
    dispatch mode sees the ops functorch runs on the whole batch. Every step has op rows of the
    forward and the backward, and step 0's ReLU output row equals the cast oracle of the plain
    batched forward's ReLU output (all samples at once)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(2)]
    rec = _per_sample_training(model, data, "vmap", ops=True)
    assert "recording_error" not in rec.run.meta, rec.run.meta["recording_error"]
    t = rec.run.tensors
    ops = t[t.role == "op_output"]
    assert sorted(ops.step.unique()) == [0, 1]
    relu = ops[(ops.step == 0) & (ops.module == "1") & ops.name.str.startswith("aten.relu")]
    assert len(relu) == 1 and relu.iloc[0]["numel"] == 5 * 16
    with torch.no_grad():
        want = oracle(plain[1](plain[0](data[0][0])))
    for k, v in want.items():
        got = relu.iloc[0][k]
        assert (math.isnan(v) and math.isnan(got)) or got == v, (k, got, v)
    assert ops[ops.step == 0].name.str.contains("backward|threshold").any()  # (the backward's ops too)


@pytest.mark.parametrize("staged", [False, True], ids=["host-rows", "staged-rows"])
@pytest.mark.parametrize("batched", ["is_grads_batched", "vmap"])
def test_a_batched_backward_in_a_recorded_step_is_noted_and_changes_no_row(batched, staged, monkeypatch):
    """Each step also takes the Jacobian of the outputs with respect to the input through
    ``torch.autograd.grad(..., is_grads_batched=True)`` or ``torch.func.vmap`` over
    ``torch.autograd.grad`` (a gradient penalty, as WGAN-GP or input saliency compute it): that
    backward hands the output hooks vmap's batched tensors (no storage: ``data_ptr()`` raises).
    The recording goes on; those gradients,
    which are Jacobian rows and not the training gradient, are listed as not measured, and the
    frames equal those of the same training without the batched backward."""
    from mpscope.recording import step_buffer

    monkeypatch.setattr(step_buffer.StepBuffer, "stage_cpu", staged)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(3)]

    def train(jacobian: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with mpscope.record(model, opt) as rec:
            for x, y in data:
                x = x.clone().requires_grad_(True)
                out = model(x)
                rows = torch.eye(3).unsqueeze(1).expand(3, len(x), 3)
                if jacobian and batched == "vmap":
                    torch.func.vmap(lambda v: torch.autograd.grad(out, x, v, retain_graph=True))(rows)
                elif jacobian:
                    torch.autograd.grad(out, x, grad_outputs=rows, is_grads_batched=True, retain_graph=True)
                F.cross_entropy(out, y).backward()
                opt.step()
                opt.zero_grad()
        return rec.run

    got, want = train(True), train(False)
    assert "recording_error" not in got.meta, got.meta["recording_error"]
    notes = got.meta.get("not_measured", {})
    assert set(notes) == {f"activation_grad {m}/output" for m in ("", "0", "1", "2")}  # ("": the model)
    assert set(notes.values()) == {"computed in a batched backward (autograd.grad with is_grads_batched=True or under vmap)"}
    assert "not_measured" not in want.meta
    assert sorted(got.tensors.step.unique()) == [0, 1, 2] and (want.tensors.role == "activation_grad").any()
    for a, b in ((got.tensors, want.tensors), (got.histograms, want.histograms), (got.steps, want.steps)):
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))


class _Dequantized(torch.Tensor):
    """A ``__torch_dispatch__`` wrapper subclass without storage of its own (as torchao's float8 and
    NF4 tensors are): float32 to every op, which sees ``codes * scale`` (bfloat16 codes)."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: float):
        t = torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32, device=codes.device)
        t.codes, t.scale = codes, scale
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # (what nn.Parameter needs)
            return _Dequantized(args[0].codes, args[0].scale)

        def plain(a):
            return a.codes.float() * a.scale if isinstance(a, _Dequantized) else a

        return func(*[plain(a) for a in args], **{k: plain(v) for k, v in (kwargs or {}).items()})


class _QuantizedLinear(torch.nn.Module):
    """A frozen quantized weight (QLoRA's NF4 base weights) and a trained bias."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        codes = (torch.randn(n_out, n_in) * 64).to(torch.bfloat16)
        self.weight = torch.nn.Parameter(_Dequantized(codes, 1 / 64), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class _FakeQuant(torch.nn.Module):
    """Quantizes its input to bfloat16 codes with a power-of-two scale (no gradient flows through it)."""

    def forward(self, x):
        return _Dequantized((x.detach() * 64).to(torch.bfloat16), 1 / 64)


@pytest.mark.parametrize("staged", [False, True], ids=["host-rows", "staged-rows"])
def test_a_wrapper_subclass_records_the_values_it_computes_with(staged, monkeypatch):
    """A module output and a frozen weight that are ``__torch_dispatch__`` wrapper subclasses (no
    storage of their own: a quantized activation, a QLoRA-style quantized base weight): their rows
    hold the values every op computes with (what copying them into a plain tensor gives, ``codes *
    scale``), on the host rows as on the staged rows, and the recording goes on (no recording
    error) although the wrapper itself cannot be read ('data is not allocated yet' from the fused
    kernel, '.numpy() is not supported for tensor subclasses' from the torch ops), neither the
    activation in its hook nor the weight at the optimizer step."""
    from mpscope.recording import step_buffer

    monkeypatch.setattr(step_buffer.StepBuffer, "stage_cpu", staged)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), _FakeQuant(), _QuantizedLinear(16, 3))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(2)]
    outputs = []
    model[1].register_forward_hook(lambda m, a, out: outputs.append(out.codes.float() * out.scale))
    with mpscope.record(model, opt) as rec:
        for x, y in data:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert "recording_error" not in rec.run.meta, rec.run.meta["recording_error"]
    t = rec.run.tensors
    rows = t[(t.module == "1") & (t.role == "activation")]
    assert list(rows.step) == [0, 1] and (rows.dtype == "float32").all()
    for (_, row), out in zip(rows.iterrows(), outputs):
        for k, v in oracle(out).items():
            assert (math.isnan(v) and math.isnan(row[k])) or row[k] == v, (k, row[k], v)
    w = model[2].weight
    rows = t[(t.module == "2") & (t.role == "weight") & (t.name == "weight")]
    assert list(rows.step) == [0, 1]
    for _, row in rows.iterrows():
        for k, v in oracle(w.codes.float() * w.scale).items():
            assert (math.isnan(v) and math.isnan(row[k])) or row[k] == v, (k, row[k], v)


def test_a_nested_jagged_output_is_listed_not_measured():
    """A module output that is a nested tensor of the jagged layout (also a ``__torch_dispatch__``
    wrapper subclass, whose shape holds a symbolic ragged size): listed as not measured (nested),
    the recording goes on, and the rows of the plain tensors around it are there."""
    class Ragged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pack, self.head = torch.nn.Identity(), torch.nn.Linear(4, 2)

        def forward(self, x):
            nt = self.pack(torch.nested.nested_tensor([x[:2], x[2:]], layout=torch.jagged))
            return self.head(nt.values())

    model = Ragged()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mpscope.record(model, opt) as rec:
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    assert "recording_error" not in rec.run.meta, rec.run.meta["recording_error"]
    assert rec.run.meta["not_measured"] == {"activation pack/output": "nested"}
    t = rec.run.tensors
    assert {"activation", "activation_grad", "param_grad"} <= set(t[t.module == "head"].role)


@pytest.mark.parametrize("path", ["fused kernel", "torch ops"])
def test_a_tensor_that_takes_a_dead_tensors_identity_is_logged_under_every_key(fused, monkeypatch, path):
    """The step's seen tensors are told apart by (id, version counter, data pointer). Once a tensor
    dies, another can get all three back (CPython reuses the id, the allocator the memory). Such a
    tensor is a new one: observed under a module it shares with the dead tensor (a module that
    returns its child's output, as the dead one was), it is logged again, not taken for the dead
    tensor's repeat. The identity is given here, as that reuse gives it now and then."""
    if path == "torch ops":
        monkeypatch.setattr(kernel, "current", lambda start=True: None)
        monkeypatch.setattr(kernel, "core", lambda: None)
    model = torch.nn.Linear(4, 4)
    with mpscope.record(model) as rec:
        pass_id = Pass(PassKind.FORWARD, 1)
        ident = (1234567, 0, 7654321)
        for scale in (1.0, 3.0):  # the first tensor, then the one that takes its identity
            t = torch.full((4,), scale)
            facts = ("float32", 4, ident, path == "fused kernel")
            rec._observer.observe_now("child", "activation", "output", t, facts, False, pass_id)
            rec._observer.observe_now("parent", "activation", "output", t, facts, False, pass_id)
            del t
    rows = rec.run.tensors.set_index("module")
    for module in ("child", "parent"):
        assert rows.loc[module, "numel"] == 8, module  # both tensors, four elements each
        assert rows.loc[module, "max"] == 3.0 and rows.loc[module, "min"] == 1.0


def _train_other(recorded, trained, steps: int = 3):
    """Steps of SGD on ``trained`` while ``recorded`` is recorded without optimizer=; returns the
    recorder and mpscope's warnings."""
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mpscope.record(recorded) as rec:
            for _ in range(steps):
                recorded(x)
                trained(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    return rec, [str(w.message) for w in caught if "mpscope" in str(w.message)]


@pytest.mark.parametrize("member", ["another_model", "ema_copy"])
def test_recording_a_model_nobody_trains_warns_and_says_so_in_meta(member):
    torch.manual_seed(0)
    trained = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    recorded = (torch.nn.Sequential(torch.nn.Linear(4, 1)) if member == "another_model"
                else copy.deepcopy(trained).requires_grad_(False))
    rec, ours = _train_other(recorded, trained)
    assert len(ours) == 1 and "optimizers stepped 3 times" in ours[0] and "not the model being trained" in ours[0]
    assert rec.run.meta["untrained_model"] == 3


def test_recording_the_trained_model_gives_no_such_warning():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    rec, ours = _train_other(model, model)
    assert ours == [] and "untrained_model" not in rec.run.meta and len(rec.run.steps) == 3


@pytest.mark.parametrize("member", ["optimizer_given", "both_found"])
def test_the_grad_scaler_left_out_of_record_is_adopted_with_its_scale(member):
    """record(model, opt) (or record(model)) around a loop that scales its loss with a GradScaler:
    the loss scale rows are the scaler's own (GradScaler.get_scale after each update), not 1.0."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    scales = []
    with mpscope.record(model, opt if member == "optimizer_given" else None) as rec:
        for _ in range(3):
            scales.append(scaler.get_scale())
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    s = rec.run.steps
    assert rec.scaler is scaler and rec.run.meta["scaler"]["init_scale"] == 2.0**12
    assert s.loss_scale.tolist() == scales == [2.0**12, 2.0**13, 2.0**14]  # growth_interval=1: it grows each step
    assert s.scale_after.tolist() == [2.0**13, 2.0**14, 2.0**15]


def test_auto_false_adopts_no_grad_scaler():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with mpscope.record(model, opt, auto=False) as rec:
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert rec.scaler is None and rec.run.meta["scaler"] is None
