"""Recording stays true in unusual but legitimate training loops and never breaks them: only passes
that train the recorded model make its steps, PyTorch entry points are seen whatever name reaches
them, recorder errors never reach training, and every patch is undone in any order of exit."""

from __future__ import annotations

import itertools
import math
import warnings

import pandas.testing as pd_testing
import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.clip_grad as cg
from torch.amp import GradScaler
from torch.nn.modules import module as module_module
from torch.optim import optimizer as optimizer_module
from torch.utils.checkpoint import checkpoint

import mpscope
from mpscope import recorder as recorder_module
from mpscope.recording import patches

from loops import ReturnsItsParameter, assert_rows_match_tap, train_with_tap

X, Y = torch.randn(40, 8, generator=torch.Generator().manual_seed(1)), torch.randn(40, 1, generator=torch.Generator().manual_seed(2))
XE = torch.randn(400, 8, generator=torch.Generator().manual_seed(3)) * 5  # an evaluation batch


class Block(torch.nn.Module):
    def __init__(self, ckpt=None):
        super().__init__()
        self.fc, self.act, self.ckpt = torch.nn.Linear(16, 16), torch.nn.Tanh(), ckpt

    def forward(self, h):
        if self.ckpt is None:
            return self.act(self.fc(h))
        return checkpoint(lambda t: self.act(self.fc(t)), h, use_reentrant=self.ckpt == "reentrant")


def mlp(seed=0, ckpt=None):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), Block(ckpt), torch.nn.Linear(16, 1))


# -------------------------------------------------------------------------------- the property test
def step_plain(m, other, scaler):
    loss = F.mse_loss(m(X), Y)
    scaler.scale(loss).backward()
    return [loss.item()], [len(X)]


def step_accumulation(m, other, scaler):
    losses = []
    for xs, ys in ((X[:25], Y[:25]), (X[25:], Y[25:])):
        loss = F.mse_loss(m(xs), ys)
        scaler.scale(loss).backward()
        losses.append(loss.item())
    return losses, [25, 15]


def step_eval_passes(m, other, scaler):
    with torch.no_grad():
        m(XE)  # validation under no_grad
    m(XE[:100])  # a forward whose output is never backpropagated (e.g. a metric)
    return step_plain(m, other, scaler)


def step_two_models(m, other, scaler):
    loss_b = F.mse_loss(other(X), Y)  # another model, its own backward, the same scaler
    scaler.scale(loss_b * 100).backward()
    return step_plain(m, other, scaler)


def step_gradient_penalty(m, other, scaler):
    x = X.clone().requires_grad_(True)
    out = m(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = F.mse_loss(out, Y) + 0.1 * ((g.norm(dim=1) - 1) ** 2).mean()
    scaler.scale(loss).backward()
    return [loss.item()], [len(X)]


LOOPS = {"plain": (None, step_plain), "accumulation": (None, step_accumulation),
         "eval_passes": (None, step_eval_passes), "two_models": (None, step_two_models),
         "checkpoint_reentrant": ("reentrant", step_plain), "checkpoint_non_reentrant": ("non_reentrant", step_plain),
         "gradient_penalty": (None, step_gradient_penalty)}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_recorded_loss_and_activation_rows_are_the_training_passes(loop):
    """For each loop: the step's loss is what the loop backpropagated into the recorded model
    (summed over micro-batches), and each activation row's numel is the training batch's."""
    ckpt, step = LOOPS[loop]
    m, other = mlp(0, ckpt), mlp(1)
    opt = torch.optim.SGD(list(m.parameters()), lr=0.01)
    opt_b = torch.optim.SGD(other.parameters(), lr=0.01)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    want_loss, want_rows = [], []
    with mpscope.record(m, optimizer=opt, scaler=scaler) as rec:
        for _ in range(3):
            opt.zero_grad()
            opt_b.zero_grad()
            losses, batch = step(m, other, scaler)
            scaler.step(opt)
            scaler.update()
            want_loss.append(sum(losses))
            want_rows.append(sum(batch))
    steps = rec.run.steps
    assert list(steps.loss) == want_loss
    t = rec.run.tensors
    for module, width in (("0", 16), ("1.fc", 16), ("1", 16), ("2", 1)):
        act = t[(t.role == "activation") & (t.module == module)]
        assert list(act.numel) == [n * width for n in want_rows], (module, list(act.numel))
        grad = t[(t.role == "activation_grad") & (t.module == module)]
        assert len(grad) == 3, (module, list(grad.step))


# -------------------------------------------------------------------------------- kind 1: which passes train
def test_eval_pass_after_each_step_is_not_merged_into_the_training_step():
    """An fp16 MLP with an eval pass under no_grad after each step. Module '0' keeps
    the training batch's 40 rows and max; no extra NaN-loss step appears at the end."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = GradScaler("cpu")
    maxima = []  # the oracle: module '0''s output in the training passes
    handle = m[0].register_forward_hook(
        lambda mod, args, out: maxima.append(out.detach().max().item()) if torch.is_grad_enabled() else None)
    with mpscope.record(m, optimizer=opt, scaler=scaler) as rec:
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(m(X).float(), Y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                m(XE)
    handle.remove()
    steps = rec.run.steps
    assert len(steps) == 3 and steps.loss.notna().all()
    act = rec.run.tensors.query("role == 'activation' and module == '0'")
    assert list(act.numel) == [40 * 16] * 3
    assert list(act["max"]) == maxima


def test_gan_recording_the_generator_logs_the_generator_loss():
    """A GAN with one GradScaler, recording only the generator: the discriminator's loss (scaled
    and backpropagated first) is not the generator's; one training backward per step."""
    torch.manual_seed(0)
    G = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    D = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    og, od = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    scaler = GradScaler("cpu")
    real = torch.randn(16, 2) * 3
    g_losses = []
    with mpscope.record(G, optimizer=og, scaler=scaler) as rec:
        for _ in range(3):
            fake = G(torch.randn(16, 4))
            od.zero_grad()
            d_loss = (F.binary_cross_entropy_with_logits(D(real), torch.ones(16, 1))
                      + F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(16, 1))) * 10
            scaler.scale(d_loss).backward()
            scaler.step(od)
            og.zero_grad()
            g_loss = F.binary_cross_entropy_with_logits(D(fake), torch.ones(16, 1))
            scaler.scale(g_loss).backward()
            scaler.step(og)
            scaler.update()
            g_losses.append(g_loss.item())
    assert list(rec.run.steps.loss) == g_losses
    assert list(rec.run.steps.backward_count) == [1, 1, 1]


