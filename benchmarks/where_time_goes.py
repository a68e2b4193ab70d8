"""Where mpscope's per-step cost goes: the stats kernel, its histogram, and the Python around it.

Run ``python benchmarks/where_time_goes.py`` (about two minutes on a 2-core CPU). Four parts:

1. **Step split** on the small GPT of ``benchmarks/overhead.py`` (bf16 CPU autocast, AdamW): in
   each round, median step time of ``--steps`` steps unhooked, fully recorded, fully recorded with
   histograms on the first step only (``hist_every`` huge), and fully recorded with the stats kernel
   replaced by a stub that returns zeros (what is left is hooks, bookkeeping and the host copy),
   fully recorded with the kernel replaced by one ``torch.sum`` per tensor (``read_only``: one read
   of the same tensors at the same moments by PyTorch's own vectorized reduction; the tensors are
   read where they lie, mostly no longer in the core's caches, which the kernel pays too), and, for
   scale, no mpscope at all but a no-op forward hook on every module that registers a
   no-op tensor hook on each output (PyTorch's own price of hooks of that kind).
   Medians over rounds of the differences to the unhooked step of the same round.
   **Host path per tensor**: in the kernel-stubbed blocks, the time spent inside mpscope's entry
   points (the functions PyTorch and mpscope's patches call: the root pre-hook, the forward hooks,
   the gradient hooks, the parameter post-accumulate hooks, the optimizer's step post-hook with the
   step end, parameter batch and host copy, and everything run through ``Recorder._safe``), per
   recorded step, divided by the tensors observed per step: mpscope's own Python per tensor,
   without PyTorch's price of calling a hook. The whole-step difference (kernel stubbed minus no-op
   hooks, per tensor) is printed too; on a shared 2-core machine it moves by several microseconds
   from run to run.
2. **Host path, launch-bound**: the same time inside mpscope's entry points (kernel stubbed) on
   the same module tree at d_model 32, sequence 16, batch 2, whose ops take microseconds: the
   host path as it runs on a GPU host (the CPU launches kernels, its caches stay warm), where the
   small GPT's CPU ops leave each hook to run on cold caches. Twice: as a CPU run records (the
   fused kernel writes each tensor's stats into the step's host rows), and as a GPU run records
   (:func:`as_a_gpu_run_records`: each observed tensor is copied into the step's staging buffer,
   one copy, and the stats are taken in batched passes into rows the step end copies to the host),
   the figure that counts for a GPU host. The stub stands in for the statistics' own work, which
   it leaves out: the batched pass (one compiled call per full staging buffer and per step on a
   GPU) and the staging copies' data movement (each copy is still dispatched, into a ``meta``
   buffer; a GPU host adds the copy's launch call).
   **Ops on the GPU path** (counted, not timed: the same on any machine): the ATen ops mpscope
   dispatches in a recorded step of the tiny GPT as a GPU run records, with the statistics' own
   torch ops (the function CUDA compiles, run eagerly here) in place of the fused kernel: per
   observed tensor, and the number of batched statistics passes per step. On a GPU each op is a
   kernel launch or less, and each statistics pass one compiled call.
3. **In-step reads**: the kernel's calls timed where they happen, during fully recorded steps
   (``--steps`` steps, alternately with the kernel and with one ``torch.sum`` per tensor in its
   place, so that both read tensors the same training left in the same caches): milliseconds per
   step and nanoseconds per element by dtype and call size. Unlike the step split, these are timed
   around the calls themselves and move little with the machine's load.
4. **Kernel throughput**: best-of-N time of the fused CPU kernel on one contiguous tensor of each
   dtype and size, with and without the exponent histogram, on 1 and on all intra-op threads,
   in nanoseconds per element (hot caches: the same tensor again and again).

The last line printed is a JSON object of all parts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402

import mpscope  # noqa: E402
from mpscope import kernel, stats  # noqa: E402
from mpscope.recorder import Recorder  # noqa: E402
from mpscope.recording.activations import ActivationHooks  # noqa: E402
from mpscope.recording.clock import StepClock  # noqa: E402
from mpscope.recording.observer import Observer  # noqa: E402
from mpscope.recording.step_buffer import StagedRows, StepBuffer  # noqa: E402
from mpscope.demo import GPT, CharDataset, GPTConfig  # noqa: E402


def stub_stats(module, tensors, hist):
    """Stand-in for :func:`mpscope.kernel.fused_stats` of the right shape that reads nothing: the
    first rows of zero tables made once (contiguous, as the kernel's own results). Fresh zeros would
    time a host memset of up to 1 MB a step (a GPU run's batch and staged rows with histograms),
    work that no statistics pass does on a GPU host; mpscope only reads these results."""
    n, width = len(tensors), 10 + (279 if hist else 0)
    zeros = _STUB_ZEROS.get(width)
    if zeros is None or len(zeros[0]) < n:
        zeros = _STUB_ZEROS[width] = (torch.zeros(max(n, 1024), width, dtype=torch.long),
                                      torch.zeros(max(n, 1024), 3, dtype=torch.double))
    return zeros[0][:n], zeros[1][:n]


_STUB_ZEROS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # counts width -> (counts, extrema)


def stub_stats_into(module, tensors, hist, counts, extrema, row):
    """Stand-in for :func:`mpscope.kernel.fused_stats_into` that reads and writes nothing (the rows
    keep what they hold: zeros)."""


def read_stats_into(module, tensors, hist, counts, extrema, row):
    """Stand-in for :func:`mpscope.kernel.fused_stats_into` that reads each tensor once with
    PyTorch's own reduction (``torch.sum``, vectorized, on the intra-op threads) and writes nothing:
    what one read of the same tensors at the same moments costs."""
    for t in tensors:
        t.sum()


def read_stats(module, tensors, hist):
    read_stats_into(module, tensors, hist, None, None, 0)
    return stub_stats(module, tensors, hist)


@contextlib.contextmanager
def stats_kernel(stubbed: bool | str):
    """The fused kernel's entry points, replaced by stubs that read nothing when ``stubbed`` (True)
    or by one ``torch.sum`` per tensor when ``stubbed == "read"``."""
    real = kernel.fused_stats, getattr(kernel, "fused_stats_into", None)
    if stubbed == "read":
        kernel.fused_stats, kernel.fused_stats_into = read_stats, read_stats_into
    elif stubbed:
        kernel.fused_stats, kernel.fused_stats_into = stub_stats, stub_stats_into
    try:
        yield
    finally:
        kernel.fused_stats, kernel.fused_stats_into = real


@contextlib.contextmanager
def noop_hooks(model):
    """A no-op forward hook on every module, registering a no-op hook on each output tensor."""

    def on_grad(grad):
        return None

    def on_output(module, args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(on_grad)

    handles = [m.register_forward_hook(on_output) for m in model.modules()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def observed_per_step(work, model, opt) -> int:
    """Tensors observed in one recorded step of ``work`` (hook observations and the step end's
    batch), counted with the kernel's C++ hook path off: then every single-tensor observation goes
    through ``Observer.observe_now`` (the hooks call it directly; the C++ path makes the same
    observations, ``tests/test_hook_path.py``); the step end gathers its batch with
    ``parameter_batch.gather``."""
    from mpscope.recording import parameter_batch

    counted = {"n": 0}
    obs, gather, begin = Observer.observe_now, parameter_batch.gather, Observer.begin_step

    def count_obs(self, *a, **k):
        counted["n"] += 1
        return obs(self, *a, **k)

    def count_batch(*a):
        tensors, form = gather(*a)
        counted["n"] += len(tensors)
        return tensors, form

    def python_form(self, *a):
        begin(self, *a)
        self.fast = None

    Observer.observe_now, parameter_batch.gather, Observer.begin_step = count_obs, count_batch, python_form
    try:
        with mpscope.record(model, optimizer=opt):
            work.step(model, opt, 0)
            counted["n"] = 0
            work.step(model, opt, 1)
    finally:
        Observer.observe_now, parameter_batch.gather, Observer.begin_step = obs, gather, begin
    return counted["n"]


def tiny_gpt_workload():
    """The small GPT's module tree (4 layers, 4 heads: the same modules, parameters and observed
    tensors) at d_model 32, sequence 16, batch 2: its ops take microseconds, so the host path runs
    as on a GPU host, where the CPU only launches kernels and its caches stay warm."""
    data = CharDataset.from_stdlib(16)
    cfg = GPTConfig(vocab_size=data.vocab_size, d_model=32, n_layer=4, n_head=4, seq_len=16)
    gen = data.generator(0)
    return overhead.Workload("tiny_gpt", "tiny GPT (d_model 32, 4 layers, seq 16, batch 2), bf16 CPU autocast, AdamW",
                             lambda: GPT(cfg), [data.batch(2, gen) for _ in range(4)],
                             lambda m, x, y: m(x, y)[1])


@contextlib.contextmanager
def as_a_gpu_run_records(stubbed: bool = True):
    """Recorders take a GPU run's path on the CPU: each observed tensor is staged
    (:class:`mpscope.recording.step_buffer.StagedRows`: one copy into the staging buffer, the stats
    taken in batched passes). With ``stubbed``, the statistics' device work is left out as the
    stubbed kernel leaves it out: the batched pass returns zeros (like :func:`stub_stats`) and the
    staging buffer is on the ``meta`` device, so each staging copy is dispatched like any op but
    moves no data (on a GPU the copy runs on the device; the host adds its launch call)."""
    real = stats.staged_stats, StagedRows.__init__
    StepBuffer.stage_cpu = True
    if stubbed:
        def init_on_meta(self, *args, **kwargs):
            real[1](self, *args, **kwargs)
            self.buffer = torch.empty(self.elements, dtype=torch.float32, device="meta")

        stats.staged_stats = lambda flat, sizes, fp16, hist: stats.DeviceStats(*stub_stats(None, sizes, hist), hist)
        StagedRows.__init__ = init_on_meta
    try:
        yield
    finally:
        StepBuffer.stage_cpu = False
        stats.staged_stats, StagedRows.__init__ = real


def warm_tiny_gpt():
    """:func:`tiny_gpt_workload` with its model and AdamW after 3 steps, and the tensors one of its
    recorded steps observes: ``(work, model, optimizer, tensors per step)``."""
    work = tiny_gpt_workload()
    torch.manual_seed(0)
    model = work.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(3):
        work.step(model, opt, i)
    n_obs = observed_per_step(work, model, opt)
    return work, model, opt, n_obs


def launch_bound_host(rounds: int, steps: int, device_path: bool = False) -> dict:
    """Host path per observed tensor (time inside mpscope's entry points, stats kernel stubbed, as
    in the step split) on :func:`tiny_gpt_workload`: medians over ``rounds`` rounds of ``steps``
    recorded steps; with ``device_path``, as a GPU run records (:func:`as_a_gpu_run_records`)."""
    work, model, opt, n_obs = warm_tiny_gpt()
    per_step, step_ms = [], []
    for r in range(rounds):
        rows = as_a_gpu_run_records() if device_path else contextlib.nullcontext()
        with stats_kernel(True), rows, entry_timer() as spent, mpscope.record(model, optimizer=opt):
            work.step(model, opt, 0)
            spent["s"] = 0.0
            t = time.perf_counter()
            for i in range(steps):
                work.step(model, opt, i)
            step_ms.append((time.perf_counter() - t) * 1e3 / steps)
        per_step.append(spent["s"] * 1e3 / steps)
    ms = statistics.median(per_step)
    out = {"tensors_per_step": n_obs, "step_ms": round(statistics.median(step_ms), 2), "in_hooks_ms": round(ms, 3),
           "host_us_per_tensor": round(ms * 1e3 / max(n_obs, 1), 2)}
    print(f"   {n_obs} tensors observed per recorded step; recorded step {out['step_ms']:.1f} ms, of which "
          f"{ms:.2f} ms inside mpscope's entry points = {out['host_us_per_tensor']:.2f} us per tensor")
    out["hooks_hot"] = hook_path_micro(work, model, opt, device_path)
    return out


def hook_path_micro(work, model, opt, device_path: bool = False, n: int = 400, rounds: int = 30) -> dict:
    """Microseconds of the hooks alone, hot (statistics stubbed; with ``device_path`` as a GPU run
    records them): the forward hook on a module's fresh bfloat16 output that requires grad (its
    activation row and the gradient hook it registers) and the gradient hook's entry on a fresh
    gradient (its row), ``n`` of each per round, best of ``rounds`` rounds, inside a recorded step
    of :func:`warm_tiny_gpt`'s ``work``, ``model`` and ``opt``. Returns ``{"forward_hook": us, "gradient": us, "per_tensor": us}``,
    per_tensor being their mean (each activation observes two tensors)."""
    mods = list(model.modules())[1:]
    w = torch.randn(16, 32, requires_grad=True)
    grads = [torch.randn(16, 32, dtype=torch.bfloat16) for _ in range(n)]
    fwd, grad = float("inf"), float("inf")
    rows = as_a_gpu_run_records() if device_path else contextlib.nullcontext()
    with stats_kernel(True), rows, mpscope.record(model, optimizer=opt) as rec:
        work.step(model, opt, 0)
        hooks, state = rec._activations, rec._state
        rec._ledger.forward_began(True, -1)  # a forward pass of the model is running
        pass_id = state.pass_id
        for _ in range(rounds):
            outs = [(w * 1.5).to(torch.bfloat16) for _ in range(n)]
            t0 = time.perf_counter()
            for i, o in enumerate(outs):
                hooks.forward_hook(mods[i % len(mods)], (), o)
            t1 = time.perf_counter()
            for i, g in enumerate(grads):
                hooks.gradient(f"m{i % 50}", "output", pass_id, g)
            t2 = time.perf_counter()
            fwd, grad = min(fwd, (t1 - t0) / n), min(grad, (t2 - t1) / n)
            rec._drain(True)  # hands the rows to the Run: the step's rows start over
            hooks.grad_hooks.clear()
        rec._ledger.forward_ended(False)
    out = {"forward_hook": round(fwd * 1e6, 2), "gradient": round(grad * 1e6, 2),
           "per_tensor": round((fwd + grad) * 1e6 / 2, 2)}
    print(f"   the hooks alone, hot (statistics stubbed): forward hook {out['forward_hook']:.2f} us (activation row "
          f"and gradient hook), gradient {out['gradient']:.2f} us: {out['per_tensor']:.2f} us per hooked tensor")
    return out


def gpu_path_ops() -> dict:
    """ATen ops mpscope dispatches per recorded step of :func:`tiny_gpt_workload` as a GPU run
    records (:func:`as_a_gpu_run_records`, the statistics as the torch ops of
    :func:`mpscope.stats.batch_stats`, no fused kernel): a recorded step's ops minus an unhooked
    step's, per step and per observed tensor, and the statistics passes (``batch_stats`` calls)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    work, model, opt, n_obs = warm_tiny_gpt()
    with Count() as plain:
        work.step(model, opt, 0)
    passes = {"n": 0}
    real = stats.batch_stats, stats._cpu_stats, Observer.begin_step

    def counted(*a, **k):
        passes["n"] += 1
        return real[0](*a, **k)

    def begin_without_kernel(self, *a, **k):
        out = real[2](self, *a, **k)
        self.fused = None  # the parameter batches take the torch ops too
        return out

    stats.batch_stats, stats._cpu_stats, Observer.begin_step = counted, stats._torch_stats, begin_without_kernel
    stats._compiled_batch_stats.cache_clear()
    try:
        with as_a_gpu_run_records(stubbed=False), mpscope.record(model, optimizer=opt):
            work.step(model, opt, 0)
            passes["n"] = 0
            with Count() as recorded:
                work.step(model, opt, 1)
    finally:
        stats.batch_stats, stats._cpu_stats, Observer.begin_step = real
        stats._compiled_batch_stats.cache_clear()
    ops = recorded.n - plain.n
    out = {"tensors_per_step": n_obs, "ops_per_step": ops, "ops_per_tensor": round(ops / n_obs, 2),
           "stats_passes_per_step": passes["n"]}
    print(f"   {n_obs} tensors observed per recorded step: {ops} ATen ops by mpscope ({out['ops_per_tensor']:.1f} "
          f"per tensor), {passes['n']} batched statistics passes")
    return out


