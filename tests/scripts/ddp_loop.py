"""A DistributedDataParallel loop over gloo (test script for `mpscope run` under torchrun): each rank
trains on its own batches, writes its losses to OUT/losses_rank<N>.json, rank 0 the final weights;
ends with destroy_process_group().

    torchrun --nproc-per-node 2 ddp_loop.py OUT
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main(out: Path):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(5):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    (out / f"losses_rank{rank}.json").write_text(json.dumps(losses))
    if rank == 0:
        torch.save(model.module.state_dict(), out / "weights.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    main(out)