def train_with_passes(m, other=None, *, evaluate=False, compile_how=None, **record_kw):
    """3 fp16 steps of ``m`` (CPU autocast, GradScaler); with ``evaluate`` an evaluation pass under
    no_grad after each step; with ``other`` another model's step (same scaler) before each of
    ``m``'s. Returns the Run."""
    run_model = m
    if compile_how == "wrap":
        run_model = torch.compile(m, backend="aot_eager")
    elif compile_how == "method":
        m.compile(backend="aot_eager")
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = GradScaler("cpu")
    with mpscope.record(run_model, optimizer=opt, scaler=scaler, **record_kw) as rec:
        for _ in range(3):
            opt.zero_grad()
            if other is not None:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss_b = F.mse_loss(other(XE).float(), torch.zeros(len(XE), 1)) * 100
                scaler.scale(loss_b).backward()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(run_model(X).float(), Y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if evaluate:
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                    run_model(XE)
    return rec.run


def rows(run, role):
    cols = ["step", "module", "name", "dtype", "numel", "min", "max", "nan_count"]
    return run.tensors[run.tensors.role == role][cols].astype({"module": str, "name": str, "dtype": str}) \
        .reset_index(drop=True)


@pytest.mark.parametrize("member", ["eval_pass", "other_model"])
def test_op_rows_are_those_of_the_training_passes(member):
    """``ops=True``: an evaluation pass under no_grad after each step, or another model trained
    with the same scaler in the step, leaves the op rows exactly those of the loop without it, names
    included: the other model's backward does not count in the loss's call indices (the oracle: the
    same loop, same seeds, without the extra pass). The evaluation's ops are in the audit under
    their own phase, ``eval``; the other model's are neither in the audit nor in ``op_facts``."""
    plain = train_with_passes(mlp(), ops=True)
    extra = train_with_passes(mlp(), mlp(1) if member == "other_model" else None,
                              evaluate=member == "eval_pass", ops=True)
    want, got = rows(plain, "op_output"), rows(extra, "op_output")
    assert len(want) > 40
    assert got.equals(want)
    assert list(extra.steps.loss) == list(plain.steps.loss)
    audit = extra.tables["ops"]
    # the audit of the training ops is the same; the other model's ops are in it not at all, nor in op_facts
    trained = lambda a: a[a.phase != "eval"].reset_index(drop=True)  # noqa: E731
    pd_testing.assert_frame_equal(trained(audit), trained(plain.tables["ops"]))
    pd_testing.assert_frame_equal(extra.tables["op_facts"], plain.tables["op_facts"])
    if member == "eval_pass":
        assert set(audit.phase) == {"forward", "backward", "eval"}
        ev = audit[audit.phase == "eval"]
        mm = ev[(ev.module == "0") & ev.op.str.contains("addmm")]
        assert list(mm.numel) == [len(XE) * 16] * 3  # the evaluation batch through Linear(8, 16)


@pytest.mark.parametrize("how", ["wrap", "method"])
def test_activations_inside_a_compiled_region_are_those_of_the_training_passes(how):
    """torch.compile(m) and m.compile(): the activations the compiled region hands over keep the
    training batch's rows with an evaluation pass under no_grad after each step (the oracle: the
    eager model's rows without evaluation)."""
    torch._dynamo.reset()
    eager = train_with_passes(mlp())
    compiled = train_with_passes(mlp(), evaluate=True, compile_how=how)
    assert rows(compiled, "activation").equals(rows(eager, "activation"))
    assert list(compiled.steps.loss) == list(eager.steps.loss)


class QueryNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.inp, self.block = ReturnsItsParameter(4, 16), torch.nn.Linear(16, 16), Block("reentrant")

    def forward(self, x):
        return self.block(self.inp(x) + self.q(x).sum(0))


def _query_net_rows(extra):
    """Three steps of QueryNet (batch 8); ``extra``: where a forward on an evaluation batch of 32
    runs in each step (None: nowhere)."""
    torch.manual_seed(0)
    m = QueryNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(4)
    with mpscope.record(m, optimizer=opt) as rec:
        for _ in range(3):
            x, xe = torch.randn(8, 16, generator=g), torch.randn(32, 16, generator=g) * 1e3
            opt.zero_grad()
            if extra == "no_grad_before":
                with torch.no_grad():
                    m(xe)
            loss = m(x).square().mean()
            if extra == "no_grad_between":
                with torch.no_grad():
                    m(xe)
            elif extra == "unused_between":
                m(xe)  # grad enabled, never backpropagated (a metric)
            loss.backward()  # the checkpointed block re-runs here, after the extra pass
            opt.step()
    return rec.run.tensors


@pytest.mark.parametrize("extra", ["no_grad_before", "no_grad_between", "unused_between"])
def test_an_extra_pass_is_not_made_a_training_pass_by_gradients_of_its_leaf_or_of_a_rerun(extra):
    """The extra pass is made no training pass by the gradient the training pass sends to the
    Parameter the extra pass's module returned (the same leaf in both passes), nor by a reentrant
    checkpoint's re-run during backward, which runs while the extra pass is the latest: the extra
    pass's rows stay out of the step. The oracle: every activation row has the training batch's
    numel, and the rows equal those of the same loop without the extra pass."""
    got, want = _query_net_rows(extra), _query_net_rows(None)
    act = got[got.role == "activation"]
    widths = {"q": 64, "inp": 8 * 16, "block.fc": 8 * 16, "block.act": 8 * 16, "block": 8 * 16, "": 8 * 16}
    assert set(act.module) == set(widths) and len(act) == 3 * len(widths)
    assert all(n == widths[mod] for mod, n in zip(act.module, act.numel)), list(zip(act.module, act.numel))
    assert (got.role == "activation_grad").sum() == 3 * len(widths)
    assert got.equals(want)


class Trunk(torch.nn.Module):
    """The demo GPT's blocks and final LayerNorm (input: the embeddings, which require grad), with
    each block optionally run in its own checkpoint (``blocks``: None, "reentrant", "non_reentrant")."""

    def __init__(self, gpt, blocks=None):
        super().__init__()
        self.blocks, self.ln_f, self.ckpt = gpt.blocks, gpt.ln_f, blocks

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.ckpt is None else checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
        return self.ln_f(x)


class ReentrantCheckpoint(torch.autograd.Function):
    """Reentrant activation checkpointing written as Megatron-LM / DeepSpeed write theirs (not
    torch.utils.checkpoint): the forward runs ``fn`` under no_grad, the backward runs it again with
    grad on detached inputs, RNG state restored, and backpropagates through that re-run."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn, ctx.rng = fn, torch.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                out = ctx.fn(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


def _whole_model_checkpoint_rows(model, embed, head, params, steps, call):
    """Train ``model`` (run as ``call(x)``, ``x`` = ``embed(ids)``) on ``steps`` with an evaluation
    forward under no_grad between each forward and its backward (see ``train_with_tap``)."""

    def loss_of(ids):
        logits = head(call(embed(ids)))
        with torch.no_grad():
            call(embed(ids[:1]) * 3)  # evaluation between forward and backward
        return F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.utils.checkpoint's reentrant-variant advice
        return train_with_tap(model, params, steps, loss_of)


def _token_batches(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (3, 16), generator=g) for _ in range(2)] for _ in range(2)]


@pytest.mark.parametrize("whole, blocks", [("reentrant", None), ("reentrant", "reentrant"), ("reentrant", "non_reentrant"),
                                           ("non_reentrant", None), (None, "reentrant"), (None, None)])
def test_whole_model_checkpoint_records_the_forward_that_trained_it(whole, blocks):
    """The recorded model's root called inside a checkpoint (``whole``), its blocks possibly
    checkpointed too (``blocks``): the demo GPT's trunk, dropout 0.1, micro-batches, an evaluation
    pass between forward and backward. A reentrant checkpoint runs the forward under no_grad and
    backpropagates through its re-run in backward: the activations recorded there are the
    re-run's. The oracle
    (GradientTap, plain PyTorch hooks): each step's activation rows hold the very outputs gradients
    flowed through, once, and the activation-gradient rows those gradients."""
    from mpscope.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=32, d_model=32, n_layer=1, n_head=2, seq_len=16, dropout=0.1))
    trunk = Trunk(gpt, blocks)

    def call(x):
        return trunk(x) if whole is None else checkpoint(trunk, x, use_reentrant=whole == "reentrant")

    def embed(ids):
        return gpt.drop(gpt.tok_emb(ids) + gpt.pos_emb(torch.arange(ids.shape[1])))

    t, taps = _whole_model_checkpoint_rows(trunk, embed, lambda h: gpt.head(h), gpt.parameters(),
                                           _token_batches(32), call)
    assert len(taps[0]) == 2 + 16  # the trunk, its final LayerNorm, the block and its 15 modules
    for step, got in enumerate(taps):
        assert_rows_match_tap(t, step, got)


def test_a_reentrant_checkpoint_of_its_own_around_an_hf_model_records_the_forward_that_trained_it():
    """Megatron / DeepSpeed-style reentrant checkpointing (an autograd Function of its own, not
    torch's) around a transformers GPT-2 built from a config, fed embeddings from outside: the same
    oracle as above."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=48, n_positions=16,
                                  attn_implementation="eager", use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    body = transformers.GPT2Model(cfg)
    body.train()
    emb, head = torch.nn.Embedding(48, 32), torch.nn.Linear(32, 48)
    params = [*body.parameters(), *emb.parameters(), *head.parameters()]

    def call(x):
        return ReentrantCheckpoint.apply(lambda e: body(inputs_embeds=e).last_hidden_state, x)

    t, taps = _whole_model_checkpoint_rows(body, emb, head, params, _token_batches(48, 1), call)
    assert len(taps[0]) >= 10
    for step, got in enumerate(taps):
        assert_rows_match_tap(t, step, got)


class AutoEncoder(torch.nn.Module):
    """An encoder and a decoder (Linear, GELU, Linear each); the training loop calls them directly."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        self.decoder = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))

    def forward(self, x):
        return self.decoder(self.encoder(x))


@pytest.mark.parametrize("member", ["checkpoint_sequential", "encoder_decoder_called_directly"])
def test_modules_run_outside_the_models_forward_after_a_no_grad_pass_keep_their_rows(member):
    """The model's forward runs first under no_grad (targets from the model itself, as in
    self-distillation), then the training forward runs its modules without calling the model:
    ``checkpoint_sequential`` on the demo GPT's blocks (reentrant), or an autoencoder's encoder and
    decoder called by the loop. Those modules belong to the training pass, not to the no_grad pass
    that is dropped: their activation rows stay. The oracle: the GradientTap's outputs and
    gradients."""
    from torch.utils.checkpoint import checkpoint_sequential

    from mpscope.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    if member == "checkpoint_sequential":
        gpt = GPT(GPTConfig(vocab_size=32, d_model=32, n_layer=2, n_head=2, seq_len=16, dropout=0.0))
        model = torch.nn.Sequential(*gpt.blocks, gpt.ln_f)
        params = gpt.parameters()

        def loss_of(ids):
            x = gpt.tok_emb(ids)
            with torch.no_grad():
                target = model(x)
            h = checkpoint_sequential(model, 2, x, use_reentrant=True)
            return F.mse_loss(h.float(), target.float() * 0.5)

        steps = _token_batches(32)
    else:
        model = AutoEncoder()
        params = model.parameters()

        def loss_of(x):
            with torch.no_grad():
                target = model(x)
            return F.mse_loss(model.decoder(model.encoder(x)).float(), target.float() * 0.5 + x)

        g = torch.Generator().manual_seed(0)
        steps = [[torch.randn(8, 32, generator=g) for _ in range(2)] for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.utils.checkpoint's reentrant-variant advice
        t, taps = train_with_tap(model, params, steps, loss_of)
    assert len(taps[0]) >= 6 and "" not in taps[0]
    for step, got in enumerate(taps):
        assert_rows_match_tap(t, step, got)


# -------------------------------------------------------------------------------- kind 2: entry points
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_clipping_imported_by_name_before_recording_is_seen(clip):
    """``from torch.nn.utils import clip_grad_norm_`` (bound before record() patches anything), then
    clipping before unscale_: the clip is seen (clip norm = the returned norm) and flagged."""
    from torch.nn.utils import clip_grad_norm_
    from torch.nn.utils.clip_grad import clip_grad_value_

    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = GradScaler("cpu")
    with mpscope.record(m, optimizer=opt, scaler=scaler) as rec:
        opt.zero_grad()
        scaler.scale(F.mse_loss(m(X), Y)).backward()
        norm = clip_grad_norm_(m.parameters(), 1.0) if clip == "norm" else clip_grad_value_(m.parameters(), 0.1)
        scaler.step(opt)
        scaler.update()
    s = rec.run.steps
    assert bool(s.clipped_before_unscale.iloc[0])
    if clip == "norm":
        assert s.clip_norm.iloc[0] == float(norm)
    codes = {f.code for f in mpscope.advise(rec.run).findings}
    assert "clip_before_unscale" in codes


def clip_then_step(clip, accumulate=False):
    """Train 2 steps (one micro-batch, or two with ``accumulate``) running ``clip(m)`` before
    ``scaler.step``; returns the Run and the norms ``clip`` returned."""
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    norms = []
    with mpscope.record(m, optimizer=opt, scaler=scaler) as rec:
        for _ in range(2):
            opt.zero_grad()
            for xs, ys in (((X[:20], Y[:20]), (X[20:], Y[20:])) if accumulate else ((X, Y),)):
                scaler.scale(F.mse_loss(m(xs), ys)).backward()
            norms.append(clip(m, scaler, opt))
            scaler.step(opt)
            scaler.update()
    return rec.run, norms


def clip_new_api(m, scaler, opt):
    """Newer PyTorch's recommended pair, as bound in the torch.nn.utils namespace, before unscale_."""
    params = list(m.parameters())
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
    return float(norm)


def clip_by_hand(m, scaler, opt):
    """A hand-written clip (no torch clip function at all) before unscale_."""
    with torch.no_grad():
        grads = [p.grad for p in m.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for g in grads:
            g.mul_(torch.clamp(1.0 / (norm + 1e-6), max=1.0))
    return float(norm)


def clip_after_unscale(m, scaler, opt):
    scaler.unscale_(opt)
    return float(torch.nn.utils.clip_grads_with_norm_(list(m.parameters()), 1.0,
                                                      torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]))
                 or 0.0)


