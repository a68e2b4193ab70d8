"""What mpscope costs per training step, against the unhooked step and Hugging Face's debugger.

Run ``python benchmarks/overhead.py`` (about 5 minutes on a 2-core CPU) or ``--quick`` (< 2 min).

Method. For each model, one copy per mode is built from one ``state_dict`` and trained on the same
batches, in one process. Time is taken in *rounds*: in each round every mode runs one block (one
untimed warm-up step, then ``--steps`` timed steps; the recorder is entered around the block), in an
order rotated every round. A block's figure is its mean step time; a mode's ratio in a round is its
block time over the unhooked block's time in the same round, and the report gives the median of
those ratios over rounds with their interquartile range. The modes:

* ``none``: no hooks;
* ``full``: ``mpscope.record`` with every role, every step, histograms every step;
* ``full_out``: ``full`` writing to disk as it goes (``out=`` a new directory per block: every
  8 recorded steps, at most once a second; see :class:`mpscope.run.RankFiles`);
* ``every10``: the same as ``full`` with ``every=10`` (each timed block holds exactly one recorded step);
* ``hf_coverage``: ``mpscope.record(roles=["activation", "weight"])``, the tensors HF's debugger
  looks at (forward outputs and weights; it also reads module inputs);
* ``hf_debug``: ``transformers.debug_utils.DebugUnderflowOverflow`` (abs min/max of every module's
  weights, inputs and outputs, plus an inf/nan check with ``.item()`` per tensor).

Then every mode runs one more block under :class:`common.OpCounter` (a ``TorchDispatchMode``) to
count, per step, the ATen ops, the bytes their tensor inputs span, and the host syncs, each split
into the training step's own and the instrumentation's (mpscope's or HF's source on the stack). At
the end the weights of all copies are compared bitwise: instrumentation must not change training.

Models: the small GPT of ``mpscope.demo`` (d_model 256, 4 layers, 4 heads, sequence 128, batch 16,
on Python's standard-library source) and a convolutional net (4 × Conv2d/BatchNorm2d/ReLU on
32 × 32 × 3 images, batch 32, 10 classes; the images are seeded Gaussian noise, since no image data
set ships with Python and only the step's cost matters here), both under CPU autocast bfloat16
with AdamW. The last line printed is a JSON object of the median ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OpCounter  # noqa: E402

import mpscope  # noqa: E402
from mpscope.demo import GPT, GPTConfig, CharDataset  # noqa: E402
from mpscope.recording import step_buffer  # noqa: E402

MODES = ("none", "full", "full_out", "every10", "hf_coverage", "hf_debug")
#: The recorder's once-per-recorded-step host copy: the ops issued from this file are attributed
#: to "flush" rather than to the hooks.
FLUSH_FILES = (step_buffer.__file__,)


# --------------------------------------------------------------------------- workloads


class ConvNet(nn.Module):
    """4 × [Conv2d 3×3 → BatchNorm2d → ReLU] (32, 64 /2, 128 /2, 128 channels) → avg pool → Linear."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        chans = [(3, 32, 1), (32, 64, 2), (64, 128, 2), (128, 128, 1)]
        layers = []
        for cin, cout, stride in chans:
            layers += [
                nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=False),
            ]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(128, classes)

    def forward(self, x):
        return self.head(self.pool(self.features(x)).flatten(1))


class Workload:
    """A model factory, a fixed list of batches and the loss; ``step`` is one training step."""

    def __init__(self, name, describe, make_model, batches, loss_fn, dtype=torch.bfloat16,
                 device="cpu"):
        self.name, self.describe = name, describe
        self.make_model, self.loss_fn, self.dtype = make_model, loss_fn, dtype
        self.device = torch.device(device)
        self.batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        if self.device.type != "cpu":
            self.describe = self.describe.replace("CPU autocast", f"{self.device} autocast")

    def step(self, model, opt, i):
        x, y = self.batches[i % len(self.batches)]
        with torch.autocast(self.device.type, dtype=self.dtype):
            loss = self.loss_fn(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the harness's own wait, so that step times are real


def gpt_workload(n_batches: int, device="cpu") -> Workload:
    data = CharDataset.from_stdlib(128)
    cfg = GPTConfig(vocab_size=data.vocab_size, d_model=256, n_layer=4, n_head=4, seq_len=128)
    gen = data.generator(0)
    batches = [data.batch(16, gen) for _ in range(n_batches)]
    n = sum(p.numel() for p in GPT(cfg).parameters())
    return Workload(
        "gpt",
        f"small GPT (d_model 256, 4 layers, 4 heads, seq 128, batch 16, {n:,} params), "
        "bf16 CPU autocast, AdamW",
        lambda: GPT(cfg),
        batches,
        lambda m, x, y: m(x, y)[1],
        device=device,
    )


def conv_workload(n_batches: int, device="cpu") -> Workload:
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g))
        for _ in range(n_batches)
    ]
    n = sum(p.numel() for p in ConvNet().parameters())
    return Workload(
        "conv",
        f"conv net (4 x Conv2d/BatchNorm2d/ReLU, 32x32x3 images, batch 32, {n:,} params), "
        "bf16 CPU autocast, AdamW",
        ConvNet,
        batches,
        lambda m, x, y: nn.functional.cross_entropy(m(x), y),
        device=device,
    )


