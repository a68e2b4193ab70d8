"""The fused kernel's build: a cache key covering everything that changes the binary, build locks
left by killed builds that never hang, no training step waiting for a build, and identical rows
whichever path records."""


from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import mpscope
from mpscope import kernel
from mpscope.cli import main


def test_cache_key_changes_with_everything_that_changes_the_binary():
    spec = kernel.build_spec()
    assert spec["torch"] == torch.__version__
    assert "-O3" in spec["cflags"].split()
    assert spec["cxx11_abi"] == str(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    key = kernel.cache_key(spec)
    assert kernel.cache_key(dict(spec)) == key and len(key) == 16
    changes = {"torch": "2.99.0+cu999", "torch_git": "0" * 40, "cxx11_abi": str(not eval(spec["cxx11_abi"])),
               "python": "cpython-3.99.0-.cpython-399-x86_64-linux-gnu.so", "cflags": "-O2",
               "ldflags": "-lfoo", "compiler": "/opt/other/clang++", "platform": "darwin-arm64",
               "source": "f" * 64}
    assert set(changes) == set(spec)  # every field of the spec is covered here
    keys = {key}
    for field, value in changes.items():
        keys.add(kernel.cache_key({**spec, field: value}))
    assert len(keys) == len(changes) + 1
    assert kernel.binary_path(key).name == f"mpscope_kernel_{key}.so"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_locks_are_recognised_and_taken_over(tmp_path):
    import platform

    lock = tmp_path / "k.lock"
    now = time.time()
    lock.write_text(f"{_dead_pid()} {now:.3f} {platform.node()}\n")
    assert kernel.lock_is_stale(lock)  # its process is gone (a build killed by a kernel restart)
    lock.write_text(f"{__import__('os').getpid()} {now:.3f} {platform.node()}\n")
    assert not kernel.lock_is_stale(lock)  # a live build
    assert not kernel._take_lock(lock)
    lock.write_text(f"{__import__('os').getpid()} {now - 2 * kernel.LOCK_STALE_S:.3f} {platform.node()}\n")
    if sys.platform.startswith("linux"):  # (elsewhere a reused process id cannot be told from a live build)
        # this process started before that lock time: a live build, however long it takes at idle priority
        started = __import__("os").stat(f"/proc/{__import__('os').getpid()}").st_ctime
        lock.write_text(f"{__import__('os').getpid()} {started + 1:.3f} {platform.node()}\n")
        assert not kernel.lock_is_stale(lock, now=started + 10 * kernel.LOCK_STALE_S)
        # a process id taken by a process started after the lock: the build's process is gone
        lock.write_text(f"{__import__('os').getpid()} {started - 60:.3f} {platform.node()}\n")
        assert kernel.lock_is_stale(lock)
    lock.write_text(f"{__import__('os').getpid()} {now - 2 * kernel.LOCK_STALE_S:.3f} another-host\n")
    assert kernel.lock_is_stale(lock)  # another host's (a shared cache directory): older than any build takes
    lock.write_text(f"{__import__('os').getpid()} {now:.3f} another-host\n")
    assert not kernel.lock_is_stale(lock)
    lock.write_text("garbage")
    assert not kernel.lock_is_stale(lock)  # unreadable but fresh: maybe being written
    assert kernel.lock_is_stale(lock, now=now + 2 * kernel.LOCK_STALE_S)
    lock.write_text(f"{_dead_pid()} {now:.3f} {platform.node()}\n")
    assert kernel._take_lock(lock)  # replaced by ours
    assert lock.read_text().split()[0] == str(__import__("os").getpid())


_REAL_START = kernel._start_background


@pytest.fixture
def cold_cache(tmp_path, monkeypatch):
    """An empty kernel cache and a fresh process state; background builds are only noted."""
    monkeypatch.setenv("MPSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MPSCOPE_KERNEL", raising=False)
    monkeypatch.setattr(kernel, "_STATE", kernel._State())
    started = []

    def start(for_next_run=False):  # what the real one does to the state, without the build
        started.append(time.monotonic())
        kernel._STATE.thread = threading.Thread(target=lambda: None)

    monkeypatch.setattr(kernel, "_start_background", start)
    return started


@pytest.mark.parametrize("disabled", [False, True])
def test_load_ext_starts_the_build_before_any_cell_records(cold_cache, monkeypatch, disabled):
    """``%load_ext mpscope`` on a cold cache starts the background build (not the first recorded
    cell), registers the magics, and does not wait; with ``MPSCOPE_KERNEL=torch`` it builds nothing."""
    pytest.importorskip("IPython")
    from types import SimpleNamespace

    from mpscope import magic

    if disabled:
        monkeypatch.setenv("MPSCOPE_KERNEL", "torch")
    registered = []
    magic.load_ipython_extension(SimpleNamespace(register_magics=registered.append))
    assert registered == [magic.MpscopeMagics]
    assert len(cold_cache) == (0 if disabled else 1)


def test_a_live_build_of_another_process_is_waited_for_not_joined(cold_cache, capsys):
    """Another process holds a live lock on this environment's build: no second builder is spawned
    (none would wait for it, nor rewrite its log), that is said once, the lock is looked at again
    only every OTHER_RECHECK_S, and the binary it leaves is loaded then."""
    import platform

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = kernel.binary_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".lock").write_text(f"{other.pid} {time.time():.3f} {platform.node()}\n")
        for _ in range(3):
            assert kernel.current() is None
            kernel.build_for_next_run()
        assert cold_cache == []
        said = [line for line in capsys.readouterr().err.splitlines() if "another process" in line]
        assert len(said) == 1 and str(other.pid) in said[0]
        assert kernel._STATE.other_until > time.monotonic()
        kernel._STATE.other_until = 0.0  # (its OTHER_RECHECK_S have passed)
        path.with_suffix(".lock").unlink()  # its build ended without a binary: this process starts one
        assert kernel.current() is None and len(cold_cache) == 1
    finally:
        other.kill()
        other.wait()


