"""IPython magics: ``%%mpscope`` around a training cell, and ``%mpscope`` line commands.

Imported only by ``%load_ext mpscope`` (``mpscope.load_ipython_extension``).

Cell form (must be the cell's first line)::

    %%mpscope MODEL [--optimizer OPT] [--scaler SCALER] [--every N] [--hist-every N] [--modules REGEX]
                    [--ops] [-o VAR] [-q] [--export PATH] [--tensorboard DIR] [--apply]
    <the training-loop cell, unchanged>

``--tensorboard DIR`` also writes the Run as TensorBoard events into DIR (``run.to_tensorboard``;
needs ``pip install 'mpscope[tensorboard]'``, checked before the cell runs). With ``%mpscope attach``
the events are written at ``%mpscope detach``.

``--apply`` re-runs the cell with the last run's recommendation applied (``mpscope.apply``): the
new Run goes to VAR, the previous one to ``VAR_before``, and a before/after table (skipped steps,
non-finite rows, loss, error findings cleared) to ``VAR_round_trip``. It first puts back what the
last run started from (``mpscope.start_state``, kept in host memory by every cell up to 4 GiB): the
model's weights, buffers and gradients, the optimizers holding its parameters and their LR
schedulers, the GradScaler the cell used, the random streams (torch, CUDA, random, NumPy, generators
the cell names); then the recommended GradScaler settings. It says what it cannot put back: an
iterator made outside the cell (re-create it in the cell), an optimizer or scaler not found among
the notebook's names (name it with --optimizer / --scaler), all of it above the size limit. The
last run must be of the same model (module names, classes and parameter count), else nothing runs.
If the cell raises, the recommendation is undone, the previous run stays in VAR and the partial one
goes to ``VAR_applied``. VAR (``-o``) is a Python name.

Line forms::

    %mpscope attach MODEL [--optimizer OPT] [--scaler SCALER] [--every N] [--modules REGEX] [-o VAR]
                          [--tensorboard DIR]
    %mpscope detach        %mpscope status
    %mpscope explore [RUN]  %mpscope advise [RUN]  %mpscope export PATH [--format F] [RUN]
    %mpscope compare RUN_A RUN_B
    %mpscope help [SUBCOMMAND]   (also %mpscope -h, %mpscope attach -h, %%mpscope -h)

MODEL, OPT, SCALER and RUN are names (or expressions) in the notebook's namespace. Without
``--optimizer`` / ``--scaler`` the recorder adopts the optimizer that steps MODEL's parameters and the
GradScaler that the cell uses, whether they exist before the cell (the single one in the namespace)
or are created by it: re-running a cell that builds a new optimizer never records a stale one.
The Run is stored as ``_mpscope`` (or ``-o VAR``).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import keyword
import shlex
import weakref

import numpy as np
import torch
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display
from torch.amp import GradScaler

from mpscope import kernel
from mpscope.advisor import advise, try_advise
from mpscope.applying import apply, round_trip
from mpscope.comparison import compare
from mpscope.compiled import modules as compiled_modules
from mpscope.distributed import type_name
from mpscope.recorder import Recorder, RecorderError, record
from mpscope.run import Run
from mpscope.schema import EXPORT_FORMATS, ExportFormat
from mpscope.start_state import StartState
from mpscope.summary import html_summary, text_summary
from mpscope.tensorboard import summary_writer_class
from mpscope.widgets import explore

DEFAULT_VAR = "_mpscope"


class _Help(Exception):
    """``-h`` / ``--help`` was asked for: the text to print (not an error)."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line: IPython shows a UsageError as one message, no traceback
        raise UsageError(_one_line(f"{message}; usage: {self.format_usage().strip().removeprefix('usage: ')}"))

    def exit(self, status=0, message=None):  # -h
        raise _Help(self.format_help())


