"""``mpscope run``: profile a training script without editing it.

Usage::

    mpscope run [options] train.py ARGS...              # or: mpscope run [options] -- python train.py ARGS...
    python -m mpscope run [options] train.py ARGS...
    mpscope run [options] -- python -m package.train ARGS...
    torchrun --nproc-per-node 2 -m mpscope run [options] train.py ARGS...

Options (those of :func:`mpscope.record` and of ``%%mpscope``): ``--every N``, ``--hist-every N``,
``--modules REGEX``, ``--roles LIST`` (comma-separated), ``--ops``, ``--shadow``, ``--max-steps N``,
``--out DIR`` (default ``./mpscope-run``), ``--model-attr NAME`` / ``--model-class REGEX`` (which
model, where the script trains several), ``-q`` (no printed summary: one line says where the files
are), ``--no-report`` (no ``report.html``). Everything after the script's path (or after ``--``) is
the script's own command line.

How it runs the script: in this process, unchanged (``runpy``: ``__name__ == "__main__"``,
``sys.argv`` = the script and its arguments, the script's directory first on ``sys.path``). Training
is bitwise the same as without mpscope: mpscope only observes.

Which model: PyTorch's global hooks tell mpscope which modules ran a forward
(``register_module_forward_pre_hook``) and which optimizer steps first
(``register_optimizer_step_pre_hook`` / ``..._post_hook``). The model recorded is the outermost
module whose forward ran and which holds parameters that this optimizer steps (climbing to an
enclosing module with the very same parameters, e.g. a LightningModule around its network; where
the optimizer steps several modules that ran separately, their closest common parent). Plain loops,
``transformers.Trainer``, Lightning and Accelerate are all found this way; under DDP the model is
the ``DistributedDataParallel`` wrapper (rows carry the user's module names). Where that optimizer
steps parameters of several unrelated models, nothing is recorded and a message names them; choose
with ``--model-class REGEX`` (searched in the class name, outermost match) or ``--model-attr NAME``
(a name, dotted for attributes, e.g. ``trainer.model``, looked up in the script's frames and
globals at the optimizer step). A script whose other optimizers train other models is told which
at the end.

**The first optimizer step is not recorded.** It is how mpscope finds the model and its optimizer;
recording starts at the model's next call (``mpscope.record(model, optimizer=opt, auto=True,
...)``, which also adopts the GradScaler the script uses), so the Run's step 0 is the script's
second optimizer step (``run.meta["launch"]["optimizer_steps_before"]`` says how many steps went
before). Steps skipped by a GradScaler before the first real ``optimizer.step()`` are not recorded
either.

At the end (also when the script raises, calls ``sys.exit`` or is interrupted): the recorder is
detached, the Run is in ``--out`` (``mpscope.Run.load(out)``; written as recording goes, so a
killed process keeps its steps), ``--out/report.html`` is written, and the summary and the
recommendation are printed as ``mpscope demo`` prints them (the recommendation is also written to
``recommended_torch.py`` and ``recommendation.json`` there). A ``--out`` holding an earlier
recording is left alone: the run goes to ``out-1`` (``-2``, ...) beside it.

Under ``torchrun`` (the script initialises ``torch.distributed``) every rank records with the same
options and rank 0 writes and reports the merged Run (see :mod:`mpscope.distributed`); a script that
calls ``destroy_process_group()`` has its recording ended just before.

Exit code: the script's own (0; ``sys.exit(n)`` gives n; an exception prints its traceback, after
mpscope has saved what it recorded, and gives 1; Ctrl-C gives 130); 2 for bad mpscope options or a
script that does not exist.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import runpy
import sys
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook, register_module_module_registration_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from mpscope.advisor import try_advise
from mpscope.demo.training import write_recommendation  # `mpscope demo`'s own: the same files, the same line
from mpscope.distributed import fresh_sibling
from mpscope.recorder import RecorderError, check_options, record
from mpscope.run import MERGED_DIR, RankFiles, Run
from mpscope.summary import text_summary

__all__ = ["DEFAULT_OUT", "main"]

#: Where the Run goes without ``--out``.
DEFAULT_OUT = "mpscope-run"
#: Exit code of a run ended by Ctrl-C (as a shell reports a process ended by SIGINT).
INTERRUPTED = 130
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?(\.exe)?")


class _Usage(Exception):
    """Bad ``mpscope run`` usage: one line, exit code 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpscope run",
        description="Profile a training script without editing it: record the model the first optimizer "
                    "steps (from its second step on), then save, report and advise.",
        epilog="Examples: mpscope run --every 10 train.py --lr 3e-4 | mpscope run -- python train.py | "
               "torchrun --nproc-per-node 2 -m mpscope run train.py")
    p.add_argument("--every", type=int, default=1, help="record every N-th step (default 1)")
    p.add_argument("--hist-every", type=int, default=1, help="take exponent histograms every N-th recorded step")
    p.add_argument("--modules", metavar="REGEX", help="record only modules whose qualified name matches")
    p.add_argument("--roles", metavar="LIST", help="comma-separated roles (default: all), e.g. activation,param_grad")
    p.add_argument("--ops", action="store_true", help="also record every op's output (role op_output)")
    p.add_argument("--shadow", action="store_true", help="also compare each module with a float32 reference forward")
    p.add_argument("--max-steps", type=int, default=None, help="stop recording after N steps (training goes on)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default ./{DEFAULT_OUT})")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model-attr", metavar="NAME",
                       help="record the module bound to NAME in the script (dotted: trainer.model)")
    which.add_argument("--model-class", metavar="REGEX",
                       help="record the outermost trained module whose class name matches")
    p.add_argument("-q", "--quiet", action="store_true", help="no printed report: one line says where the files are")
    p.add_argument("--no-report", action="store_true", help="don't write report.html (its charts take a few seconds)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS] | -- python SCRIPT [ARGS]",
                   help="the training script and its arguments")
    return p