def test_clip_grads_with_norm_called_from_torch_nn_utils_before_unscale_is_seen():
    """``torch.nn.utils.clip_grads_with_norm_`` is the very function object the patched helper
    wraps, bound in another namespace: the clip is seen, with the norm it was given."""
    run, norms = clip_then_step(clip_new_api)
    s = run.steps
    assert list(s.clipped_before_unscale) == [True, True]
    assert list(s.clip_norm) == norms
    assert "clip_before_unscale" in {f.code for f in mpscope.advise(run).findings}


def rescale_by_hand(m, scaler, opt):
    """Averaging by hand before unscale_ (a constant factor, whatever the norm): harmless."""
    with torch.no_grad():
        for p in m.parameters():
            p.grad.div_(2)
    return float("nan")


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("change", [clip_by_hand, rescale_by_hand], ids=["clip", "rescale"])
def test_gradients_changed_by_hand_before_unscale_are_seen_by_their_effect(change, accumulate):
    """No clip function runs: the gradients changed in place between the backward and unscale_.
    The Run lists the steps; the effect cannot tell a clip from a harmless rescale, so the advisor
    warns and names both readings instead of reporting a clip."""
    run, _ = clip_then_step(change, accumulate)
    s = run.steps
    assert not s.clipped_before_unscale.any()
    assert run.meta["grads_changed_before_unscale"] == [0, 1]
    codes = {f.code: f for f in mpscope.advise(run).findings}
    assert "clip_before_unscale" not in codes
    f = codes["grads_changed_before_unscale"]
    assert f.severity == "warning" and f.value == 2 and f.step == 0
    assert f.threshold == float(s.loss_scale.iloc[0]) == 2.0**10
    assert "harmless" in f.message and "threshold" in f.message


