"""torch.compile'd models under mpscope.record: bounded compilations, the user's names, and the
same numbers as the eager model.

Oracles: dynamo's own counters (``torch._dynamo.utils.counters``), the eager model's recording on
the same inputs, and the compiled model trained without mpscope (weights bitwise equal).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpscope
from mpscope.demo.model import GPT, GPTConfig

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.convert_frame import input_codes  # noqa: E402
from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

STEPS, EVERY, VOCAB = 20, 3, 64
KEY = ["step", "module", "role", "name"]
STATS = ["dtype", "numel", "min", "max", "absmax", "absmin_nonzero", "zero_frac", "subnormal_frac",
         "fp16_underflow_frac", "fp16_subnormal_frac", "fp16_overflow_frac", "bf16_underflow_frac",
         "nan_count", "inf_count", "loss_scale"]


def _train(how: str | None, record: bool = True):
    """20 bf16-autocast AdamW steps of a small GPT; ``how``: None (eager), "wrap"
    (torch.compile(model)), "wrap-fullgraph", "method" (model.compile()). Returns (run, model,
    graphs compiled, compiled versions of each region dynamo compiled)."""
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=1, n_head=2, d_model=32, dropout=0.0))
    run_model = model
    if how in ("wrap", "wrap-fullgraph"):
        run_model = torch.compile(model, backend="aot_eager", fullgraph=how == "wrap-fullgraph")
    elif how == "method":
        model.compile(backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    rec = mpscope.record(run_model, optimizer=opt, every=EVERY) if record else None
    with rec if rec is not None else torch.enable_grad():
        for _ in range(STEPS):
            x = torch.randint(0, VOCAB, (4, 16), generator=g)
            y = torch.randint(0, VOCAB, (4, 16), generator=g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(run_model(x).float().view(-1, VOCAB), y.view(-1))
            loss.backward()
            opt.step()
    regions = [len(_debug_get_cache_entry_list(c)) for c in (r() for r in input_codes.seen) if c is not None]
    return (rec.run if rec else None), model, counters["stats"]["unique_graphs"], [n for n in regions if n]


@pytest.fixture(scope="module")
def eager_run():
    return _train(None)[0]


@pytest.mark.parametrize("how", ["wrap", "method", "wrap-fullgraph"])
def test_compiled_model_recorded_like_eager(how, eager_run):
    _, plain_model, plain_graphs, _ = _train(how, record=False)
    run, model, graphs, regions = _train(how)
    # at most two graphs per compiled region (a code object dynamo compiled): with and without
    # the recording hooks, over 20 steps with every=3
    assert plain_graphs >= 1 and regions and max(regions) <= 2 and graphs <= 2 * len(regions), (graphs, regions)
    # training unchanged by recording
    for (n, a), (_, b) in zip(plain_model.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n
    t, e = run.tensors, eager_run.tensors
    assert not t.module.str.contains("_orig_mod").any()
    assert run.meta["model"] == "GPT" and run.meta["compiled"] is True
    assert sorted(set(t.module)) == sorted(set(e.module))
    # nothing missing: the activation gradients inside the region come through GradTap
    assert not run.meta["unobserved"].get("activation_grad")
    expect = e
    assert len(t) == len(expect) and not t.duplicated(KEY).any()
    assert (e.role == "activation_grad").any() and (t.role == "activation").any()
    merged = expect.merge(t, on=KEY, suffixes=("_eager", "_compiled"), validate="one_to_one")
    assert len(merged) == len(t)
    for c in STATS:
        a, b = merged[f"{c}_eager"], merged[f"{c}_compiled"]
        same = (a == b) | (a.isna() & b.isna())
        assert same.all(), (c, merged.loc[~same, KEY].head())
    assert run.steps.recorded.tolist() == [i % EVERY == 0 for i in range(STEPS)]
    assert run.meta["autocast_dtype"] == "bfloat16"


def test_compiled_submodule_keeps_user_names(eager_run):
    """A compiled block inside an eager model (model.blocks[0] = torch.compile(block))."""
    dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=1, n_head=2, d_model=32, dropout=0.0))
    model.blocks[0] = torch.compile(model.blocks[0], backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, VOCAB, (4, 16))
    with mpscope.record(model, optimizer=opt) as rec:
        opt.zero_grad()
        F.cross_entropy(model(x).view(-1, VOCAB), x.view(-1)).backward()
        opt.step()
    t = rec.run.tensors
    assert sorted(set(t.module)) == sorted(set(eager_run.tensors.module))
    # the compiled block's own output is observed from outside its region, the modules inside it
    # from inside the graph: activations and their gradients
    for name in sorted(set(t.module[t.module.str.startswith("blocks.0")])):
        assert {"activation", "activation_grad"} <= set(t[t.module == name].role), name
    assert not rec.run.meta["unobserved"]
    assert not t.duplicated(KEY).any()


def test_model_compiled_before_recording_and_a_plain_twin():
    """Dynamo does not guard on module hooks by default: code compiled before recording (and for
    an unrecorded instance of the same class) must not run in place of the hooked code."""
    dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=1, n_head=2, d_model=32, dropout=0.0)
    model, twin = GPT(cfg), GPT(cfg)
    twin.load_state_dict(model.state_dict())
    cm, ct = torch.compile(model, backend="aot_eager"), torch.compile(twin, backend="aot_eager")
    x = torch.randint(0, VOCAB, (4, 16))
    cm(x)  # compiled before the recorder exists
    eager = GPT(cfg)
    eager.load_state_dict(model.state_dict())
    with mpscope.record(eager) as ref:
        eager(x)
        ref.step()
    with mpscope.record(cm) as rec:
        for _ in range(2):
            ct(x)  # the unrecorded twin runs between recorded calls
            cm(x)
            rec.step()
    t, e = rec.run.tensors, ref.run.tensors
    acts = t[t.role == "activation"]
    for step in (0, 1):
        assert set(acts[acts.step == step].module) == set(e[e.role == "activation"].module)
    merged = e[e.role == "activation"].merge(acts[acts.step == 0], on=["module", "name"])
    assert (merged.absmax_x == merged.absmax_y).all()


def test_compiled_model_returning_its_loss():
    """GPT(x, y) returns (logits, loss) with the loss computed inside the compiled graph: no
    gradient flows into the logits output (its hook gets an undefined gradient)."""
    dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=1, n_head=2, d_model=32, dropout=0.0))
    cm = torch.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, VOCAB, (4, 16))
    with mpscope.record(cm, optimizer=opt) as rec:
        for _ in range(2):
            opt.zero_grad()
            cm(x, x)[1].backward()
            opt.step()
        assert rec.attached  # no internal error stopped the recording
    t = rec.run.tensors
    assert sorted(set(t.step)) == [0, 1] and (t.role == "param_grad").any()


def test_activation_gradients_inside_a_compiled_region_by_output_container():
    """Outputs in a plain tuple or dict get their gradients recorded from inside the compiled graph
    (as eager records them); a named tuple's are listed in meta ``unobserved`` with a warning."""
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")

    class Split(torch.nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.kind, self.lin = kind, torch.nn.Linear(8, 16)

        def forward(self, x):
            a, b = self.lin(x).chunk(2, dim=-1)
            return {"tuple": lambda: (a, b), "dict": lambda: {"a": a, "b": b}, "named": lambda: Pair(a, b)}[self.kind]()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.parts = torch.nn.ModuleList(Split(k) for k in ("tuple", "dict", "named"))

        def forward(self, x):
            outs = [p(x) for p in self.parts]
            return (outs[0][0] * outs[0][1]).sum() + (outs[1]["a"] - outs[1]["b"]).pow(2).sum() + outs[2].a.sum()

    def grads(compiled):
        dynamo.reset()
        torch.manual_seed(0)
        net = Net()
        with mpscope.record(torch.compile(net, backend="aot_eager") if compiled else net, roles=["activation_grad"]) as rec:
            net_in = torch.randn(4, 8)
            (rec.model(net_in)).backward()
            rec.step()
        t = rec.run.tensors
        return t.set_index(["module", "name"]).sort_index(), rec.run.meta

    eager, _ = grads(False)
    with pytest.warns(UserWarning, match="parts.2"):
        compiled, meta = grads(True)
    assert meta["unobserved"]["activation_grad"] == ["parts.2"]
    keep = eager.index.get_level_values("module") != "parts.2"
    expect = eager[keep]
    assert set(eager.index[~keep]) == {("parts.2", "output.0")}  # b gets no gradient
    assert list(compiled.index) == list(expect.index)
    for c in ("absmax", "absmin_nonzero", "min", "max", "zero_frac"):
        assert (compiled[c].values == expect[c].values).all(), c


# --- inductor: what recording does to the numbers ------------------------------------------------
# Handing a module's output to ``mpscope::observe`` makes inductor store that output, which changes
# what it fuses around it. Two of inductor's own rules then give other last bits, with the same
# values going in: (1) inside a fused kernel a bf16 intermediate stays in float32 (a stored one is
# rounded to bf16, as eager PyTorch does) unless ``emulate_precision_casts``; (2) the C++ backend
# vectorises a reduction (LayerNorm's mean and variance) with a width chosen from the dtypes of every
# node fused into the kernel (32 float lanes with a bf16 load or store fused in, 16 without), so the
# summation order follows the fusion; scalar code (``cpp.simdlen=1``) has one order. The first test
# turns both rules off and asks for bitwise equality, dropout included (activation gradients aside:
# storing a gradient changes the compiled backward's last bits even so); the second keeps inductor's
# defaults and bounds the recorded run's difference by the compiled run's own difference to eager.


def _inductor_available() -> bool:
    import shutil

    import torch._inductor.config as icfg

    return shutil.which(icfg.cpp.cxx[1] or "g++") is not None


inductor = pytest.mark.skipif(not _inductor_available(), reason="inductor's C++ backend needs a C++ compiler")


def _inductor_train(record: bool, steps: int, compiled: bool = True, every: int = 1, dropout: float = 0.0,
                    roles=None):
    """``steps`` bf16-autocast AdamW steps of a one-block GPT (width 128) under inductor (or eager
    with ``compiled=False``), same init, inputs and dropout seed every call, recorded with ``roles``
    (None: all); returns (model, losses, first step's parameter gradients)."""
    dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=1, n_head=4, d_model=128, dropout=dropout))
    run_model = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 4, 16), generator=g) for _ in range(steps)]
    torch.manual_seed(2)  # the dropout masks
    losses, grads = [], None
    rec = mpscope.record(run_model, optimizer=opt, every=every, roles=roles) if record else None
    with rec if rec is not None else torch.enable_grad():
        for x, y in batches:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = run_model(x, y)[1]
            loss.backward()
            if grads is None:
                grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            losses.append(loss.detach())
    if rec is not None:
        assert (rec.run.tensors.role == "activation").any() and rec.run.meta["compiled"] is compiled
    return model, torch.stack(losses), grads