@dataclass
class _Target:
    """What to run: a script path or a module (``-m``), and its arguments."""

    kind: str  # "path" | "module"
    name: str
    args: list[str] = field(default_factory=list)
    unbuffered: bool = False

    def label(self) -> str:
        return self.name if self.kind == "path" else f"-m {self.name}"


def _target(command: list[str]) -> _Target:
    cmd = list(command)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        raise _Usage("name the script to run: mpscope run [options] train.py ARGS (or: -- python train.py ARGS)")
    unbuffered = False
    if _PYTHON.fullmatch(os.path.basename(cmd[0])) or os.path.realpath(cmd[0]) == os.path.realpath(sys.executable):
        cmd = cmd[1:]
        while cmd and cmd[0].startswith("-"):
            flag = cmd.pop(0)
            if flag == "-m" or (flag.startswith("-m") and len(flag) > 2):
                name = flag[2:] or (cmd.pop(0) if cmd else "")
                if not name:
                    raise _Usage("python -m needs a module name")
                return _Target("module", name, cmd, unbuffered)
            if flag == "-u":
                unbuffered = True
                continue
            raise _Usage(f"the interpreter option {flag} cannot be applied to a script mpscope runs in its own "
                         f"process: run `python {flag} -m mpscope run ...` instead")
        if not cmd:
            raise _Usage("name the script python should run: mpscope run -- python train.py ARGS")
    elif cmd[0] == "-m":
        if len(cmd) < 2:
            raise _Usage("-m needs a module name")
        return _Target("module", cmd[1], cmd[2:])
    if cmd[0].startswith("-"):
        raise _Usage(f"unknown option {cmd[0]} (mpscope run's options come before the script; see mpscope run -h)")
    return _Target("path", cmd[0], cmd[1:], unbuffered)


def _options(args) -> dict:
    """The ``record()`` keyword arguments, checked (a :class:`RecorderError` says what is wrong)."""
    roles = [r.strip() for r in args.roles.split(",") if r.strip()] if args.roles is not None else None
    options = dict(every=args.every, hist_every=args.hist_every, modules=args.modules, roles=roles,
                   max_steps=args.max_steps, ops=args.ops)
    check_options(**options)
    if args.model_class is not None:
        try:
            re.compile(args.model_class)
        except re.error as e:
            raise _Usage(f"--model-class {args.model_class!r} is not a regular expression ({e})") from None
    return dict(options, shadow=args.shadow)