@pytest.mark.parametrize("clip", [clip_after_unscale, lambda m, scaler, opt: None], ids=["after_unscale", "none"])
def test_gradients_left_alone_until_unscale_are_not_flagged(clip):
    run, _ = clip_then_step(clip, accumulate=True)
    assert not run.steps.clipped_before_unscale.any()
    assert "grads_changed_before_unscale" not in run.meta


def test_autograd_backward_called_directly_is_counted_with_its_loss():
    """``torch.autograd.backward(scaled)`` never calls ``Tensor.backward``: the parameters'
    gradients show the training backward, and its loss is the one given to ``scaler.scale``."""
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = GradScaler("cpu")
    losses = []
    with mpscope.record(m, optimizer=opt, scaler=scaler) as rec:
        for _ in range(2):
            opt.zero_grad()
            loss = F.mse_loss(m(X), Y)
            torch.autograd.backward(scaler.scale(loss))
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    assert list(rec.run.steps.loss) == losses
    assert list(rec.run.steps.backward_count) == [1, 1]
    assert (rec.run.tensors.role == "activation_grad").any()


def test_reentrant_checkpointing_on_gpt2_keeps_every_activation_gradient():
    """transformers GPT-2 with ``gradient_checkpointing_enable(use_reentrant=True)``: the same
    activation and activation-gradient rows (names and element counts) as without checkpointing."""
    transformers = pytest.importorskip("transformers")

    def rows(reentrant):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
        model = transformers.GPT2LMHeadModel(cfg)
        model.train()
        if reentrant:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with mpscope.record(model, optimizer=opt) as rec:
                model(ids, labels=ids).loss.backward()
                opt.step()
        t = rec.run.tensors
        return {r: t[t.role == r].set_index(["module", "name"]).numel.sort_index() for r in ("activation", "activation_grad")}

    plain, ckpt = rows(False), rows(True)
    inside = [m for m in plain["activation_grad"].index.get_level_values(0) if m.startswith("transformer.h.")]
    assert len(inside) >= 20
    for role in ("activation", "activation_grad"):
        assert ckpt[role].equals(plain[role]), role


