"""transformers.Trainer + mpscope.integrations.hf.MPScopeCallback on a tiny GPT-2 built from a config.

Oracles: the Trainer's own log (``state.log_history``), Accelerate's GradScaler and its
``optimizer_step_was_skipped``, and the gradients as the Trainer leaves them (captured by a plain
callback of our own).
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import mpscope  # noqa: E402
from mpscope.demo.data import load_text  # noqa: E402
from mpscope.integrations.hf import MPScopeCallback  # noqa: E402

SEQ = 32
PROBE = ("transformer.h.0.mlp.c_fc", "weight")  # a parameter whose gradient the oracle keeps


class _Text(torch.utils.data.Dataset):
    """Byte-level language modelling on Python's own source (16 sequences of 32 bytes)."""

    def __init__(self):
        data = torch.tensor(list(load_text()[:16 * SEQ].encode()), dtype=torch.long)
        self.seqs = data.view(16, SEQ)

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return {"input_ids": self.seqs[i], "labels": self.seqs[i]}


class _CPUFloat16Trainer(Trainer):
    """Accelerate's GPU fp16 path (autocast float16 around forward, a GradScaler in backward, the
    optimizer step and clip_grad_norm_) switched on for the CPU, where Accelerate leaves fp16 off."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.native_amp = True
        self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)


class _InfAt(_CPUFloat16Trainer):
    """Multiplies the loss by inf at one optimizer step (its first micro-batch)."""

    inf_step = 1

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * math.inf if self.state.global_step == self.inf_step else loss


class _Oracle(TrainerCallback):
    """What the Trainer did, step by step: the scale used in backward, whether the gradients were
    unscaled before the optimizer step, the probe gradient after it, and skipped steps."""

    def __init__(self):
        self.trainer = None
        self.scale, self.unscaled, self.grad_absmax, self.skipped, self.scale_after = [], [], [], [], []

    def _scaler(self):
        return self.trainer.accelerator.scaler

    def on_step_begin(self, args, state, control, **kw):
        s = self._scaler()
        self.scale.append(s.get_scale() if s is not None else 1.0)

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        s = self._scaler()
        inner = optimizer.optimizer
        self.unscaled.append(s is not None and s._per_optimizer_states[id(inner)]["stage"].name == "UNSCALED")
        self.before = [p.detach().clone() for p in model.parameters()]

    def on_optimizer_step(self, args, state, control, model=None, **kw):
        p = model.get_submodule(PROBE[0]).get_parameter(PROBE[1])
        self.grad_absmax.append(float(p.grad.abs().max()))
        # skipped: no parameter changed (the Trainer's fused AdamW runs step() and skips inside,
        # which Accelerate's optimizer_step_was_skipped does not see)
        self.skipped.append(all(torch.equal(a, b) for a, b in zip(self.before, model.parameters())))
        s = self._scaler()
        self.scale_after.append(s.get_scale() if s is not None else 1.0)


def _train(precision, *, callback=None, trainer_cls=Trainer, max_grad_norm=1.0, steps=4, tmp):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=str(tmp / "trainer"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=steps, logging_steps=1, report_to=[], use_cpu=True, bf16=precision == "bf16",
        fp16=precision == "fp16", max_grad_norm=max_grad_norm, save_strategy="no", disable_tqdm=True,
        seed=0, learning_rate=1e-3, logging_nan_inf_filter=False, dataloader_num_workers=0,
    )
    oracle = _Oracle()
    trainer = trainer_cls(model=model, args=args, train_dataset=_Text(), callbacks=[oracle])
    oracle.trainer = trainer
    if callback is not None:
        trainer.add_callback(callback)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, losses, oracle


@pytest.mark.parametrize("precision,max_grad_norm", [("bf16", 1.0), ("fp16", 0.0)])
def test_trainer_steps_loss_scale_and_grads(precision, max_grad_norm, tmp_path):
    cb = MPScopeCallback(out=tmp_path / "run", show=False)
    cls = _CPUFloat16Trainer if precision == "fp16" else Trainer
    model, losses, oracle = _train(precision, callback=cb, trainer_cls=cls, max_grad_norm=max_grad_norm, tmp=tmp_path)
    run = cb.run
    steps = run.steps
    # one row per optimizer step (gradient accumulation 2: two backward passes each)
    assert len(steps) == len(losses) == 4
    assert list(steps.backward_count) == [2] * 4
    # the loss the Trainer logs is the sum of its micro-batch losses: the recorded step loss
    assert steps.loss.tolist() == pytest.approx(losses, rel=1e-6)
    assert steps.loss_scale.tolist() == oracle.scale
    assert steps.scale_after.tolist() == oracle.scale_after
    assert steps.skipped.tolist() == oracle.skipped == [False] * 4
    # what autocast the run really used: Accelerate enters it inside model.forward
    assert run.meta["autocast_dtype"] == ("bfloat16" if precision == "bf16" else "float16")
    assert (run.meta["scaler"] is not None) == (precision == "fp16")
    acts = run.tensors[run.tensors.role == "activation"]
    assert (acts[acts.module == "transformer.h.0.mlp.c_fc"].dtype == run.meta["autocast_dtype"]).all()
    # gradients read after the Trainer's optimizer step: unscaled, and labelled so
    g = run.tensors[(run.tensors.module == PROBE[0]) & (run.tensors.role == "param_grad") & (run.tensors.name == PROBE[1])]
    assert g.absmax.tolist() == pytest.approx(oracle.grad_absmax, rel=1e-6)
    if precision == "fp16":
        assert all(oracle.unscaled)  # clip_grad_norm_(..., inf) unscales even with max_grad_norm off
    assert (g.loss_scale == 1.0).all()
    # activation gradients flow in backward multiplied by the scale in effect
    ag = run.tensors[run.tensors.role == "activation_grad"]
    assert sorted(set(ag.loss_scale)) == sorted(set(oracle.scale))
    # written to `out`, and nothing left attached
    assert len(mpscope.Run.load(tmp_path / "run").steps) == 4
    assert cb.recommendation is not None and cb.recorder is None
    assert not hasattr(model, "_mpscope_recorder")


def test_trainer_unchanged_by_callback(tmp_path):
    m1, l1, _ = _train("fp16", trainer_cls=_CPUFloat16Trainer, tmp=tmp_path)
    m2, l2, _ = _train("fp16", trainer_cls=_CPUFloat16Trainer, callback=MPScopeCallback(every=2, show=False), tmp=tmp_path)
    assert l1 == l2
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n


def test_trainer_fp16_on_cpu_reports_what_ran(tmp_path):
    """Accelerate leaves fp16 off on the CPU: the run really was fp32, without a GradScaler."""
    cb = MPScopeCallback(show=False)
    _train("fp16", callback=cb, steps=2, tmp=tmp_path)
    assert cb.run.meta["autocast_dtype"] is None and cb.run.meta["scaler"] is None
    assert set(cb.run.tensors[cb.run.tensors.role == "activation"].dtype) == {"float32"}


class _Logs(TrainerCallback):
    """A stand-in for a reporting callback (TensorBoard, W&B): what reaches on_log."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs))


