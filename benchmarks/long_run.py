"""Memory on a long run: 100,000 recorded steps (every=1) with spilling to Parquet.

Prints the process's resident memory at checkpoints and the Run's in-memory rows, then checks that
`Run.load` reads every row back. Usage:

    python benchmarks/long_run.py [--steps 100000] [--spill-rows 200000]

The last line is a JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import mpscope


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--spill-rows", type=int, default=200_000)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    out = {"steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        spill = Path(tmp) / "spill"
        t0 = time.perf_counter()
        checkpoints = {}
        with mpscope.record(model, optimizer=opt, scaler=scaler, spill_dir=spill, spill_rows=args.spill_rows) as rec:
            for step in range(args.steps):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                if (step + 1) % (args.steps // 10) == 0:
                    checkpoints[step + 1] = round(rss_mb(), 1)
                    print(f"step {step + 1}: RSS {checkpoints[step + 1]} MB, in-memory rows "
                          f"{rec.run.nbytes()['tensor_rows']}, spilled parts {rec.run.nbytes()['spilled_parts']}", flush=True)
        out["seconds"] = round(time.perf_counter() - t0, 1)
        run = rec.run
        rows_per_step = len(run.tensors[run.tensors.step == 0])
        d = run.save(Path(tmp) / "run")
        back = mpscope.Run.load(d)
        out["rows"] = len(back.tensors)
        out["rows_expected"] = rows_per_step * args.steps
        out["steps_loaded"] = len(back.steps)
        out["rss_mb"] = checkpoints
        first, last = checkpoints[min(checkpoints)], checkpoints[max(checkpoints)]
        out["rss_growth_mb_after_first_tenth"] = round(last - first, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