# -------------------------------------------------------------------------------- kind 4: never crash training
def train_sparse(record: bool):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    idx = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(0))

    def loop():
        for _ in range(3):
            opt.zero_grad()
            m(idx).pow(2).mean().backward()
            opt.step()

    if not record:
        loop()
        return m, None
    with mpscope.record(m, optimizer=opt) as rec:
        loop()
    return m, rec.run


def test_sparse_gradients_are_skipped_with_a_note_and_training_is_unchanged():
    plain, _ = train_sparse(False)
    recorded, run = train_sparse(True)
    for a, b in zip(plain.parameters(), recorded.parameters()):
        assert torch.equal(a, b)
    assert run.meta["not_measured"] == {"param_grad 0/weight": "sparse"}
    assert len(run.steps) == 3
    t = run.tensors
    assert ((t.role == "param_grad") & (t.module == "1")).sum() == 2 * 3  # weight and bias, dense: measured


def test_nested_tensor_outputs_are_skipped_with_a_note():
    class Ragged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 1)

        def forward(self, x):
            y = self.fc(x)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                nested = torch.nested.nested_tensor([y[:3, 0], y[3:, 0]])  # an extra ragged output
            return y, nested

    m = Ragged()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with mpscope.record(m, optimizer=opt) as rec:
        y, _ = m(X)
        F.mse_loss(y, Y).backward()
        opt.step()
    assert rec.run.meta["not_measured"] == {"activation /output.1": "nested"}
    assert set(rec.run.tensors.query("role == 'activation'").name) == {"output", "output.0"}


def test_a_spill_dir_that_is_a_file_is_refused_at_record(tmp_path):
    """record() itself refuses a spill_dir that is a file (RecorderError: pass a directory), so no
    training step starts with it."""
    f = tmp_path / "spill"
    f.write_text("not a directory")
    m = mlp()
    with pytest.raises(mpscope.recorder.RecorderError, match="spill_dir=.* is a file; pass a directory"):
        mpscope.record(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), spill_dir=f)


def test_an_internal_error_warns_once_detaches_and_training_goes_on(monkeypatch):
    """Any recorder failure inside a hook: one warning, the rows so far kept, every hook and patch
    removed, and training bitwise the same as without mpscope."""
    def train(record):
        m = mlp()
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        scaler = GradScaler("cpu")
        ctx = mpscope.record(m, optimizer=opt, scaler=scaler) if record else None
        if ctx:
            ctx.__enter__()
        try:
            for i in range(4):
                if i == 2 and ctx:
                    monkeypatch.setattr(recorder_module._stats, "device_stats", boom)
                    monkeypatch.setattr(recorder_module._kernel, "fused_stats_into", boom)  # the host-rows path
                opt.zero_grad()
                scaler.scale(F.mse_loss(m(X), Y)).backward()
                scaler.step(opt)
                scaler.update()
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
        return m, ctx

    def boom(*a, **k):
        raise RuntimeError("stats kernel exploded")

    plain, _ = train(False)
    with pytest.warns(RuntimeWarning, match="internal error in .*stats kernel exploded.*training goes on") as w:
        recorded, rec = train(True)
    assert len([x for x in w if "internal error" in str(x.message)]) == 1
    for a, b in zip(plain.parameters(), recorded.parameters()):
        assert torch.equal(a, b)
    assert list(rec.run.steps.step) == [0, 1] and set(rec.run.tensors.step) == {0, 1}
    assert "stats kernel exploded" in rec.run.meta["recording_error"]
    assert not rec.attached and torch.Tensor.backward is _ORIGINALS[(torch.Tensor, "backward")]



