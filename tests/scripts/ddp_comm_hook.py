"""Two gloo ranks of DDP under a communication hook, recorded with precision forensics.

``python -m torch.distributed.run --standalone --nproc-per-node 2 ddp_comm_hook.py OUT HOOKS SCALE``:
HOOKS is a comma-separated list, each run in turn: ``sum_then_divide`` (casts each bucket to float16 and all-reduces it, dividing by the group
size after the sum: a sum past 65504 is inf) or ``fp16_compress`` (PyTorch's fp16_compress_hook,
which divides before the all-reduce). Rank 0 writes OUT/result_<hook>.json: the forensics rows, both
ranks' float32 gradients (an all_gather of the same step's gradients without the hook), and
whether the hooked gradients came out finite.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import mpscope


def sum_then_divide(state, bucket):
    t = bucket.buffer().to(torch.float16)
    dist.all_reduce(t)  # every rank's float16 gradient summed in float16
    bucket.buffer().copy_(t.div_(dist.get_world_size()))
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def main(out: Path, hooks: str, scale: float) -> None:
    dist.init_process_group("gloo")
    for hook in hooks.split(","):
        one(out, hook, scale)
    dist.barrier()  # (rank 1 waits while rank 0 advises: no rank leaves the group early)
    dist.destroy_process_group()


def one(out: Path, hook: str, scale: float) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 16, generator=g) * scale, torch.randn(32, 4, generator=g)
    # the oracle: this step's float32 gradients of every rank, without the hook
    plain = [torch.autograd.grad(((model(x) - y) ** 2).mean(), model.parameters())]
    flat = torch.cat([t.flatten() for t in plain[0]])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    ddp = DDP(model)
    ddp.register_comm_hook(None, {"sum_then_divide": sum_then_divide, "fp16_compress": fp16_compress_hook}[hook])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    with mpscope.record(ddp, optimizer=opt, ops=True, shadow=True) as rec:
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        finite = all(bool(p.grad.isfinite().all()) for p in model.parameters())
        opt.step()
    if rank == 0:
        rows = rec.run.tables["forensics"]
        advice = mpscope.advise(rec.run)
        (out / f"result_{hook}.json").write_text(json.dumps({
            "rows": rows.astype(str).to_dict("records"),
            "findings": [{"code": f.code, "message": f.message, "fix": f.fix} for f in advice.findings],
            "grads": [t.tolist() for t in every],
            "finite": finite,
        }))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
