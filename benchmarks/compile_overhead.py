"""What mpscope costs on a torch.compile'd model, and how often it makes dynamo compile.

Run ``python benchmarks/compile_overhead.py`` (a few minutes on a 2-core CPU, most of it
compiling) or ``--quick``.

Method. The demo's small GPT (d_model 128, 2 layers, 4 heads, sequence 64, batch 8, Python's
standard-library source) under CPU autocast bfloat16 with AdamW, compiled with
``torch.compile(model, backend=...)`` (default inductor). One copy per mode is built from one
``state_dict``, in one process:

* ``none``: the compiled model, no recording;
* ``full``: ``mpscope.record(compiled, optimizer=opt)`` with every role, every step, histograms;
* ``every10``: the same with ``every=10`` (each timed block of 10 steps holds one recorded step).

Every copy first runs ``--warmup`` steps inside its recorder (compiling: the recorded and the plain
variant), then time is taken in rounds: in each round every mode runs ``--steps`` timed steps, in an
order rotated every round; a mode's ratio in a round is its mean step time over ``none``'s in the
same round. The report gives the median ratio over rounds and the interquartile range, dynamo's
graph count (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``) after warm-up and at the
end (no graph may be added after warm-up), and whether the weights of the three copies are
bitwise equal at the end (if not, ``||w - w_none|| / ||w_none||`` over all weights; under inductor
they differ: ``benchmarks/compile_numerics.py`` measures why and against what). The last line is
a JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from torch._dynamo.utils import counters

import mpscope
from mpscope.demo import GPT, CharDataset, GPTConfig

MODES = ("none", "full", "every10")


def demo_gpt() -> tuple[GPT, list]:
    """The demo's GPT (d_model 128, 2 layers, 4 heads, sequence 64, dropout 0) after
    ``torch.manual_seed(0)``, and 8 batches of 8 sequences of Python's standard-library source."""
    data = CharDataset.from_stdlib(64)
    cfg = GPTConfig(vocab_size=data.vocab_size, d_model=128, n_layer=2, n_head=4, seq_len=64, dropout=0.0)
    gen = data.generator(0)
    batches = [data.batch(8, gen) for _ in range(8)]
    torch.manual_seed(0)
    return GPT(cfg), batches


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=11)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--quick", action="store_true", help="3 rounds, aot_eager backend (no C++ compile)")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.backend = 3, "aot_eager"
    base, batches = demo_gpt()
    copies = {}
    for mode in MODES:
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        compiled = torch.compile(m, backend=a.backend)
        rec = None
        if mode != "none":
            rec = mpscope.record(compiled, optimizer=opt, every=10 if mode == "every10" else 1)
            rec.attach()
        copies[mode] = (m, compiled, opt, rec)
    i = {mode: 0 for mode in MODES}

    def run(mode, n):
        m, compiled, opt, _ = copies[mode]
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = batches[i[mode] % len(batches)]
            i[mode] += 1
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = compiled(x, y)[1]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return (time.perf_counter() - t0) / n

    t0 = time.perf_counter()
    for mode in MODES:
        run(mode, a.warmup)
    warm_s = time.perf_counter() - t0
    graphs_warm = counters["stats"]["unique_graphs"]
    ratios = {mode: [] for mode in MODES}
    times = {mode: [] for mode in MODES}
    try:
        for r in range(a.rounds):
            order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
            block = {mode: run(mode, a.steps) for mode in order}
            for mode in MODES:
                times[mode].append(block[mode])
                ratios[mode].append(block[mode] / block["none"])
    finally:
        for _, _, _, rec in copies.values():
            if rec is not None:
                rec.__exit__(None, None, None)
    graphs_end = counters["stats"]["unique_graphs"]
    ref = copies["none"][0].state_dict()
    drift = {}  # ||w - w_none|| / ||w_none|| over all floating weights, per mode
    for mode in MODES[1:]:
        sd = copies[mode][0].state_dict()
        num = sum(float((sd[k].double() - v.double()).pow(2).sum()) for k, v in ref.items() if v.is_floating_point())
        den = sum(float(v.double().pow(2).sum()) for v in ref.values() if v.is_floating_point())
        drift[mode] = (num / den) ** 0.5
    same = all(d == 0.0 for d in drift.values())
    result = {"backend": a.backend, "graphs_after_warmup": graphs_warm, "graphs_at_end": graphs_end,
              "weights_bitwise_equal": same, "weight_drift": {k: float(f"{v:.3g}") for k, v in drift.items()},
              "warmup_s": round(warm_s, 1)}
    print(f"torch {torch.__version__}, backend {a.backend}, {a.rounds} rounds x {a.steps} steps, "
          f"warm-up {a.warmup} steps per mode ({warm_s:.0f} s, compiling)")
    for mode in MODES:
        q = statistics.quantiles(ratios[mode], n=4) if len(ratios[mode]) > 1 else [ratios[mode][0]] * 3
        med = statistics.median(ratios[mode])
        result[mode] = round(med, 3)
        print(f"  {mode:8s} step {statistics.median(times[mode]) * 1e3:8.1f} ms  ratio {med:.3f} (IQR {q[0]:.3f}-{q[2]:.3f})")
    print(f"  dynamo graphs: {graphs_warm} after warm-up, {graphs_end} at the end; weights bitwise equal: {same}"
          + ("" if same else f" (||w - w_none|| / ||w_none||: {result['weight_drift']})"))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