def step_split(rounds: int, steps: int) -> dict:
    work = overhead.gpt_workload(4)
    torch.manual_seed(0)
    model = work.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def median_step() -> float:
        times = []
        for i in range(steps):
            t = time.perf_counter()
            work.step(model, opt, i)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    for i in range(3):
        work.step(model, opt, i)
    n_obs = observed_per_step(work, model, opt)
    modes = {"full": (False, {}), "no_histograms": (False, {"hist_every": 10**9}), "kernel_stubbed": (True, {}),
             "read_only": ("read", {})}
    extra = {m: [] for m in (*modes, "noop_hooks")}
    base_ms, in_hooks_ms = [], []
    for r in range(rounds):
        base = median_step()
        base_ms.append(base)
        line = [f"none {base:.1f}"]
        for name, (stubbed, kw) in modes.items():
            timer = entry_timer() if stubbed is True else contextlib.nullcontext({})
            with stats_kernel(stubbed), timer as spent, mpscope.record(model, optimizer=opt, **kw):
                work.step(model, opt, 0)  # the first recorded step (always with histograms)
                spent["s"] = 0.0
                ms = median_step()
            if stubbed is True:
                in_hooks_ms.append(spent["s"] * 1e3 / steps)
            extra[name].append(ms - base)
            line.append(f"{name} {ms:.1f}")
        with noop_hooks(model):
            ms = median_step()
        extra["noop_hooks"].append(ms - base)
        line.append(f"noop_hooks {ms:.1f}")
        print(f"   round {r + 1}/{rounds}: " + ", ".join(line) + " ms/step", flush=True)
    base = statistics.median(base_ms)
    out = {"base_ms": round(base, 1)}
    for name, v in extra.items():
        out[f"{name}_extra_ms"] = round(statistics.median(v), 1)
    full = out["full_extra_ms"]
    out["tensors_per_step"] = n_obs
    out["in_hooks_ms"] = round(statistics.median(in_hooks_ms), 2)
    out["host_us_per_tensor"] = round(out["in_hooks_ms"] * 1e3 / max(n_obs, 1), 2)
    per = (out["kernel_stubbed_extra_ms"] - out["noop_hooks_extra_ms"]) * 1e3 / max(n_obs, 1)
    out["step_diff_us_per_tensor"] = round(per, 1)
    out["host_us_per_tensor_micro"] = round(per_tensor_micro(), 2)
    out["step_end_us_per_tensor_micro"] = round(step_end_micro(), 2)
    out["kernel_ms"] = round(full - out["kernel_stubbed_extra_ms"], 1)
    out["histogram_ms"] = round(full - out["no_histograms_extra_ms"], 1)
    out["read_floor_ms"] = round(out["read_only_extra_ms"] - out["kernel_stubbed_extra_ms"], 1)
    print(f"   {n_obs} tensors observed per recorded step; host path (kernel stubbed): "
          f"{out['in_hooks_ms']:.2f} ms per step inside mpscope's entry points = {out['host_us_per_tensor']:.2f} us "
          f"per tensor; whole-step difference (kernel stubbed minus no-op hooks) "
          f"{out['step_diff_us_per_tensor']:.1f} us per tensor; Observer.observe alone "
          f"{out['host_us_per_tensor_micro']:.2f} us per tensor, the step end's parameter batch alone "
          f"{out['step_end_us_per_tensor_micro']:.2f} us per tensor (micro-benchmarks)")
    print(f"   unhooked step {base:.1f} ms; full recording +{full:.1f} ms ({1 + full / base:.3f}x): "
          f"stats kernel {out['kernel_ms']:.1f} ms (of which exponent histograms {out['histogram_ms']:.1f} ms), "
          f"hooks + bookkeeping + host copy {out['kernel_stubbed_extra_ms']:.1f} ms "
          f"(no-op hooks alone: {out['noop_hooks_extra_ms']:.1f} ms); one torch.sum per recorded tensor "
          f"instead of the kernel: {out['read_floor_ms']:.1f} ms (read_only minus kernel_stubbed)")
    return out


