"""What precision forensics (``mpscope.record(..., ops=True, shadow=True)``) costs per recorded step.

Run ``python benchmarks/forensics_overhead.py`` (about four minutes on a 2-core CPU).

Model: the small GPT of ``mpscope.demo`` (d_model 128, 2 layers, 4 heads, sequence 64, batch 8) under
CPU autocast bfloat16 with AdamW, on Python's standard-library source.

* **Time**: each mode (plain; ``record(ops=True, shadow=True, every=1)``) in a fresh subprocess on the
  same seeded model and batches, the modes alternating over ``--rounds`` (op recording's dispatch mode
  sees every op of its thread, so a plain copy cannot share the process), with the allocator as a
  user has it (the memory runs' settings below make every large allocation a system call, so they
  are separate runs). The ratio is the recorded mode's median step time over the plain one's (target:
  at most 15x).
* **The engine's share**: a third mode records the same way with the engine held off (op recording
  and the module-level float32 shadow alone).
* **Memory**: each mode in a fresh subprocess (Linux), with glibc's ``MALLOC_MMAP_THRESHOLD_`` at
  64 KiB and ``malloc_trim`` before the measured steps, so freed tensors leave the resident set and
  it follows live memory. Two figures per mode, both from the peak resident size over the measured
  steps (``VmHWM``, reset through ``/proc/self/clear_refs``), after one warm step of the same mode
  (one-time costs are no step's): the **training peak**, above the process before the model and
  optimizer existed (torch, pandas and mpscope imported, the data loaded, torch and the recording
  warmed by a step of a throwaway copy of the model, recorded the same way): the model, its optimizer
  state, the step's transients and what the recording keeps; and the **step growth**, above the
  resident size just before the measured steps (the step's transients alone). The target ratio
  (at most 3x) is read on the training peak; the growth ratio is printed beside it.

The last line printed is a JSON object with both ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys

import torch

import mpscope
from mpscope.demo import GPT, CharDataset, GPTConfig
from shadow_overhead import one_step  # (a bf16 training step, timed; benchmarks/ is the script's path)


DATA = None


def _data():
    global DATA
    if DATA is None:
        DATA = CharDataset.from_stdlib(64)
    return DATA


def _model(seed=0):
    torch.manual_seed(seed)
    m = GPT(GPTConfig(vocab_size=_data().vocab_size, d_model=128, n_layer=2, n_head=4, seq_len=64))
    return m, torch.optim.AdamW(m.parameters(), lr=3e-4)


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [_data().batch(8, g) for _ in range(n)]


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(mode: str, steps: int) -> None:
    import ctypes

    import pandas  # noqa: F401  (imported before the baseline in every mode: no step's memory)

    import mpscope.recorder  # noqa: F401
    import mpscope.recording.forensics  # noqa: F401

    torch.set_num_threads(1)
    batches = _batches(steps + 1)
    if mode == "no_engine":  # op recording and the module-level shadow, the engine held off: its own share
        from mpscope.recording.forensics import Forensics
        Forensics.begin_step = lambda self, recording: setattr(self, "on", False)
    # one-time costs before the baseline: torch's first-use allocations (kernels, pools) and, recorded the
    # same way, the recording's (modules imported on first use, dispatch caches)
    warm, warm_opt = _model(seed=1)
    with (mpscope.record(warm, optimizer=warm_opt, ops=True, shadow=True) if mode != "plain"
          else contextlib.nullcontext()):
        one_step(warm, warm_opt, batches[0])
    del warm, warm_opt
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _status_kb("VmRSS")
    m, opt = _model()
    rec = None
    if mode != "plain":
        rec = mpscope.record(m, optimizer=opt, ops=True, shadow=True)
        rec.__enter__()
    try:
        one_step(m, opt, batches[0])  # warm: first-call allocations are no step's
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = _status_kb("VmRSS")
        _reset_peak()
        times = [one_step(m, opt, b) for b in batches[1:]]
        peak = _status_kb("VmHWM")
    finally:
        if rec is not None:
            rec.__exit__(None, None, None)
    print(json.dumps({"mode": mode, "step_s": statistics.median(times), "step_peak_kb": max(1, peak - before),
                      "training_peak_kb": peak - base, "peak_rss_kb": peak}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=["plain", "no_engine", "forensics"])
    args = ap.parse_args()
    if args.child:
        child(args.child, args.steps)
        return
    got = {"plain": [], "no_engine": [], "forensics": []}
    timed = {m: [] for m in got}
    for _ in range(args.rounds):  # alternating, so the modes see the same stretch of machine load
        for mode in got:
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # large frees go back to the OS at once
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1]
            got[mode].append(json.loads(out))
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            timed[mode].append(json.loads(out)["step_s"])
    t = {m: statistics.median(ts) for m, ts in timed.items()}
    mem = {m: statistics.median(r["training_peak_kb"] for r in rs) for m, rs in got.items()}
    grow = {m: statistics.median(r["step_peak_kb"] for r in rs) for m, rs in got.items()}
    rss = {m: statistics.median(r["peak_rss_kb"] for r in rs) for m, rs in got.items()}
    time_ratio, mem_ratio = t["forensics"] / t["plain"], mem["forensics"] / mem["plain"]
    print(f"plain step {t['plain'] * 1e3:.1f} ms, forensic step {t['forensics'] * 1e3:.1f} ms: {time_ratio:.1f}x "
          f"(target <= 15x); op recording and the module shadow alone (engine off): {t['no_engine'] * 1e3:.1f} ms, "
          f"{t['no_engine'] / t['plain']:.1f}x")
    print(f"training peak (model, optimizer state, the step, what the recording keeps): plain "
          f"{mem['plain'] / 1024:.1f} MiB, forensic {mem['forensics'] / 1024:.1f} MiB: {mem_ratio:.1f}x (target <= 3x); "
          f"engine off {mem['no_engine'] / 1024:.1f} MiB")
    print(f"step growth (the step's transients alone): plain {grow['plain'] / 1024:.1f} MiB, forensic "
          f"{grow['forensics'] / 1024:.1f} MiB: {grow['forensics'] / grow['plain']:.1f}x; engine off "
          f"{grow['no_engine'] / 1024:.1f} MiB; peak resident set (the process, torch included): plain "
          f"{rss['plain'] / 1024:.0f} MiB, forensic {rss['forensics'] / 1024:.0f} MiB")
    print(json.dumps({"time_ratio": round(time_ratio, 2), "memory_ratio": round(mem_ratio, 2),
                      "no_engine_time_ratio": round(t["no_engine"] / t["plain"], 2),
                      "no_engine_memory_ratio": round(mem["no_engine"] / mem["plain"], 2),
                      "growth_ratio": round(grow["forensics"] / grow["plain"], 2),
                      "plain_ms": round(t["plain"] * 1e3, 2)}))


if __name__ == "__main__":
    main()
