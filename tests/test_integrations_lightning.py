"""lightning.pytorch.Trainer + mpscope.integrations.lightning.MPScopeCallback on a LightningModule
around a tiny GPT-2 built from a config.

Oracles: what Lightning itself does, captured by a plain callback of our own: the losses its
training_step returned, the precision plugin's GradScaler, the gradients as they are in
``on_before_optimizer_step`` and whether the parameters changed in the optimizer step.
"""

from __future__ import annotations

import math

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import mpscope  # noqa: E402
from mpscope.demo.data import load_text  # noqa: E402
from mpscope.integrations.lightning import MPScopeCallback  # noqa: E402

SEQ = 32
PROBE = ("model.transformer.h.0.mlp.c_fc", "weight")


class LitGPT(L.LightningModule):
    def __init__(self, inf_step=None):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
        self.inf_step = inf_step

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        if self.trainer.global_step == self.inf_step:
            loss = loss * math.inf
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Oracle(L.Callback):
    def __init__(self):
        self.losses, self.scale, self.scale_after, self.grad_absmax, self.skipped = [], [], [], [], []
        self._step = None

    def _scaler(self, trainer):
        return getattr(trainer.precision_plugin, "scaler", None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._step != trainer.global_step:  # the first micro-batch of an optimizer step
            self._step = trainer.global_step
            s = self._scaler(trainer)
            self.scale.append(s.get_scale() if s is not None else 1.0)
            self.losses.append(0.0)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        p = pl_module.get_submodule(PROBE[0]).get_parameter(PROBE[1])
        self.grad_absmax.append(float(p.grad.abs().max()))
        self.before = [q.detach().clone() for q in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Lightning's outputs carry the loss it back-propagated (divided by accumulate_grad_batches)
        self.losses[-1] += float(outputs["loss"])
        if trainer.global_step != self._step:  # the optimizer stepped after this micro-batch
            s = self._scaler(trainer)
            self.scale_after.append(s.get_scale() if s is not None else 1.0)
            self.skipped.append(all(torch.equal(a, b) for a, b in zip(self.before, pl_module.parameters())))


class _Metrics(Logger):
    """A logger keeping what it is sent (stands in for TensorBoard / W&B)."""

    def __init__(self):
        super().__init__()
        self.metrics = []

    name, version = "mem", 0

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def _fit(precision, *, callback=None, inf_step=None, steps=4, logger=False, extra=()):
    data = torch.tensor(list(load_text()[: 16 * SEQ].encode()), dtype=torch.long).view(16, SEQ)
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    module = LitGPT(inf_step)
    oracle = _Oracle()
    kwargs = dict(precision=precision) if precision != "16-mixed" else dict(
        # Lightning turns precision="16-mixed" into bf16 on the CPU; its fp16 plugin is given explicitly
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2))])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=2, logger=logger,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1, callbacks=[oracle, *extra] + ([callback] if callback else []), **kwargs)
    trainer.fit(module, loader)
    return module, oracle


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_steps_loss_scale_and_grads(precision, tmp_path):
    cb = MPScopeCallback(out=tmp_path / "run", show=False)
    module, oracle = _fit(precision, callback=cb)
    run = cb.run
    s = run.steps
    assert len(s) == 4 and list(s.backward_count) == [2] * 4
    assert s.loss.tolist() == pytest.approx(oracle.losses, rel=1e-5)
    assert s.loss_scale.tolist() == oracle.scale and s.scale_after.tolist() == oracle.scale_after
    assert s.skipped.tolist() == oracle.skipped == [False] * 4
    assert run.meta["autocast_dtype"] == ("bfloat16" if precision == "bf16-mixed" else "float16")
    assert (run.meta["scaler"] is not None) == (precision == "16-mixed")
    t = run.tensors
    g = t[(t.module == PROBE[0]) & (t.role == "param_grad") & (t.name == PROBE[1])]
    assert g.absmax.tolist() == pytest.approx(oracle.grad_absmax, rel=1e-6)
    assert (g.loss_scale == 1.0).all()  # unscaled by Lightning before on_before_optimizer_step
    assert sorted(set(t[t.role == "activation_grad"].loss_scale)) == sorted(set(oracle.scale))
    assert len(mpscope.Run.load(tmp_path / "run").steps) == 4
    assert cb.recorder is None and not hasattr(module, "_mpscope_recorder")