def _rank() -> int:
    """This process's rank: torch.distributed's when initialised, else torchrun's ``RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _resolve_out(out: Path, rank: int) -> Path:
    """``out``, or ``out-1`` (``-2``, ...) beside it when ``out`` is a file or holds an earlier recording."""
    if RankFiles.problem(out, rank) is None and not (out / MERGED_DIR).exists():
        return out
    return fresh_sibling(out)


def _say(*lines: str) -> None:
    """mpscope's own messages (not the report): stderr, so the script's stdout stays its own."""
    for line in lines:
        print(line, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- finding the model
def _subtree(module: torch.nn.Module) -> set[int]:
    return {id(m) for m in module.modules()}


def _param_ids(module: torch.nn.Module) -> set[int]:
    return {id(p) for p in module.parameters()}


def _holds(module: torch.nn.Module, wanted: set[int]) -> bool:
    return any(id(p) in wanted for p in module.parameters())


def _outermost(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Those of ``modules`` inside none of the others (in the order given)."""
    subtrees = {id(m): _subtree(m) for m in modules}
    covered: set[int] = set()
    outer = []
    for m in sorted(modules, key=lambda m: -len(subtrees[id(m)])):  # a parent holds more than its children
        if id(m) not in covered:
            outer.append(m)
            covered |= subtrees[id(m)]
    order = {id(m): i for i, m in enumerate(modules)}
    return sorted(outer, key=lambda m: order[id(m)])


def _user_frame(filename: str) -> bool:
    """Whether a frame's file is the user's code (not the standard library, an installed package, or mpscope)."""
    if filename.startswith("<"):
        return False
    parts = Path(filename).parts
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    here = str(Path(__file__).resolve().parent)
    return not (filename.startswith(here) or filename.startswith(os.path.dirname(os.__file__)))


