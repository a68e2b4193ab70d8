"""No host synchronisation inside mpscope's hooks during a real training step.

The oracle is the ATen dispatcher itself: every op of the step runs under a ``TorchDispatchMode``
(``benchmarks/common.py``'s ``OpCounter``) that flags the ops that read a device value on the host
(``aten._local_scalar_dense`` behind ``.item()`` / ``bool()`` / ``float()``, ``nonzero``,
boolean-mask indexing, ...) and those that would block on a host-to-device copy on CUDA, and
attributes each op to the training step or to mpscope from the Python stack. The counter is
checked against code that is known to synchronise: GradScaler's own ``found_inf.item()`` (in
``GradScaler.step``) and Hugging Face's ``DebugUnderflowOverflow`` hooks.
Only the recorder's host copy (once per recorded step: the code in ``mpscope/recording/step_buffer.py``)
may copy to the host.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

import mpscope
from mpscope.demo import GPT, GPTConfig, CharDataset
from mpscope.recording import step_buffer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mpscope_bench_common", ROOT / "benchmarks" / "common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

#: The once-per-recorded-step host copy: every frame whose code lives in this file.
FLUSH_FILES = (step_buffer.__file__,)


@pytest.fixture(scope="module")
def data():
    return CharDataset.from_stdlib(32)


def _workload(data, dtype, device="cpu"):
    torch.manual_seed(0)
    model = GPT(GPTConfig(data.vocab_size, d_model=32, n_layer=2, n_head=2, seq_len=32)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device) if dtype == torch.float16 else None
    gen = data.generator(0)
    batches = [data.batch(4, gen, device=device) for _ in range(4)]
    clip = dtype == torch.float16

    def step(i):
        x, y = batches[i % len(batches)]
        with torch.autocast(device, dtype=dtype):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()

    return model, opt, scaler, step


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16-scaler-clip", "bf16"])
def test_no_host_sync_inside_hooks(data, dtype):
    model, opt, scaler, step = _workload(data, dtype)
    with mpscope.record(model, optimizer=opt, scaler=scaler, every=1) as rec:
        step(0)  # first step builds mpscope's per-process tables (lru caches): not steady state
        counter = common.OpCounter(flush_files=FLUSH_FILES)
        with counter:
            step(1)
    run = rec.run
    assert len(run.steps) == 2 and run.steps.recorded.all()
    # The hooks did run under the counter (else "0 syncs" would prove nothing) ...
    assert counter.total_ops("mpscope") > 0
    assert set(run.tensors[run.tensors.step >= 1].role.unique()) >= {
        "activation", "activation_grad", "param_grad", "weight", "optimizer_state"
    }
    # ... and the counter sees syncs where PyTorch makes them: GradScaler.step reads found_inf
    # with .item() once per optimizer (torch/amp/grad_scaler.py, _maybe_opt_step).
    if scaler is not None:
        assert counter.syncs[None]["aten._local_scalar_dense"] >= 1
    assert counter.total_syncs("mpscope") == 0, "\n".join(counter.sync_stacks)
    assert counter.total_h2d("mpscope") == 0, "\n".join(counter.h2d_stacks)


def test_counter_catches_syncs_inside_third_party_hooks(data):
    """Hugging Face's debugger calls ``.item()`` in its forward hooks: the counter must see them
    as the hooks' syncs, not the model's."""
    from transformers.debug_utils import DebugUnderflowOverflow

    model, _, _, _ = _workload(data, torch.bfloat16)
    DebugUnderflowOverflow(model)
    x, _ = data.batch(2, data.generator(1))
    counter = common.OpCounter()
    with counter, torch.no_grad():
        model(x)
    n_modules = len(list(model.modules()))
    assert counter.total_syncs(None) == 0  # the model's own forward does not synchronise
    # detect_overflow: isnan(t).any().item() and isinf(t).any().item() for every output at least
    assert counter.syncs["hf"]["aten._local_scalar_dense"] >= 2 * n_modules


def test_sync_classification():
    x = torch.randn(64)
    counter = common.OpCounter()
    with counter:
        x.sum().item()
        x[x > 0]
        torch.nonzero(x > 0)
        bool(x.sum() > 0)
        x.view(torch.int32) & 0x7FFFFFFF  # bit views: no sync
        torch.histc(x, bins=8, min=-4, max=4)  # fixed range: no sync
    assert counter.syncs[None] == {
        "aten._local_scalar_dense": 2,
        "aten.index": 1,
        "aten.nonzero": 1,
    }


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_recorded_step_under_sync_debug_error(data, monkeypatch):
    """A recorded bf16 step on CUDA under ``torch.cuda.set_sync_debug_mode("error")``: any
    synchronising CUDA call outside the recorder's flush raises RuntimeError."""
    model, opt, _, step = _workload(data, torch.bfloat16, device="cuda")

    def allow_sync(fn):
        def wrapped(*args, **kwargs):
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(mode)

        return wrapped

    # every function of the host-copy file (the step buffer's methods) may synchronise
    for cls in (c for c in vars(step_buffer).values() if inspect.isclass(c) and c.__module__ == step_buffer.__name__):
        for name, fn in list(vars(cls).items()):
            if inspect.isfunction(fn) and fn.__code__.co_filename == step_buffer.__file__:
                monkeypatch.setattr(cls, name, allow_sync(fn))
    with mpscope.record(model, optimizer=opt, every=1) as rec:
        step(0)  # warm-up: per-process tables, cuDNN/cuBLAS handles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(1)
            step(2)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert len(rec.run.steps) == 3
    assert (rec.run.tensors.step == 2).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16-scaler-clip", "bf16"])
def test_idle_steps_do_no_stats_work_and_allocate_nothing(data, dtype):
    """With ``every=N`` the steps in between only write their step scalars (loss, loss scale,
    found_inf, scale after, clip norms) into a preallocated device buffer: every ATen op mpscope
    issues there is an in-place write or a view, none computes stats or allocates."""
    model, opt, scaler, step = _workload(data, dtype)
    with mpscope.record(model, optimizer=opt, scaler=scaler, every=1000) as rec:
        step(0)  # the recorded step
        counter = common.OpCounter(flush_files=FLUSH_FILES)
        with counter:
            for i in range(1, 4):
                step(i)
    ops = counter.ops.get("mpscope", {})
    assert ops, "the idle steps issued no mpscope op at all: the counter saw nothing to judge"
    in_place_or_view = {"aten.copy_", "aten.fill_", "aten.add_", "aten.clamp_",
                        "aten.detach", "aten.view", "aten.select", "aten.alias", "aten._unsafe_view"}
    assert set(ops) <= in_place_or_view, dict(ops)
    assert not counter.ops.get("flush")  # nothing reaches the host before the buffer is full
    steps = rec.run.steps
    assert len(steps) == 4 and list(steps.recorded) == [True, False, False, False]
    assert steps.loss.notna().all() and (steps.loss_scale > 0).all()