def test_lightning_unchanged_by_callback():
    m1, o1 = _fit("16-mixed")
    m2, o2 = _fit("16-mixed", callback=MPScopeCallback(every=2, show=False))
    assert o1.losses == o2.losses
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n


def test_lightning_inf_loss_is_a_skipped_step_and_logged():
    cb, logger = MPScopeCallback(show=False), _Metrics()
    _, oracle = _fit("16-mixed", callback=cb, inf_step=1, steps=3, logger=logger)
    s = cb.run.steps
    assert oracle.skipped == [False, True, False]
    assert s.skipped.tolist() == oracle.skipped and s.found_inf.tolist() == oracle.skipped
    assert s.scale_after.tolist() == oracle.scale_after and oracle.scale_after[1] == oracle.scale[1] * 0.5
    sent = {step: m for step, m in logger.metrics if "mpscope/skipped_steps" in m}
    assert [sent[k]["mpscope/skipped_steps"] for k in sorted(sent)] == [0.0, 1.0, 1.0]
    assert [sent[k]["mpscope/loss_scale"] for k in sorted(sent)] == oracle.scale_after


def test_lightning_exception_detaches():
    class Boom(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 1:
                raise RuntimeError("boom")

    cb = MPScopeCallback(show=False)
    with pytest.raises(RuntimeError, match="boom"):
        _fit("bf16-mixed", callback=cb, extra=[Boom()])
    assert cb.recorder is None and len(cb.run.steps) == 1


# ---------------------------------------------------------------- manual optimization, two optimizers


class LitGAN(L.LightningModule):
    """Manual optimization: a generator and a discriminator, each with its own optimizer, both
    stepped every ``step_every`` batches (``opt.step()`` then ``opt.zero_grad()``: no ``.grad`` is
    left at the batch's end; in between the gradients add up over the batches). The generator's
    loss is multiplied by inf in batch ``inf_batch``.

    The oracle is the module's own: per batch the losses it backpropagated, the GradScaler's scale
    before and after it, and per optimizer step each parameter's gradient (max, min) as Lightning
    hands it to ``on_before_optimizer_step`` (unscaled)."""

    def __init__(self, step_every=1, inf_batch=None):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.G = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        self.D = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.step_every, self.inf_batch = step_every, inf_batch
        self.losses, self.scale, self.scale_after, self.grads = [], [], [], []

    def _scale(self):
        s = getattr(self.trainer.precision_plugin, "scaler", None)
        return s.get_scale() if s is not None else 1.0

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        z, real = batch[:, :4], batch[:, 4:]
        stepping = (batch_idx + 1) % self.step_every == 0
        self.scale.append(self._scale())
        self.grads.append({})
        self.toggle_optimizer(opt_g)
        fake = self.G(z)
        g_loss = torch.nn.functional.softplus(-self.D(fake)).mean() / self.step_every
        if batch_idx == self.inf_batch:
            g_loss = g_loss * math.inf
        self.manual_backward(g_loss)
        if stepping:
            opt_g.step()
            opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = (torch.nn.functional.softplus(-self.D(real))
                  + torch.nn.functional.softplus(self.D(fake.detach()))).mean() / self.step_every
        self.manual_backward(d_loss)
        if stepping:
            opt_d.step()
            opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.losses.append(float(g_loss.detach()) + float(d_loss.detach()))
        self.scale_after.append(self._scale())

    def on_before_optimizer_step(self, optimizer):
        names = {id(p): n for n, p in self.named_parameters()}
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            self.grads[-1][names[id(p)]] = (float(p.grad.max()), float(p.grad.min()))

    def configure_optimizers(self):
        return torch.optim.Adam(self.G.parameters(), lr=1e-2), torch.optim.Adam(self.D.parameters(), lr=1e-2)


def _fit_gan(precision, *, callback=None, batches=4, **kwargs):
    torch.manual_seed(1)
    loader = torch.utils.data.DataLoader(torch.randn(batches * 8, 6), batch_size=8)
    module = LitGAN(**kwargs)
    plugin = dict(precision=precision) if precision != "16-mixed" else dict(
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback] if callback else [], **plugin)
    trainer.fit(module, loader)
    return module, trainer