def test_a_cold_cache_or_a_live_lock_never_makes_a_caller_wait(cold_cache):
    import os
    import platform

    t0 = time.perf_counter()
    assert kernel.current() is None  # cold: a background build starts, the caller goes on
    assert len(cold_cache) == 1
    assert kernel.current(start=False) is None and len(cold_cache) == 1
    path = kernel.binary_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".lock").write_text(f"{os.getpid()} {time.time():.3f} {platform.node()}\n")
    assert kernel.current() is None
    assert time.perf_counter() - t0 < 1.0
    # a foreground build waits for a live lock for a bounded time, then says so
    with pytest.raises(RuntimeError, match="another process has been building"):
        kernel.build(wait=0.3)


def _without_core(monkeypatch) -> None:
    """As an install where mpscope._core could not be compiled."""
    monkeypatch.setattr(kernel, "core", lambda: None)
    monkeypatch.setattr(kernel, "_core_module", lambda: None)


@pytest.mark.parametrize("core", [True, False], ids=["core", "no-core"])
def test_a_recorder_on_a_cold_cache_records_meanwhile_and_starts_the_build(cold_cache, monkeypatch, core):
    """A CPU run on a cold cache records through mpscope._core and starts the extension's build
    when it detaches (a build beside its steps would slow them); without mpscope._core it records
    through the torch ops and starts the build when it attaches."""
    if not core:
        _without_core(monkeypatch)
    assert (kernel.core() is not None) == core
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mpscope.record(model, optimizer=opt) as rec:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        assert len(cold_cache) == (0 if core else 1)
        assert (rec._observer.fused is not None) == core and rec._observer.kern is None
    assert len(cold_cache) == 1
    assert rec.run.meta["fused_kernel_from_step"] is None and len(rec.run.tensors) > 0


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _data(steps: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 16, generator=g) * 10 ** (k - 2), torch.randn(64, 4, generator=g)) for k in range(steps)]


