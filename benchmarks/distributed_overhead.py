"""What multi-rank recording costs per training step: 2 gloo ranks, the demo GPT, DDP and FSDP2.

Run ``python benchmarks/distributed_overhead.py`` (it starts the two ranks itself with
``torch.multiprocessing``; under five minutes on a 2-core CPU: 4 min 37 s to 4 min 54 s on a
shared one) or ``--quick`` (the small GPT, 3 rounds: seconds).

Method. Each rank builds, for each wrapper (DDP, FSDP2 ``fully_shard`` on every block and the
root), one model copy per mode from the same seed and trains it on its half of the same global
batches, under CPU autocast bfloat16 with AdamW:

* ``none``: no recorder;
* ``every1``: ``mpscope.record`` with every role, every step, histograms every step, merged across
  the ranks at every recorded step (``reduce_every=1``);
* ``every10``: the same with ``every=10`` (each timed window holds exactly one recorded step).

The two ranks share two CPUs (one intra-op thread each, plus gloo's threads), so the time of a
step moves by tens of per cent with the moment's load (the other rank, another process): timed in
five rounds of separate 10-step blocks, FSDP2 ``every10`` reads 0.933×, 0.949× and 1.075× (IQR
0.967–1.144) in three runs of the same code. So each recorded model is timed in pairs with the
``none`` model: in a round, for each recorded mode (the order alternates between
rounds), the recorder is entered, both models take one untimed warm-up step, then ``--steps``
pairs of steps on the same batches, the ``none`` step and the recorded step one after the other
(which one goes first alternates), each timed on each rank; a step's time is the slowest rank's.
The recorder is left after the timed part. A pair shares the moment's load.

The ratio of a window is built per kind of step of the recorded model: recorded steps, the step
right after a recorded one (it may finish the recorded step's work: the exchange's collectives
run in the background), and the other unrecorded steps. For each kind, the median of the pairs'
ratios (recorded / ``none``), weighted by that kind's share of the window's steps; so a cost that
every step of a kind pays counts whole, and a step slowed at random does not. With ``every10``
that is 0.1 × (recorded step) + 0.1 × (step after) + 0.8 × (median unrecorded step). The report
gives the median of the windows' ratios over rounds and their interquartile range; ``block``: the
plain ratio of the window's sums (median and IQR), for comparison; and ``idle``: the median ratio
of the ``every10`` pairs whose recorded-model step was an unrecorded one (not the step after a
recorded one), i.e. what an attached recorder costs on the steps it does not record. While the
recorder is attached the ``none`` model's ``loss.backward()`` also passes through the recorder's
``Tensor.backward`` wrapper (a few microseconds; the recorder's grad-reset check of a recorded
step may run there), so the ``none`` steps are not entirely free of mpscope.

Bytes exchanged per recorded step: what this rank contributed to the merge's collectives (header,
SUM and MIN blocks, new key names), divided by the recorded steps, for rank 0; the tensors
themselves never cross ranks. Merging per recorded step: the time the training thread spent in
exchanges during the timed steps (packing, starting the collectives, which then run in the
background, and unpacking on rank 0), not the exchange at exit. The last line printed is a JSON
object of the figures: ``<wrapper>_<mode>`` the median ratio (as above), ``<wrapper>_<mode>_block``
the median plain ratio, ``<wrapper>_every10_idle``, and ``<wrapper>_bytes_per_recorded_step``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import mpscope
from mpscope.demo import GPT, CharDataset, GPTConfig
from mpscope.demo.data import load_text

MODES = ("none", "every1", "every10")
EVERY = {"every1": 1, "every10": 10}
#: Rounds by default (about 35 s each on the demo GPT, both wrappers, on a shared 2-core machine).
ROUNDS = 8


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


def train_step(net, opt, data, rank: int, share: int, i: int) -> None:
    """Training step ``i``: this rank's ``share`` sequences of global batch ``i``, bf16 autocast."""
    x, y = data.batch(share * dist.get_world_size(), data.generator(i))
    x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = net(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _paired(base, other, data, rank, share, start, steps, mode):
    """One warm-up step of each model, then ``steps`` pairs of timed steps: the ``none`` model
    ``base`` and the recorded model ``other`` train on the same batch one after the other (which
    one goes first alternates), so that each pair shares the moment's load. Returns (each timed
    step's seconds on the slowest rank for ``base`` and for ``other``, the kind of each of
    ``other``'s steps, the recorder, seconds in exchanges)."""
    for net, opt in (base, other):
        train_step(net, opt, data, rank, share, start)
    rec = mpscope.record(other[0], optimizer=other[1], every=EVERY[mode])
    rec.__enter__()
    kinds, times = [], []
    try:
        dist.barrier()
        for i in range(steps):
            kinds.append("recorded" if rec.recording else "after" if kinds and kinds[-1] == "recorded" else "idle")
            pair = {}
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                train_step(*(base, other)[which], data, rank, share, start + 1 + i)
                pair[which] = time.perf_counter() - t0
            times.append((pair[0], pair[1]))
        dist.barrier()
        merge_s = rec._ranks.seconds  # the timed steps' exchanges, not the one at exit
    finally:
        rec.__exit__(None, None, None)
    dt = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt[:, 0].tolist(), dt[:, 1].tolist(), kinds, rec, merge_s


def _ratio(windows) -> float:
    """Recorded / ``none`` time over ``windows`` (each ``(none times, recorded times, kinds)`` of
    paired steps): for each kind of step, the median ratio of its pairs over all the windows,
    weighted by that kind's share of the steps."""
    by, n = {}, 0
    for base, times, kinds in windows:
        n += len(times)
        for b, t, k in zip(base, times, kinds):
            by.setdefault(k, []).append(t / b)
    return sum(len(v) * statistics.median(v) for v in by.values()) / n


def _interval(windows, n: int = 1000) -> tuple[float, float]:
    """5th and 95th percentiles of :func:`_ratio` over ``n`` resamplings of the windows (rounds)
    with replacement (a bootstrap; fixed seed)."""
    rng = random.Random(0)
    est = sorted(_ratio([rng.choice(windows) for _ in windows]) for _ in range(n))
    return est[int(0.05 * n)], est[int(0.95 * n) - 1]


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
        windows, blocks, idle, base = {m: [] for m in MODES[1:]}, {m: [] for m in MODES[1:]}, [], []
        sent = {m: [0, 0, 0.0] for m in MODES[1:]}  # bytes, recorded steps, seconds in exchanges
        start = 0
        for r in range(args["rounds"]):
            for mode in (MODES[1:] if r % 2 == 0 else MODES[:0:-1]):
                b, t, kinds, rec, merge_s = _paired(nets["none"], nets[mode], data, rank, share, start, args["steps"], mode)
                sent[mode][0] += rec._ranks.bytes_sent
                sent[mode][1] += int(rec.local_run.steps.recorded.sum())
                sent[mode][2] += merge_s
                start += args["steps"] + 1
                base.extend(b)
                windows[mode].append((b, t, kinds))
                blocks[mode].append(sum(t) / sum(b))
                if mode == "every10":
                    idle.extend(y / x for x, y, k in zip(b, t, kinds) if k == "idle")
        out[kind] = {
            mode: {"ratio": _ratio(windows[mode]), "ci90": _interval(windows[mode]),
                   "iqr": _quartiles([_ratio([w]) for w in windows[mode]]),
                   "block": statistics.median(blocks[mode]), "block_iqr": _quartiles(blocks[mode]),
                   "bytes_per_recorded_step": sent[mode][0] / max(1, sent[mode][1]),
                   "merge_ms_per_recorded_step": 1e3 * sent[mode][2] / max(1, sent[mode][1])}
            for mode in MODES[1:]
        }
        out[kind]["step_s_none"] = statistics.median(base)
        out[kind]["idle_ratio"] = statistics.median(idle) if idle else float("nan")
    out["fused_kernel"] = fused
    finish_rank(rank, out, result_path)


def finish_rank(rank: int, out: dict, result_path: str) -> None:
    """Rank 0 writes ``out`` as JSON to ``result_path``; every rank leaves the process group."""
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def spawn(rank_main, args: dict, prefix: str) -> dict:
    """Run ``rank_main(rank, 2, init, args, result_path)`` in two processes (file:// rendezvous in a
    new temporary directory); returns what rank 0 wrote to ``result_path``."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    result = os.path.join(tmp, "result.json")
    torch.multiprocessing.spawn(rank_main, args=(2, f"file://{tmp}/rendezvous", args, result), nprocs=2, join=True)
    with open(result) as f:
        return json.load(f)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller GPT and fewer rounds")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=16, help="global batch, split over the ranks")
    a = p.parse_args(argv)
    args = {"quick": a.quick, "rounds": a.rounds or (3 if a.quick else ROUNDS), "steps": a.steps, "batch": a.batch}
    res = spawn(rank_main, args, "mpscope-dist-bench-")
    print(f"2 gloo ranks on this machine ({os.cpu_count()} CPUs), demo GPT "
          f"({'quick' if a.quick else 'd_model 256, 4 layers, seq 128'}), global batch {a.batch}, bf16 autocast, "
          f"AdamW; {args['rounds']} rounds of {a.steps} timed steps; stats by the "
          f"{'fused CPU kernel' if res['fused_kernel'] else 'torch-op path (the kernel was not available)'}")
    for kind in ("ddp", "fsdp2"):
        print(f"  {kind:5s} unrecorded step {res[kind]['step_s_none'] * 1e3:.1f} ms; every10's unrecorded steps "
              f"x{res[kind]['idle_ratio']:.3f}")
        for mode in MODES[1:]:
            r = res[kind][mode]
            print(f"  {kind:5s} {mode:8s} step time x{r['ratio']:.3f} (90% interval {r['ci90'][0]:.3f}-{r['ci90'][1]:.3f}; "
                  f"rounds' IQR {r['iqr'][0]:.3f}-{r['iqr'][1]:.3f}; "
                  f"block x{r['block']:.3f}, IQR {r['block_iqr'][0]:.3f}-{r['block_iqr'][1]:.3f}), "
                  f"{r['bytes_per_recorded_step'] / 1024:.1f} KiB exchanged and "
                  f"{r['merge_ms_per_recorded_step']:.1f} ms merging per recorded step (rank 0)")
    summary = {f"{k}_{m}": round(res[k][m]["ratio"], 4) for k in ("ddp", "fsdp2") for m in MODES[1:]}
    summary.update({f"{k}_{m}_ci90": [round(x, 4) for x in res[k][m]["ci90"]] for k in ("ddp", "fsdp2") for m in MODES[1:]})
    summary.update({f"{k}_{m}_block": round(res[k][m]["block"], 4) for k in ("ddp", "fsdp2") for m in MODES[1:]})
    summary.update({f"{k}_every10_idle": round(res[k]["idle_ratio"], 4) for k in ("ddp", "fsdp2")})
    summary.update({f"{k}_bytes_per_recorded_step": int(res[k]["every1"]["bytes_per_recorded_step"]) for k in ("ddp", "fsdp2")})
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
