"""Instructions mpscope's host path executes per observed tensor, counted by callgrind.

Run ``python benchmarks/host_instructions.py`` (about 4 minutes on 2 cores; needs valgrind with
its ``valgrind/callgrind.h`` header and a C compiler, and skips with a message without them).

The noise-free companion of ``where_time_goes.py``'s launch-bound host path. On a shared machine
the time inside mpscope's entry points moves by microseconds per tensor from run to run (other
tenants' load changes caches and clocks); the number of instructions executed there moves by
0.2 % at most (two runs of one tree give the same count to the instruction; one with the test
suite running beside it is 0.1-0.2 % off). The children run on one intra-op thread: a thread pool's
spin-waits would add instructions that depend on timing.
It measures the same thing: the tiny GPT of ``where_time_goes.py`` (d_model 32, sequence 16,
batch 2, AdamW), the stats kernel stubbed, and only what runs inside mpscope's entry points
(``where_time_goes.ENTRY_POINTS``: the hooks, the step end with its parameter batch and host copy,
``Recorder._safe``), divided by the tensors observed per step. Twice, in parallel: as a CPU run
records (host rows) and as a GPU run records (``where_time_goes.as_a_gpu_run_records``).

How: each child runs under ``valgrind --tool=callgrind --collect-atstart=no`` and toggles
collection on at the outermost entry point's start and off at its end (``CALLGRIND_TOGGLE_COLLECT``
from a small C library built here and called through ctypes; its own call costs about 2,000
instructions per entry point call, left in the figures: the same for any two versions compared).
Valgrind runs the program about 50 times slower, so a child takes minutes (importing torch alone
takes about 45 s). Instructions are not time: here a hook inside a step runs cold, at about half
an instruction per cycle, and the same hook in a hot loop at about two; compare versions with
this, report time with ``where_time_goes.py``.

The last line printed is a JSON object: per path, instructions per observed tensor and the raw
counts.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
_TOGGLE_C = "#include <valgrind/callgrind.h>\nvoid mpscope_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }\n"


def _child(path: str, lib: str, steps: int) -> None:
    """Record ``steps`` steps of the tiny GPT with collection on inside the entry points only."""
    sys.path.insert(0, str(HERE))
    # (imported here, in the child only: the parent never imports torch)
    import torch
    import where_time_goes as W

    import mpscope

    toggle = ctypes.CDLL(lib).mpscope_toggle
    # one intra-op thread: a thread pool's spin-waits would add instructions that depend on timing
    torch.set_num_threads(1)
    work, model, opt, n_obs = W.warm_tiny_gpt()
    counting = [False]

    def switch():  # collection on at an outermost entry point's start, off at its end
        if counting[0]:
            toggle()

    gpu = W.as_a_gpu_run_records() if path == "gpu" else contextlib.nullcontext()
    with W.stats_kernel(True), gpu, W.around_entry_points(switch, switch), mpscope.record(model, optimizer=opt):
        for i in range(4):  # (the kernel's plans and the step's buffers settle)
            work.step(model, opt, i)
        counting[0] = True
        for i in range(steps):
            work.step(model, opt, i)
        counting[0] = False
    print(json.dumps({"observed_per_step": n_obs, "steps": steps}), flush=True)


def _build_toggle(folder: Path) -> Path:
    src, lib = folder / "toggle.c", folder / "libtoggle.so"
    src.write_text(_TOGGLE_C)
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True,
                   capture_output=True, text=True)
    return lib


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="recorded steps counted per path (default 6)")
    ap.add_argument("--child", choices=["rows", "gpu"], help=argparse.SUPPRESS)
    ap.add_argument("--lib", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.lib, args.steps)
        return 0
    if shutil.which("valgrind") is None:
        print("host_instructions: valgrind is not installed (apt-get install valgrind); nothing measured")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        try:
            lib = _build_toggle(Path(tmp))
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"host_instructions: cannot build the callgrind toggle (a C compiler and valgrind/callgrind.h "
                  f"are needed): {getattr(e, 'stderr', e)}; nothing measured")
            return 0
        env = dict(os.environ, PYTHONHASHSEED="0")  # (the same dict and set layouts in every run)
        # the interpreter itself, not a launcher script: valgrind follows no exec into a child
        python = os.path.realpath(sys.executable)
        procs = {path: subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--callgrind-out-file=/dev/null",
             python, __file__, "--child", path, "--lib", str(lib), "--steps", str(args.steps)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for path in ("rows", "gpu")}
        out = {}
        for path, p in procs.items():
            stdout, stderr = p.communicate()
            collected = re.search(r"Collected\s*:\s*([\d,]+)", stderr)
            if p.returncode or collected is None or not stdout.strip():
                print(f"host_instructions: the {path} child failed (rc {p.returncode}):\n{stderr[-3000:]}")
                return 1
            facts = json.loads(stdout.strip().splitlines()[-1])
            n = int(collected.group(1).replace(",", ""))
            per = n / facts["steps"] / facts["observed_per_step"]
            out[path] = {"instructions_per_tensor": round(per), "instructions": n, **facts}
            print(f"{'host rows (a CPU run)' if path == 'rows' else 'GPU path':24s} "
                  f"{per:8.0f} instructions per observed tensor "
                  f"({n:,} in {facts['steps']} steps x {facts['observed_per_step']} tensors)")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