# --------------------------------------------------------------------------- modes


def record_kwargs(**kw):
    """Drop keyword arguments that this version of ``mpscope.record`` does not take."""
    params = inspect.signature(mpscope.record).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kw
    return {k: v for k, v in kw.items() if k in params}


class Mode:
    """One instrumented copy of the model and its optimizer."""

    def __init__(self, name: str, model: nn.Module, opt):
        self.name, self.model, self.opt = name, model, opt
        self.hf = None
        self.last_run = None
        if name == "hf_debug":
            from transformers.debug_utils import DebugUnderflowOverflow

            self.hf = DebugUnderflowOverflow(model)  # hooks stay for the model's lifetime

    @contextlib.contextmanager
    def active(self):
        if self.name in ("none", "hf_debug"):
            yield
            return
        kw = dict(optimizer=self.opt)
        if self.name in ("full", "full_out"):
            kw.update(every=1, hist_every=1)
        if self.name == "full_out":
            kw.update(out=tempfile.mkdtemp(prefix="mpscope-overhead-"))
        elif self.name == "every10":
            kw.update(every=10)
        elif self.name == "hf_coverage":
            kw.update(roles=["activation", "weight"])
        try:
            with mpscope.record(self.model, **record_kwargs(**kw)) as rec:
                yield
        finally:
            if "out" in kw:
                shutil.rmtree(kw["out"], ignore_errors=True)
        self.last_run = rec.run


def build_modes(work: Workload, modes) -> dict[str, Mode]:
    torch.manual_seed(0)
    base = work.make_model()
    state = copy.deepcopy(base.state_dict())
    out = {}
    for name in modes:
        model = work.make_model().to(work.device)
        model.load_state_dict(state)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out[name] = Mode(name, model, opt)
    return out


# --------------------------------------------------------------------------- measurement


def run_block(work: Workload, mode: Mode, start: int, steps: int, counter=None) -> tuple[float, int]:
    """One untimed warm-up step then ``steps`` timed ones; returns (mean seconds/step, next i)."""
    with mode.active():
        work.step(mode.model, mode.opt, start)
        total = 0.0
        ctx = counter if counter is not None else contextlib.nullcontext()
        with ctx:
            for k in range(1, steps + 1):
                t0 = time.perf_counter()
                work.step(mode.model, mode.opt, start + k)
                total += time.perf_counter() - t0
    return total / steps, start + steps + 1


def quartiles(xs):
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def run_nbytes(run) -> tuple[float, int, str]:
    """(bytes, tensor rows, how measured) of a Run's in-memory tensor rows."""
    rows = len(run.tensors)
    if hasattr(run, "nbytes"):
        nb = run.nbytes()
        if isinstance(nb, dict):
            extra = f"; histograms add {nb.get('histogram_bytes', 0) / 1e3:.1f} kB"
            return float(nb["tensor_bytes"]), int(nb["tensor_rows"]), "Run.nbytes()" + extra
        return float(nb), rows, "Run.nbytes()"
    total = sum(
        int(df.memory_usage(deep=True).sum()) for df in (run.tensors, run.steps, run.histograms)
    )
    return float(total), rows, "pandas memory_usage(deep=True) of tensors+steps+histograms (no Run.nbytes())"


