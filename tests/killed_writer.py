"""A training process for tests/test_streaming.py to kill: ``python killed_writer.py ENTRY OUT STEPS``.

ENTRY is ``record`` (a loop in ``mpscope.record(out=OUT)``), ``hf`` (a ``transformers.Trainer``
with ``MPScopeCallback(out=OUT)``) or ``ddp`` (two gloo ranks of DDP, each in
``mpscope.record(out=OUT)``). Each prints ``step N`` once step N has ended (rank 0 for ``ddp``) and
waits 0.15 s per step, so that the test can kill it at a known step; ``STEPS`` steps in all.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import mpscope

PAUSE = 0.15


def announce(step: int) -> None:
    print(f"step {step}", flush=True)
    time.sleep(PAUSE)


def mlp_loop(out: str, steps: int) -> None:
    """An fp16-autocast MLP with a GradScaler; batches from a seeded generator (the same every run)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with mpscope.record(model, optimizer=opt, scaler=scaler, out=out):
        for step in range(steps):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            announce(step)


def hf_trainer(out: str, steps: int) -> None:
    """A GPT-2 from a config (random weights) under ``transformers.Trainer`` on Python's own text."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from mpscope.demo.data import load_text
    from mpscope.integrations.hf import MPScopeCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    text = load_text()[:20_000].encode("ascii", "replace")
    ids = torch.tensor([min(b, 127) for b in text]).view(-1, 32)

    class Text(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    class Announce(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            announce(state.global_step - 1)

    args = TrainingArguments(output_dir=str(Path(out).parent / "trainer"), per_device_train_batch_size=4,
                             max_steps=steps, use_cpu=True, report_to=[], save_strategy="no",
                             logging_steps=1000, seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Text(),
                      callbacks=[MPScopeCallback(out=out, show=False, log=False), Announce()])
    trainer.train()


def ddp_rank(rank: int, world: int, init: str, out: str, steps: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    net = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    with mpscope.record(net, optimizer=opt, out=out):
        for step in range(steps):
            loss = net(torch.randn(8, 8, generator=g)).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0:
                announce(step)
            else:
                time.sleep(PAUSE)
    dist.destroy_process_group()


def main(entry: str, out: str, steps: int) -> None:
    if entry == "record":
        mlp_loop(out, steps)
    elif entry == "hf":
        hf_trainer(out, steps)
    else:
        rendezvous = Path(out).parent / "rendezvous"
        torch.multiprocessing.spawn(ddp_rank, args=(2, f"file://{rendezvous}", out, steps), nprocs=2, join=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