#: The recording's entry points, (class, method): what PyTorch's hooks and callbacks, the optimizer and
#: mpscope's patches call (``Recorder._safe`` runs every patched function's recorder part).
ENTRY_POINTS = tuple((cls, name) for cls, names in (
    (Recorder, ("_optimizer_post_hook", "_adopt_optimizer", "_safe", "_drain", "step")),
    (ActivationHooks, ("root_pre_hook", "root_post_hook", "forward_hook", "gradient", "traced")),
    (StepClock, ("parameter_gradient", "_grads_settled"))) for name in names)


@contextlib.contextmanager
def around_entry_points(enter, leave):
    """Call ``enter()`` when an outermost call into :data:`ENTRY_POINTS` starts and ``leave()`` when
    it ends (calls nested inside one are not seen). The methods are wrapped on the class, so enter
    this before ``mpscope.record``: hooks hold the bound methods of the time they were registered."""
    depth = [0]
    originals = {(cls, name): getattr(cls, name) for cls, name in ENTRY_POINTS}

    def wrapped(f):
        def wrapper(*args, **kwargs):
            if depth[0]:
                return f(*args, **kwargs)
            depth[0] = 1
            enter()
            try:
                return f(*args, **kwargs)
            finally:
                leave()
                depth[0] = 0

        return wrapper

    for (cls, name), f in originals.items():
        setattr(cls, name, wrapped(f))
    try:
        yield
    finally:
        for (cls, name), f in originals.items():
            setattr(cls, name, f)