def _grad_rows(run):
    t = run.tensors
    g = t[t.role == "param_grad"]
    return {(int(r.step), f"{r.module}.{r.name}"): (r.max, r.min, int(r.numel), int(r.nan_count + r.inf_count))
            for r in g.itertuples()}, len(g)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("step_every", [1, 2], ids=["each_batch", "accumulate2"])
def test_lightning_manual_two_optimizers_one_step_per_batch_with_every_gradient(precision, step_every):
    """Two optimizers stepped in each stepping batch make one mpscope step (not one per optimizer
    step, nor one more at the end); its param_grad rows are both optimizers' gradients as their
    steps used them (though zeroed right after), its loss the losses of its batches."""
    cb = MPScopeCallback(show=False)
    module, trainer = _fit_gan(precision, callback=cb, step_every=step_every)
    n = 4 // step_every
    assert trainer.global_step == 2 * n  # Lightning counts each optimizer step
    s = cb.run.steps
    assert len(s) == n and s.step.tolist() == list(range(n))
    assert s.backward_count.tolist() == [2 * step_every] * n
    per_step = [sum(module.losses[k * step_every:(k + 1) * step_every]) for k in range(n)]
    assert s.loss.tolist() == pytest.approx(per_step, rel=1e-6)
    assert s.loss_scale.tolist() == module.scale[::step_every]
    assert s.scale_after.tolist() == module.scale_after[step_every - 1::step_every]
    assert s.skipped.tolist() == s.found_inf.tolist() == [False] * n
    rows, count = _grad_rows(cb.run)
    numel = {name: p.numel() for name, p in module.named_parameters()}
    expected = {(k, name): (mx, mn, numel[name], 0)
                for k in range(n) for name, (mx, mn) in module.grads[(k + 1) * step_every - 1].items()}
    assert len(expected) == n * len(numel) and count == len(rows)  # every parameter, once per step
    assert rows == expected
    t = cb.run.tensors
    assert set(t[t.role == "optimizer_state"].module.astype(str)) == {"G.0", "G.2", "D.0", "D.2"}
    assert cb.recorder is None and not hasattr(module, "_mpscope_recorder")


def test_lightning_manual_two_optimizers_unchanged_by_callback():
    m1, t1 = _fit_gan("16-mixed", step_every=2)
    m2, t2 = _fit_gan("16-mixed", callback=MPScopeCallback(every=2, show=False), step_every=2)
    assert m1.losses == m2.losses and t1.global_step == t2.global_step
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n


def test_lightning_manual_generator_skipped_is_its_batchs_skipped_step():
    """fp16, one GradScaler for both optimizers: the generator's inf gradients in batch 1 skip its
    step and halve the scale before the discriminator's backward; step 1 is skipped, found inf, and
    keeps the scale it began with; the discriminator's gradients of that batch are in step 1."""
    cb = MPScopeCallback(show=False)
    module, _ = _fit_gan("16-mixed", callback=cb, inf_batch=1)
    s = cb.run.steps
    assert len(s) == 4
    assert s.skipped.tolist() == s.found_inf.tolist() == [False, True, False, False]
    assert module.scale_after[1] == module.scale[1] * 0.5
    assert s.loss_scale.tolist() == module.scale and s.scale_after.tolist() == module.scale_after
    assert math.isinf(s.loss[1]) and math.isfinite(s.loss[2])
    rows, _ = _grad_rows(cb.run)
    for name, (mx, mn) in module.grads[1].items():
        got = rows[(1, name)]
        if name.startswith("G."):
            assert got[3] > 0  # the generator's inf / NaN gradients
        else:
            assert got[:2] == (mx, mn) and got[3] == 0
