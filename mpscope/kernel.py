"""The fused CPU stats kernels: ``mpscope._core``, compiled when mpscope is installed, and the PyTorch
extension (``_kernel.cpp``), built once per environment, in the background.

Both read each tensor once and compute every count, min/max and the exponent histogram in that
pass (about the cost of one elementwise op; the statistics are ``_stats_core.h``, which both
compile), where the torch-op path of :mod:`mpscope.stats` needs about ten. Results are identical;
the tests run all three against the cast oracle. ``mpscope._core`` needs only Python's headers (a
few seconds to compile, at ``pip install``), so it is there from a run's first recorded step; it
takes raw pointers from :class:`_Core`. The extension reads tensors directly on PyTorch's intra-op
threads and, once loaded, replaces it (:func:`stats_module`). Every run, on any device, also uses
the extension for host work the recorder does per tensor: ``stage_copy``, the staging copy of each
hooked tensor on an accelerator (:class:`mpscope.recording.step_buffer.StagedRows`), dispatched
from C++ (about 2 µs less host time per tensor than from Python), ``tensor_facts``, what each hook
needs to know of a tensor in one call (:func:`mpscope.stats.tensor_facts` is its Python form),
``forward_hook`` and ``observe_now``, the usual case of a module's forward hook and of a single
tensor's row in one call each (``ActivationHooks.on_forward`` and ``Observer.observe_now`` are their
Python form and take every other case; both read the recording's ``HookState``), and at a recorded
step's end ``gather``, ``same_looks`` and ``same_module_tree`` (:mod:`mpscope.recording.parameter_batch`
and the observer's parameter plan): the same answers as their Python forms without a Python object
made per tensor or module.

Building (a C++ compiler and ninja; about half a minute of compiling) never holds up a training
step:

* The binary is cached under ``$MPSCOPE_CACHE_DIR`` (default ``~/.cache/mpscope/kernels``) as
  ``mpscope_kernel_<key>.so``, where ``key`` (:func:`cache_key`) hashes everything that changes
  the binary (:func:`build_spec`): the kernel source, the torch version, git revision and C++ ABI,
  the Python implementation and version, the platform, the compiler and the compiler / linker flags.
  Two environments on one machine (two venvs, two torch versions) keep two binaries side by side.
* :func:`current` never waits: it returns the loaded kernel if it is ready, loads a cached binary
  (milliseconds), or starts the build in a background process and returns None. ``%load_ext
  mpscope`` calls it (so a notebook's build usually finishes before a cell records), and the
  recorder when it attaches and at each step boundary, so recording uses :mod:`mpscope._core` (or
  the torch-op path) until the kernel is ready and switches over at the next step. A CPU run whose
  statistics :mod:`mpscope._core` takes calls it with ``start=False`` while it records and starts
  the build when it detaches. Every build is announced on stderr, with
  its key, when it starts and when it ends.
* The background build runs at a lowered CPU priority, compiler included: where
  :mod:`mpscope._core` (the same statistics, compiled when mpscope is installed) takes a CPU run's
  statistics meanwhile, only on CPU time training leaves idle (niceness :data:`IDLE_BUILD_NICE`,
  ``SCHED_IDLE`` on Linux), so it does not slow the steps recorded meanwhile; without it (the
  torch-op path is several times slower) at niceness :data:`BUILD_NICE` (``SCHED_BATCH``), which
  slows those steps less than a build at normal priority and still finishes when training keeps
  every CPU busy.
* :func:`load` waits for the kernel (building it in the foreground if need be); ``mpscope
  build-kernel`` uses it to build ahead of time (container images, CI).
* A build holds ``<binary>.lock`` (its process id, start time and host). A lock whose process is
  gone is stale and is taken over (:func:`lock_is_stale`); a live one never is, however long an
  idle-priority build takes. While another process holds a live lock, :func:`current` spawns no
  builder of its own (it says so once and loads the binary when it appears); only :func:`load`
  waits for one, never a training step. Each build compiles in a fresh directory and moves the
  finished binary into place atomically, so a killed build leaves nothing half-written behind.

If the build fails (no C++ compiler or ninja, a cache directory that cannot be made or written),
mpscope goes on with :mod:`mpscope._core` (or the torch-op path where that was not compiled) and
says so once through :mod:`warnings`. The environment variable ``MPSCOPE_KERNEL=torch`` makes it
use the torch-op path, ``MPSCOPE_KERNEL=core`` :mod:`mpscope._core`, without building or saying
anything.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from functools import lru_cache
from pathlib import Path

import torch

from mpscope.formats import BF16, FORMATS, FP16

_SOURCE = Path(__file__).with_name("_kernel.cpp")
#: Every file the build compiles: the extension and the statistics it shares with :mod:`mpscope._core`.
_SOURCES = (_SOURCE, _SOURCE.with_name("_stats_core.h"))
#: A build lock older than this (seconds) is stale: the build takes about a minute on 2 CPU cores,
#: so after ten minutes its process is gone.
LOCK_STALE_S = 600.0
#: Longest wait (seconds) of :func:`load` on a live build lock of another process before it falls
#: back to the torch-op path.
LOCK_WAIT_S = 180.0
#: Compiler flags of every build (OpenMP flags are added where they apply, see :func:`build_spec`).
CFLAGS = ("-O3",)


def _f32_bits(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.float32).view(torch.int32))


#: fp16 / bf16 thresholds as float32 bit patterns: |x| <= under -> 0, < normal -> subnormal,
#: >= overflow -> inf (round to nearest even; see mpscope.formats.Format).
CAST_BITS = [
    _f32_bits(FP16.underflow_threshold),
    _f32_bits(FP16.normal_threshold),
    _f32_bits(FP16.overflow_threshold),
    _f32_bits(BF16.underflow_threshold),
    _f32_bits(BF16.normal_threshold),
    _f32_bits(BF16.overflow_threshold),
]
_TINY_BITS = {torch.float16: _f32_bits(FORMATS["float16"].min_normal),
              torch.bfloat16: _f32_bits(FORMATS["bfloat16"].min_normal),
              torch.float32: _f32_bits(FORMATS["float32"].min_normal)}
#: The tiny bit patterns of float16, bfloat16 and float32, then :data:`CAST_BITS`: what the kernel's
#: hook path (``forward_hook``, ``observe_now``) passes its stats of one tensor.
HOOK_BITS = (_TINY_BITS[torch.float16], _TINY_BITS[torch.bfloat16], _TINY_BITS[torch.float32], *CAST_BITS)


def _openmp_flags() -> list[str]:
    """``-fopenmp`` where PyTorch's own intra-op threads are OpenMP (Linux wheels; the extension then
    uses the ``libgomp`` PyTorch already loaded, so ``at::parallel_for`` really runs on
    ``torch.get_num_threads()`` threads). Elsewhere (e.g. Apple clang, which has no ``-fopenmp``) the
    kernel is built without it and ``at::parallel_for`` runs on the calling thread only."""
    if sys.platform.startswith("linux") and "parallel backend: OpenMP" in torch.__config__.parallel_info():
        return ["-fopenmp"]
    return []


# ----------------------------------------------------------------------------- cache key
@lru_cache(maxsize=1)
def build_spec() -> dict[str, str]:
    """Everything that changes the compiled binary, as strings.

    Keys: ``source`` (SHA-256 of ``_kernel.cpp`` and ``_stats_core.h``), ``torch`` (version),
    ``torch_git`` (revision), ``cxx11_abi``, ``python`` (implementation, version and extension suffix), ``platform``
    (OS and machine), ``compiler`` (``$CXX`` or ``c++``, resolved on ``PATH``), ``cflags``, ``ldflags``.
    """
    omp = _openmp_flags()
    cxx = os.environ.get("CXX", "c++")

    return {
        "source": hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES)).hexdigest(),
        "torch": torch.__version__,
        "torch_git": str(getattr(torch.version, "git_version", "")),
        "cxx11_abi": str(bool(torch._C._GLIBCXX_USE_CXX11_ABI)),
        "python": f"{sys.implementation.name}-{platform.python_version()}-{sysconfig.get_config_var('EXT_SUFFIX')}",
        "platform": f"{sys.platform}-{platform.machine()}",
        "compiler": str(Path(shutil.which(cxx) or cxx).resolve()) if shutil.which(cxx) else cxx,
        "cflags": " ".join([*CFLAGS, *omp]),
        "ldflags": " ".join(omp),
    }


def cache_key(spec: dict[str, str]) -> str:
    """16 hex digits of the SHA-256 of ``spec`` (see :func:`build_spec`): equal keys, equal binaries."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """Where binaries are kept: ``$MPSCOPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpscope/kernels``,
    else ``~/.cache/mpscope/kernels``."""
    env = os.environ.get("MPSCOPE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mpscope" / "kernels"


def binary_path(key: str | None = None) -> Path:
    """The cached binary of ``key`` (default: this environment's)."""
    key = key or cache_key(build_spec())
    return cache_dir() / f"mpscope_kernel_{key}.so"


def _choice() -> str:
    """``MPSCOPE_KERNEL``, lower case: ``torch`` (the torch-op path), ``core`` (mpscope._core only)
    or anything else (every kernel there is)."""
    return os.environ.get("MPSCOPE_KERNEL", "").lower()


def disabled() -> bool:
    """True when ``MPSCOPE_KERNEL`` is ``torch`` (the torch-op path: no kernel at all) or ``core``
    (:mod:`mpscope._core` only: the PyTorch extension is neither built nor loaded)."""
    return _choice() in ("torch", "core")


def _say(msg: str) -> None:
    print(f"mpscope: {msg}", file=sys.stderr, flush=True)


def _describe(spec: dict[str, str]) -> str:
    return f"torch {spec['torch']}, {spec['python'].split('-')[0]} {spec['python'].split('-')[1]}, " \
           f"{spec['platform']}, {spec['cflags']}"


# ----------------------------------------------------------------------------- build lock
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _started_after(pid: int, t: float) -> bool:
    """Whether process ``pid`` started after time ``t`` (seconds since the epoch), by the creation
    time of ``/proc/<pid>`` (Linux); False where that cannot be read."""
    try:
        return os.stat(f"/proc/{pid}").st_ctime > t + 1.0
    except OSError:
        return False


def lock_is_stale(lock: Path, now: float | None = None) -> bool:
    """Whether a build lock is left over. On this host: its process is gone, or the process id now
    belongs to a process started after the lock was taken (Linux); a live build is never stale, as
    one at idle priority may take far longer than :data:`LOCK_STALE_S` while training keeps the
    CPUs busy. From another host (a shared cache directory): older than :data:`LOCK_STALE_S`. A lock
    that cannot be read: its file older than that."""
    now = time.time() if now is None else now
    try:
        pid_s, started_s, host = lock.read_text().split()[:3]
        pid, started = int(pid_s), float(started_s)
    except (OSError, ValueError):
        try:
            return now - lock.stat().st_mtime > LOCK_STALE_S
        except OSError:
            return True  # gone meanwhile
    if host != platform.node():
        return now - started > LOCK_STALE_S
    return not _pid_alive(pid) or _started_after(pid, started)


def _take_lock(lock: Path) -> bool:
    """Create ``lock`` (pid, start time, host) unless a live build holds it; a stale one is replaced."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if not lock_is_stale(lock):
                return False
            _say(f"removing a stale kernel build lock ({lock}: {lock.read_text().strip() if lock.exists() else ''})")
            try:
                lock.unlink()
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {time.time():.3f} {platform.node()}\n")
        return True
    return False


# ----------------------------------------------------------------------------- build
class BuildBusy(RuntimeError):
    """Another process still builds the kernel for this environment (its lock is live)."""


def build(force: bool = False, wait: float | None = None) -> Path:
    """Compile the kernel for this environment into the cache (announced on stderr) and return
    the binary's path; returns at once when it is already there (unless ``force``).

    Waits up to ``wait`` seconds (default :data:`LOCK_STALE_S`) for a live build of the same key by
    another process; a stale lock (:func:`lock_is_stale`) is taken over.

    Raises:
        BuildBusy: waiting timed out (a RuntimeError).
        RuntimeError: the build failed (no C++ compiler, no ninja, ...).
    """
    spec = build_spec()
    key = cache_key(spec)
    target = binary_path(key)
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.with_suffix(".lock")
    wait = LOCK_STALE_S if wait is None else wait
    deadline = time.monotonic() + wait
    said = False
    while not _take_lock(lock):
        if target.exists() and not force:
            return target
        if not said:
            _say(f"waiting for another process building the kernel ({lock})")
            said = True
        if time.monotonic() > deadline:
            raise BuildBusy(f"another process has been building the kernel for over {wait:.0f} s "
                            f"(its lock {lock} is still there)")
        time.sleep(0.5)
    try:
        if target.exists() and not force:
            return target
        _say(f"compiling the fused CPU stats kernel (key {key}: {_describe(spec)}; about half a minute) "
             f"into {target.parent}")
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f"build-{key}-") as tmp:
            os.replace(_compile(Path(tmp), target.stem), target)
        target.with_suffix(".json").write_text(json.dumps(spec, indent=1, sort_keys=True))
        _say(f"fused CPU stats kernel built in {time.perf_counter() - t0:.0f} s: {target}")
        return target
    except Exception as e:
        raise RuntimeError(f"{type(e).__name__}: {str(e)[-400:]}") from e
    finally:
        try:
            lock.unlink()
        except FileNotFoundError:
            pass


def _compile(directory: Path, name: str) -> Path:
    """Compile ``_kernel.cpp`` in the empty ``directory`` into the extension ``name``; its path."""
    from torch.utils.cpp_extension import load as _load

    for path in _SOURCES:
        shutil.copyfile(path, directory / path.name)
    src = directory / _SOURCE.name
    omp = _openmp_flags()
    _load(name=name, sources=[str(src)], extra_cflags=[*CFLAGS, *omp], extra_ldflags=omp,
          build_directory=str(directory), verbose=False)
    return directory / f"{name}.so"


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _State:
    """This process's kernel: the module once loaded; the background build while it runs."""

    def __init__(self):
        self.module = None
        self.failed = False
        self.thread: threading.Thread | None = None
        self.proc: subprocess.Popen | None = None
        self.guard = threading.Lock()
        self.other_until = 0.0  # time.monotonic() before which another process's live build is assumed
        self.said_other = False


_STATE = _State()


def _fail(e: BaseException) -> None:
    _STATE.failed = True
    warnings.warn(
        f"mpscope: the fused CPU stats kernel could not be built ({str(e)[:300]}); "
        "recording goes on without it, with the same values: a CPU run takes its statistics through "
        + ("mpscope._core (about as fast; its hooks' host work stays in Python)" if _core_module() is not None
           else "torch ops (slower)")
        + ", a run on an accelerator its staging copies (about 2 us more host time per tensor). Install a "
        "C++ compiler and `pip install ninja` for the fast path.",
        RuntimeWarning,
        stacklevel=3,
    )


def _load_cached():
    path = binary_path()
    try:
        if not path.exists():
            return None
    except OSError as e:  # the cache directory cannot be read (no permission on a parent)
        _fail(e)
        return None
    try:
        _STATE.module = _import(path)
    except Exception as e:  # a binary that does not load here (copied from elsewhere, truncated)
        _fail(e)
        return None
    return _STATE.module


def current(start: bool = True):
    """The kernel if it can be used now, else None; never waits for a build.

    Loads a cached binary of this environment if there is one; otherwise, with ``start``, starts
    the build in a background process (announced on stderr) and returns None until it is done.
    """
    return _look(start, for_next_run=False)


def build_for_next_run() -> None:
    """Start the background build if this environment has no binary yet and no process builds one;
    never waits. A CPU recording through :mod:`mpscope._core`, which defers the build, calls it
    when it detaches: the build, announced as one for the next run, goes on after this process
    exits."""
    _look(True, for_next_run=True)


def _look(start: bool, for_next_run: bool):
    """:func:`current`'s body: the loaded module, else a cached binary loaded, else (with ``start``,
    when no build of ours or of another process runs) the background build started; never waits."""
    if disabled():
        return None
    st = _STATE
    if st.module is not None or st.failed:
        return st.module
    if st.thread is not None or time.monotonic() < st.other_until:  # a build, ours or another's, runs
        return None
    with st.guard:
        if st.module is None and st.thread is None and not st.failed:
            if _load_cached() is None and start and not st.failed and not _other_building():
                _start_background(for_next_run)
    return st.module


#: Seconds between two looks at a live build lock of another process (see :func:`_other_building`).
OTHER_RECHECK_S = 10.0


def _other_building() -> bool:
    """Whether another process holds a live lock on this environment's build (it then finishes the
    binary, which :func:`current` loads): said once on stderr; :func:`current` looks again (a stat
    and a small read) only every :data:`OTHER_RECHECK_S` seconds. No second builder is spawned, so
    none waits and none rewrites the build's log."""
    lock = binary_path().with_suffix(".lock")
    try:
        live = lock.exists() and not lock_is_stale(lock)
    except OSError:
        return False
    if live:
        _STATE.other_until = time.monotonic() + OTHER_RECHECK_S
        if not _STATE.said_other:
            _STATE.said_other = True
            holder = lock.read_text().split()[:1] if lock.exists() else []
            _say(f"another process (pid {holder[0] if holder else '?'}) is building the fused CPU stats kernel "
                 f"for this environment ({lock}); this one loads it when it is done")
    return live


#: Niceness of the background build (and of the compiler it runs; ``nice(1)``'s range is -20 .. 19)
#: where :mod:`mpscope._core` is missing, so that until the build ends a CPU run's statistics take the
#: torch-op path (several times slower). Linux's scheduler gives a niceness-5 task about a quarter
#: of a CPU that a niceness-0 thread also wants (weights 335 vs 1024, ``sched_prio_to_weight`` in
#: kernel/sched/core.c), so a build of about 40 s of CPU finishes in a few minutes even while
#: training keeps every CPU busy. Niceness 19 (weight 15, about 1.5 %) starves it: on the 2-CPU
#: demo the compiler gets 3 % of a CPU and has not finished after 6 minutes.
BUILD_NICE = 5
#: Niceness of the build where :mod:`mpscope._core` takes the statistics meanwhile (at the same
#: speed as the extension, less a few microseconds of host work per tensor): the extension is then
#: worth only CPU time that training leaves idle. On Linux the build also runs as ``SCHED_IDLE``
#: (weight 3: it runs when a CPU has nothing else to run, and is preempted at once otherwise), so
#: it does not slow the steps recorded meanwhile (a recorded step beside a niceness-5 build takes
#: up to ten times its steady time on 2 CPUs: docs/performance-history.md, fifteenth measurement).
#: It may then finish only after the run that started it; the next run finds it built.
IDLE_BUILD_NICE = 19


def _priority(idle: bool) -> tuple[int, str]:
    """The background build's niceness and scheduling policy (a name in :mod:`os`): see
    :data:`IDLE_BUILD_NICE` and :data:`BUILD_NICE`."""
    return (IDLE_BUILD_NICE, "SCHED_IDLE") if idle else (BUILD_NICE, "SCHED_BATCH")


def _low_priority(idle: bool) -> str:
    """The first lines of the background build process, run before anything is imported (importing
    torch alone takes seconds of CPU); the compiler processes inherit them. ``idle`` (mpscope._core
    is there): niceness :data:`IDLE_BUILD_NICE` and, on Linux, ``SCHED_IDLE``; else niceness
    :data:`BUILD_NICE` and ``SCHED_BATCH`` (no preempting others when it wakes up). Where neither
    exists (Windows) the build runs at the usual priority."""
    nice, policy = _priority(idle)
    return (
        "import os, sys\n"
        f"try: os.nice({nice})\n"
        "except (AttributeError, OSError): pass\n"
        f"try: os.sched_setscheduler(0, os.{policy}, os.sched_param(0))\n"
        "except (AttributeError, OSError): pass\n"
    )


def _builder(idle: bool) -> str:
    """What the background build process runs (``-c`` rather than ``-m``: the package imports this
    module), at the priority of :func:`_low_priority`."""
    return _low_priority(idle) + "from mpscope.kernel import _main\nsys.exit(_main(['--build']))\n"


def _builder_env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)  # the directory mpscope was imported from
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _spawn(argv: list[str], idle: bool, **popen_kw) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen_kw)`` from a short-lived thread whose scheduling policy is
    lowered first (``SCHED_IDLE`` with ``idle``, else ``SCHED_BATCH``) where a policy belongs to a
    thread (Linux): the child inherits it at fork, so it runs at that priority from its first
    instruction, Python's own start-up included, which otherwise competes with the first training
    step after attach (measured: about 30 ms of it on 2 CPUs). The calling thread keeps its own.
    Raises what Popen raises."""
    box: dict = {}

    def run():
        if sys.platform.startswith("linux"):
            try:
                os.sched_setscheduler(0, getattr(os, _priority(idle)[1]), os.sched_param(0))
            except (AttributeError, OSError):
                pass
        try:
            box["proc"] = subprocess.Popen(argv, **popen_kw)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    th = threading.Thread(target=run, name="mpscope-kernel-spawn", daemon=True)
    th.start()
    th.join()
    if "error" in box:
        raise box["error"]
    return box["proc"]


def _start_background(for_next_run: bool = False) -> None:
    spec = build_spec()
    key = cache_key(spec)
    log = binary_path(key).with_suffix(".log")
    out = None
    try:
        # (a cache directory that cannot be made or written, e.g. a read-only home in a container,
        # is a failed build: warned once, the torch-op path records)
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "w")
        idle = _core_module() is not None
        proc = _spawn([sys.executable, "-c", _builder(idle)], idle, stdout=out, stderr=subprocess.STDOUT,
                      stdin=subprocess.DEVNULL, env=_builder_env())
    except OSError as e:
        if out is not None:
            out.close()
        _fail(e)
        return
    if for_next_run:
        _say(f"the fused CPU stats kernel is not built for this environment yet (key {key}: {_describe(spec)}); "
             f"building it in the background for the next run (pid {proc.pid}, about half a minute of CPU time "
             f"that nothing else wants; it goes on after this process exits; log {log})")
    else:
        meanwhile = ("mpscope._core takes a CPU run's statistics (the same values, at about the same speed) and "
                     "torch ops a run on an accelerator's staging copies" if idle else
                     "recording takes the same values through torch ops (the statistics of a CPU run, the staging "
                     "copies of a run on an accelerator)")
        _say(f"the fused CPU stats kernel is not built for this environment yet (key {key}: {_describe(spec)}); "
             f"building it in the background (pid {proc.pid}, about half a minute of CPU time"
             f"{' that training leaves idle' if idle else ''}, log {log}); until it is ready, {meanwhile}")
    _STATE.proc = proc
    t0 = time.perf_counter()

    def wait():
        try:
            try:  # (an idle-priority build may take long while training keeps the CPUs busy)
                rc = proc.wait(timeout=None if idle else LOCK_STALE_S + 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "timeout"
            out.close()
            if rc == 0 and _load_cached() is not None:
                if not for_next_run:
                    _say(f"fused CPU stats kernel ready after {time.perf_counter() - t0:.0f} s; recording "
                         "switches to it at the next step")
            elif rc == _BUSY:  # another process builds it (see _main): loaded when it is done
                _STATE.other_until = time.monotonic() + OTHER_RECHECK_S
            elif _STATE.module is None and not _STATE.failed:
                tail = log.read_text()[-400:] if log.exists() else ""
                _fail(RuntimeError(f"background build exited with {rc}: {tail}"))
        finally:
            _STATE.proc = None
            _STATE.thread = None

    th = threading.Thread(target=wait, name="mpscope-kernel-build", daemon=True)
    _STATE.thread = th
    th.start()


def load():
    """The kernel, waiting for it: joins a background build, or builds in the foreground
    (announced on stderr; a live build of another process is waited on for at most
    :data:`LOCK_WAIT_S`). None when it is disabled or cannot be built (warned once)."""
    if disabled():
        return None
    st = _STATE
    if st.module is not None or st.failed:
        return st.module
    th = st.thread
    if th is not None:
        th.join(LOCK_STALE_S + 120)
        if st.module is not None or st.failed:
            return st.module
    with st.guard:
        if st.module is None and not st.failed and _load_cached() is None and not st.failed:
            try:
                build(wait=LOCK_WAIT_S)
            except Exception as e:
                _fail(e)
                return None
            _load_cached()
    return st.module


def _forget() -> None:
    """Forget this process's kernel state (tests re-read ``MPSCOPE_KERNEL`` and the cache)."""
    if _STATE.thread is None:
        _STATE.module = None
    _STATE.failed = False