@pytest.mark.parametrize("staged", [False, True], ids=["host-rows", "staged-rows"])
@pytest.mark.parametrize("boundary", ["recorder.step()", "block end"])
def test_an_internal_error_at_a_step_end_the_loop_calls_warns_and_detaches(boundary, staged, monkeypatch):
    """``recorder.step()`` and the end of the ``with`` block end a step outside any hook: a stats
    failure there (the step's parameter stats; through the staged rows also its activations'
    batched pass) warns once and detaches as one inside a hook does, keeps the rows recorded
    before, and never reaches the training loop."""
    from mpscope.recording.step_buffer import StepBuffer

    monkeypatch.setattr(StepBuffer, "stage_cpu", staged)

    def boom(*a, **k):
        raise RuntimeError("stats kernel exploded")

    m = mlp()
    with pytest.warns(RuntimeWarning, match="internal error in .*stats kernel exploded") as w:
        with mpscope.record(m) as rec:
            for i in range(3):
                F.mse_loss(m(X), Y).backward()
                if i == 2:
                    for name in ("device_stats", "staged_stats"):
                        monkeypatch.setattr(recorder_module._stats, name, boom)
                    monkeypatch.setattr(recorder_module._kernel, "fused_stats_into", boom)
                    if boundary == "block end":
                        break
                rec.step()
            F.mse_loss(m(X), Y).backward()  # training goes on
    assert len([x for x in w if "internal error" in str(x.message)]) == 1
    t = rec.run.tensors
    assert list(rec.run.steps.step) == [0, 1] and set(t.step) == ({0, 1} if staged else {0, 1, 2})
    # the failed step's activation rows: taken in their hooks on the host rows (kept), in the
    # failed batched pass through the staged rows (lost)
    assert set(t[t.step == 2].role) <= {"activation", "activation_grad", "loss"}
    assert "stats kernel exploded" in rec.run.meta["recording_error"] and not rec.attached
    assert not any(mod._forward_hooks for mod in m.modules())

# -------------------------------------------------------------------------------- kind 5: leaks
_ORIGINALS = {(torch.Tensor, "backward"): torch.Tensor.backward,
              **{(cg, n): getattr(cg, n) for n in patches.CLIP_HELPERS},
              (GradScaler, "scale"): GradScaler.__dict__["scale"], (GradScaler, "update"): GradScaler.__dict__["update"]}


def assert_all_original(scaler, models):
    for (obj, attr), fn in _ORIGINALS.items():
        assert (obj.__dict__[attr] if isinstance(obj, type) else getattr(obj, attr)) is fn, attr
    assert not {"scale", "update", "step", "unscale_"} & set(vars(scaler))
    assert not patches._LIVE
    assert all(recorder_module._ATTACHED.get(m) is None for m in models)
    assert not optimizer_module._global_optimizer_post_hooks and not optimizer_module._global_optimizer_pre_hooks
    assert not module_module._global_forward_hooks and not module_module._global_forward_pre_hooks
    assert torch._C._len_torch_dispatch_stack() == 0  # the op recorder's dispatch mode
    for m in models:
        assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in m.modules())
        assert not any(p._post_accumulate_grad_hooks for p in m.parameters())


def test_recorders_entered_and_exited_in_every_order_restore_every_patched_name():
    """Three recorders (one with max_steps, one wrapping a shared GradScaler instance, one in auto
    mode patching GradScaler's class and recording ops: a dispatch mode and global module and
    optimizer hooks), entered in every order and exited in every order."""
    models = [torch.nn.Linear(2, 2) for _ in range(3)]
    scaler = GradScaler("cpu")
    for enter in itertools.permutations(range(3)):
        for leave in itertools.permutations(range(3)):
            recs = [mpscope.record(models[0], max_steps=2), mpscope.record(models[1], scaler=scaler),
                    mpscope.record(models[2], auto=True, ops=True)]
            for i in enter:
                recs[i].__enter__()
            loss = sum(m(torch.ones(1, 2)).sum() for m in models)
            scaler.scale(loss).backward()
            for i in leave:
                recs[i].__exit__(None, None, None)
            assert_all_original(scaler, models)


