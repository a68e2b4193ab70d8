"""What the fp32 shadow (``mpscope.record(..., shadow=True)``) costs per training step.

Run ``python benchmarks/shadow_overhead.py`` (a few minutes on a 2-core CPU) or ``--quick``.

Method: as ``benchmarks/ops_overhead.py``. One copy of the model per mode, built from one
``state_dict``, trained on the same batches in one process, in rounds; in each round every mode
runs one block (one untimed warm-up step, then ``--steps`` timed steps, the recorder entered around
the block), in an order rotated every round. A mode's ratio in a round is its mean step time over
the plain block's in the same round; the report gives the median over rounds and the interquartile
range. With ``every=10`` and blocks of 10 timed steps, each timed block holds exactly one recorded
step. Modes:

* ``none``: no instrumentation;
* ``every10``: ``mpscope.record(model, opt, every=10)``;
* ``every10_shadow``: the same with ``shadow=True`` (one float32 reference forward plus the own
  contribution of every module on each recorded step);
* ``every1`` and ``every1_shadow`` (with ``--every1``): every step recorded, without and with the
  shadow (the cost of one shadowed step next to one recorded step).

Model: the small GPT of ``mpscope.demo`` (d_model 128, 2 layers, 4 heads, sequence 64, batch 8,
dropout 0.1, on Python's standard-library source) under CPU autocast bfloat16 with AdamW. At the
end the weights of all copies are compared bitwise (dropout included: the shadow draws from a
forked RNG). The last line printed is a JSON object of the median ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time

import torch

import mpscope
from mpscope.demo import GPT, CharDataset, GPTConfig

MODES = {"none": None, "every10": dict(every=10), "every10_shadow": dict(every=10, shadow=True)}
EVERY1 = {"every1": dict(every=1), "every1_shadow": dict(every=1, shadow=True)}


def block(kwargs, model, opt, batches, start, steps) -> float:
    """Mean seconds per step over ``steps`` timed steps (after one warm-up step)."""
    rec = mpscope.record(model, opt, **kwargs) if kwargs is not None else None
    if rec is not None:
        rec.__enter__()
    total = 0.0
    try:
        for i in range(steps + 1):
            x, y = batches[(start + i) % len(batches)]
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)[1]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i:
                total += time.perf_counter() - t0
    finally:
        if rec is not None:
            rec.__exit__(None, None, None)
    return total / steps


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument("--every1", action="store_true", help="also time every step recorded, with and without the shadow")
    args = ap.parse_args(argv)
    modes = {**MODES, **(EVERY1 if args.every1 else {})}
    rounds = 3 if args.quick else args.rounds
    data = CharDataset.from_stdlib(64)
    cfg = GPTConfig(vocab_size=data.vocab_size, d_model=128, n_layer=2, n_head=4, seq_len=64, dropout=0.1)
    gen = data.generator(0)
    batches = [data.batch(8, gen) for _ in range(args.steps + 1)]
    torch.manual_seed(0)
    base = GPT(cfg)
    copies = {}
    for m in modes:
        model = copy.deepcopy(base)
        copies[m] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          "threads; GPT d_model 128, 2 layers, seq 64, batch 8, dropout 0.1, bf16 CPU autocast, AdamW")
    names = list(modes)
    ratios: dict = {m: [] for m in names}
    times: dict = {m: [] for m in names}
    for r in range(rounds):
        got = {}
        for m in names[r % len(names):] + names[: r % len(names)]:
            torch.manual_seed(1000 + r)  # every mode draws the same dropout masks in a round
            got[m] = block(modes[m], *copies[m], batches, r * (args.steps + 1), args.steps)
        for m in names:
            times[m].append(got[m])
            ratios[m].append(got[m] / got["none"])
        print(f"round {r}: " + ", ".join(f"{m} {got[m] * 1e3:.1f} ms" for m in names), flush=True)
    ref = list(copies["none"][0].parameters())
    for m in names[1:]:
        same = all(torch.equal(a, b) for a, b in zip(ref, copies[m][0].parameters()))
        print(f"weights of '{m}' bitwise equal to 'none': {same}")
    summary = {}
    for m in names:
        q = statistics.quantiles(ratios[m], n=4) if len(ratios[m]) > 1 else [ratios[m][0]] * 3
        summary[m] = round(statistics.median(ratios[m]), 3)
        print(f"{m:>15}: {statistics.median(times[m]) * 1e3:8.1f} ms/step, x{summary[m]:.3f} "
              f"(IQR {q[0]:.3f}-{q[2]:.3f}) vs none")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