class _Attacher:
    """Finds the model the first optimizer steps, attaches a recorder from the model's next call
    on, and ends the recording; see the module docstring."""

    def __init__(self, options: dict, out: Path, script: str | None, model_attr: str | None,
                 model_class: str | None, command: list[str]):
        self.options, self.out, self.script = options, out, script
        self.model_attr, self.model_class, self.command = model_attr, model_class, command
        self.seen: dict[int, weakref.ref] = {}  # modules whose forward ran, in order of their first call
        self.parents: dict[int, list[weakref.ref]] = {}  # module -> the modules it was registered in
        self.steps: dict[int, int] = {}  # optimizer id -> steps taken (an entry once it began its first)
        self.examined: set[int] = set()
        self.model = self.optimizer = None
        self.model_label = ""
        self.recorder = None
        self.done = False  # the choice is made (a recorder attached or attaching), or given up
        self.armed = False
        self.stopped = False
        self.rank = 0
        self.problems: list[str] = []  # why nothing is recorded
        self.others: dict[int, str] = {}  # other models the script trains (id -> description)
        self.waiting: list[str] = []  # optimizers a --model-* choice did not match
        self._others_known: list[torch.nn.Module] = []  # (at the choice) the other models whose forward ran
        self._targets: set[int] = set()
        self._orig_call = None
        self._handles: dict[str, object] = {}
        self._patched: list[tuple[object, str, object]] = []

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        self._handles = {
            "forward": register_module_forward_pre_hook(self._forward_pre),
            "registration": register_module_module_registration_hook(self._registered),
            "step_pre": register_optimizer_step_pre_hook(self._step_pre),
            "step_post": register_optimizer_step_post_hook(self._step_post),
        }
        if dist.is_available():
            c10d = dist.distributed_c10d
            original = c10d.destroy_process_group

            def destroy_process_group(group=None, *args, **kwargs):
                if group is None:  # the whole job's: mpscope's last exchange needs it
                    self.stop()
                return original(group, *args, **kwargs)

            for obj in (dist, c10d):
                if getattr(obj, "destroy_process_group", None) is original:
                    self._patched.append((obj, "destroy_process_group", original))
                    obj.destroy_process_group = destroy_process_group

    def uninstall(self) -> None:
        """Remove mpscope's global hooks and patches (the recorder's own are removed by :meth:`stop`)."""
        self._disarm()
        for name in list(self._handles):
            self._drop(name)
        for obj, attr, original in reversed(self._patched):
            setattr(obj, attr, original)
        self._patched.clear()

    def _drop(self, name: str) -> None:
        handle = self._handles.pop(name, None)
        if handle is not None:
            handle.remove()

    def stop(self, error: BaseException | None = None) -> None:
        """End the recording (every hook removed, the last step closed, the files completed)."""
        if self.recorder is None or self.stopped:
            return
        self.stopped = True
        self.rank = _rank()
        try:
            self.recorder.__exit__(type(error) if error is not None else None, error,
                                   error.__traceback__ if error is not None else None)
        except Exception as e:  # mpscope's trouble never hides the script's outcome
            self.problems.append(f"ending the recording failed ({type(e).__name__}: {e})")

    # ------------------------------------------------------------------ global hooks
    def _forward_pre(self, module, args):
        if torch.compiler.is_compiling():  # (traced by dynamo: nothing, so the compiled graph is the same)
            return
        ref = self.seen.get(id(module))
        if ref is None or ref() is not module:
            self.seen[id(module)] = weakref.ref(module)

    def _registered(self, parent, name, child):
        if child is not None:
            refs = self.parents.setdefault(id(child), [])
            if not any(r() is parent for r in refs):
                refs.append(weakref.ref(parent))

    def _step_pre(self, optimizer, args, kwargs):
        # an optimizer begins its first step: it is chosen from in the post-step hook, once the step
        # has run (a Lightning closure runs the forward inside optimizer.step())
        self.steps.setdefault(id(optimizer), 0)

    def _step_post(self, optimizer, args, kwargs):
        try:
            self.steps[id(optimizer)] = self.steps.get(id(optimizer), 0) + 1
            if id(optimizer) in self.examined:
                return
            self.examined.add(id(optimizer))
            if self.done:
                self._note_other(optimizer)
            else:
                self._choose(optimizer)
        except Exception as e:  # never let mpscope break the training step
            self.done = True
            self.problems.append(f"finding the model failed ({type(e).__name__}: {e})")
            self._release_watch()

    # ------------------------------------------------------------------ choosing
    def _known(self) -> list[torch.nn.Module]:
        """The modules whose forward ran, then the modules they were registered in (ancestors)."""
        out: dict[int, torch.nn.Module] = {}
        for ref in self.seen.values():
            m = ref()
            if m is not None:
                out[id(m)] = m
        stack = list(out.values())
        while stack:
            for parent in self._parents_of(stack.pop()):
                if id(parent) not in out:
                    out[id(parent)] = parent
                    stack.append(parent)
        return list(out.values())

    def _parents_of(self, module) -> list[torch.nn.Module]:
        found = []
        for ref in self.parents.get(id(module), ()):
            p = ref()
            if p is not None and any(c is module for c in p._modules.values()):  # still its child
                found.append(p)
        return found

    def _ancestors(self, module) -> list[torch.nn.Module]:
        """``module`` and every module it is registered in, nearest first."""
        out, stack, seen = [], [module], set()
        while stack:
            m = stack.pop(0)
            if id(m) in seen:
                continue
            seen.add(id(m))
            out.append(m)
            stack.extend(self._parents_of(m))
        return out

    def _choose(self, optimizer) -> None:
        wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
        known = self._known()
        holders = [m for m in known if _holds(m, wanted)]
        if self.model_attr is not None:
            model = self._by_attr(self.model_attr, wanted, optimizer)
        elif self.model_class is not None:
            model = self._by_class(holders, optimizer)
        else:
            model = self._by_default(holders, optimizer)
        if model is None:
            return
        self._arm(model, optimizer)

    def _by_default(self, holders, optimizer):
        ran = [m for m in holders if self._ran(m)]
        roots = _outermost(ran or holders)
        if not roots:
            self.waiting.append(f"{type(optimizer).__name__} steps parameters of no module whose forward ran")
            return None
        if len(roots) == 1:
            return self._widen(roots[0])
        common = self._common_parent(roots)
        if common is not None:
            return common
        names = ", ".join(self._describe(m) for m in roots)
        self._give_up(
            f"the first optimizer to step ({type(optimizer).__name__}) steps parameters of several unrelated "
            f"models: {names}. Choose one with --model-class REGEX (its class name) or --model-attr NAME "
            "(its name in the script).")
        return None

    def _by_class(self, holders, optimizer):
        pattern = re.compile(self.model_class)
        matches = _outermost([m for m in holders if pattern.search(type(m).__name__)
                              or pattern.search(f"{type(m).__module__}.{type(m).__qualname__}")])
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            self._give_up(f"--model-class {self.model_class!r} matches several unrelated models that "
                          f"{type(optimizer).__name__} steps: {', '.join(self._describe(m) for m in matches)}. "
                          "Use a narrower pattern, or --model-attr NAME.")
            return None
        if holders:
            self.waiting.append(f"{type(optimizer).__name__} trains "
                                + ", ".join(self._describe(m) for m in _outermost(holders)))
        return None

    def _by_attr(self, name: str, wanted: set[int], optimizer):
        found = self._lookup(name)
        if found is _MISSING:
            self.waiting.append(f"{type(optimizer).__name__} stepped where no name {name!r} was in the script's scope")
            return None
        if not isinstance(found, torch.nn.Module):
            self._give_up(f"--model-attr {name} is a {type(found).__name__}, not a torch.nn.Module: "
                          "name the model the script trains.")
            return None
        if not _holds(found, wanted):
            self.waiting.append(f"{type(optimizer).__name__} steps no parameter of {name} ({type(found).__name__})")
            return None
        return found

    def _ran(self, module) -> bool:
        ref = self.seen.get(id(module))
        return ref is not None and ref() is module

    def _widen(self, module):
        """Climb to the outermost enclosing module with the very same parameters (a LightningModule
        around its network, a wrapper whose forward did not run)."""
        params = _param_ids(module)
        while True:
            up = [p for p in self._parents_of(module) if _param_ids(p) == params]
            if not up:
                return module
            module = up[0]

    def _common_parent(self, roots):
        """The smallest module that every one of ``roots`` is registered in, or None."""
        chains = [self._ancestors(r) for r in roots]
        shared = set.intersection(*({id(m) for m in c} for c in chains))
        candidates = [m for m in chains[0] if id(m) in shared]
        return min(candidates, key=lambda m: len(_subtree(m))) if candidates else None

    def _give_up(self, message: str) -> None:
        self.done = True
        self.problems.append(message)
        if _rank() == 0:
            _say(f"mpscope: {message} Nothing is recorded; training goes on.")
        self._release_watch()

    def _note_other(self, optimizer) -> None:
        """(After the choice) another optimizer stepped: note the models it trains that are not the
        recorded one, for the message at the end."""
        if self.model is None:
            return
        wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if wanted & _param_ids(self.model):
            return
        roots = [m for m in self._others_known if _holds(m, wanted)]
        label = ", ".join(self._describe(m) for m in _outermost(roots)) if roots else \
            f"parameters of another model (stepped by {type(optimizer).__name__})"
        self.others[id(optimizer)] = label

    # ------------------------------------------------------------------ names for messages
    def _scopes(self):
        """The namespaces the script's names live in, innermost first: its frames' locals and globals,
        ``__main__``'s globals, then the locals of other user code on the stack."""
        frames = []
        f = sys._getframe(1)
        while f is not None:
            frames.append(f)
            f = f.f_back
        script = os.path.realpath(self.script) if self.script else None
        mine = [f for f in frames if script and os.path.realpath(f.f_code.co_filename) == script]
        scopes = []
        for f in mine:
            scopes += [f.f_locals, f.f_globals]
        main = sys.modules.get("__main__")
        if main is not None:
            scopes.append(vars(main))
        scopes += [f.f_locals for f in frames if f not in mine and _user_frame(f.f_code.co_filename)]
        return scopes

    def _lookup(self, dotted: str):
        head, *rest = dotted.split(".")
        for scope in self._scopes():
            if head in scope:
                obj = scope[head]
                try:
                    for attr in rest:
                        obj = getattr(obj, attr)
                except AttributeError:
                    continue
                return obj
        return _MISSING

    def _name_of(self, module) -> str | None:
        for scope in self._scopes():
            for k, v in list(scope.items()):
                if v is module and not k.startswith("_"):
                    return k
        return None

    def _describe(self, module) -> str:
        n = sum(p.numel() for p in module.parameters())
        name = self._name_of(module)
        what = f"{type(module).__name__}, {n:,} parameters"
        return f"{name} ({what})" if name else what

    # ------------------------------------------------------------------ attaching
    def _arm(self, model, optimizer) -> None:
        """Chosen: attach at the model's next call (the start of the next step), not inside this step."""
        self.done = True
        self.model, self.optimizer = model, optimizer
        self.model_label = self._describe(model)
        inside = _subtree(model)
        ran = [ref() for ref in self.seen.values()]
        trained = [m for m in ran if m is not None and any(p.requires_grad for p in m.parameters())]
        self._others_known = [m for m in _outermost(trained) if id(m) not in inside and id(model) not in _subtree(m)]
        self._release_watch()
        self._targets = _subtree(model)
        original = torch.nn.Module.__dict__["__call__"]
        attacher = self

        def __call__(module, *args, **kwargs):
            if id(module) in attacher._targets and attacher.armed:
                attacher._disarm()
                attacher._attach()
            return original(module, *args, **kwargs)

        self._orig_call = original
        torch.nn.Module.__call__ = __call__
        self.armed = True

    def _disarm(self) -> None:
        if self._orig_call is not None:
            torch.nn.Module.__call__ = self._orig_call
            self._orig_call = None
        self.armed = False

    def _release_watch(self) -> None:
        """The choice is made: stop watching forwards and registrations (the post-step hook stays,
        to name other models; it cannot remove itself while PyTorch iterates its hooks)."""
        for name in ("forward", "registration", "step_pre"):
            self._drop(name)
        self.seen.clear()
        self.parents.clear()

    def _attach(self) -> None:
        opt = self.optimizer
        try:
            rec = record(self.model, optimizer=opt, auto=True, out=self.out, **self.options)
            rec.run.meta["launch"] = {"command": list(self.command),
                                      "optimizer_steps_before": self.steps.get(id(opt), 0)}
            rec.__enter__()
        except Exception as e:  # (RecorderError: e.g. the script records this model itself)
            self.problems.append(f"could not start recording {self.model_label}: {e}")
            _say(f"mpscope: could not start recording {self.model_label}: {e}; training goes on unobserved.")
            return
        self.recorder = rec
        if _rank() == 0:
            _say(f"mpscope: recording {self.model_label}, stepped by {type(opt).__name__}, from its optimizer step "
                 f"{self.steps.get(id(opt), 0) + 1} on (run step 0); writing to {self.out}")