def test_a_traced_model_is_recorded_twice_and_a_scripted_one_refused_clearly():
    """A torch.jit.trace'd model is recorded twice in a row (each record() exits cleanly and the
    next is accepted); a torch.jit.script'd one is refused with a message naming the eager model."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(m, torch.randn(2, 4))
        scripted = torch.jit.script(m)
    opt = torch.optim.SGD(traced.parameters(), lr=0.1)
    for _ in range(2):  # the second record() must not be refused
        with mpscope.record(traced, optimizer=opt) as rec:
            traced(torch.randn(2, 4)).sum().backward()
            opt.step()
        assert len(rec.run.steps) == 1 and not math.isnan(rec.run.steps.loss.iloc[0])
        assert (rec.run.tensors.role == "activation").any()
    for _ in range(2):
        with pytest.raises(mpscope.recorder.RecorderError, match="torch.jit.script model .* record the eager model"):
            mpscope.record(scripted, optimizer=opt)
    assert_all_original(GradScaler("cpu"), [traced, scripted])


@pytest.mark.parametrize("member", ["mlp", "gpt2_ops_shadow"])
def test_a_copy_of_the_model_made_while_recording_is_neither_recorded_nor_broken(member, tmp_path):
    """The kind: a loop copies the model while it is recorded (an EMA or best-model snapshot with
    ``copy.deepcopy``, a checkpoint with ``torch.save(model)``). The hooks mpscope puts on the model
    are copied with it, without the recorder (a bound method's deep copy would copy the whole
    recorder and raise ``cannot pickle 'module' object``), and they pickle (no local lambda).
    Members: an fp16 MLP with a GradScaler (module, root and parameter hooks), and HF GPT-2 with
    ``ops=True`` and the fp32 shadow (the shadow's hooks). The oracle is the same loop without the
    copies: the recorded rows are equal, and the copies (an EMA updated and run every step, one
    saved and loaded) run and add no row."""
    import copy

    def build():
        torch.manual_seed(0)
        if member == "mlp":
            return mlp(), lambda m: F.mse_loss(m(X).float(), Y), {}
        from transformers import GPT2Config, GPT2LMHeadModel

        m = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                       attn_implementation="eager", use_cache=False))
        m.eval()  # (no dropout: both runs draw the same numbers)
        ids = torch.randint(0, 64, (2, 16))
        return m, lambda m: m(ids, labels=ids).loss, {"ops": True, "shadow": True}

    def run(copies: bool):
        m, loss_of, kw = build()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        scaler = GradScaler("cpu", init_scale=2.0**8)
        ema = None
        with mpscope.record(m, optimizer=opt, scaler=scaler, **kw) as rec:
            for step in range(3):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = loss_of(m)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                if copies:
                    if ema is None:
                        ema = copy.deepcopy(m)
                    with torch.no_grad():
                        for pe, p in zip(ema.parameters(), m.parameters()):
                            pe.lerp_(p, 0.1)
                        ema_loss = loss_of(ema)
                    torch.save(m, tmp_path / "model.pt")
        t = rec.run.tensors
        rows = t.astype({c: str for c in t.select_dtypes("category")}).sort_values(["step", "role", "module", "name"])
        return rows.reset_index(drop=True), ema_loss if copies else None

    (got, ema_loss), (want, _) = run(True), run(False)
    assert len(want) > 20
    pd_testing.assert_frame_equal(got, want)
    assert torch.isfinite(ema_loss)
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with mpscope.record(loaded) as rec:  # the loaded copy can itself be recorded, once
        loss_of = build()[1]
        loss_of(loaded).backward()
        rec.step()
    assert set(rec.run.tensors.step) == {0} and len(rec.run.tensors) > 0


def _all_rows(run):
    """Every tensor row of ``run`` sorted by step, role, module, name (text columns), and its steps."""
    t = run.tensors
    t = t.astype({c: str for c in t.select_dtypes("category")}).sort_values(["step", "role", "module", "name"])
    return t.reset_index(drop=True), run.steps.reset_index(drop=True)


def _train_with_probe(model, loss_of, probe_of, after: bool = False):
    """3 float16 steps (CPU autocast, GradScaler) of ``loss_of()``, with ``probe_of()`` (when given)
    after the loss in each, or once after the last step (``after``); returns the Run. The probe's
    gradients, where it returns some, are finite."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", init_scale=2.0**8)

    def probe():
        with torch.autocast("cpu", dtype=torch.float16):
            out = probe_of()
        assert not isinstance(out, tuple) or all(torch.isfinite(g).all() for g in out)

    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of()
            if probe_of is not None and not after:
                probe()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if probe_of is not None and after:
            probe()
    return rec.run


def _gpt2_small():
    import transformers

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  attn_implementation="eager", use_cache=False)
    m = transformers.GPT2LMHeadModel(cfg)
    m.eval()  # (no dropout: both runs draw the same numbers)
    return m


@pytest.mark.parametrize("member", ["autoencoder_encoder", "gpt2_transformer"])
def test_a_submodule_called_directly_under_no_grad_is_an_evaluation_pass(member):
    """The kind: the loop runs part of the model under no_grad without calling the model (an
    encoder for validation features, ``model.transformer`` for hidden states). Modules run outside
    the model's forward with grad enabled belong to no pass and keep their rows (a loop may train
    through them). Under no_grad they are an evaluation pass (an autograd Function's forward, as
    reentrant checkpointing runs, excepted), whose rows are not merged into the training step's (no
    activation with twice the numel, no errors from an input that overflows float16 that the
    training never has). Members:
    the autoencoder's encoder on an overflowing batch, HF GPT-2's transformer. The oracle is the
    same loop without the probe: every row, the steps and the findings are equal."""
    def run(probe: bool):
        torch.manual_seed(0)
        if member == "autoencoder_encoder":
            model, x = AutoEncoder(), torch.randn(16, 32)
            loss_of = lambda: F.mse_loss(model(x).float(), x)  # noqa: E731
            probe_of = torch.no_grad()(lambda: model.encoder(x[:4] * 1e5))
        else:
            model = _gpt2_small()
            ids, ids_val = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
            loss_of = lambda: model(ids, labels=ids).loss  # noqa: E731
            probe_of = torch.no_grad()(lambda: model.transformer(ids_val))
        run = _train_with_probe(model, loss_of, probe_of if probe else None)
        return (*_all_rows(run), [(f.kind, f.module) for f in mpscope.advise(run).findings])

    (rows_, steps, findings), (want, want_steps, want_findings) = run(True), run(False)
    assert len(want) > 20
    pd_testing.assert_frame_equal(rows_, want)
    pd_testing.assert_frame_equal(steps, want_steps)
    assert findings == want_findings


@pytest.mark.parametrize("member", ["mlp_grad_norm_monitor", "gpt2_saliency"])
def test_a_backward_that_trains_no_parameter_leaves_its_pass_out(member):
    """The kind: a pass of the model is backpropagated in a training step by a backward that gives
    no parameter a gradient (``torch.autograd.grad`` of a validation loss for a gradient-norm monitor
    whose gradients are thrown away, a saliency map ``autograd.grad(loss, inputs_embeds)``). A
    gradient reaches its outputs, yet its rows are not merged into the training step's (no doubled
    numel, no added findings): a pass trains the model when a gradient reaches it in a backward in
    which a parameter gets its gradient. Members: an fp16 MLP, HF GPT-2. The oracle is
    the same loop without the probe: every row and the steps are equal."""
    def run(probe: bool):
        torch.manual_seed(0)
        if member == "mlp_grad_norm_monitor":
            model, x, y = mlp(), X, Y
            loss_of = lambda: F.mse_loss(model(x).float(), y)  # noqa: E731

            def probe_of():
                val = F.mse_loss(model(XE[:8]).float(), torch.zeros(8, 1))
                return torch.autograd.grad(val, list(model.parameters()))
        else:
            model = _gpt2_small()
            ids, ids_val = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
            loss_of = lambda: model(ids, labels=ids).loss  # noqa: E731

            def probe_of():
                with torch.no_grad():  # (a submodule called directly under no_grad: evaluation too)
                    emb = model.transformer.wte(ids_val)
                emb.requires_grad_(True)
                return torch.autograd.grad(model(inputs_embeds=emb, labels=ids_val).loss, emb)
        return _all_rows(_train_with_probe(model, loss_of, probe_of if probe else None))

    (rows_, steps), (want, want_steps) = run(True), run(False)
    assert len(want) > 20
    pd_testing.assert_frame_equal(rows_, want)
    pd_testing.assert_frame_equal(steps, want_steps)


