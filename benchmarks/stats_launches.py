"""Kernel launches of the torch-op statistics per batch on CUDA (target: at most 3).

Run ``python benchmarks/stats_launches.py`` on a machine with a GPU (``benchmarks/cuda_check.sh``
does). For batches of 1, 8 and 64 tensors of mixed float16 / bfloat16 / float32 (sizes 1 … 2^20,
inf/NaN/subnormals included), it compiles :func:`mpscope.stats.batch_stats` (the first call of
each shape family; not timed), then counts the CUDA kernels one ``device_stats`` call launches
with ``torch.profiler`` (kernel events, excluding the concatenation of the inputs into one flat
view, which is listed separately), and checks the results against the CPU's fused kernel (or the
CPU torch-op path) bit for bit. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import json
import sys

import torch

from mpscope import stats


def batch(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        size = [1, 100, 4097, 2**16, 2**20][i % 5]
        x = torch.randn(size, generator=g) * torch.exp2(torch.randint(-30, 20, (size,), generator=g).float())
        x[:: 997] = float("nan")
        x[5:: 1001] = float("inf")
        out.append(x.to((torch.float16, torch.bfloat16, torch.float32)[i % 3]))
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("stats_launches: no CUDA device here; nothing measured (run it on a GPU machine)")
        return 0
    from torch.profiler import ProfilerActivity, profile

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    result = {}
    for n in (1, 8, 64):
        cpu = batch(n, n)
        ref = stats.device_stats(cpu, hist=True, fused=None)
        gpu = [t.cuda() for t in cpu]
        for _ in range(3):  # compile and warm up
            stats.device_stats(gpu, hist=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ds = stats.device_stats(gpu, hist=True)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        cat = [k for k in kernels if "cat" in k.lower() or "copy" in k.lower() or "elementwise" in k.lower()]
        same = torch.equal(ds.counts.cpu(), ref.counts) and torch.equal(ds.extrema.cpu(), ref.extrema)
        result[n] = {"kernels": len(kernels), "of_which_flatten": len(cat), "equal_to_cpu": same}
        print(f"   batch of {n:3d}: {len(kernels)} kernels ({len(cat)} flattening the inputs), "
              f"results equal to the CPU's: {same}")
        print("      " + ", ".join(k[:60] for k in kernels))
    print("== targets")
    for n, r in result.items():
        stat_kernels = r["kernels"] - r["of_which_flatten"]
        print(f"   batch of {n:3d}: statistics kernels {stat_kernels} <= 3: {'met' if stat_kernels <= 3 else 'NOT met'}")
    print(json.dumps(result))
    return 0 if all(r["equal_to_cpu"] for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