_MISSING = object()


# --------------------------------------------------------------------------- running the script
def _exit_code(e: SystemExit) -> int:
    """The process exit code Python gives for ``SystemExit(e.code)`` (printing a message code)."""
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _execute(target: _Target) -> tuple[int, BaseException | None]:
    """Run the script as ``python`` would (``__main__``, its ``sys.argv``, its directory on ``sys.path``).
    Returns ``(exit code, the exception it raised or None)``; a ``SystemExit`` is an exit code."""
    saved_argv, saved_path = sys.argv, sys.path[:]
    if target.unbuffered:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.reconfigure(write_through=True)
            except (AttributeError, ValueError):
                pass
    try:
        if target.kind == "path":
            sys.argv = [target.name, *target.args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target.name)))
            runpy.run_path(target.name, run_name="__main__")
        else:
            sys.argv = [target.name, *target.args]  # run_module puts the module's file in argv[0]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target.name, run_name="__main__", alter_sys=True)
        return 0, None
    except SystemExit as e:
        return _exit_code(e), None
    except KeyboardInterrupt as e:
        return INTERRUPTED, e
    except BaseException as e:
        return 1, e
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def _module_file(name: str) -> str | None:
    """The file ``python -m name`` runs (to find the script's frames), or None."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def _print_traceback(error: BaseException) -> None:
    """The script's traceback as ``python`` prints it: mpscope's and runpy's frames left out."""
    skip = {os.path.realpath(__file__), os.path.realpath(runpy.__file__), "<frozen runpy>"}
    tb = error.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in skip
                              or os.path.realpath(tb.tb_frame.f_code.co_filename) in skip):
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb)
    sys.stderr.flush()