@contextlib.contextmanager
def entry_timer():
    """Seconds spent inside :data:`ENTRY_POINTS` (outermost calls only), in the yielded dict's
    ``"s"`` (see :func:`around_entry_points`)."""
    spent = {"s": 0.0, "t": 0.0}

    def enter():
        spent["t"] = time.perf_counter()

    def leave():
        spent["s"] += time.perf_counter() - spent["t"]

    with around_entry_points(enter, leave):
        yield spent


def per_tensor_micro(n: int = 500, rounds: int = 40) -> float:
    """Microseconds of the recorder's per-tensor host path alone: ``Observer.observe`` on small
    tensors (half fresh, half seen before in the step: row reuse) with the stats kernel stubbed;
    ``n`` calls per step (a step's worth), best of ``rounds`` steps."""
    model = torch.nn.Linear(4, 4)
    best = float("inf")
    with stats_kernel(True):
        with mpscope.record(model) as rec:
            if kernel.current() is None:
                return float("nan")
            xs = [torch.randn(16) for _ in range(n)]
            names = [f"output.{i}" for i in range(n)]
            observe = rec._observer.observe
            for r in range(rounds):
                rec._drain(True)  # hands the step's rows to the Run: the tables start over
                fresh = [torch.randn(16) for _ in range(n // 2)]
                t = time.perf_counter()
                for i in range(n):
                    observe("layer", "activation", names[i], fresh[i >> 1] if i & 1 else xs[i])
                best = min(best, time.perf_counter() - t)
            rec._drain(True)
    return best * 1e6 / n


def step_end_micro(rounds: int = 40) -> float:
    """Microseconds per tensor of the step end's parameter batch alone (``Observer.record_parameters``:
    the small GPT's parameters, their gradients and AdamW's state, after two recorded steps, so
    with the plan the step before kept) with the stats kernel stubbed; best of ``rounds`` calls."""
    work = overhead.gpt_workload(4)
    torch.manual_seed(0)
    model = work.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    best, n = float("inf"), 0
    with stats_kernel(True):
        with mpscope.record(model, optimizer=opt) as rec:
            if kernel.current() is None:
                return float("nan")
            for i in range(2):
                work.step(model, opt, i)
            for r in range(rounds):
                rec._drain(True)  # hands the rows to the Run: the tables start over
                first = len(rec._state.obs)
                t = time.perf_counter()
                rec._observer.record_parameters(opt, False)
                best = min(best, time.perf_counter() - t)
                n = sum(len(o.keys) for o in rec._state.obs[first:])
            rec._drain(True)
    return best * 1e6 / max(n, 1)


def host_copy_micro(micro_batches: int, rounds: int = 60) -> dict:
    """The host copy of one recorded step of the small GPT alone (``StepBuffer._process``: its rows
    and histogram rows into the Run), real statistics, on hot caches: the third recorded step's
    copy, captured with a copy of the host tables, replayed ``rounds`` times into a fresh Run (best
    kept). ``micro_batches`` > 1 repeats every activation's key in the step (their rows merge)."""
    from mpscope.recording import step_buffer
    from mpscope.run import Run

    work = overhead.gpt_workload(4)
    torch.manual_seed(0)
    model = work.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    real, calls = step_buffer.StepBuffer._process, []

    def capture(self, buf, scalars, layout, log, hist, current, staged=None):
        tables = self.host_tables
        calls.append((self, buf.copy(), list(scalars), list(layout), list(log), hist, current,
                      tables.host_counts.copy(), tables.host_extrema.copy()))
        return real(self, buf, scalars, layout, log, hist, current, staged)

    step_buffer.StepBuffer._process = capture
    try:
        with mpscope.record(model, optimizer=opt):
            if kernel.current() is None:
                return {}
            for i in range(3):
                opt.zero_grad(set_to_none=True)
                for j in range(micro_batches):
                    x, y = work.batches[(i + j) % len(work.batches)]
                    with torch.autocast("cpu", dtype=work.dtype):
                        loss = work.loss_fn(model, x, y)
                    loss.backward()
                opt.step()
    finally:
        step_buffer.StepBuffer._process = real
    buffer, buf, scalars, layout, log, hist, current, counts, extrema = calls[-1]
    best = float("inf")
    for _ in range(rounds):
        tables = buffer.host_tables
        tables.host_counts[: len(counts)] = counts
        tables.host_extrema[: len(extrema)] = extrema
        buffer.builder = Run().builder()
        t = time.perf_counter()
        real(buffer, buf, scalars, layout, log, hist, current)
        best = min(best, time.perf_counter() - t)
    def appended(table) -> int:  # (a fresh Run knows no keys: its frames cannot be built)
        return table.rows_in_memory + table.pending_rows

    rows = appended(buffer.builder._store.tensors)
    out = {"micro_batches": micro_batches, "entries": len(log) + sum(len(o.keys) for o, _ in layout), "rows": rows,
           "hist_rows": appended(buffer.builder._store.histograms), "us": round(best * 1e6, 1)}
    print(f"   {micro_batches} micro-batch(es): {out['entries']} observations -> {rows} rows and "
          f"{out['hist_rows']} histogram rows in {out['us']:.0f} us ({best * 1e6 / max(rows, 1):.2f} us per row)")
    return out


def in_step_reads(steps: int) -> dict:
    """Milliseconds per recorded step spent in the kernel's calls, timed around each call during
    fully recorded steps of the small GPT, against one ``torch.sum`` per tensor in the kernel's
    place on every other step; by (dtype, batch of several tensors or one, size class)."""
    work = overhead.gpt_workload(4)
    torch.manual_seed(0)
    model = work.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    real = kernel.fused_stats_into
    spent: dict = {}
    mode = ["kernel"]

    def timed(module, tensors, hist, counts, extrema, row):
        t = time.perf_counter()
        if mode[0] == "kernel":
            real(module, tensors, hist, counts, extrema, row)
        else:
            read_stats_into(module, tensors, hist, counts, extrema, row)
        dt = time.perf_counter() - t
        n = sum(x.numel() for x in tensors)
        k = (str(tensors[0].dtype).replace("torch.", ""), "batch" if len(tensors) > 1 else "one", 1 << (n.bit_length() - 1))
        cell = spent.setdefault(k, {"kernel": [0, 0.0], "sum": [0, 0.0]})[mode[0]]
        cell[0] += n
        cell[1] += dt

    kernel.fused_stats_into = timed
    try:
        with mpscope.record(model, optimizer=opt):
            for i in range(2):
                work.step(model, opt, i)
            spent.clear()
            for i in range(2 * steps):
                mode[0] = "sum" if i % 2 else "kernel"
                work.step(model, opt, i)
    finally:
        kernel.fused_stats_into = real
    out, total = {}, {"kernel": 0.0, "sum": 0.0}
    print(f"   {'dtype':9s} {'call':5s} {'elements':>9s} {'kernel ms':>9s} {'sum ms':>7s} {'kernel ns/el':>12s} {'sum ns/el':>9s}"
          "   (per recorded step)")
    for k in sorted(spent):
        row = {}
        for m in ("kernel", "sum"):
            n, dt = spent[k][m]
            row[m] = (dt * 1e3 / steps, dt * 1e9 / max(n, 1))
            total[m] += dt * 1e3 / steps
        out["/".join(map(str, k))] = {m: [round(v, 3) for v in row[m]] for m in row}
        print(f"   {k[0]:9s} {k[1]:5s} {k[2]:9d} {row['kernel'][0]:9.2f} {row['sum'][0]:7.2f} {row['kernel'][1]:12.3f} "
              f"{row['sum'][1]:9.3f}")
    out["total_ms"] = {m: round(v, 2) for m, v in total.items()}
    print(f"   per recorded step: the kernel {total['kernel']:.1f} ms, one torch.sum per tensor {total['sum']:.1f} ms")
    return out


def throughput_cases():
    """``(dtype name, elements, threads, tensor)`` of the kernel throughput tables: one contiguous
    tensor of std 0.02 per dtype (bfloat16, float16, float32) and size (2^16, 2^19, 2^22), on 1 and
    on all intra-op threads (set while the case runs)."""
    threads = torch.get_num_threads()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n in (1 << 16, 1 << 19, 1 << 22):
            x = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
            for nt in sorted({1, threads}):
                torch.set_num_threads(nt)
                try:
                    yield str(dtype).replace("torch.", ""), n, nt, x
                finally:
                    torch.set_num_threads(threads)


def best_ns_per_element(module, x: torch.Tensor, hist: bool, reps: int) -> float:
    """Best of ``reps`` calls of ``module.fused_stats`` on ``x``, in nanoseconds per element."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        module.fused_stats([x], [kernel._TINY_BITS[x.dtype]], kernel.CAST_BITS, hist)
        best = min(best, time.perf_counter() - t)
    return best * 1e9 / x.numel()


def kernel_throughput(reps: int) -> dict:
    mod = kernel.load()
    if mod is None:
        print("   the fused kernel is not available here (see mpscope.kernel); skipped")
        return {}
    out = {}
    print(f"   {'dtype':9s} {'elements':>9s} {'threads':>7s} {'no hist':>8s} {'hist':>8s}   (ns per element)")
    for name, n, nt, x in throughput_cases():
        row = [best_ns_per_element(mod, x, hist, reps) for hist in (False, True)]
        out[f"{name}/{n}/{nt}"] = [round(v, 3) for v in row]
        print(f"   {name:9s} {n:9d} {nt:7d} {row[0]:8.3f} {row[1]:8.3f}")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=20, help="repetitions per kernel timing (best is kept)")
    args = ap.parse_args(argv)
    print(f"where the time goes: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if kernel.load() is None:  # build (announced) before timing: steady state is the fused kernel
        print("   the fused kernel is not available: the figures below are the torch-op path's")
    print("== step split (small GPT, full recording)")
    split = step_split(args.rounds, args.steps)
    print("== host path, launch-bound (tiny GPT, full recording, kernel stubbed), as a CPU run records (host rows)")
    launch = launch_bound_host(3 * args.rounds, args.steps)  # (short steps: more rounds for the median)
    print("== host path, launch-bound, as a GPU run records (each tensor staged, stats in batched passes)")
    launch_device = launch_bound_host(3 * args.rounds, args.steps, device_path=True)
    print("== ops on the GPU path (tiny GPT, one recorded step, counted)")
    launch_device["ops"] = gpu_path_ops()
    print("== host copy of one recorded step (small GPT, real statistics, hot loop)")
    copy = [host_copy_micro(m) for m in (1, 2)] if kernel.load() is not None else []
    print("== in-step reads (small GPT, full recording): the kernel's calls against one torch.sum per tensor")
    reads = in_step_reads(args.steps) if kernel.load() is not None else {}
    print("== fused CPU kernel throughput (one contiguous tensor, std 0.02)")
    tput = kernel_throughput(args.reps)
    result = {"step_split": split, "launch_bound": launch, "launch_bound_device_path": launch_device, "host_copy": copy, "in_step_reads": reads,
              "kernel_ns_per_element": tput}
    print("== targets")
    print(f"   {'target':42s} {'measured':>10s}  status")
    for label, value, limit in (("host path per observed tensor <= 5 us", split["host_us_per_tensor"], 5.0),
                                ("... launch-bound (tiny GPT), host rows <= 5 us", launch["host_us_per_tensor"], 5.0),
                                ("... launch-bound, device path (GPU) <= 5 us", launch_device["host_us_per_tensor"], 5.0),
                                ("... hooks alone, hot, host rows <= 5 us", launch["hooks_hot"]["per_tensor"], 5.0),
                                ("... hooks alone, hot, device path <= 5 us", launch_device["hooks_hot"]["per_tensor"], 5.0),
                                ("Observer.observe alone <= 5 us", split["host_us_per_tensor_micro"], 5.0),
                                ("step end's batch alone <= 5 us", split["step_end_us_per_tensor_micro"], 5.0)):
        print(f"   {label:42s} {value:8.1f}us  {'met' if value <= limit else 'NOT met'}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
