"""A/B of two builds of the fused CPU kernel in one process: hot throughput, new / old.

Run ``python benchmarks/kernel_ab.py OLD.so NEW.so [--rounds 7]`` with two binaries of
``mpscope/_kernel.cpp`` (``mpscope build-kernel`` puts each build in the kernel cache,
``mpscope.kernel.binary_path()`` names the current one). Both modules are loaded side by side and
timed alternately on the same tensors (std 0.02, contiguous; bfloat16, float16, float32; 2^16,
2^19 and 2^22 elements; 1 thread and all intra-op threads; with the histogram): per round the best
of 15 calls of each, and the median over rounds, in nanoseconds per element. Timing both in one
process, round by round, cancels most of what a shared machine adds; the ratio is what to read.
A tool for comparing builds, it has no targets table; the last line is a JSON object of the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from where_time_goes import best_ns_per_element, throughput_cases  # noqa: E402

from mpscope import kernel  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    old, new = kernel._import(args.old), kernel._import(args.new)
    out = {}
    print(f"   {'dtype':9s} {'elements':>9s} {'threads':>7s} {'old':>7s} {'new':>7s}  new/old   (ns per element)")
    for name, n, nt, x in throughput_cases():
        a, b = [], []
        for _ in range(args.rounds):
            a.append(best_ns_per_element(old, x, True, 15))
            b.append(best_ns_per_element(new, x, True, 15))
        a, b = statistics.median(a), statistics.median(b)
        out[f"{name}/{n}/{nt}"] = round(b / a, 3)
        print(f"   {name:9s} {n:9d} {nt:7d} {a:7.3f} {b:7.3f}  {b / a:7.3f}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