load.cache_clear = _forget  # for code that calls load.cache_clear(), as on an lru_cache


def fused_stats(module, tensors: list[torch.Tensor], hist: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel over CPU float16/bfloat16/float32 tensors.

    Returns ``(counts, extrema)``: int64 (n, 10 [+ 279 histogram bins]) and float64 (n, 3), laid out
    as :class:`mpscope.stats.DeviceStats` describes.
    """
    # the kernel reads raw data (autograd is off inside it); tensors that need grad pass as they are
    counts, extrema = module.fused_stats(tensors, _tiny_bits(tensors), CAST_BITS, hist)
    return counts, extrema


def _tiny_bits(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's own smallest normal as a float32 bit pattern; TypeError for a dtype the fused
    kernels do not take."""
    try:
        return [_TINY_BITS[t.dtype] for t in tensors]
    except KeyError:
        bad = sorted({str(t.dtype) for t in tensors if t.dtype not in _TINY_BITS})
        raise TypeError(f"mpscope's fused CPU kernels take float16/bfloat16/float32 tensors, not {', '.join(bad)} "
                        "(mpscope.stats.device_stats takes every floating dtype)") from None


def fused_stats_into(module, tensors: list[torch.Tensor], hist: bool, counts: torch.Tensor, extrema: torch.Tensor,
                     row: int) -> None:
    """Run the kernel over CPU float16/bfloat16/float32 tensors, writing tensor ``i``'s stats into
    row ``row + i`` of preallocated tables instead of allocating two tensors per call.

    ``counts``: contiguous CPU int64 (rows, 10 + 279), ``extrema``: contiguous CPU float64 (rows, 3),
    laid out as :class:`mpscope.stats.DeviceStats` describes; without ``hist`` the 279 histogram
    columns of those rows are left as they were. Raises RuntimeError when the rows do not fit.
    """
    module.fused_stats_into(tensors, _tiny_bits(tensors), CAST_BITS, hist, counts, extrema, row)


# ----------------------------------------------------------------------------- mpscope._core
class _Core:
    """:mod:`mpscope._core` (``_core.cpp``: the statistics of ``_stats_core.h`` compiled when mpscope
    is installed, without PyTorch headers) behind the PyTorch extension's ``fused_stats`` and
    ``fused_stats_into``, so :func:`fused_stats` and :func:`fused_stats_into` take either. The same
    numbers as the extension; a tensor that is not contiguous (or has the negative bit) is copied
    first, and the chunks of a call run on ``torch.get_num_threads()`` OpenMP threads where the
    module was built with OpenMP (Linux), else on the calling thread."""

    def __init__(self, lib):
        self.lib = lib
        self.width = lib.NCOUNT + lib.NHIST
        self._checked: tuple | None = None  # the last (counts, extrema) found well formed

    def fused_stats(self, tensors, tiny_bits, cast, hist: bool):
        counts = torch.empty(len(tensors), self.lib.NCOUNT + (self.lib.NHIST if hist else 0), dtype=torch.int64)
        extrema = torch.empty(len(tensors), 3, dtype=torch.float64)
        self._into(tensors, tiny_bits, cast, hist, counts, extrema, 0)
        return counts, extrema

    def fused_stats_into(self, tensors, tiny_bits, cast, hist: bool, counts, extrema, row0: int) -> None:
        n = len(tensors)
        checked = self._checked
        if checked is None or checked[0] is not counts or checked[1] is not extrema:  # (the same tables, call after call)
            if not (counts.dtype == torch.int64 and counts.dim() == 2 and counts.shape[1] == self.width
                    and counts.is_contiguous() and counts.is_cpu):
                raise RuntimeError("mpscope fused_stats_into: counts must be a contiguous CPU int64 "
                                   f"[rows, {self.width}] tensor")
            if not (extrema.dtype == torch.float64 and extrema.dim() == 2 and extrema.shape[1] == 3
                    and extrema.is_contiguous() and extrema.is_cpu):
                raise RuntimeError("mpscope fused_stats_into: extrema must be a contiguous CPU float64 [rows, 3] tensor")
            self._checked = (counts, extrema)
        if row0 < 0 or row0 + n > counts.shape[0] or row0 + n > extrema.shape[0]:
            raise RuntimeError(f"mpscope fused_stats_into: rows {row0}..{row0 + n} outside the tables")
        self._into(tensors, tiny_bits, cast, hist, counts, extrema, row0)

    def _into(self, tensors, tiny_bits, cast, hist, counts, extrema, row0) -> None:
        if not tensors:
            return
        kept, addresses, numels, kinds = [], [], [], []
        for t in tensors:
            kind = _CORE_KINDS.get(t.dtype)
            if kind is None or not t.is_cpu:
                raise RuntimeError(f"mpscope fused_stats: CPU float32/float16/bfloat16 tensors only, not "
                                   f"{t.dtype} on {t.device}")
            if t.is_neg() or not t.is_contiguous():  # (copied: data, not part of any graph)
                with torch.no_grad():
                    t = t.resolve_neg().contiguous()
            kept.append(t)  # (alive until the kernel has read it)
            addresses.append(t.data_ptr())
            numels.append(t.numel())
            kinds.append(kind)
        width = counts.shape[1]
        self.lib.stats_into(addresses, numels, kinds, tiny_bits, cast, hist, counts.data_ptr() + 8 * width * row0,
                            width, extrema.data_ptr() + 24 * row0, torch.get_num_threads())


_CORE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@lru_cache(maxsize=1)
def _core_module() -> _Core | None:
    try:
        import mpscope._core as lib  # (optional: compiled by setup.py where a C++ compiler is)
    except ImportError:  # not compiled when mpscope was installed (no C++ compiler there)
        return None
    return _Core(lib)


def core() -> _Core | None:
    """:mod:`mpscope._core` behind the extension's interface (see :class:`_Core`), or None where it
    was not compiled when mpscope was installed, or with ``MPSCOPE_KERNEL=torch``."""
    return None if _choice() == "torch" else _core_module()


def stats_module():
    """What takes CPU float32/float16/bfloat16 statistics now, never waiting: the PyTorch extension
    once it is loaded (:func:`current`, which starts its build on a cold cache), else :func:`core`,
    else None (the torch-op path of :mod:`mpscope.stats`). Either module goes to
    :func:`fused_stats` / :func:`fused_stats_into`; both give the same numbers."""
    return current() or core()


def hist_nonzero(module, counts, col0: int, nbins: int, rows, group, ngroups: int):
    """The non-zero exponent histogram bins of rows of a host count table, in one pass.

    ``counts``: int64 NumPy array (rows, width), C order, a row's bins in columns ``col0 .. col0 +
    nbins - 1``; ``rows``: int64 array of the table rows to read, in order. With ``group`` None each
    row is its own entry (numbered in the order of ``rows``); else an int64 array, one group number
    in ``0 .. ngroups - 1`` per row: the rows of a group add up, and entries are the groups in number
    order. Returns ``(entry, bin, count)`` int64 arrays with one element per non-zero bin, ascending
    by entry, then bin. Integer arrays of another dtype or layout are copied as int64, C order.
    Raises RuntimeError for a row or group out of range, columns outside the table or a negative
    ``ngroups``; TypeError for arrays NumPy cannot safely cast to int64 (floats: never truncated).
    """
    return module.hist_nonzero(counts, col0, nbins, rows, _NO_GROUPS if group is None else group, ngroups)


_NO_GROUPS = torch.zeros(0, dtype=torch.int64).numpy()


#: The background builder's exit status when another process still builds (:class:`BuildBusy`).
_BUSY = 3


def _main(argv: list[str]) -> int:
    """The background builder's entry point (see :func:`_builder`): 0 built, :data:`_BUSY` another
    process still builds, 1 failed."""
    try:
        print(build(force="--force" in argv))
    except BuildBusy as e:
        print(f"mpscope: {e}", file=sys.stderr)
        return _BUSY
    except Exception as e:
        print(f"mpscope: kernel build failed: {e}", file=sys.stderr)
        return 1
    return 0
