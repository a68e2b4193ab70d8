"""What mpscope itself does on the steps ``every=N`` leaves unrecorded: 2 gloo ranks, the demo GPT,
DDP and FSDP2.

Run ``python benchmarks/idle_step_cost.py`` (about a minute on a 2-core CPU; ``--quick``: the
small GPT). A step-time ratio cannot see a cost of a tenth of a millisecond on a 200 ms step
(``benchmarks/distributed_overhead.py``'s rounds vary by several per cent on two CPUs), so this
script measures mpscope's own part directly, in the training process:

* **µs per unrecorded step**: the wall time spent inside mpscope during the step, taken with
  ``time.perf_counter`` around every way PyTorch enters it on such a step: the recorder's
  guarded hook bodies (``Recorder._safe``: the root's forward pre-hook, the ``Tensor.backward``
  wrapper, the optimizer's step hook, which ends the step and opens the next) and the parameters'
  post-accumulate-grad hooks (``Recorder._param_grad_hook``; FSDP2 calls them after its
  reduce-scatter). Nested entries count once. The median over the unrecorded steps of rank 0 is
  reported; the last unrecorded step before a recorded one also installs the recorded step's hooks
  (``last_before_recorded``), so it is reported apart. The timers add about 0.1 µs per entry.
* **ATen ops per unrecorded step** that mpscope issued (``benchmarks/common.py``'s ``OpCounter``,
  over the unrecorded steps of the second window of ``every`` steps; those steps are not timed),
  and the **collectives** it issued on unrecorded steps (``torch.distributed`` functions called
  from mpscope's code; there should be none).

Method: ``every=10``, bf16 CPU autocast, AdamW, no GradScaler, one intra-op thread per rank; the
first window of steps warms up and is not counted. The last line printed is a JSON object of the
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import mpscope
from mpscope import recorder as _recorder
from mpscope.demo import GPT, CharDataset
from mpscope.demo.data import load_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (benchmarks/ is not a package)
from distributed_overhead import _config, _wrap, finish_rank, spawn, train_step  # noqa: E402

EVERY = 10
COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_object", "broadcast", "barrier",
               "reduce_scatter_tensor", "all_gather_into_tensor", "gather_object", "broadcast_object_list")
_MPSCOPE = str(Path(mpscope.__file__).resolve().parent) + os.sep


class _Clock:
    """Seconds spent inside the timed mpscope entry points (outermost entries only)."""

    def __init__(self) -> None:
        self.seconds, self.depth, self.entries, self.collectives = 0.0, 0, 0, 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth = 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.depth = 0
                self.entries += 1
        return timed

    def count_collective(self, fn):
        def counted(*args, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(_MPSCOPE):
                self.collectives += 1
            return fn(*args, **kwargs)
        return counted


def _measure(kind: str, rank: int, steps: int, quick: bool, data, clock: _Clock) -> dict:
    torch.manual_seed(0)
    net = _wrap(GPT(_config(quick, data.vocab_size)), kind)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step(i):
        train_step(net, opt, data, rank, 8, i)

    step(0)
    plain, last, entries, collectives, ops, counted = [], [], [], 0, {}, 0
    with mpscope.record(net, optimizer=opt, every=EVERY) as rec:
        for i in range(steps):
            unrecorded = not rec.recording
            clock.seconds, clock.entries, clock.collectives = 0.0, 0, 0
            counter = common.OpCounter() if (unrecorded and EVERY < i < 2 * EVERY) else None
            if counter is not None:
                with counter:
                    step(i + 1)
                for name, n in counter.ops.get("mpscope", {}).items():
                    ops[name] = ops.get(name, 0) + n
                counted += 1
            else:
                step(i + 1)
            if unrecorded and i > EVERY:
                collectives += clock.collectives
                if counter is None:  # the op counter's dispatch mode slows everything: not timed
                    (last if rec.recording else plain).append(clock.seconds)
                    if not rec.recording:
                        entries.append(clock.entries)
    return {"us_per_unrecorded_step": 1e6 * statistics.median(plain) if plain else None,
            "us_last_before_recorded": 1e6 * statistics.median(last) if last else None,
            "entries_per_unrecorded_step": statistics.median(entries) if entries else None,
            "unrecorded_steps_timed": len(plain) + len(last),
            "collectives_on_unrecorded_steps": collectives,
            "aten_ops_per_unrecorded_step": ({k: v / counted for k, v in sorted(ops.items())} if counted else None)}


def rank_main(rank: int, world: int, init: str, args: dict, result_path: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    clock = _Clock()
    _recorder.Recorder._safe = clock.wrap(_recorder.Recorder._safe)
    _recorder.Recorder._param_grad_hook = clock.wrap(_recorder.Recorder._param_grad_hook)
    for name in COLLECTIVES:
        setattr(dist, name, clock.count_collective(getattr(dist, name)))
    data = CharDataset(load_text(), seq_len=64 if args["quick"] else 128)
    out = {kind: _measure(kind, rank, args["steps"], args["quick"], data, clock) for kind in ("ddp", "fsdp2")}
    finish_rank(rank, out, result_path)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small GPT (d_model 64, 2 layers)")
    p.add_argument("--steps", type=int, default=60, help="steps per wrapper (every=10; the first 11 warm up)")
    a = p.parse_args(argv)
    res = spawn(rank_main, {"quick": a.quick, "steps": a.steps}, "mpscope-idle-")
    print(f"2 gloo ranks ({os.cpu_count()} CPUs), demo GPT ({'quick' if a.quick else 'd_model 256, 4 layers'}), "
          f"every={EVERY}, {a.steps} steps per wrapper; rank 0")
    for kind in ("ddp", "fsdp2"):
        r = res[kind]
        print(f"  {kind:5s} mpscope {r['us_per_unrecorded_step']:.1f} us per unrecorded step "
              f"({r['entries_per_unrecorded_step']:.0f} entries), {r['us_last_before_recorded']:.1f} us on the "
              f"last one before a recorded step; {r['collectives_on_unrecorded_steps']} collectives")
        print(f"        ATen ops mpscope issues per unrecorded step: {r['aten_ops_per_unrecorded_step']}")
    summary = {f"{k}_us_per_unrecorded_step": round(res[k]["us_per_unrecorded_step"], 1) for k in ("ddp", "fsdp2")}
    summary.update({f"{k}_aten_ops_per_unrecorded_step": sum((res[k]["aten_ops_per_unrecorded_step"] or {}).values())
                    for k in ("ddp", "fsdp2")})
    summary["collectives_on_unrecorded_steps"] = sum(res[k]["collectives_on_unrecorded_steps"] for k in ("ddp", "fsdp2"))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