def _train(model_seed: int, current, steps: int = 4, before_step=None, core=None):
    """Train the small model under autocast float16 with every step recorded; ``current`` replaces
    ``kernel.current`` (None: the real one), ``core`` replaces ``kernel.core`` (None: the real one,
    False: no mpscope._core), ``before_step(i)`` runs before step i."""
    model = _model(model_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    data = _data(steps)
    real, real_core = kernel.current, kernel.core
    kernel.current = current or real
    kernel.core = (lambda: None) if core is False else (core or real_core)
    try:
        with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
            for i, (x, y) in enumerate(data):
                if before_step is not None:
                    before_step(i)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    finally:
        kernel.current, kernel.core = real, real_core
    return rec.run


def test_switching_paths_mid_run_changes_no_value():
    """The PyTorch extension, mpscope._core and the torch ops, from the start and switched at a step
    boundary (to the extension once it is built): the same rows."""
    fused = kernel.load()
    if fused is None:
        pytest.skip("the fused kernel cannot be built here")
    core = kernel.core()
    assert core is not None, "mpscope._core was not compiled: reinstall mpscope (pip install -e .)"

    def later():  # "building" while the recorder attaches and for steps 0 and 1
        calls = []

        def current(start=True):
            calls.append(1)
            return fused if len(calls) > 3 else None
        return current

    runs = {"torch": _train(0, lambda start=True: None, core=False),
            "core": _train(0, lambda start=True: None, core=lambda: core),
            "fused": _train(0, lambda start=True: fused),
            "torch, then fused": _train(0, later(), core=False),
            "core, then fused": _train(0, later(), core=lambda: core)}
    assert runs["torch"].meta["fused_kernel_from_step"] is None
    assert runs["core"].meta["fused_kernel_from_step"] is None
    assert runs["fused"].meta["fused_kernel_from_step"] == 0
    assert runs["torch, then fused"].meta["fused_kernel_from_step"] == 2
    assert runs["core, then fused"].meta["fused_kernel_from_step"] == 2
    ref = runs["torch"]
    assert len(ref.tensors) > 20 and ref.steps.recorded.all()
    for name in ("core", "fused", "torch, then fused", "core, then fused"):
        got = runs[name]
        assert got.tensors.equals(ref.tensors), name
        assert got.histograms.equals(ref.histograms), name
    # and the rows are the cast oracle's: fp16 underflow of the first activation at every step
    t = ref.tensors
    assert (t.role == "activation").any()
    for v in t[(t.role == "loss")].fp16_underflow_frac:
        assert v == 0.0 and not math.isnan(v)


def test_build_kernel_command(capsys, monkeypatch):
    if kernel.load() is None:
        pytest.skip("the fused kernel cannot be built here")
    assert main(["build-kernel"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == str(kernel.binary_path()) and kernel.binary_path().exists()
    assert f"cache key {kernel.cache_key(kernel.build_spec())}" in out[1] and "torch=" in out[1]
    monkeypatch.setenv("MPSCOPE_KERNEL", "torch")
    assert main(["build-kernel"]) == 2


@pytest.fixture
def built():
    """The path of this environment's binary in the default cache (built if need be)."""
    if kernel.load() is None:
        pytest.skip("the fused kernel cannot be built here (no C++ compiler / ninja)")
    # (not the module's __file__: a kernel this process compiled itself names its build directory,
    # which is gone once the binary has moved into the cache)
    return kernel.binary_path()


def test_stale_build_lock_left_by_a_killed_build_is_taken_over(built, cold_cache, monkeypatch):
    """A process killed during the build (a notebook restart) leaves its lock behind: an hour-old
    lock is removed, the build runs and the kernel loads."""
    import os
    import platform
    import shutil

    monkeypatch.setattr(kernel, "_compile", lambda d, name: Path(shutil.copyfile(built, d / f"{name}.so")))
    lock = kernel.binary_path().with_suffix(".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(f"{os.getpid()} {time.time() - 3600:.3f} {platform.node()}\n")
    t0 = time.monotonic()
    assert kernel.load() is not None
    assert time.monotonic() - t0 < 30 and not lock.exists() and kernel.binary_path().exists()


def test_live_build_lock_is_waited_on_with_a_timeout_then_the_torch_path(cold_cache, monkeypatch):
    """Another process building right now (a fresh lock that does not go away): wait at most
    LOCK_WAIT_S, leave its lock alone, warn, and compute the same stats on the torch-op path."""
    import os
    import platform

    from mpscope.stats import tensor_stats

    monkeypatch.setattr(kernel, "LOCK_WAIT_S", 0.5)
    lock = kernel.binary_path().with_suffix(".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(f"{os.getpid()} {time.time():.3f} {platform.node()}\n")
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="another process has been building"):
        assert kernel.load() is None
    assert time.monotonic() - t0 < 10
    assert lock.exists()
    x = torch.tensor([1e-8, 7e4, 1.0, 0.0], dtype=torch.float32)
    s = tensor_stats(x)
    assert s["fp16_overflow_frac"] == float((x.to(torch.float16).isinf()).float().mean())
    assert s["fp16_underflow_frac"] == float(((x.to(torch.float16) == 0) & (x != 0)).float().mean())


@pytest.mark.parametrize("core", [True, False], ids=["core", "no-core"])
def test_rows_are_identical_whatever_state_the_kernel_is_in(built, cold_cache, monkeypatch, core):
    """Through the real kernel state: not built and building (the recorder never waits), disabled,
    failed to build, ready from the start, and built while the run goes on (switched at a step
    boundary), with mpscope._core recording meanwhile and without it: the same rows, and the rows
    are the casts' (first activation of step 0)."""
    import shutil

    if not core:
        _without_core(monkeypatch)

    def ready_now():  # what the background build's waiting thread does when the build is done
        kernel.binary_path().parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, kernel.binary_path())
        kernel._load_cached()
        kernel._STATE.thread = None

    runs = {"building": _train(0, None)}
    assert len(cold_cache) == 1 and runs["building"].meta["fused_kernel_from_step"] is None
    monkeypatch.setenv("MPSCOPE_KERNEL", "torch")
    runs["disabled"] = _train(0, None)
    monkeypatch.delenv("MPSCOPE_KERNEL")
    monkeypatch.setattr(kernel, "_STATE", kernel._State())
    kernel._STATE.failed = True
    runs["failed"] = _train(0, None)
    monkeypatch.setattr(kernel, "_STATE", kernel._State())
    runs["built mid-run"] = _train(0, None, before_step=lambda i: ready_now() if i == 2 else None)
    # without mpscope._core a second cold start began a build, done before step 2; with it, the run
    # began none (the binary came from elsewhere: another process, %load_ext), nor at its end
    assert len(cold_cache) == (1 if core else 2)
    assert runs["built mid-run"].meta["fused_kernel_from_step"] in (2, 3)
    runs["ready"] = _train(0, None)
    assert runs["ready"].meta["fused_kernel_from_step"] == 0 and len(cold_cache) == (1 if core else 2)
    ref = runs.pop("ready")
    assert len(ref.tensors) > 20 and ref.steps.recorded.all()
    for name, run in runs.items():
        assert run.tensors.equals(ref.tensors), name
        assert run.histograms.equals(ref.histograms), name
    # the first Linear's float16 output at step 0, against the casts
    x0 = _data(1)[0][0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        out = _model(0)[0](x0)
    assert out.dtype == torch.float16
    row = ref.tensors[(ref.tensors.step == 0) & (ref.tensors.module == "0") & (ref.tensors.role == "activation")].iloc[0]
    o = out.double()
    assert row.numel == out.numel() and row["max"] == float(o.max()) and row["min"] == float(o.min())
    assert row.zero_frac == float((o == 0).double().mean())
    assert row.bf16_underflow_frac == float(((out.to(torch.bfloat16) == 0) & (out != 0)).double().mean())
    assert row.absmin_nonzero == float(o[o != 0].abs().min())


@pytest.mark.parametrize("idle", [True, False], ids=["core-present", "no-core"])
def test_the_background_build_runs_at_a_low_priority(idle):
    """The build process lowers its priority before importing anything, so that compiling takes only
    the CPU time training leaves (with mpscope._core taking the statistics meanwhile: only idle CPU
    time, SCHED_IDLE); the compiler processes it starts inherit it. Read back from the OS."""
    import os

    if not hasattr(os, "nice"):
        pytest.skip("no process priorities on this platform")
    prelude = kernel._low_priority(idle)
    assert kernel._builder(idle).startswith(prelude)
    policy = "SCHED_IDLE" if idle else "SCHED_BATCH"
    probe = prelude + (
        "import subprocess\n"
        f"print(os.nice(0), getattr(os, 'sched_getscheduler', lambda p: -1)(0) == getattr(os, '{policy}', -1))\n"
        "print(subprocess.run([sys.executable, '-c', 'import os; print(os.nice(0))'], capture_output=True, "
        "text=True).stdout)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    want = kernel.IDLE_BUILD_NICE if idle else kernel.BUILD_NICE
    assert out[0] == out[2] == str(want)  # the builder and a child it starts
    assert out[1] == str(hasattr(os, policy))


@pytest.mark.parametrize("idle", [True, False])
def test_the_builder_process_starts_at_its_low_priority(idle):
    """The build process is spawned from a thread whose policy is lowered first, so it starts at
    that policy (Python's own start-up included); the spawning thread keeps its own."""
    import os

    if not sys.platform.startswith("linux"):
        pytest.skip("scheduling policies per thread are Linux's")
    before = os.sched_getscheduler(0)
    proc = kernel._spawn([sys.executable, "-S", "-c", "import os; print(os.sched_getscheduler(0))"], idle,
                         stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert int(out) == (os.SCHED_IDLE if idle else os.SCHED_BATCH)
    assert os.sched_getscheduler(0) == before
    with pytest.raises(FileNotFoundError):
        kernel._spawn(["/nonexistent/mpscope-builder"], idle)


def test_the_build_idles_only_where_the_core_takes_the_statistics(cold_cache, monkeypatch):
    """With mpscope._core the background build starts at idle priority, without it at niceness 5."""
    monkeypatch.setattr(kernel, "_start_background", _REAL_START)
    started = []

    class _Proc:
        pid = 0

        def wait(self, timeout=None):
            return 1

    def popen(argv, **kw):
        started.append(argv[-1])
        return _Proc()

    monkeypatch.setattr(kernel.subprocess, "Popen", popen)
    monkeypatch.setattr(kernel, "_fail", lambda e: None)
    for core in (True, False):
        monkeypatch.setattr(kernel, "_core_module", (lambda: object()) if core else (lambda: None))
        kernel._start_background()
        th = kernel._STATE.thread  # (None once its wait for the fake build has ended)
        if th is not None:
            th.join(5)
    assert started == [kernel._builder(True), kernel._builder(False)]


def test_a_build_for_the_next_run_says_so_and_a_busy_builder_is_no_failure(cold_cache, monkeypatch, capsys):
    """The build a CPU recording starts at its detach is announced as one for the next run that goes
    on after the process exits; a builder that found another process building (exit status _BUSY)
    is no failure: the kernel is looked for again later, nothing is warned."""
    monkeypatch.setattr(kernel, "_start_background", _REAL_START)
    failed = []
    monkeypatch.setattr(kernel, "_fail", failed.append)

    class _Proc:
        pid = 4242

        def wait(self, timeout=None):
            return kernel._BUSY

    monkeypatch.setattr(kernel.subprocess, "Popen", lambda argv, **kw: _Proc())
    kernel.build_for_next_run()
    th = kernel._STATE.thread
    if th is not None:
        th.join(5)
    err = capsys.readouterr().err
    assert "for the next run (pid 4242" in err and "goes on after this process exits" in err
    assert failed == [] and kernel._STATE.other_until > time.monotonic()
    assert kernel.current() is None  # (looked for again only after OTHER_RECHECK_S)


@pytest.mark.parametrize("staged", [False, True], ids=["host-rows", "staged-rows"])
def test_a_kernel_cache_that_cannot_be_written_never_stops_a_recording(staged, tmp_path, monkeypatch):
    """``MPSCOPE_CACHE_DIR`` (or the home directory it defaults to) that cannot be made or written (a
    read-only home in a container; here a path below a regular file): the recorder attaches on the
    CPU and through the staged rows of an accelerator run (which start the kernel build at attach
    too), warns once that the kernel cannot be built, and records the rows of the torch-op path."""
    from mpscope.recording.step_buffer import StepBuffer

    monkeypatch.setattr(StepBuffer, "stage_cpu", staged)
    monkeypatch.delenv("MPSCOPE_KERNEL", raising=False)
    want = _train(0, lambda start=True: None, steps=2)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MPSCOPE_CACHE_DIR", str(blocker / "kernels"))
    monkeypatch.setattr(kernel, "_STATE", kernel._State())
    with pytest.warns(RuntimeWarning, match="could not be built") as caught:
        got = _train(0, None, steps=2)
    said = [str(w.message) for w in caught if "could not be built" in str(w.message)]
    assert len(said) == 1 and "accelerator" in said[0]  # (it says what a GPU run does without it)
    assert kernel.current() is None and kernel.load() is None  # (failed: asked again, no new attempt)
    assert got.meta["fused_kernel_from_step"] is None and len(got.tensors) > 10
    assert got.tensors.equals(want.tensors) and got.histograms.equals(want.histograms)