def test_trainer_inf_loss_is_a_skipped_step_and_logs_reach_reporters(tmp_path, monkeypatch):
    from transformers import trainer as hf_trainer

    reporter = _Logs()
    # where Trainer puts the report_to callbacks: before the user's callbacks
    monkeypatch.setattr(hf_trainer, "get_reporting_integration_callbacks", lambda report_to: [reporter])
    cb = MPScopeCallback(show=False)
    _, losses, oracle = _train("fp16", trainer_cls=_InfAt, callback=cb, steps=3, tmp=tmp_path)
    s = cb.run.steps
    assert oracle.skipped == [False, True, False]
    assert s.skipped.tolist() == oracle.skipped and s.found_inf.tolist() == oracle.skipped
    # GradScaler backs off by its backoff_factor on the skipped step
    assert s.scale_after.tolist() == oracle.scale_after
    assert oracle.scale_after[1] == oracle.scale[1] * 0.5
    assert math.isinf(s.loss[1]) and math.isinf(losses[1])
    assert s.loss[0] == pytest.approx(losses[0], rel=1e-6)
    per_step = [l for l in reporter.logs if "loss" in l]
    assert [l["mpscope/skipped_steps"] for l in per_step] == [0.0, 1.0, 1.0]
    assert [l["mpscope/loss_scale"] for l in per_step] == s.scale_after.tolist()
    assert per_step[1]["mpscope/nonfinite_tensors"] > 0 and per_step[0]["mpscope/nonfinite_tensors"] == 0


def test_callback_bad_arguments():
    with pytest.raises(mpscope.recorder.RecorderError, match="every"):
        MPScopeCallback(every=0)