@inductor
def test_inductor_recording_changes_no_value():
    """With bf16 intermediates rounded as eager rounds them and one summation order (scalar code),
    recording activations, weights, gradients and optimizer state under inductor leaves every loss
    and weight bitwise equal over recorded and unrecorded steps with dropout on: mpscope changes no
    value and draws no random number. (Activation gradients are left out: storing the gradient at
    the softmax output changes the compiled backward's last bits even so; the next test bounds
    that.) One thread: the compiled embedding backward adds with atomics, a run-to-run difference
    of its own."""
    import torch._inductor.config as icfg

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with icfg.patch({"cpp.simdlen": 1, "emulate_precision_casts": True}):
            plain, plain_losses, _ = _inductor_train(False, 3, dropout=0.1)
            roles = ["activation", "param_grad", "weight", "optimizer_state", "loss"]
            model, losses, _ = _inductor_train(True, 3, every=2, dropout=0.1, roles=roles)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(losses, plain_losses), (losses, plain_losses)
    for (n, a), (_, b) in zip(plain.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n


@inductor
def test_inductor_recording_within_inductors_own_difference_to_eager():
    """Inductor's defaults, every role recorded (activation gradients included): the first step's
    gradients recorded differ from the unrecorded compiled step's by no more than the unrecorded compiled step's differ from eager PyTorch's (norm over all
    parameters), and the loss likewise."""
    _, eager_loss, eager = _inductor_train(False, 1, compiled=False)
    _, plain_loss, plain = _inductor_train(False, 1)
    _, loss, recorded = _inductor_train(True, 1)

    def dist(a, b):
        return torch.sqrt(sum(((x.float() - y.float()) ** 2).sum() for x, y in zip(a, b)))

    assert dist(plain, eager) > 0  # inductor's numbers are not eager's: the bound is a real one
    assert dist(recorded, plain) <= dist(plain, eager), (dist(recorded, plain), dist(plain, eager))
    assert (loss - plain_loss).abs() <= (plain_loss - eager_loss).abs()