@pytest.mark.parametrize("member", ["submodule_with_grad", "frozen_root", "gpt2_functional_call_detached",
                                    "grad_norm_after_the_last_step"])
def test_a_probe_no_training_backward_reaches_leaves_no_rows(member):
    """The kind: a forward of the model, or of part of it, whose outputs no backward that trains the
    model reaches. Members: the autoencoder's encoder called directly with grad enabled and never
    backpropagated (modules run outside the model's forward with grad: each call is a pass of its
    own, kept when a training backward reaches it); the model run with every parameter frozen (its
    output needs no grad: no hookless pass kept for want of hooks); HF GPT-2 through
    ``torch.func.functional_call`` on detached parameters (likewise); a gradient-norm monitor's
    ``autograd.grad`` after the last optimizer step (it adds no fourth step). The oracle is
    the same loop without the probe: every row and the steps are equal."""
    def run(probe: bool):
        torch.manual_seed(0)
        if member == "gpt2_functional_call_detached":
            model = _gpt2_small()
            ids, ids_val = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
            loss_of = lambda: model(ids, labels=ids).loss  # noqa: E731
            detached = lambda: {k: v.detach() for k, v in model.named_parameters()}  # noqa: E731
            probe_of = lambda: torch.func.functional_call(model, detached(), (ids_val,)).logits  # noqa: E731
        else:
            model, x = AutoEncoder(), torch.randn(16, 32)
            loss_of = lambda: F.mse_loss(model(x).float(), x)  # noqa: E731
            if member == "submodule_with_grad":
                probe_of = lambda: model.encoder(x[:4] * 3)  # noqa: E731
            elif member == "frozen_root":
                def probe_of():
                    model.requires_grad_(False)
                    out = model(x[:4] * 3)
                    model.requires_grad_(True)
                    return out
            else:
                def probe_of():
                    val = F.mse_loss(model(x[:4] * 3).float(), x[:4])
                    return torch.autograd.grad(val, list(model.parameters()))
        run = _train_with_probe(model, loss_of, probe_of if probe else None,
                                after=member == "grad_norm_after_the_last_step")
        return _all_rows(run)

    (rows_, steps), (want, want_steps) = run(True), run(False)
    assert len(want) > 20
    pd_testing.assert_frame_equal(rows_, want)
    pd_testing.assert_frame_equal(steps, want_steps)


def _backward_by(entry: str, loss, other, model, scale):
    """Backpropagate ``loss`` (and ``other``) through ``entry``; returns the loss the loop minimised."""
    if entry == "Tensor.backward":
        scale(loss).backward()
    elif entry == "autograd.backward":
        torch.autograd.backward(scale(loss))
    elif entry == "autograd.backward of two losses":
        torch.autograd.backward([scale(loss), scale(other)])
        return loss + other
    elif entry == "autograd.backward, weighted":
        torch.autograd.backward([scale(loss), scale(other)], [torch.tensor(2.0), torch.tensor(0.25)])
        return 2.0 * loss + 0.25 * other
    else:  # autograd.grad of the parameters, assigned by the loop
        for p, g in zip(model.parameters(), torch.autograd.grad(scale(loss), list(model.parameters()))):
            p.grad = g
    return loss


@pytest.mark.parametrize("entry, scaled", [
    *((e, s) for e in ("Tensor.backward", "autograd.backward", "autograd.grad") for s in (False, True)),
    ("autograd.backward of two losses", False), ("autograd.backward, weighted", False),
])
def test_the_recorded_loss_is_the_loss_backpropagated_whatever_the_entry_point(entry, scaled):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = GradScaler("cpu", init_scale=2.0**8) if scaled else None
    scale = (lambda t: scaler.scale(t)) if scaled else (lambda t: t)  # looked up at each call, as a loop does
    minimised = []
    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        for _ in range(3):
            opt.zero_grad()
            out = model(torch.randn(16, 4))
            minimised.append(float(_backward_by(entry, out.pow(2).mean(), out.abs().mean(), model, scale)))
            (scaler.step(opt), scaler.update()) if scaled else opt.step()
    steps = rec.run.steps
    assert steps.loss.tolist() == pytest.approx(minimised, rel=1e-6)
    assert steps.backward_count.tolist() == [1, 1, 1]
    assert (rec.run.tensors.role == "loss").sum() == 3


def test_a_gradient_penalty_grad_of_the_inputs_is_not_a_training_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    minimised = []
    with mpscope.record(model, optimizer=opt) as rec:
        for _ in range(3):
            opt.zero_grad()
            x = torch.randn(16, 4, requires_grad=True)
            (gx,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)  # WGAN-GP's penalty
            loss = model(x.detach()).pow(2).mean() + gx.pow(2).mean()
            loss.backward()
            opt.step()
            minimised.append(float(loss))
    assert rec.run.steps.loss.tolist() == pytest.approx(minimised, rel=1e-6)
    assert rec.run.steps.backward_count.tolist() == [1, 1, 1]
