"""Every way a recording or an apply block ends leaves PyTorch as it found it: each attribute mpscope
replaces (mpscope.recording.patches, mpscope.applying, mpscope.compiled) is checked after each exit
path of each entry point."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo.config as dynamo_config
import torch.nn.utils.clip_grad as cg

import mpscope
from mpscope.recording.patches import CLIP_HELPERS, live

#: Everything mpscope may replace while it works, read afresh on each call.
REPLACEABLE = {
    "Tensor.backward": lambda: torch.Tensor.backward,
    "autograd.backward": lambda: torch.autograd.backward,
    "autograd.grad": lambda: torch.autograd.grad,
    **{f"GradScaler.{n}": (lambda n=n: getattr(torch.amp.GradScaler, n)) for n in ("__init__", "scale", "update", "step")},
    "autocast.__init__": lambda: torch.amp.autocast_mode.autocast.__init__,
    **{f"clip_grad.{n}": (lambda n=n: getattr(cg, n)) for n in CLIP_HELPERS},
    "dynamo skip_nnmodule_hook_guards": lambda: dynamo_config.skip_nnmodule_hook_guards,
    # mpscope run (mpscope.launch; its exit paths: tests/test_launch.py)
    "Module.__call__": lambda: torch.nn.Module.__call__,
    "distributed.destroy_process_group": lambda: torch.distributed.destroy_process_group,
}


@pytest.fixture
def untouched():
    """Asserts, after the test, that every replaceable attribute is what it was before it."""
    before = {k: get() for k, get in REPLACEABLE.items()}
    yield
    assert [k for k, get in REPLACEABLE.items() if get() is not before[k]] == []
    assert live() == []


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def train(model, steps=3, fail_at=None, error=ValueError):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for i in range(steps):
        if i == fail_at:
            raise error("the loop stops here")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()


def hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


@pytest.mark.parametrize("exit_by", ["the block's end", "an exception", "KeyboardInterrupt"])
@pytest.mark.parametrize("compiled", [False, True])
def test_record_leaves_nothing_replaced(untouched, exit_by, compiled):
    model = mlp()
    target = torch.compile(model, backend="eager") if compiled else model
    error = KeyboardInterrupt if exit_by == "KeyboardInterrupt" else ValueError
    fail_at = None if exit_by == "the block's end" else 2
    with pytest.raises(error) if fail_at is not None else contextlib.nullcontext():
        with mpscope.record(target, auto=True) as rec:
            train(target, fail_at=fail_at, error=error)
    assert hooks(model) == 0 and len(rec.run.steps) == (3 if fail_at is None else 2)


def _recommendation():
    gs = {"init_scale": 2.0**6, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5}
    return mpscope.Recommendation(dtype="float16", grad_scaler=gs, device_type="cpu", fp32_modules=["2"])


@pytest.mark.parametrize("grad_scaler", ["recommended", None])
@pytest.mark.parametrize("exit_by", ["the block's end", "an exception"])
def test_a_scaler_passed_to_apply_gets_the_advice_inside_and_its_own_settings_back(untouched, grad_scaler, exit_by):
    """A GradScaler made before the block (``apply(..., scalers=[s])``): inside, the recommended
    init_scale and growth_interval (or, with ``grad_scaler=None``, disabled: the loss comes back
    unscaled); after, its own settings and enabled flag, with the scale the training left."""
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1)
    advice = _recommendation() if grad_scaler else mpscope.Recommendation(dtype="bfloat16", device_type="cpu")
    loss = torch.ones(())
    with pytest.raises(ValueError) if exit_by == "an exception" else contextlib.nullcontext():
        with mpscope.apply(model, advice, scalers=[scaler]) as applied:
            inside = scaler.state_dict(), float(scaler.scale(loss)), list(applied.scalers)
            if exit_by == "an exception":
                raise ValueError("the loop stops here")
    if grad_scaler:
        assert inside[0]["scale"] == 2.0**6 and inside[0]["growth_interval"] == 5 and inside[1] == 2.0**6
    else:
        assert inside[0] == {} and inside[1] == 1.0
    assert inside[2] == [scaler]
    after = scaler.state_dict()
    assert scaler.is_enabled() and after["growth_interval"] == 1 and after["growth_factor"] == 2.0
    assert after["scale"] == (2.0**6 if grad_scaler else 2.0**12)  # the scale the block left (none used)


def test_apply_refuses_a_scaler_that_is_not_a_grad_scaler():
    with pytest.raises(ValueError, match="scalers= takes torch.amp.GradScaler objects; got SGD"):
        mpscope.apply(mlp(), _recommendation(), scalers=[torch.optim.SGD(mlp().parameters(), lr=0.1)])


@pytest.mark.parametrize("order", ["a b a b", "a b b a", "a r a r", "r a r a"])
def test_apply_blocks_and_recorders_left_in_any_order_leave_nothing_replaced(untouched, order):
    """``a``/``b``: two apply blocks, ``r``: a recorder; the first occurrence enters, the second exits."""
    m1, m2 = mlp(), mlp()
    blocks = {"a": mpscope.apply(m1, _recommendation()), "b": mpscope.apply(m2, _recommendation()),
              "r": mpscope.record(m1, auto=True)}
    entered = set()
    for name in order.split():
        if name in entered:
            blocks[name].__exit__(None, None, None)
        else:
            blocks[name].__enter__()
            entered.add(name)
            train(m1 if name != "b" else m2, steps=1)
    assert hooks(m1) == hooks(m2) == 0


def test_a_trainer_that_raises_in_its_data_leaves_nothing_replaced(untouched, tmp_path):
    transformers = pytest.importorskip("transformers")
    from mpscope.integrations.hf import MPScopeCallback

    class Data(torch.utils.data.Dataset):
        """The ninth sample read is corrupt: the third batch of 4 fails, after a step or two."""

        read = 0

        def __len__(self):
            return 64

        def __getitem__(self, i):
            Data.read += 1
            if Data.read > 8:
                raise OSError(f"sample {i} is corrupt")
            ids = torch.arange(16) % 64
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16,
                                                                 n_layer=1, n_head=2))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=10,
                                          use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                                          dataloader_num_workers=0)
    cb = MPScopeCallback(show=False, log=False, out=tmp_path / "run")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(), callbacks=[cb])
    with pytest.raises(OSError, match="is corrupt"):
        trainer.train()
    assert cb.recorder is None and hooks(model) == 0
    loaded = mpscope.Run.load(tmp_path / "run")  # out= written, and complete: no warning
    assert len(cb.run.steps) == len(loaded.steps) >= 1 and "complete" not in loaded.meta


def test_a_second_train_with_the_same_callback_records_again_and_leaves_nothing(untouched, tmp_path):
    transformers = pytest.importorskip("transformers")
    from mpscope.integrations.hf import MPScopeCallback

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = (torch.arange(16) + i) % 64
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16,
                                                                 n_layer=1, n_head=2))
    cb = MPScopeCallback(show=False, log=False)
    runs = []
    for max_steps in (3, 2):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                              max_steps=max_steps, use_cpu=True, report_to=[], save_strategy="no",
                                              disable_tqdm=True)
        transformers.Trainer(model=model, args=args, train_dataset=Data(), callbacks=[cb]).train()
        assert cb.recorder is None and hooks(model) == 0
        runs.append(cb.run)
    assert runs[0] is not runs[1] and [len(r.steps) for r in runs] == [3, 2]


def test_a_second_lightning_fit_with_the_same_callback_records_again_and_leaves_nothing(untouched):
    lightning = pytest.importorskip("lightning.pytorch")
    from mpscope.integrations.lightning import MPScopeCallback

    class Lit(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, i):
            x, y = batch
            return (self.net(x) - y).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    module, cb, runs = Lit(), MPScopeCallback(show=False, log=False), []
    for max_steps in (3, 2):
        trainer = lightning.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
        assert cb.recorder is None and hooks(module) == 0
        runs.append(cb.run)
    assert runs[0] is not runs[1] and [len(r.steps) for r in runs] == [3, 2]
