"""Record a data-parallel or sharded training job with mpscope, one ``record()`` per rank.

Run on CPU with two processes (gloo)::

    torchrun --nproc-per-node 2 examples/ddp_fsdp.py --wrapper ddp   --out runs/ddp
    torchrun --nproc-per-node 2 examples/ddp_fsdp.py --wrapper fsdp2 --out runs/fsdp2
    torchrun --nproc-per-node 2 examples/ddp_fsdp.py --wrapper fsdp1 --out runs/fsdp1

On GPUs the same script runs with NCCL (``--device cuda``, one GPU per rank). Each rank trains the
demo GPT (character-level, on Python's own standard-library sources) on its own share of every
batch, in float16 autocast with a GradScaler, and records with the same ``mpscope.record(...)``
call it would use alone. Afterwards::

    import mpscope
    run = mpscope.Run.load("runs/ddp")          # merged over the ranks
    mpscope.Run.load("runs/ddp", rank=1)        # rank 1's own rows
    mpscope.advise(run)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import mpscope
from mpscope.demo.data import CharDataset, load_text
from mpscope.demo.model import GPT, Block, GPTConfig


def wrap(model: torch.nn.Module, kind: str, device: torch.device) -> torch.nn.Module:
    """The model wrapped for data parallelism: DDP, FSDP2 (``fully_shard``) or FSDP1."""
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, use_orig_params=True, device_id=device,
                                    auto_wrap_policy=ModuleWrapPolicy({Block}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wrapper", choices=["ddp", "fsdp2", "fsdp1"], default="ddp")
    p.add_argument("--out", default="runs/ddp_fsdp", help="directory for the per-rank files and the merged run")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="global batch (split over the ranks)")
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--reduce-every", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl, one GPU per rank)")
    args = p.parse_args()

    if "RANK" not in os.environ:
        raise SystemExit("launch this with torchrun, e.g. `torchrun --nproc-per-node 2 examples/ddp_fsdp.py`")
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    data = CharDataset(load_text(), seq_len=64)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(GPTConfig(vocab_size=data.vocab_size, d_model=64, n_layer=2, n_head=4, seq_len=64)).to(device)
    net = wrap(model, args.wrapper, device)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    # FSDP1 shards gradients itself, so its scaler must all-reduce found_inf (ShardedGradScaler)
    if args.wrapper == "fsdp1":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device.type)
    else:
        scaler = torch.amp.GradScaler(device.type)
    share = args.batch // world

    with mpscope.record(net, optimizer=opt, scaler=scaler, out=args.out, every=args.every,
                        reduce_every=args.reduce_every) as rec:
        for step in range(args.steps):
            x, y = data.batch(args.batch, data.generator(step), device=device)  # the same global batch
            x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
            with torch.autocast(device.type, dtype=torch.float16):
                _, loss = net(x, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

    if rank == 0:  # recorder.run is the merged Run on rank 0
        run = rec.run
        print(f"{run!r} over ranks {run.ranks}; merged in {run.meta['distributed']['exchanges']} exchanges")
        advice = mpscope.advise(run)
        print(f"recommended dtype: {advice.dtype}")
        for f in advice.findings[:5]:
            where = f" (rank {f.rank})" if f.rank is not None else ""
            print(f"  [{f.severity}] {f.code}{where}: {f.message[:140]}")
        print(f"saved: {args.out}/merged (merged) and {args.out}/ranks/<table>/rank=N/ (each rank's own)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
