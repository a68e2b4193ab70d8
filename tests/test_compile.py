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


@pytest.mark.filterwarnings("ignore:mpscope. .* module\\(s\\) run inside")
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
    # the only rows missing: activation gradients of modules inside the region, listed as such
    missing = set(run.meta["unobserved"]["activation_grad"])
    expect = e[~((e.role == "activation_grad") & e.module.isin(missing))]
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
    with pytest.warns(UserWarning, match="blocks.0.attn"):
        with mpscope.record(model, optimizer=opt) as rec:
            opt.zero_grad()
            F.cross_entropy(model(x).view(-1, VOCAB), x.view(-1)).backward()
            opt.step()
    t = rec.run.tensors
    assert sorted(set(t.module)) == sorted(set(eager_run.tensors.module))
    # the compiled block's own output is observed from outside its region, gradient included
    assert {"activation", "activation_grad"} <= set(t[t.module == "blocks.0"].role)
    assert "blocks.0" not in rec.run.meta["unobserved"]["activation_grad"]
    assert not t.duplicated(KEY).any()


@pytest.mark.filterwarnings("ignore:mpscope. .* module\\(s\\) run inside")
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
    with pytest.warns(UserWarning, match="run inside a torch.compile"):
        with mpscope.record(cm, optimizer=opt) as rec:
            for _ in range(2):
                opt.zero_grad()
                cm(x, x)[1].backward()
                opt.step()
            assert rec.attached  # no internal error stopped the recording
    t = rec.run.tensors
    assert sorted(set(t.step)) == [0, 1] and (t.role == "param_grad").any()