def _record_parser(prog: str) -> _Parser:
    p = _Parser(prog=prog, add_help=True)
    p.add_argument("model", help="name of the torch.nn.Module in the notebook")
    p.add_argument("--optimizer", help="name of the optimizer (default: the only one, or the one the cell creates)")
    p.add_argument("--scaler", help="name of the GradScaler (default: the only one, or the one the cell creates)")
    p.add_argument("--every", type=int, default=1, help="record every N-th step (default 1)")
    p.add_argument("--hist-every", type=int, default=1, help="take exponent histograms every N-th recorded step")
    p.add_argument("--modules", help="regex selecting module names")
    p.add_argument("--ops", action="store_true", help="also record every op's output (role op_output)")
    p.add_argument("-o", "--out", default=DEFAULT_VAR, type=_variable,
                   help=f"variable to store the Run in, a Python name (default {DEFAULT_VAR})")
    p.add_argument("-q", "--quiet", action="store_true", help="don't display the recommendation and explorer")
    p.add_argument("--export", metavar="PATH", help="also export the recommended config to PATH (format from the suffix)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write the run as TensorBoard events into DIR (pip install 'mpscope[tensorboard]')")
    p.add_argument("--apply", action="store_true",
                   help="re-run the cell with the last run's recommendation applied (mpscope.apply), from the "
                        "weights, optimizer, scaler and random state the last run started from, and show both "
                        "runs side by side; the previous run stays in VAR_before")
    return p


def _variable(name: str) -> str:
    """``-o NAME``: a Python identifier that is not a keyword (the Run is stored under it, and
    ``%mpscope advise NAME`` reads it back as an expression)."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise argparse.ArgumentTypeError(f"{name!r} is not a Python variable name; pass e.g. -o run1")
    return name


def _line_parsers() -> dict[str, _Parser]:
    ps = {"attach": _record_parser("%mpscope attach")}
    for name in ("detach", "status"):
        ps[name] = _Parser(prog=f"%mpscope {name}")
    for name in ("explore", "advise"):
        ps[name] = _Parser(prog=f"%mpscope {name}")
        ps[name].add_argument("run", nargs="?", default=None, help=f"a Run in the notebook (default {DEFAULT_VAR})")
    ex = ps["export"] = _Parser(prog="%mpscope export")
    ex.add_argument("path")
    ex.add_argument("run", nargs="?", default=None)
    ex.add_argument("--format", "-f", choices=EXPORT_FORMATS, default=None, help="default: from the file suffix")
    cmp = ps["compare"] = _Parser(prog="%mpscope compare")
    cmp.add_argument("run_a")
    cmp.add_argument("run_b")
    return ps


def _format_from_suffix(path: str) -> str:
    """The export format a file name asks for: ``.py`` torch, ``.json`` json, ``.yaml``/``.yml`` yaml.

    Raises:
        UsageError: any other suffix (naming the formats and ``--format``), never a silent JSON.
    """
    fmt = ExportFormat.from_path(path)
    if fmt is None:
        raise UsageError(
            f"cannot tell the export format from {path!r}: use a .py (torch), .json or .yaml file, or name "
            f"it with --format {{{','.join(EXPORT_FORMATS)}}}, e.g. %mpscope export {path} --format accelerate")
    return fmt.value


def _size(nbytes: int) -> str:
    """``nbytes`` in words: ``3.2 GiB``, ``512 KiB``."""
    for unit, power in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 2**power:
            return f"{nbytes / 2**power:.3g} {unit}"
    return f"{nbytes} bytes"


def _check_tensorboard(logdir: str | None) -> None:
    """``--tensorboard DIR``: the tensorboard package is installed (before any training runs).

    Raises:
        UsageError: it is not; the message says what to install.
    """
    if logdir is None:
        return
    try:
        summary_writer_class()
    except ImportError as e:
        raise UsageError(f"--tensorboard {logdir}: {_one_line(e)}") from None


def _write_tensorboard(run, logdir: str | None, quiet: bool) -> None:
    """``--tensorboard DIR``: write ``run``'s events into DIR; a failure is printed (the run is stored)."""
    if logdir is None:
        return
    try:
        run.to_tensorboard(logdir)
    except (OSError, ImportError, ValueError) as e:
        print(f"mpscope: could not write TensorBoard events to {logdir!r} ({type(e).__name__}: {_one_line(e)}); "
              "the run is stored.")
        return
    if not quiet:
        print(f"mpscope: wrote TensorBoard events to {logdir} (tensorboard --logdir {logdir}).")