def read_bandwidth(device="cpu", mb: int = 256, reps: int = 5) -> float:
    """Memory read bandwidth in bytes/s: the best of ``reps`` ``torch.sum`` over ``mb`` MB of
    float32 (one pass, nothing written), with this process's torch threads."""
    x = torch.ones(mb * (1 << 20) // 4, device=device)
    best = math.inf
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        x.sum()
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def recorded_bytes_per_step(run) -> float:
    """Bytes of the tensors a recorded step reads (numel x element size over the tensor rows of
    the recorded steps / recorded steps): the floor of the stats work is one read of these."""
    t = run.tensors
    if not len(t):
        return float("nan")
    size = t["dtype"].astype(str).map(
        lambda d: torch.empty((), dtype=getattr(torch, d)).element_size()
    ).astype("int64")
    return float((t["numel"].astype("int64") * size).sum()) / t["step"].nunique()


def bench(work: Workload, modes, rounds: int, steps: int, out=print) -> dict:
    ms = build_modes(work, modes)
    out(f"\n== {work.describe}")
    times = {m: [] for m in modes}
    nexti = {m: 0 for m in modes}
    t_start = time.perf_counter()
    for r in range(rounds):
        order = list(modes[r % len(modes):]) + list(modes[: r % len(modes)])
        for m in order:
            t, nexti[m] = run_block(work, ms[m], nexti[m], steps)
            times[m].append(t)
        print(f"   [{work.name}] round {r + 1}/{rounds}: "
              + ", ".join(f"{m} {1e3 * times[m][-1]:.0f} ms" for m in modes), file=sys.stderr)
    bench_s = time.perf_counter() - t_start

    # op / byte / sync counts: one more block per mode under the dispatch mode
    counts = {}
    for m in modes:
        c = OpCounter(flush_files=FLUSH_FILES)
        _, nexti[m] = run_block(work, ms[m], nexti[m], steps, counter=c)
        counts[m] = c

    same = all(
        torch.equal(a, b)
        for m in modes[1:]
        for a, b in zip(ms[modes[0]].model.state_dict().values(), ms[m].model.state_dict().values())
    )
    base = times["none"] if "none" in modes else None
    result = {}
    q1, med, q3 = quartiles(times[modes[0]])
    out(f"   {rounds} rounds x {len(modes)} modes x ({steps} timed + 1 warm-up) steps in "
        f"{bench_s:.0f} s; unhooked step: median {1e3 * statistics.median(base):.1f} ms "
        f"(IQR {1e3 * quartiles(base)[0]:.1f}-{1e3 * quartiles(base)[2]:.1f})")
    out(f"   {'mode':<12} {'ratio':>6} {'IQR':>13} {'best':>6} {'ms/step':>8} {'ops/step':>9} "
        f"{'+ops':>7} {'MB read':>8} {'+MB':>7} {'syncs':>6} {'instr.':>6} {'flush':>5}")
    n0 = counts["none"].total_ops() / steps if "none" in counts else 0
    b0 = counts["none"].total_bytes() / steps if "none" in counts else 0
    for m in modes:
        ratios = [t / b for t, b in zip(times[m], base)]
        q1, med, q3 = quartiles(ratios)
        best = min(times[m]) / min(base)
        c = counts[m]
        ops = c.total_ops() / steps
        mb = c.total_bytes() / steps / 1e6
        instr_syncs = (c.total_syncs("mpscope") + c.total_syncs("hf")) / steps
        flush_syncs = c.total_syncs("flush") / steps
        result[m] = dict(
            ratio=med, q1=q1, q3=q3, best=best, times=times[m], ms=1e3 * statistics.median(times[m]), ops=ops,
            extra_ops=ops - n0, mb=mb, extra_mb=mb - b0 / 1e6, syncs=c.total_syncs() / steps,
            instr_syncs=instr_syncs, flush_syncs=flush_syncs,
        )
        out(f"   {m:<12} {med:6.3f} {q1:6.3f}-{q3:6.3f} {best:6.3f} {1e3 * statistics.median(times[m]):8.1f} "
            f"{ops:9.0f} {ops - n0:7.0f} {mb:8.1f} {mb - b0 / 1e6:7.1f} "
            f"{c.total_syncs() / steps:6.1f} {instr_syncs:6.1f} {flush_syncs:5.1f}")
    out("   (ratio: step time / unhooked step time in the same round, median and IQR over rounds;"
        " best: fastest block / fastest unhooked block, less sensitive to other processes;"
        " ops, MB read (bytes spanned by the tensor inputs of every non-view ATen op) and host syncs are"
        " per step; +: above the unhooked step; instr.: syncs with mpscope's or HF's code on the"
        " stack outside the recorder's flush; flush: inside it)")
    for m in modes:
        c = counts[m]
        top = []
        for who in ("mpscope", "hf", "flush"):
            top += [f"{who}:{k} {v / steps:.0f}" for k, v in c.ops.get(who, Counter()).most_common(6)]
        if top:
            out(f"   {m} instrumentation ops/step: " + ", ".join(top))
        if c.sync_stacks:
            out(f"   {m} host syncs in instrumentation, e.g.: {c.sync_stacks[0]}")
    out(f"   weights bitwise identical across all modes after training: {'yes' if same else 'NO'}")
    if "full" in ms and ms["full"].last_run is not None:
        nbytes, rows, how = run_nbytes(ms["full"].last_run)
        per = nbytes / rows if rows else float("nan")
        out(f"   Run memory (full mode, last block: {rows} tensor rows): {nbytes / 1e3:.1f} kB, "
            f"{per:.0f} bytes per tensor row [{how}]")
        result["bytes_per_row"] = per
        rb = recorded_bytes_per_step(ms["full"].last_run)
        bw = read_bandwidth(work.device)
        floor_ms = 1e3 * rb / bw
        base_ms = 1e3 * min(base)
        out(f"   tensors read by one fully recorded step: {rb / 1e6:.1f} MB; read bandwidth "
            f"(torch.sum over 256 MB, best of 5) {bw / 1e9:.1f} GB/s -> floor of full recording "
            f"{floor_ms:.1f} ms/step = {1 + floor_ms / base_ms:.3f}x the fastest unhooked block "
            f"(the +MB column sees only ATen ops, not a custom kernel)")
        result["floor_ratio"] = 1 + floor_ms / base_ms
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="blocks per mode (default 8)")
    ap.add_argument("--steps", type=int, default=10,
                    help="timed steps per block (default 10; keep a multiple of 10 for every10)")
    ap.add_argument("--models", default="gpt,conv", help="comma list of gpt, conv")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--quick", action="store_true", help="3 rounds (< 2 minutes on 2 CPU cores)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = ap.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(","))
    bad = [m for m in modes if m not in MODES]
    if bad or "none" not in modes:
        ap.error(f"--modes must include 'none' and only use {', '.join(MODES)}; got {args.modes!r}")
    if modes[0] != "none":
        modes = ("none",) + tuple(m for m in modes if m != "none")
    rounds = 3 if args.quick else args.rounds
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"mpscope overhead benchmark: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"python {platform.python_version()}, mpscope {mpscope.__version__}, "
          f"load average {os.getloadavg()[0]:.2f} (other processes share these CPUs)")
    if args.device.startswith("cuda"):
        print(f"device: {torch.cuda.get_device_name()} (capability "
              f"{'.'.join(map(str, torch.cuda.get_device_capability()))}), {time.strftime('%Y-%m-%d')}")
    print(f"command: python benchmarks/overhead.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    results = {}
    makers = {"gpt": gpt_workload, "conv": conv_workload}
    for name in args.models.split(","):
        name = name.strip()
        if name not in makers:
            ap.error(f"--models: unknown model {name!r}; choose from {', '.join(makers)}")
        work = makers[name](n_batches=args.steps + 1, device=args.device)
        results[name] = bench(work, modes, rounds, args.steps)
    summary = {
        name: {m: round(r[m]["ratio"], 3) for m in modes} for name, r in results.items()
    }
    for name, r in results.items():
        if "hf_debug" in r and "hf_coverage" in r:
            over_hf = r["hf_debug"]["ratio"] - 1
            over_cov = r["hf_coverage"]["ratio"] - 1
            summary[name]["hf_overhead_over_cov_overhead"] = (
                round(over_hf / over_cov, 2) if over_cov > 0 else None
            )
        if "bytes_per_row" in r:
            summary[name]["bytes_per_row"] = round(r["bytes_per_row"], 1)
        summary[name]["instr_syncs_per_step"] = {
            m: round(r[m]["instr_syncs"], 2) for m in modes if m != "none"
        }
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if "gpt" in results:
        r = results["gpt"]
        print("== targets (small GPT)")
        print(f"   {'target':30s} {'measured':>9s} {'IQR':>13s}  status")
        for m, lim in (("full", 1.07), ("every10", 1.02)):
            if m in r:
                ok = "met" if r[m]["ratio"] <= lim else "NOT met"
                print(f"   {m + ' recording <= ' + str(lim) + 'x':30s} {r[m]['ratio']:8.3f}x "
                      f"{r[m]['q1']:6.3f}-{r[m]['q3']:.3f}  {ok}")
        if "full" in r and "full_out" in r:  # writing to disk: the same rounds' blocks, paired
            q1, med, q3 = quartiles([a / b for a, b in zip(r["full_out"]["times"], r["full"]["times"])])
            print(f"   {'full_out / full <= 1.02x':30s} {med:8.3f}x {q1:6.3f}-{q3:.3f}  {'met' if med <= 1.02 else 'NOT met'}")
        if "bytes_per_row" in r:
            print(f"   {'bytes per tensor row <= 100':30s} {r['bytes_per_row']:9.0f}  "
                  f"{'met' if r['bytes_per_row'] <= 100 else 'NOT met'}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
