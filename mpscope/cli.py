"""Command line: ``mpscope demo | report | advise | compare | build-kernel``.

* ``mpscope demo [--steps N] [--dtype float16|bfloat16] [--device auto|cpu|cuda] [--out DIR] [--every N] [-q]``:
  train the embedded character-level GPT on Python's own source text under autocast, record it,
  save the run to ``DIR/run``, print the summary and the recommendation, write the config.
* ``mpscope report RUN_DIR [-o report.html] [--rank N] [-q]``: standalone HTML report of a saved run
  (``--rank N``: rank N's own rows of a multi-rank ``out=`` directory), with a progress bar on stderr
  once it takes more than half a second (``-q``: none).
* ``mpscope advise RUN_DIR [--format F] [-o PATH] [--rank N]``: print the recommendation, or export it.
  Without ``--format``, ``-o PATH``'s suffix decides: ``.py`` torch, ``.json`` json, ``.yaml`` /
  ``.yml`` yaml, ``.txt`` text (the printed recommendation); any other suffix asks for ``--format``.
* ``mpscope compare RUN_A RUN_B [--tol T] [--frac-tol F] [--rank N]``: print where two saved runs part
  (the text of ``mpscope.compare(Run.load(RUN_A), Run.load(RUN_B)).to_text()``, the directories as
  the runs' labels); how the runs differ besides their numbers is also printed, one
  ``mpscope: warning:`` line each on stderr. Exit code 0 whether or not they diverge.
* ``mpscope build-kernel [--force]``: build the fused CPU stats kernel for this environment ahead
  of time (container images, CI) into its cache (``$MPSCOPE_CACHE_DIR``, default
  ``~/.cache/mpscope/kernels``); prints the binary's path and what its cache key covers.

Exit codes: 0 on success, 2 on bad usage or an unreadable or invalid run directory, 1 when the demo
itself fails or the kernel cannot be built; always one line on stderr (``MPSCOPE_TRACEBACK=1`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from mpscope import kernel, launch
from mpscope.advisor import advise
from mpscope.comparison import compare
from mpscope.demo import run_demo
from mpscope.recorder import RecorderError
from mpscope.report import write_report
from mpscope.run import Run, RunFileError
from mpscope.schema import EXPORT_FORMATS, ExportFormat

FORMATS = ("text", *EXPORT_FORMATS)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpscope", description="Mixed-precision profiler for PyTorch training.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("run", add_help=False, help="profile a training script without editing it (mpscope run -h)")

    d = sub.add_parser("demo", help="profile the embedded small GPT on real text")
    d.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's own, < 3 min on 2 CPU cores)")
    d.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16", help="autocast dtype (default float16, with a GradScaler)")
    d.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when available")
    d.add_argument("--out", default="mpscope-demo", help="output directory (default ./mpscope-demo)")
    d.add_argument("--every", type=int, default=1, help="record every N-th step")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no report; one line says where the files are")

    r = sub.add_parser("report", help="write a standalone HTML report of a saved run")
    r.add_argument("run_dir")
    r.add_argument("-o", "--output", default="report.html")
    r.add_argument("--rank", type=int, default=None, help="a multi-rank run's directory: report rank N's own rows")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar; only the line naming the file")

    a = sub.add_parser("advise", help="print or export the recommendation for a saved run")
    a.add_argument("run_dir")
    a.add_argument("--format", "-f", choices=FORMATS, default=None,
                   help="default: text, or with -o the file's suffix (.py torch, .json json, .yaml/.yml yaml, .txt text)")
    a.add_argument("-o", "--output", default=None, help="file to write (required for every format but text)")
    a.add_argument("--rank", type=int, default=None, help="a multi-rank run's directory: advise on rank N's own rows")

    c = sub.add_parser("compare", help="print where two saved runs of the same model part")
    c.add_argument("run_a")
    c.add_argument("run_b")
    c.add_argument("--tol", type=float, default=0.1, help="relative tolerance on absmax and the loss (default 0.1)")
    c.add_argument("--frac-tol", type=float, default=None, help="absolute tolerance on the fractions (default: --tol)")
    c.add_argument("--rank", type=int, default=None, help="multi-rank runs' directories: compare rank N's own rows")

    k = sub.add_parser("build-kernel", help="build the fused CPU stats kernel ahead of time (images, CI)")
    k.add_argument("--force", action="store_true", help="rebuild even if this environment's binary is cached")
    return p


def _build_kernel(force: bool) -> int:
    if kernel.disabled():
        print(f"mpscope: MPSCOPE_KERNEL={os.environ.get('MPSCOPE_KERNEL')} is set: the kernel would not be used; "
              "unset it to build", file=sys.stderr)
        return 2
    spec = kernel.build_spec()
    try:
        path = kernel.build(force=force)
    except RuntimeError as e:
        print(f"mpscope: the kernel could not be built ({e}); recording will use the torch-op path. "
              "Install a C++ compiler and `pip install ninja`.", file=sys.stderr)
        return 1
    print(f"{path}\ncache key {kernel.cache_key(spec)} covers: "
          + ", ".join(f"{k}={v[:12] if k == 'source' else v}" for k, v in sorted(spec.items())))
    return 0


def _advise_format(fmt: str | None, output: str | None) -> str:
    """``mpscope advise``'s format: ``--format`` when given; else text without ``-o``; else the
    suffix of ``-o`` (the export mapping, :meth:`ExportFormat.from_path`, plus ``.txt`` for text).

    Raises:
        _Usage: a suffix that names no format.
    """
    if fmt is not None:
        return fmt
    if output is None or str(output).lower().endswith(".txt"):
        return "text"
    found = ExportFormat.from_path(output)
    if found is None:
        raise _Usage(f"cannot tell the format from {output!r}: use a .py (torch), .json (json), .yaml / .yml (yaml) "
                     f"or .txt (text) file, or name it with --format {{{','.join(FORMATS)}}}")
    return found.value


def _compare(args) -> int:
    run_a, run_b = Run.load(args.run_a), Run.load(args.run_b)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comparison = compare(run_a, run_b, tol=args.tol, frac_tol=args.frac_tol, labels=(args.run_a, args.run_b),
                             rank=args.rank)
    print(comparison.to_text())
    for w in caught:
        print(f"mpscope: warning: {w.message}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # everything after its options is the script's own command line
        return launch.main(argv[1:])
    args = _parser().parse_args(argv)

    if args.command == "advise" and args.format not in (None, "text") and not args.output:
        print(f"mpscope: --format {args.format} writes a file: add -o PATH", file=sys.stderr)
        return 2
    if args.command == "build-kernel":
        return _build_kernel(args.force)
    try:
        if args.command == "demo":
            kwargs = {"dtype": args.dtype, "device": args.device, "out": args.out, "every": args.every, "quiet": args.quiet}
            if args.steps is not None:
                if args.steps < 1:
                    raise _Usage(f"--steps must be >= 1; got {args.steps}")
                kwargs["steps"] = args.steps
            run_demo(**kwargs)
            if args.quiet:
                print(f"mpscope: run saved to {args.out}/run; recommended config in {args.out}/ "
                      f"(mpscope advise {args.out}/run to print it)")
            return 0
        if args.command == "report":
            path = write_report(Run.load(args.run_dir).for_rank(args.rank), args.output, progress=not args.quiet)
            print(f"wrote {path}")
            return 0
        if args.command == "compare":
            return _compare(args)
        if args.command == "advise":
            fmt = _advise_format(args.format, args.output)  # a bad suffix fails before the run is read
            advice = advise(Run.load(args.run_dir).for_rank(args.rank))
            if fmt == "text":
                text = advice.to_text()
                if args.output:
                    with open(args.output, "w") as f:
                        f.write(text + "\n")
                print(text)
                return 0
            if not args.output:
                raise _Usage(f"--format {fmt} writes a file: add -o PATH")
            path = advice.export(args.output, format=fmt)
            print(f"wrote {path or args.output}")
            return 0
    except (RunFileError, RecorderError, _Usage, ValueError, OSError) as e:
        # bad input: one line that says what to do, no traceback
        print(f"mpscope: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        # anything else is still one line (MPSCOPE_TRACEBACK=1 shows the traceback); on a saved
        # run it comes from that run's content, which is input too (exit 2)
        if os.environ.get("MPSCOPE_TRACEBACK"):
            raise
        what = ("run the demo" if args.command == "demo" else f"compare {args.run_a} {args.run_b}"
                if args.command == "compare" else f"{args.command} {args.run_dir}")
        print(f"mpscope: cannot {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              "(set MPSCOPE_TRACEBACK=1 to see where)", file=sys.stderr)
        return 1 if args.command == "demo" else 2
    return 2  # pragma: no cover


class _Usage(Exception):
    pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
