"""Building the fused CPU kernel never hangs on a build lock left behind by a killed process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import _get_build_directory

from mpscope import kernel
from mpscope.stats import tensor_stats


def test_stale_build_lock_left_by_a_killed_build_is_removed(tmp_path):
    """A process killed during the build (a notebook restart) leaves ``lock`` in the build
    directory; PyTorch would wait on it forever. An hour-old lock is removed and the kernel loads."""
    kernel.load.cache_clear()
    try:
        if kernel.load() is None:
            pytest.skip("the fused kernel cannot be built here (no C++ compiler / ninja)")
    finally:
        kernel.load.cache_clear()
    name = kernel.build_name()
    built = Path(_get_build_directory(name, verbose=False))
    copy = tmp_path / name  # TORCH_EXTENSIONS_DIR/<name>: a private copy, so no other process waits
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", ".ninja_lock"))
    lock = copy / "lock"
    lock.touch()
    hour_ago = time.time() - 3600
    os.utime(lock, (hour_ago, hour_ago))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-c", "import mpscope.kernel as k; print(k.load() is not None)"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"
    assert not lock.exists()


def test_live_build_lock_is_waited_on_with_a_timeout_then_the_torch_path(tmp_path, monkeypatch):
    """Another process building right now (a fresh lock that does not go away): wait at most
    LOCK_WAIT_S, leave its lock alone, warn, and compute the same stats on the torch-op path."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(kernel, "LOCK_WAIT_S", 0.5)
    (tmp_path / kernel.build_name()).mkdir()
    lock = tmp_path / kernel.build_name() / "lock"
    lock.touch()
    kernel.load.cache_clear()
    try:
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match="another process has been building"):
            assert kernel.load() is None
        assert time.monotonic() - t0 < 10
        assert lock.exists()
        x = torch.tensor([1e-8, 7e4, 1.0, 0.0], dtype=torch.float32)
        s = tensor_stats(x)
        assert s["fp16_overflow_frac"] == float((x.to(torch.float16).isinf()).float().mean())
        assert s["fp16_underflow_frac"] == float(((x.to(torch.float16) == 0) & (x != 0)).float().mean())
    finally:
        kernel.load.cache_clear()
