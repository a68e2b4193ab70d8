"""What the fp32 shadow (``mpscope.record(..., shadow=True)``) costs per training step.

Run ``python benchmarks/shadow_overhead.py`` (a few minutes on a 2-core CPU) or ``--quick``.

Method (made for a shared, noisy machine): one copy of the model per mode, built from one seed,
each under its own recorder for the whole run, trained on the same batches in one process. Steps
are interleaved: for each step index every mode runs that step, in an order rotated every step, so
all modes see the same moment's machine load. Steps are grouped in windows of ``--steps`` (10)
consecutive steps; with ``every=10`` each window holds exactly one recorded step. A mode's ratio in
a window is its time over the plain copy's in the same window; the report gives the median over
``--rounds`` windows and the interquartile range. Modes:

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
import contextlib
import copy
import json
import platform
import sys
import time

import pandas as pd
import torch

import mpscope
from mpscope.demo import GPT, CharDataset, GPTConfig

MODES = {"none": None, "every10": dict(every=10), "every10_shadow": dict(every=10, shadow=True)}
EVERY1 = {"every1": dict(every=1), "every1_shadow": dict(every=1, shadow=True)}


def one_step(model, opt, batch) -> float:
    """Seconds for one training step (bf16 CPU autocast forward, backward, AdamW)."""
    x, y = batch
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y)[1]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def _setup(modes, steps):
    """The batches, and one (model, AdamW) per mode, every model a copy of one seeded GPT."""
    data = CharDataset.from_stdlib(64)
    gen = data.generator(0)
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=data.vocab_size, d_model=128, n_layer=2, n_head=4, seq_len=64, dropout=0.1))
    models = {m: copy.deepcopy(base) for m in modes}
    return ([data.batch(8, gen) for _ in range(steps + 1)],
            {m: (g, torch.optim.AdamW(g.parameters(), lr=1e-3)) for m, g in models.items()})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument("--every1", action="store_true", help="also time every step recorded, with and without the shadow")
    args = ap.parse_args(argv)
    modes = {**MODES, **(EVERY1 if args.every1 else {})}
    rounds = 3 if args.quick else args.rounds
    batches, copies = _setup(modes, args.steps)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          "threads; GPT d_model 128, 2 layers, seq 64, batch 8, dropout 0.1, bf16 CPU autocast, AdamW")
    names = list(modes)
    per_round = []  # one dict per window: mode -> mean seconds per step
    with contextlib.ExitStack() as stack:
        for m in names:
            if modes[m] is not None:
                stack.enter_context(mpscope.record(*copies[m], **modes[m]))
        for m in names:  # step 0 of every recorder (recorded, first calls): not timed
            torch.manual_seed(999)
            one_step(*copies[m], batches[0])
        for r in range(rounds):
            got = dict.fromkeys(names, 0.0)
            for i in range(args.steps):
                k = 1 + r * args.steps + i
                for j in range(len(names)):
                    m = names[(k + j) % len(names)]
                    torch.manual_seed(k)  # every mode draws the same dropout masks at a step
                    got[m] += one_step(*copies[m], batches[k % len(batches)]) / args.steps
            per_round.append(got)
            print(f"window {r}: " + ", ".join(f"{m} {got[m] * 1e3:.1f} ms" for m in names), flush=True)
    plain = list(copies["none"][0].parameters())
    equal = {m: all(torch.equal(a, b) for a, b in zip(plain, copies[m][0].parameters())) for m in names[1:]}
    print("weights bitwise equal to 'none': " + ", ".join(f"{m} {v}" for m, v in equal.items()))
    seconds = pd.DataFrame(per_round)[names]
    ratio = seconds.div(seconds["none"], axis=0)
    table = pd.DataFrame({"ms_per_step": seconds.median() * 1e3, "ratio": ratio.median(),
                          "ratio_q1": ratio.quantile(0.25), "ratio_q3": ratio.quantile(0.75)})
    print(table.round(3).to_string())
    summary = {m: round(float(ratio[m].median()), 3) for m in names}
    summary["shadow_over_every10"] = round(float((seconds["every10_shadow"] / seconds["every10"]).median()), 3)
    if "every1_shadow" in names:
        summary["shadow_over_every1"] = round(float((seconds["every1_shadow"] / seconds["every1"]).median()), 3)
    print(json.dumps(summary))
    return summary

if __name__ == "__main__":
    sys.exit(0 if main() else 1)
