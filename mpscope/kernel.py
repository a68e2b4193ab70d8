"""The fused CPU stats kernel (``_kernel.cpp``): built once with ``torch.utils.cpp_extension.load``.

It reads each tensor once and computes every count, min/max and the exponent histogram in that
pass (about the cost of one elementwise op), where the torch-op path of :mod:`mpscope.stats` needs
about ten, on PyTorch's intra-op threads. Results are identical; the tests run both against the
cast oracle.

The build (C++ compiler and ninja; about half a minute, cached by PyTorch under
``$TORCH_EXTENSIONS_DIR`` / ``~/.cache/torch_extensions``) happens on first use. If it fails, or if
the environment variable ``MPSCOPE_KERNEL=torch`` is set, mpscope uses the torch-op path and says so
once through :mod:`warnings`.

PyTorch guards a build with a ``lock`` file in the build directory and waits for it to disappear,
without a timeout; a process killed mid-build (a notebook kernel restart) leaves it behind. A lock
older than :data:`LOCK_STALE_S` is such a leftover and is removed; a younger one (another process
building right now) is waited on for at most :data:`LOCK_WAIT_S`, then the torch-op path is used.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import warnings
from functools import lru_cache
from pathlib import Path

import torch

from mpscope.formats import BF16, FP16, FORMATS

_SOURCE = Path(__file__).with_name("_kernel.cpp")
#: A build lock older than this (seconds) is stale: the build takes about a minute on 2 CPU cores,
#: so after ten minutes its process is gone.
LOCK_STALE_S = 600.0
#: Longest wait (seconds) on a live build lock of another process before falling back.
LOCK_WAIT_S = 180.0


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


def _openmp_flags() -> list[str]:
    """``-fopenmp`` where PyTorch's own intra-op threads are OpenMP (Linux wheels; the extension then
    uses the ``libgomp`` PyTorch already loaded, so ``at::parallel_for`` really runs on
    ``torch.get_num_threads()`` threads). Elsewhere (e.g. Apple clang, which has no ``-fopenmp``) the
    kernel is built without it and ``at::parallel_for`` runs on the calling thread only."""
    if sys.platform.startswith("linux") and "parallel backend: OpenMP" in torch.__config__.parallel_info():
        return ["-fopenmp"]
    return []


def build_name() -> str:
    """The extension's name, which is also its build directory's name (it changes with the source)."""
    return f"mpscope_kernel_{hashlib.sha1(_SOURCE.read_bytes()).hexdigest()[:10]}"


@lru_cache(maxsize=1)
def load():
    """The compiled extension module, or None when it is disabled or cannot be built."""
    if os.environ.get("MPSCOPE_KERNEL", "").lower() == "torch":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as _load

        name = build_name()
        if not (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists():
            print(f"mpscope: compiling the fused CPU stats kernel (once; about a minute; cached under "
                  f"{Path(_get_build_directory(name, verbose=False)).parent})", file=sys.stderr, flush=True)
        if not _lock_cleared(Path(_get_build_directory(name, verbose=False)) / "lock"):
            warnings.warn(
                f"mpscope: another process has been building the fused CPU stats kernel for over {LOCK_WAIT_S:.0f} s "
                "(its lock file is still there); using the slower torch-op path in this process.",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        omp = _openmp_flags()
        return _load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", *omp],
            extra_ldflags=omp,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, read-only cache ...
        warnings.warn(
            f"mpscope: the fused CPU stats kernel could not be built ({type(e).__name__}: {str(e)[:200]}); "
            "using the slower torch-op path. Install a C++ compiler and `pip install ninja` for the fast path.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _lock_cleared(lock: Path) -> bool:
    """Whether PyTorch can take the build lock ``lock`` without waiting forever.

    No lock: True. A lock older than :data:`LOCK_STALE_S` (its builder died): removed, True. A
    younger one: polled until it goes (True), turns stale (removed, True) or :data:`LOCK_WAIT_S`
    passes (False).
    """
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return True
        if age > LOCK_STALE_S:
            try:
                lock.unlink()
            except FileNotFoundError:
                pass
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(0.2, LOCK_WAIT_S))


def device_stats(module, tensors: list[torch.Tensor], hist: bool):
    """Run the fused kernel over CPU float16/bfloat16/float32 tensors -> :class:`mpscope.stats.DeviceStats`."""
    from mpscope.stats import DeviceStats

    # the kernel reads raw data (autograd is off inside it); tensors that need grad pass as they are
    counts, extrema = module.fused_stats(tensors, [_TINY_BITS[t.dtype] for t in tensors], CAST_BITS, hist)
    return DeviceStats(counts, extrema, hist)