#: ``%mpscope help``: the module docstring without its note on how it is imported.
HELP = __doc__.split("Imported only by", 1)[0].strip() + "\n\nCell form" + __doc__.split("Cell form", 1)[1].rstrip()


@magics_class
class MpscopeMagics(Magics):
    """``%%mpscope`` / ``%mpscope``: see the module docstring."""

    def __init__(self, shell):
        super().__init__(shell)
        self._attached: Recorder | None = None
        self._attached_var = DEFAULT_VAR
        self._attached_tensorboard: str | None = None
        self._start: tuple | None = None  # (weakref to the last cell run, the StartState it started from)

    # --------------------------------------------------------------- name resolution
    def _eval(self, expr: str, what: str, hint: str):
        try:
            return eval(expr, self.shell.user_global_ns, self.shell.user_ns)  # noqa: S307 (user's own names)
        except NameError:
            raise UsageError(f"{what} {expr!r} is not defined in this notebook. {hint}") from None
        except SyntaxError:
            raise UsageError(f"{what} {expr!r} is not a Python name or expression. {hint}") from None

    def _model(self, expr: str) -> torch.nn.Module:
        hint = "Pass the variable that holds your torch.nn.Module, e.g. `%%mpscope model`."
        model = self._eval(expr, "model", hint)
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"{expr!r} is a {type(model).__name__}, not a torch.nn.Module. {hint}")
        return model

    def _optimizer(self, expr):
        if expr:
            opt = self._eval(expr, "optimizer", "Pass the torch.optim.Optimizer's variable name.")
            if not isinstance(opt, torch.optim.Optimizer):
                raise UsageError(f"--optimizer {expr!r} is a {type(opt).__name__}, not a torch.optim.Optimizer.")
            return opt
        return None  # adopted when it first steps this model (Recorder auto mode)

    def _scaler(self, expr):
        if expr:
            s = self._eval(expr, "scaler", "Pass the torch.amp.GradScaler's variable name.")
            if not isinstance(s, GradScaler):
                raise UsageError(f"--scaler {expr!r} is a {type(s).__name__}, not a torch.amp.GradScaler.")
            return s
        return None  # adopted when the cell first uses it (Recorder auto mode)

    def _run(self, expr):
        name = expr or self._attached_var  # the last recorded run's variable
        if expr is None and name not in self.shell.user_ns:
            raise UsageError("no run yet: record one with a `%%mpscope MODEL` cell, or pass a Run: %mpscope advise RUN.")
        run = self._eval(name, "run", "Pass a mpscope.Run (the -o variable of %%mpscope, default _mpscope).")
        if isinstance(run, Recorder):
            run = run.run
        if not isinstance(run, Run):
            raise UsageError(f"{name!r} is a {type(run).__name__}, not a mpscope.Run.")
        return run

    def _recorder(self, args) -> Recorder:
        if args.every < 1:
            raise UsageError(f"--every must be >= 1; got {args.every}. Example: --every 10")
        model = self._model(args.model)
        try:
            return record(
                model,
                optimizer=self._optimizer(args.optimizer),
                scaler=self._scaler(args.scaler),
                every=args.every,
                hist_every=args.hist_every,
                modules=args.modules,
                ops=args.ops,
                auto=True,
            )
        except RecorderError as e:
            raise UsageError(_one_line(e)) from None

    # --------------------------------------------------------------- the magic
    @line_cell_magic
    def mpscope(self, line: str, cell: str | None = None):
        """Profile a mixed-precision training cell; see ``mpscope.magic`` for the syntax.

        %%mpscope MODEL [--optimizer OPT] [--scaler SCALER] [--every N] [--hist-every N] [--modules REGEX] [--ops] [-o VAR] [-q] [--export PATH] [--tensorboard DIR] [--apply]
        %mpscope attach MODEL [...] | detach | status | explore [RUN] | advise [RUN] | export PATH [--format F] [RUN] | compare A B | help
        """
        try:
            argv = shlex.split(line)
        except ValueError as e:  # an unclosed quote
            raise UsageError(f"cannot read the arguments {line!r}: {e}") from None
        try:
            return self._dispatch(argv, cell)
        except _Help as h:  # -h / --help / help: usage, printed (not an error)
            print(h.args[0])
            return None

    def _dispatch(self, argv: list[str], cell: str | None):
        if cell is not None:
            return self._cell(_record_parser("%%mpscope").parse_args(argv), cell)
        parsers = _line_parsers()
        if not argv or argv[0] in ("-h", "--help", "help"):
            if len(argv) > 1 and argv[0] == "help" and argv[1] in parsers:
                parsers[argv[1]].parse_args(["-h"])  # raises _Help with that subcommand's usage
            raise _Help(HELP + "\n\n" + _record_parser("%%mpscope").format_help())
        if argv[0] not in parsers:
            close = difflib.get_close_matches(argv[0], list(parsers), n=1, cutoff=0.5)
            hint = f"did you mean `%mpscope {close[0]}`? " if close else ""
            raise UsageError(
                f"unknown subcommand {argv[0]!r}; {hint}use one of: "
                + ", ".join(f"%mpscope {k}" for k in parsers)
                + ", or `%%mpscope MODEL` as the first line of a training cell (%mpscope help for more)."
            )
        args = parsers[argv[0]].parse_args(argv[1:])
        return getattr(self, f"_cmd_{argv[0]}")(args)

    def _cell(self, args, cell: str):
        if self._attached is not None:
            raise UsageError("a recorder is attached with `%mpscope attach`; run `%mpscope detach` first.")
        if args.export:
            _format_from_suffix(args.export)  # a bad suffix fails before the training runs
        _check_tensorboard(args.tensorboard)  # so does a missing tensorboard package
        before, before_advice, start = self._before(args) if args.apply else (None, None, None)
        reads, writes = self._names(cell)
        rec = self._recorder(args)
        model = self._model(args.model)
        applied, taken = None, False
        if args.apply:
            scalers = list(start.objects("scalers").values()) if start is not None else []
            if args.scaler and not any(s is self._scaler(args.scaler) for s in scalers):
                scalers.append(self._scaler(args.scaler))
            try:
                applied = apply(model, before_advice, scalers=scalers)
            except ValueError as e:  # ApplyError: the recommendation does not fit this model
                raise UsageError(_one_line(e)) from None
            self._restart(args, model, start, reads, writes)  # before apply: its scaler settings win
            applied.__enter__()
        else:
            self._start = None  # one start kept at a time: the last one is freed before the next is taken
        try:
            try:
                rec.__enter__()
            except RecorderError as e:
                raise UsageError(_one_line(e)) from None
            try:
                if start is not None:
                    start.restore_random()  # last, so the cell draws what the last run drew
                else:  # (with --apply: the last run's start was not kept) this run's start
                    start, taken = self._take(args, model, reads), True
                result = self.shell.run_cell(cell, store_history=False)
            finally:
                rec.__exit__(None, None, None)
        finally:
            if applied is not None:
                applied.__exit__(None, None, None)
        if taken:
            self._settle(start, rec, writes)
        failed = result is not None and not result.success
        if before is not None and failed:  # the previous run stays; the partial applied one is kept aside
            self.shell.user_ns[f"{args.out}_applied"] = rec.run
            print(f"mpscope: the cell raised under --apply; the recommendation was undone, the previous run stays "
                  f"in {args.out} and the {len(rec.run.steps)} step(s) recorded with it applied are in "
                  f"{args.out}_applied.")
            return None
        if before is not None:
            self.shell.user_ns[f"{args.out}_before"] = before
        self.shell.user_ns[args.out] = rec.run
        self._attached_var = args.out
        if start is not None:
            self._start = (weakref.ref(rec.run), start)  # an applied run started where its previous one did
        advice = self._finish(rec.run, quiet=args.quiet, export=args.export, tensorboard=args.tensorboard)
        if before is not None:
            table = round_trip(before, rec.run, before_advice, advice)
            self.shell.user_ns[f"{args.out}_round_trip"] = table
            if not args.quiet:
                display(table)
                try:
                    display(compare(before, rec.run))
                except Exception as e:  # runs too different to align step by step
                    print(f"mpscope: compare unavailable ({type(e).__name__}: {e}).")
        if failed:
            print(f"mpscope: the cell raised; the {len(rec.run.steps)} step(s) recorded before it are in {args.out}.")
        return None

    # --------------------------------------------------------------- the start a re-run restores
    def _names(self, cell: str) -> tuple[set[str], set[str]]:
        """(names the cell's code reads, names it assigns); both empty when it cannot be parsed."""
        try:
            tree = ast.parse(self.shell.transform_cell(cell))
        except (SyntaxError, ValueError):
            return set(), set()
        reads, writes = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                (reads if isinstance(node.ctx, ast.Load) else writes).add(node.id)
        return reads, writes

    def _found(self, kind) -> dict:
        """``{name: object}`` of the notebook's public names holding a ``kind`` (each object once)."""
        seen, found = set(), {}
        for name, obj in list(self.shell.user_ns.items()):
            if not name.startswith("_") and isinstance(obj, kind) and id(obj) not in seen:
                seen.add(id(obj))
                found[name] = obj
        return found

    def _take(self, args, model: torch.nn.Module, reads: set[str]) -> StartState:
        """What this cell starts from: ``model``, the optimizers holding its parameters (or
        ``--optimizer``), their LR schedulers, the GradScalers (or ``--scaler``; pruned to the one
        the cell used by :meth:`_settle`), the generators the cell names and the random streams."""
        mine = {id(p) for p in model.parameters()}
        if args.optimizer:
            optimizers = {args.optimizer: self._optimizer(args.optimizer)}
        else:
            optimizers = {n: o for n, o in self._found(torch.optim.Optimizer).items()
                          if any(id(p) in mine for g in o.param_groups for p in g["params"])}
        held = {id(o) for o in optimizers.values()}
        schedulers = {n: s for n, s in self._found(torch.optim.lr_scheduler.LRScheduler).items()
                      if id(getattr(s, "optimizer", None)) in held}
        scalers = {args.scaler: self._scaler(args.scaler)} if args.scaler else self._found(GradScaler)
        generators = {}
        ns = self.shell.user_ns
        for name in sorted(reads):
            obj = ns.get(name)
            if isinstance(obj, (torch.Generator, np.random.Generator)):
                generators[name] = obj
            elif isinstance(obj, torch.utils.data.DataLoader):  # one that shuffles with its own generator
                for where, owner in ((f"{name}.generator", obj), (f"{name}.sampler.generator", obj.sampler)):
                    if isinstance(getattr(owner, "generator", None), torch.Generator):
                        generators[where] = owner.generator
        return StartState.take(model, optimizers, scalers, schedulers, generators)

    def _settle(self, start: StartState | None, rec: Recorder, writes: set[str]) -> None:
        """After a cell: keep the GradScaler it used, forget objects it replaced, and note the
        optimizer / scaler the recorder adopted that was made before the cell but not found."""
        if start is None or not start.kept:
            return
        ns = self.shell.user_ns
        start.keep_scalers([rec.scaler] if rec.scaler is not None else [])
        for kind in ("optimizers", "schedulers"):
            start.forget([n for n, o in start.objects(kind).items() if ns.get(n) is not o])
        for obj, kind, option in ((rec.optimizer, "optimizers", "--optimizer"), (rec.scaler, "scalers", "--scaler")):
            if obj is None or any(o is obj for o in start.objects(kind).values()):
                continue
            if any(ns.get(n) is obj for n in writes):
                continue  # the cell makes it: a re-run makes it afresh
            what = "optimizer" if kind == "optimizers" else "GradScaler"
            start.notes.append(
                f"the {what} the cell used ({type(obj).__name__}) was not among the notebook's names when the cell "
                f"started, so its state was not kept: if the cell does not create it, name it with {option} EXPR "
                "(an expression such as trainer.opt works)")

    def _restart(self, args, model, start: StartState | None, reads: set[str], writes: set[str]) -> None:
        """(``--apply``) Put back what the last run started from (random streams excepted: they
        are put back right before the cell), and say once what cannot be."""
        again = ("to compare from the same start, re-create them (re-run the cells that build the model and "
                 "optimizer and seed the random generators), record the cell once without --apply, then --apply")
        missing = []
        if start is None:
            missing.append("the last run's start was not kept (it was recorded with `%mpscope attach`), so the "
                           f"re-run goes on from the current weights, optimizer and random state; {again}")
        elif not start.kept:
            missing.append(f"the last run's start was not kept: its tensors take {_size(start.nbytes)}, over the "
                           f"{_size(start.limit)} limit of mpscope.start_state.LIMIT_BYTES (host memory), so the "
                           f"re-run goes on from the current weights, optimizer and random state; {again}")
        else:
            missing += start.restore(model) + start.notes
        ns = self.shell.user_ns
        for name in sorted(reads - writes):
            obj = ns.get(name)
            if hasattr(obj, "__next__") and not isinstance(obj, type):
                missing.append(
                    f"`{name}` is an iterator made outside the cell: it goes on from where the last run left it "
                    f"and cannot be rewound, so the re-run sees other data (and its first loss differs for that "
                    f"reason alone); re-create it as the cell's first line (`{name} = ...`, with the call that made it), "
                    f"or re-run the cell that makes it before --apply")
        if missing:
            lines = "\n".join(f"  - {m}." for m in missing)
            kept = f"restored {start.describe()}; " if start is not None and start.kept else ""
            print(f"mpscope: --apply: {kept}not restored:\n{lines}")
        elif not args.quiet:
            print(f"mpscope: --apply: restored {start.describe()}, as the last run started.")

    def _before(self, args):
        """(``--apply``) The last run, its recommendation and the StartState it started from (None
        when not kept), checked to be of this cell's model.

        Raises:
            UsageError: no run yet, or the last run recorded another model (other module names or
                classes, or another parameter count).
        """
        if self._attached_var not in self.shell.user_ns:
            raise UsageError("--apply re-runs the cell with the last recommendation: record the cell once first "
                             "with `%%mpscope MODEL`, then run it again with `%%mpscope MODEL --apply`.")
        before = self._run(None)
        recorded = before.meta.get("module_types") or {}
        model = self._model(args.model)
        here = {name: type_name(m) for name, m in compiled_modules(model)}
        count = before.meta.get("param_count")
        if recorded and recorded != here or count is not None and count != sum(p.numel() for p in model.parameters()):
            differ = sorted(k for k in set(recorded) | set(here) if recorded.get(k) != here.get(k))[:3]
            raise UsageError(f"--apply: the last run ({self._attached_var}) recorded another model than {args.model!r} "
                             f"(modules {differ or 'alike'} differ, parameters {count} here "
                             f"{sum(p.numel() for p in model.parameters())}); record {args.model} once without "
                             "--apply first.")
        last, start = self._start if self._start is not None else (lambda: None, None)
        return before, advise(before), start if last() is before else None

    def _finish(self, run, quiet: bool, export: str | None, tensorboard: str | None = None):
        _write_tensorboard(run, tensorboard, quiet)
        advice, e = try_advise(run)
        if e is not None:  # a broken advisor must not lose the recorded run
            print(f"mpscope: the advisor failed ({type(e).__name__}: {e}); the run is stored.")
        if export and advice is not None:
            try:
                advice.export(export, format=_format_from_suffix(export))
            except (OSError, ValueError) as e:
                print(f"mpscope: could not export to {export!r} ({type(e).__name__}: {_one_line(e)}); the run is stored.")
        if not quiet:
            display({"text/plain": text_summary(run, advice), "text/html": html_summary(run, advice)}, raw=True)
            try:
                display(explore(run, advice=advice))
            except Exception as e:  # the explorer needs the notebook extra
                print(f"mpscope: explorer unavailable ({type(e).__name__}: {e}); pip install 'mpscope[notebook]'.")
        return advice

    def _cmd_attach(self, args):
        if self._attached is not None:
            raise UsageError("already attached; run `%mpscope detach` first.")
        _check_tensorboard(args.tensorboard)
        rec = self._recorder(args)
        try:
            rec.attach()
        except RecorderError as e:
            raise UsageError(_one_line(e)) from None
        self._attached, self._attached_var = rec, args.out
        self._attached_tensorboard = args.tensorboard
        self.shell.user_ns[args.out] = rec.run
        print(f"mpscope: attached to {args.model}; the Run fills {args.out}. `%mpscope detach` when done.")

    def release(self) -> None:
        """Detach what ``%mpscope attach`` attached, if anything (the extension is unloaded)."""
        if self._attached is not None:
            rec, self._attached = self._attached, None
            rec.__exit__(None, None, None)

    def _cmd_detach(self, args):
        if self._attached is None:
            print("mpscope: nothing attached.")
            return
        rec, self._attached = self._attached, None
        rec.__exit__(None, None, None)
        print(f"mpscope: detached; {len(rec.run.steps)} steps in {self._attached_var}.")
        tensorboard, self._attached_tensorboard = self._attached_tensorboard, None
        _write_tensorboard(rec.run, tensorboard, quiet=False)

    def _cmd_status(self, args):
        if self._attached is None:
            last = self.shell.user_ns.get(self._attached_var)
            if isinstance(last, Run):
                steps = last.steps
                rec = int(steps["recorded"].sum()) if "recorded" in steps and len(steps) else len(steps)
                print(f"mpscope: nothing attached. The last Run is {self._attached_var}: "
                      f"{last.meta.get('model', '?')}, {len(steps)} steps ({rec} recorded), "
                      f"{len(last.tensors):,} tensor rows; `%mpscope explore` or `%mpscope advise` show it.")
            else:
                print("mpscope: nothing attached and no Run yet; record one with a `%%mpscope MODEL` cell.")
        else:
            r = self._attached
            print(f"mpscope: attached to {r.run.meta.get('model')}, step {r.step_index}, "
                  f"{len(r.run.steps)} steps recorded into {self._attached_var}.")

    def _cmd_explore(self, args):
        run = self._run(args.run)
        display(explore(run))

    def _cmd_advise(self, args):
        advice = advise(self._run(args.run))
        display(advice)
        return None

    def _cmd_export(self, args):
        fmt = args.format or _format_from_suffix(args.path)
        advice = advise(self._run(args.run))
        try:
            path = advice.export(args.path, format=fmt)
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot write {args.path!r}: {type(e).__name__}: {_one_line(e)}") from None
        print(f"mpscope: wrote the {fmt} config to {path or args.path}")

    def _cmd_compare(self, args):
        comparison = compare(self._run(args.run_a), self._run(args.run_b), labels=(args.run_a, args.run_b))
        display(comparison)


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(MpscopeMagics)
    # The fused CPU stats kernel: a cached binary is loaded now; on a cold cache its build starts
    # in the background now (announced on stderr) rather than when a cell first records, so a
    # notebook's training cells usually find it ready (mpscope.kernel.current never waits).
    kernel.current()


def unload_ipython_extension(ipython) -> None:
    magics = ipython.magics_manager.registry.get("MpscopeMagics")
    if magics is not None:
        magics.release()
