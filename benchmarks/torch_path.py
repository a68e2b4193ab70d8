"""What the statistics of one recorded demo step cost on each CPU implementation.

Run ``python benchmarks/torch_path.py`` (under a minute on a 2-core CPU).

Method. The embedded demo GPT is trained exactly as ``mpscope demo`` does (default model, batch 8,
float16 autocast + GradScaler, AdamW, clipping) with every step recorded, and every call the
recorder makes to :func:`mpscope.stats.device_stats` in its third step is captured (copies of the
tensors it was given: activations and activation gradients one at a time from the hooks, the
parameters, gradients and optimizer state as batches at the step's end). The same calls are then
replayed, ``--rounds`` times in turn, through

* ``fused``: the fused C++ kernel (:mod:`mpscope.kernel`; built if need be),
* ``cpu_codes``: the CPU torch-op path that records while the kernel is being built or cannot be
  (``mpscope.stats._cpu_stats``: codes from the bits, one bincount per batch),
* ``bucketize``: the torch-op path CUDA compiles, run as is on the CPU (``mpscope.stats._torch_stats``).

Every implementation's results are checked equal to the fused kernel's (or to ``cpu_codes``'s where
there is no kernel). Reported: median milliseconds per step over the rounds (with the range), and
the ratios to the fused kernel measured in this one run. Wall time with PyTorch's threads as they
are (``--threads`` to set them); the machine may be shared (the load average is printed). The
last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from cold_start import demo_step, demo_training

import mpscope
from mpscope import kernel, stats


def capture(step: int = 2) -> list[tuple[list[torch.Tensor], bool]]:
    """The ``(tensors, hist)`` of every ``device_stats`` call of recorded step ``step`` of the demo."""
    model, opt, scaler, data, gen = demo_training()
    calls: list = []
    real = stats.device_stats
    current = {"step": -1}

    def spy(tensors, hist=True, fused=True):
        if current["step"] == step:
            calls.append(([t.detach().clone() for t in tensors], hist))
        return real(tensors, hist, fused)

    stats.device_stats = spy
    try:
        with mpscope.record(model, optimizer=opt, scaler=scaler):
            for i in range(step + 1):
                current["step"] = i
                demo_step(model, opt, scaler, data, gen)
    finally:
        stats.device_stats = real
    return calls


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch-op path vs fused kernel: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.2f} "
          "(other processes share these CPUs)")
    print("command: python benchmarks/torch_path.py " + " ".join(sys.argv[1:] if argv is None else argv))
    module = kernel.load()
    calls = capture()
    n_tensors = sum(len(ts) for ts, _ in calls)
    n_elements = sum(t.numel() for ts, _ in calls for t in ts)
    impls = {"cpu_codes": stats._cpu_stats, "bucketize": stats._torch_stats}
    if module is not None:
        impls = {"fused": lambda ts, hist: stats.device_stats(ts, hist, fused=module), **impls}
    results = {name: [fn(ts, hist) for ts, hist in calls] for name, fn in impls.items()}  # warm-up
    ref = next(iter(results))
    for name, res in results.items():
        for a, b in zip(res, results[ref]):
            assert torch.equal(a.counts, b.counts) and torch.equal(a.extrema, b.extrema), f"{name} != {ref}"
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(args.rounds):
        for name, fn in impls.items():
            t0 = time.perf_counter()
            for ts, hist in calls:
                fn(ts, hist)
            times[name].append(1e3 * (time.perf_counter() - t0))
    print(f"   one recorded demo step: {len(calls)} calls, {n_tensors} tensors, {n_elements / 1e6:.2f} M elements; "
          f"all implementations' results identical")
    base = statistics.median(times["fused"]) if "fused" in times else None
    out = {"calls": len(calls), "tensors": n_tensors, "elements": n_elements, "ms_per_step": {}, "vs_fused": {}}
    for name, ts in times.items():
        med = statistics.median(ts)
        out["ms_per_step"][name] = med
        rel = f", x{med / base:.1f} the fused kernel" if base else ""
        if base:
            out["vs_fused"][name] = med / base
        print(f"   {name:>10s}: {med:8.1f} ms per step (range {min(ts):.1f}-{max(ts):.1f}), "
              f"{1e6 * med / n_elements:.2f} ns per element{rel}")
    out["bucketize_vs_cpu_codes"] = out["ms_per_step"]["bucketize"] / out["ms_per_step"]["cpu_codes"]
    print(f"   cpu_codes is {out['bucketize_vs_cpu_codes']:.1f}x cheaper than bucketize")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
