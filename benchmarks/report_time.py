"""How long does `mpscope report` take on a saved run, and how large is the file?

End to end: ``--repeat`` runs of ``python -m mpscope report RUN_DIR -o OUT -q`` in fresh processes
(wall time and the child's CPU time, median and range), then the file's size. Then, in this
process, the stages one report pays once: importing ``mpscope.cli`` (torch, pandas), importing
altair, ``Run.load``, ``mpscope.advise`` and ``render_report``, with the size of the inlined
JavaScript and of the charts' compressed specs. The Vega bundle is cached on disk by the first
report (``mpscope.kernel.cache_dir()``); ``--cold`` deletes it first, so the first run pays the
bundling (about 2 s).

The machine's load average is printed too: on a shared machine compare CPU times, not wall times.

Run:  mpscope demo --out /tmp/demo1 -q   # once, ~1 min: a 200-step run in /tmp/demo1/run
      python benchmarks/report_time.py /tmp/demo1/run [--repeat 3] [--cold]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's mpscope, in this process and (cwd) in the CLI's


def _cli_once(run_dir: str, out: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one ``mpscope report`` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mpscope", "report", run_dir, "-o", str(out), "-q"], check=True,
                   stdout=subprocess.DEVNULL, cwd=ROOT)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _stages(run_dir: str) -> None:
    def clock():
        return time.perf_counter(), time.process_time()

    def say(what, a, b):
        print(f"  {what:<28} wall {b[0] - a[0]:6.2f} s   CPU {b[1] - a[1]:6.2f} s")

    t0 = clock()
    import mpscope.cli  # noqa: F401  (torch, pandas, mpscope)
    t1 = clock()
    import altair  # noqa: F401
    t2 = clock()
    from mpscope.report import _specs_payload, _vega_bundle, embedded_specs, render_report
    from mpscope.run import Run
    from mpscope.widgets import _default_advice

    run = Run.load(run_dir)
    t3 = clock()
    advice, _ = _default_advice(run)
    t4 = clock()
    _vega_bundle()
    t5 = clock()
    text = render_report(run, advice=advice)
    t6 = clock()
    print("stages, in this process:")
    say("import mpscope.cli", t0, t1)
    say("import altair", t1, t2)
    say("Run.load", t2, t3)
    say("advise", t3, t4)
    say("Vega bundle (cached)", t4, t5)
    say("render_report", t5, t6)
    specs = embedded_specs(text)
    cells = sum(len(rows) for s in specs for rows in (s.get("datasets") or {}).values())
    print(f"  {len(run.tensors):,} tensor rows, {len(run.histograms):,} histogram rows, {len(run.steps)} steps")
    print(f"  page {len(text.encode()) / 1e6:.2f} MB: Vega JavaScript {len(_vega_bundle().encode()) / 1e6:.2f} MB, "
          f"{len(specs)} charts with {cells:,} data rows in {len(_specs_payload(specs)) / 1e6:.2f} MB of "
          "gzip + base64")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a saved run (mpscope demo --out DIR -q writes DIR/run)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="delete the cached Vega bundle before the first run")
    args = p.parse_args()
    if not (Path(args.run_dir) / "meta.json").exists():
        sys.exit(f"{args.run_dir} holds no run: make one with `mpscope demo --out DIR -q` and pass DIR/run")
    if args.cold:
        from mpscope.kernel import cache_dir

        for f in cache_dir().glob("vega-bundle-*.js"):
            f.unlink()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "report.html"
        runs = [_cli_once(args.run_dir, out) for _ in range(args.repeat)]
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        print(f"`python -m mpscope report {args.run_dir} -q`, {args.repeat} runs: wall median "
              f"{statistics.median(walls):.2f} s ({min(walls):.2f}–{max(walls):.2f}), CPU median "
              f"{statistics.median(cpus):.2f} s ({min(cpus):.2f}–{max(cpus):.2f}); first run wall {walls[0]:.2f} s; "
              f"file {out.stat().st_size / 1e6:.2f} MB")
    _stages(args.run_dir)


if __name__ == "__main__":
    main()
