"""What op-level recording (``mpscope.record(..., ops=True)``) costs per training step.

Run ``python benchmarks/ops_overhead.py`` (about 3 minutes on a 2-core CPU) or ``--quick``.

Method. One copy of the model per mode is built from one ``state_dict`` and trained on the same
batches in one process. Time is taken in rounds: in each round every mode runs one block (one
untimed warm-up step, then ``--steps`` timed steps, the recorder entered around the block), in an
order rotated every round. A mode's ratio in a round is its mean step time over the unhooked
block's in the same round; the report gives the median ratio over rounds and its interquartile
range. Modes:

* ``none``: no instrumentation;
* ``modules``: ``mpscope.record`` with its defaults (module hooks, every role, every step);
* ``ops``: the same plus ``ops=True`` (every op's output recorded, the audit and op facts kept);
* ``ops_every10``: ``ops=True, every=10`` (each timed block of 10 steps records one);
* ``ops_filtered``: ``ops=["add", "softmax", "matmul", "mm", "bmm", "addmm"]`` (an op-set filter);
* ``ops_mode_only``: :class:`mpscope.ops.OpRecorder` alone, with a recorder whose ``_observe``
  returns zeros: the cost of the dispatch mode, module tracking, the audit and the op facts,
  without the stats of the op outputs.

The fused CPU kernel is built (announced) before anything is timed.

``--per-op`` instead times single ops (a view, a bfloat16 add, a cast of a weight to bfloat16,
forward only, inside one module) run 2,000 times in a loop, in four settings: no dispatch mode, a
bare ``TorchDispatchMode`` that only forwards each op (PyTorch's own price of a Python mode), the
op recorder with its statistics stubbed as in ``ops_mode_only``, and ``record(ops=True)``. It prints
the best of five loops per op, in microseconds, and each setting's cost above the plain op.

Model: the small GPT of ``mpscope.demo`` (d_model 128, 2 layers, 4 heads, sequence 64, batch 8, on
Python's standard-library source) under CPU autocast bfloat16 with AdamW. At the end the weights of
all copies are compared bitwise. The last line printed is a JSON object of the median ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch

import mpscope
from mpscope.demo import GPT, CharDataset, GPTConfig
from mpscope.ops import OpRecorder
from mpscope.recording.hook_state import HookState
from mpscope.recording.passes import PassLedger
from mpscope.run import Run
from mpscope.stats import DeviceStats

MODES = ("none", "modules", "ops", "ops_every10", "ops_filtered", "ops_mode_only")


class _NullObserver:
    """What OpRecorder needs from the observer, with stats switched off (the stats of an op's
    inputs are taken as a recording takes them: by the fused kernel once it is ready)."""

    fused = True

    def observe(self, module, role, name, tensor, scaled=False, pass_id=None):
        """No stats: zeros of the right shape (the op facts read the non-finite counts from them)."""
        return DeviceStats(torch.zeros(1, 10, dtype=torch.long), torch.zeros(1, 3, dtype=torch.double), False)


class _OpsOnly:
    def __init__(self, model):
        run = Run(meta={})
        state = HookState(run.meta, {})
        state.recording = True
        self.ops = OpRecorder(model, run, state, _NullObserver(), PassLedger(state))
        self.step = 0

    def __enter__(self):
        self.ops.__enter__()
        return self

    def __exit__(self, *exc):
        self.ops.__exit__(None, None, None)


def _context(mode, model, opt):
    if mode == "none":
        return None
    if mode == "modules":
        return mpscope.record(model, optimizer=opt)
    if mode == "ops":
        return mpscope.record(model, optimizer=opt, ops=True)
    if mode == "ops_every10":
        return mpscope.record(model, optimizer=opt, ops=True, every=10)
    if mode == "ops_filtered":
        return mpscope.record(model, optimizer=opt, ops=["add", "softmax", "matmul", "mm", "bmm", "addmm"])
    return _OpsOnly(model)


def run_block(mode, model, opt, batches, start, steps):
    def one(i):
        x, y = batches[i % len(batches)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    ctx = _context(mode, model, opt)
    t = 0.0
    if ctx is not None:
        ctx.__enter__()
    try:
        one(start)
        for i in range(steps):
            t0 = time.perf_counter()
            one(start + 1 + i)
            if isinstance(ctx, _OpsOnly):
                ctx.ops.on_step_end(ctx.step)
                ctx.step += 1
            t += time.perf_counter() - t0
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return t / steps


class _Repeat(torch.nn.Module):
    """One module running ``op`` ``n`` times in its forward (so the op recorder attributes them)."""

    def __init__(self, op, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64))
        self.op, self.n = op, n

    def forward(self, x):
        for _ in range(self.n):
            self.op(self, x)
        return x


PER_OP = {
    "view": lambda m, x: x.view(-1),
    "add (bf16, 4096)": lambda m, x: x + x,
    "cast weight to bf16": lambda m, x: m.w.to(torch.bfloat16),
}


def per_op(n=2000, repeats=5):
    """Best time per op (us) of each PER_OP op under each setting: {op: {setting: us}}."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Bare(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(64, 64, dtype=torch.bfloat16)
    out = {}
    for label, op in PER_OP.items():
        model = _Repeat(op, n)
        settings = {"plain": lambda: None, "bare mode": Bare, "ops_mode_only": lambda: _OpsOnly(model),
                    "ops=True": lambda: mpscope.record(model, ops=True)}
        best = {}
        for name, make in settings.items():
            times = []
            for _ in range(repeats):
                ctx = make()
                if ctx is not None:
                    ctx.__enter__()
                try:
                    with torch.no_grad() if label == "view" else torch.enable_grad():
                        t0 = time.perf_counter()
                        model(x)
                        times.append((time.perf_counter() - t0) / n * 1e6)
                finally:
                    if ctx is not None:
                        ctx.__exit__(None, None, None)
            best[name] = min(times)
        out[label] = best
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 10 steps")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--per-op", action="store_true", help="time single ops under each setting instead")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 3
    if args.threads:
        torch.set_num_threads(args.threads)
    data = CharDataset.from_stdlib(64)
    cfg = GPTConfig(vocab_size=data.vocab_size, d_model=128, n_layer=2, n_head=4, seq_len=64, dropout=0.0)
    gen = data.generator(0)
    batches = [data.batch(8, gen) for _ in range(args.steps + 1)]
    torch.manual_seed(0)
    base = GPT(cfg)
    copies = {}
    for m in MODES:
        model = copy.deepcopy(base)
        copies[m] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    from mpscope import kernel

    kernel.load()
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads; GPT d_model 128, 2 layers, seq 64, batch 8, bf16 CPU autocast; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.2f} "
          "(other processes share these CPUs)")
    print("command: python benchmarks/ops_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.per_op:
        table = per_op()
        print(f"{'op':>22s} " + " ".join(f"{k:>14s}" for k in next(iter(table.values()))) + "   (us per op, best of 5)")
        for label, best in table.items():
            print(f"{label:>22s} " + " ".join(f"{v:14.1f}" for v in best.values())
                  + "   above plain: " + ", ".join(f"{k} +{v - best['plain']:.1f}" for k, v in best.items() if k != "plain"))
        print(json.dumps(table))
        return table
    ratios = {m: [] for m in MODES}
    times = {m: [] for m in MODES}
    start = 0
    for r in range(args.rounds):
        order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
        got = {}
        for m in order:
            model, opt = copies[m]
            got[m] = run_block(m, model, opt, batches, start, args.steps)
        start += args.steps + 1
        for m in MODES:
            times[m].append(got[m])
            ratios[m].append(got[m] / got["none"])
        print(f"round {r}: " + ", ".join(f"{m} {got[m] * 1e3:.1f} ms" for m in MODES), flush=True)
    # instrumentation must not change training
    ref = list(copies["none"][0].parameters())
    for m in MODES[1:]:
        same = all(torch.equal(a, b) for a, b in zip(ref, copies[m][0].parameters()))
        print(f"weights of '{m}' bitwise equal to 'none': {same}")
    summary = {}
    for m in MODES:
        q = statistics.quantiles(ratios[m], n=4) if len(ratios[m]) > 1 else [ratios[m][0]] * 3
        summary[m] = round(statistics.median(ratios[m]), 2)
        print(f"{m:>14}: {statistics.median(times[m]) * 1e3:8.1f} ms/step, x{summary[m]:.2f} "
              f"(IQR {q[0]:.2f}-{q[2]:.2f}) vs none")
    print("== targets")
    print(f"   {'target':34s} {'measured':>9s} {'IQR':>13s}  status")
    for m, lim in (("ops", 4.0), ("ops_every10", 1.3)):
        q = statistics.quantiles(ratios[m], n=4) if len(ratios[m]) > 1 else [ratios[m][0]] * 3
        label = f"{'full op recording' if m == 'ops' else 'op recording, every=10'} <= {lim}x"
        print(f"   {label:34s} {summary[m]:8.2f}x {q[0]:6.2f}-{q[2]:.2f}  {'met' if summary[m] <= lim else 'NOT met'}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