# --------------------------------------------------------------------------- the end
def _report(att: _Attacher, quiet: bool, html: bool, script: str) -> None:
    """Rank 0 (or the only process): save, report and print the recorded run, or say why there is none."""
    rec = att.recorder
    if rec is None:
        _say(*_why_nothing(att, script))
        return
    _say(*(f"mpscope: {p}" for p in att.problems))  # (trouble ending the recording: the rows so far are kept)
    out = att.out
    run = rec.run
    if run.meta.get("distributed") is None and not (out / MERGED_DIR).exists():
        run.save(out / MERGED_DIR)  # the recorder writes it on a normal end; not after an exception
    elif run.meta.get("distributed") is not None and not (out / MERGED_DIR).exists():
        try:  # a rank ended early: merge the per-rank files written so far
            run = Run.load(out)
        except Exception:
            pass
    steps = len(run.steps)
    if steps == 0:
        _say(f"mpscope: no step of {att.model_label} was recorded (recording starts at the second optimizer step; "
             f"the script ended before another step ended). The empty run is in {out}.")
        return
    advice, error = try_advise(run)
    if error is not None:
        _say(f"mpscope: the advisor failed ({type(error).__name__}: {error}); the run is kept.")
    if not quiet:
        # as `mpscope demo` prints them
        text = advice.to_text() if advice is not None else ""
        print("", text_summary(run, advice), "", text, "", sep="\n", flush=True)
    if advice is not None:
        write_recommendation(advice, out, quiet)
    line = f"run saved to {out} (load it with mpscope.Run.load({str(out)!r}))"
    if html:
        # (imported once the script has ended: the report's charts import altair, ~1.5 s, which the
        # script's start need not wait for)
        from mpscope.report import write_report

        line += f"; report: {write_report(run, out / 'report.html', advice=advice)}"
    print(line, flush=True)


