"""What multi-rank recording costs per training step: 2 gloo ranks, the demo GPT, DDP and FSDP2.

Run ``python benchmarks/distributed_overhead.py`` (it starts the two ranks itself with
``torch.multiprocessing``; a few minutes on a 2-core CPU) or ``--quick``.

Method. Each rank builds, for each wrapper (DDP, FSDP2 ``fully_shard`` on every block and the
root), one model copy per mode from the same seed and trains it on its half of the same global
batches, under CPU autocast bfloat16 with AdamW:

* ``none``: no recorder;
* ``every1``: ``mpscope.record`` with every role, every step, histograms every step, merged across
  the ranks at every recorded step (``reduce_every=1``);
* ``every10``: the same with ``every=10`` (each timed block holds exactly one recorded step).

Time is taken in rounds: in each round every mode runs one block (one untimed warm-up step, then
``--steps`` timed steps between two barriers; the recorder is entered before and left after the
timed part), in an order rotated every round. A block's time is the slowest rank's. A mode's ratio
in a round is its block time over the ``none`` block's of the same round; the report gives the
median over rounds and the interquartile range. Bytes exchanged per recorded step: what this rank
contributed to the merge's collectives (header, SUM and MIN blocks, new key names), divided by the
recorded steps, for rank 0; the tensors themselves never cross ranks. Merging per recorded step:
the time the training thread spent in exchanges during the timed steps (packing, starting the
collectives, which then run in the background, and unpacking on rank 0), not the exchange at exit. The last line printed is a
JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import mpscope
from mpscope.demo import GPT, CharDataset, GPTConfig
from mpscope.demo.data import load_text

MODES = ("none", "every1", "every10")


def _config(quick: bool, vocab: int) -> GPTConfig:
    if quick:
        return GPTConfig(vocab_size=vocab, d_model=64, n_layer=2, n_head=4, seq_len=64)
    return GPTConfig(vocab_size=vocab, d_model=256, n_layer=4, n_head=4, seq_len=128)


def _wrap(model, kind: str):
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _block(net, opt, data, rank, share, start, steps, mode):
    """One warm-up step, then ``steps`` timed steps; returns (seconds of the slowest rank, recorder)."""
    kw = {"none": None, "every1": {"every": 1}, "every10": {"every": 10}}[mode]

    def step(i):
        x, y = data.batch(share * dist.get_world_size(), data.generator(i))
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(start)
    rec = mpscope.record(net, optimizer=opt, **kw) if kw is not None else None
    if rec is not None:
        rec.__enter__()
    try:
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(steps):
            step(start + 1 + i)
        dist.barrier()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        merge_s = rec._ranks.seconds if rec is not None else 0.0  # the timed steps' exchanges, not the one at exit
    finally:
        if rec is not None:
            rec.__exit__(None, None, None)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt) / steps, rec, merge_s


def _quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


def rank_main(rank: int, world: int, init: str, args: dict, result_path: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from mpscope import kernel

    fused = kernel.load() is not None  # built / loaded now, not inside a timed block
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    data = CharDataset(load_text(), seq_len=64 if args["quick"] else 128)
    share = args["batch"] // world
    out = {}
    for kind in ("ddp", "fsdp2"):
        nets = {}
        for mode in MODES:
            torch.manual_seed(0)
            net = _wrap(GPT(_config(args["quick"], data.vocab_size)), kind)
            nets[mode] = (net, torch.optim.AdamW(net.parameters(), lr=1e-3))
        ratios, base = {m: [] for m in MODES[1:]}, []
        sent = {m: [0, 0, 0.0] for m in MODES[1:]}  # bytes, recorded steps, seconds in exchanges
        start = 0
        for r in range(args["rounds"]):
            times = {}
            order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
            for mode in order:
                times[mode], rec, merge_s = _block(*nets[mode], data, rank, share, start, args["steps"], mode)
                if rec is not None:
                    sent[mode][0] += rec._ranks.bytes_sent
                    sent[mode][1] += int(rec.local_run.steps.recorded.sum())
                    sent[mode][2] += merge_s
                start += args["steps"] + 1
            base.append(times["none"])
            for mode in MODES[1:]:
                ratios[mode].append(times[mode] / times["none"])
        out[kind] = {
            mode: {"ratio": statistics.median(ratios[mode]), "iqr": _quartiles(ratios[mode]),
                   "bytes_per_recorded_step": sent[mode][0] / max(1, sent[mode][1]),
                   "merge_ms_per_recorded_step": 1e3 * sent[mode][2] / max(1, sent[mode][1])}
            for mode in MODES[1:]
        }
        out[kind]["step_s_none"] = statistics.median(base)
    out["fused_kernel"] = fused
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller GPT and fewer rounds")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=16, help="global batch, split over the ranks")
    a = p.parse_args(argv)
    args = {"quick": a.quick, "rounds": a.rounds or (3 if a.quick else 5), "steps": a.steps, "batch": a.batch}
    tmp = tempfile.mkdtemp(prefix="mpscope-dist-bench-")
    result = os.path.join(tmp, "result.json")
    torch.multiprocessing.spawn(rank_main, args=(2, f"file://{tmp}/rendezvous", args, result), nprocs=2, join=True)
    with open(result) as f:
        res = json.load(f)
    print(f"2 gloo ranks on this machine ({os.cpu_count()} CPUs), demo GPT "
          f"({'quick' if a.quick else 'd_model 256, 4 layers, seq 128'}), global batch {a.batch}, bf16 autocast, "
          f"AdamW; {args['rounds']} rounds of {a.steps} timed steps; stats by the "
          f"{'fused CPU kernel' if res['fused_kernel'] else 'torch-op path (the kernel was not available)'}")
    for kind in ("ddp", "fsdp2"):
        print(f"  {kind:5s} unrecorded step {res[kind]['step_s_none'] * 1e3:.1f} ms")
        for mode in MODES[1:]:
            r = res[kind][mode]
            print(f"  {kind:5s} {mode:8s} step time x{r['ratio']:.3f} (IQR {r['iqr'][0]:.3f}-{r['iqr'][1]:.3f}), "
                  f"{r['bytes_per_recorded_step'] / 1024:.1f} KiB exchanged and "
                  f"{r['merge_ms_per_recorded_step']:.1f} ms merging per recorded step (rank 0)")
    summary = {f"{k}_{m}": round(res[k][m]["ratio"], 4) for k in ("ddp", "fsdp2") for m in MODES[1:]}
    summary.update({f"{k}_bytes_per_recorded_step": int(res[k]["every1"]["bytes_per_recorded_step"]) for k in ("ddp", "fsdp2")})
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