def _why_nothing(att: _Attacher, script: str) -> list[str]:
    if att.problems:
        return [f"mpscope: nothing was recorded: {p}" for p in att.problems]
    if not att.steps:
        return [f"mpscope: no optimizer stepped while {script} ran, so nothing was recorded. mpscope run records "
                "the model whose parameters the first optimizer.step() updates, from its second step on."]
    if att.model is not None:
        return [f"mpscope: nothing was recorded: {att.model_label} was not called again after its optimizer's "
                f"first step (mpscope run records from the second optimizer step on; {script} took "
                f"{att.steps.get(id(att.optimizer), 0)})."]
    if att.model_attr is None and att.model_class is None:
        lines = [f"mpscope: nothing was recorded: no optimizer of {script} stepped the parameters of a module whose "
                 "forward ran (mpscope run records a torch.nn.Module the script calls)."]
    else:
        choice = f"--model-attr {att.model_attr}" if att.model_attr else f"--model-class {att.model_class!r}"
        lines = [f"mpscope: nothing was recorded: no optimizer of {script} trained the model {choice} names."]
    return lines + [f"  {w}" for w in att.waiting]


def _notes(att: _Attacher) -> list[str]:
    if not att.others or att.recorder is None:
        return []
    others = sorted(set(att.others.values()))
    return [f"mpscope: this script also trains {'; '.join(others)} with other optimizers; mpscope recorded "
            f"{att.model_label}. To record another model: --model-class REGEX (its class name) or "
            "--model-attr NAME (its name in the script)."]


def main(argv: list[str]) -> int:
    """``mpscope run [options] SCRIPT ARGS``: run SCRIPT in this process, record its model, report.

    Returns the script's exit code (2 for bad mpscope options or a missing script)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # -h, or argparse's usage error (already printed)
        return _exit_code(e)
    try:
        target = _target(args.command)
        options = _options(args)
    except (_Usage, RecorderError) as e:
        print(f"mpscope run: {e}", file=sys.stderr)
        return 2
    if target.kind == "path" and not os.path.isfile(target.name):
        print(f"mpscope run: can't open file {target.name!r}: no such file", file=sys.stderr)
        return 2
    rank = _rank()
    asked = Path(args.out)
    out = _resolve_out(asked, rank)
    if out != asked and rank == 0:
        _say(f"mpscope: {asked} holds an earlier recording (or is a file); this run goes to {out}")
    script = target.name if target.kind == "path" else _module_file(target.name)
    att = _Attacher(options, out, script, args.model_attr, args.model_class, [target.name, *target.args])
    att.install()
    try:
        code, error = _execute(target)  # (never raises: the script's exception is returned)
    finally:
        att.uninstall()
    att.stop(error)  # sets att.rank, unless destroy_process_group() stopped it already
    if att.recorder is None:
        att.rank = _rank()
    try:
        if att.rank == 0:
            _report(att, args.quiet, not args.no_report, target.label())
            _say(*_notes(att))
    except Exception as e:  # the script's outcome stays what it was
        _say(f"mpscope: could not save or report the run ({type(e).__name__}: {e}); what was written is in {out}")
    if error is not None:
        _print_traceback(error)
    return code
