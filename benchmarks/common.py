"""Shared pieces of the benchmarks and of ``tests/test_sync.py``: op / host-sync counting.

:class:`OpCounter` is a ``TorchDispatchMode`` that sees every ATen op that runs while it is active
(forward, backward, optimizer, hooks), and for each one records its name, the bytes of its tensor
inputs, whether it makes the host wait for the device (see :func:`is_host_sync`), and who issued
it, found from the Python call stack (see :meth:`OpCounter._who`): the workload (the model in
``mpscope/demo`` or elsewhere, the training loop, the optimizer, autograd), mpscope (a hook or the
step-end work, in mpscope's sources), the recorder's host copy (the files named as such), or Hugging
Face's ``transformers/debug_utils.py``.

Import it from a test with ``importlib`` (``benchmarks/`` is not an installed package)::

    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks/common.py")
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["SYNC_OPS", "OpCounter", "is_blocking_h2d", "is_host_sync", "instrumentation_sources"]

#: ATen ops that always read a device value on the host (the CUDA caching allocator's
#: "synchronizing" list in ``torch.cuda.set_sync_debug_mode`` terms): ``.item()``, ``bool(t)``,
#: ``float(t)`` and printing go through ``_local_scalar_dense``; ``nonzero``, ``masked_select``
#: and ``unique`` must learn their output size.
SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.item",
        "aten.is_nonzero",
        "aten.nonzero",
        "aten.masked_select",
        "aten.equal",
        "aten.allclose",
        "aten.unique",
        "aten._unique",
        "aten._unique2",
        "aten.unique_dim",
        "aten.unique_consecutive",
        "aten.unique_dim_consecutive",
    }
)


def op_name(func) -> str:
    """``aten.add`` for ``torch.ops.aten.add.Tensor`` (the overload packet's qualified name)."""
    return func._schema.name.replace("::", ".")


def is_host_sync(func, args, kwargs) -> bool:
    """Whether the op makes the host wait for the device's result.

    True for :data:`SYNC_OPS`; for indexing with a boolean/uint8 mask (``t[mask]`` runs
    ``nonzero`` inside the kernel); ``repeat_interleave`` without ``output_size``; ``bincount``
    on CUDA (it reads the input's max); and device-to-host copies that are not ``non_blocking``.
    On a CPU-only run the last three never occur; the rest are counted all the same, because the
    same code on CUDA would wait there.
    """
    name = op_name(func)
    if name in SYNC_OPS:
        return True
    if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in (indices or ())
        )
    if name == "aten.repeat_interleave":  # tensor repeats: the output size is their sum
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    if name == "aten.bincount":
        return args[0].device.type == "cuda"
    if name in ("aten._to_copy", "aten.copy_"):
        src = args[1] if name == "aten.copy_" else args[0]
        dst_cpu = (
            args[0].device.type == "cpu"
            if name == "aten.copy_"
            else str(kwargs.get("device", src.device)).startswith("cpu")
        )
        return src.device.type != "cpu" and dst_cpu and not kwargs.get("non_blocking", False)
    return False


def is_blocking_h2d(func, args, kwargs) -> bool:
    """Whether the op is a host-to-device copy that blocks the host on CUDA.

    ``torch.tensor(data, device=...)`` reaches the dispatcher as ``aten.lift_fresh`` (the data are
    copied from Python); on a CUDA device that is a synchronous copy from pageable memory, which
    ``torch.cuda.set_sync_debug_mode("error")`` rejects. Also ``copy_`` / ``_to_copy`` from a CPU
    tensor that is not pinned to a CUDA device without ``non_blocking``. On a CPU-only run only the
    first case is visible (and it is counted, since the same line would block on CUDA).
    """
    name = op_name(func)
    if name == "aten.lift_fresh":
        return True
    if name in ("aten._to_copy", "aten.copy_"):
        src = args[1] if name == "aten.copy_" else args[0]
        dst = args[0].device.type if name == "aten.copy_" else str(kwargs.get("device", src.device))
        return (
            src.device.type == "cpu"
            and dst.startswith("cuda")
            and not kwargs.get("non_blocking", False)
            and not src.is_pinned()
        )
    return False


def instrumentation_sources() -> dict[str, str]:
    """Source-path prefixes -> label for the code whose ops count as instrumentation."""
    out = {}
    try:
        import mpscope

        out[str(Path(mpscope.__file__).resolve().parent) + "/"] = "mpscope"
    except ImportError:  # pragma: no cover
        pass
    try:
        import transformers.debug_utils as du

        out[str(Path(du.__file__).resolve())] = "hf"
    except ImportError:  # pragma: no cover
        pass
    return out


_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + "/"
#: PyTorch entry points that the recorder wraps (or may wrap) and calls *for the user*: ops under
#: them belong to the training step even with an mpscope wrapper frame further out on the stack.
TRANSPARENT = frozenset(
    {
        ("_tensor.py", "backward"),
        ("autograd/__init__.py", "backward"),
        ("autograd/__init__.py", "grad"),
        ("nn/utils/clip_grad.py", "clip_grad_norm_"),
        ("nn/utils/clip_grad.py", "clip_grad_value_"),
        ("nn/utils/clip_grad.py", "_get_total_norm"),  # clip helpers mpscope wraps (any import name)
        ("nn/utils/clip_grad.py", "_clip_grads_with_norm_"),
        ("amp/grad_scaler.py", "scale"),
        ("amp/grad_scaler.py", "unscale_"),
        ("amp/grad_scaler.py", "step"),
        ("amp/grad_scaler.py", "update"),
        ("optim/optimizer.py", "zero_grad"),
    }
)


class OpCounter(TorchDispatchMode):
    """Counts ATen ops, bytes read and host syncs, split by who called them.

    Args:
        flush_files: source files whose code is the recorder's once-per-recorded-step host copy
            (``mpscope/recording/step_buffer.py``); the ops issued while a frame of theirs is on
            the stack are counted under ``"flush"``.
        exclude_dirs: source directories that are the workload, not instrumentation
            (default: ``mpscope/demo``, home of the benchmark's model).

    After use, ``ops[who]`` (Counter op name -> calls), ``bytes[who]`` (bytes of tensor inputs,
    ``numel * element_size`` summed over every tensor argument; 0 for view ops such as
    ``detach`` / ``view``, which read nothing), ``syncs[who]`` (Counter op
    name -> host syncs), ``h2d[who]`` (Counter op name -> blocking host-to-device copies, see
    :func:`is_blocking_h2d`) and ``sync_stacks`` / ``h2d_stacks`` (a short stack for each one
    outside the workload) hold the counts; ``who`` is ``None`` for the workload, else ``"mpscope"``, ``"hf"`` or
    ``"flush"``.
    """

    def __init__(self, flush_files=(), exclude_dirs=None):
        super().__init__()
        self.sources = instrumentation_sources()
        if exclude_dirs is None:
            exclude_dirs = [p + "demo/" for p, lab in self.sources.items() if lab == "mpscope"]
        self.exclude = tuple(exclude_dirs)
        self.flush_files = frozenset(str(Path(f).resolve()) for f in flush_files)
        self._code_label: dict = {}
        self.ops: dict = {}
        self.bytes: Counter = Counter()
        self.syncs: dict = {}
        self.sync_stacks: list[str] = []
        self.h2d: dict = {}
        self.h2d_stacks: list[str] = []

    def _label(self, code) -> str | None:
        """"torch", "torch-api" (a :data:`TRANSPARENT` entry point), "mpscope", "flush", "hf",
        or None (the workload: the model, the training loop, anything else)."""
        label = self._code_label.get(code, "")
        if label == "":
            fn = code.co_filename
            label = None
            if fn.startswith(_TORCH_DIR):
                rel = fn[len(_TORCH_DIR):]
                label = "torch-api" if (rel, code.co_name) in TRANSPARENT else "torch"
            elif not fn.startswith(self.exclude):
                for prefix, lab in self.sources.items():
                    if fn.startswith(prefix):
                        label = lab
                        if lab == "mpscope" and fn in self.flush_files:
                            label = "flush"
                        break
            self._code_label[code] = label
        return label

    def _who(self) -> str | None:
        """Who issued the op: walk outward from the innermost Python frame past PyTorch's own
        frames to the first other frame. The workload's (None) if that is the model / loop code,
        or if a PyTorch entry point of :data:`TRANSPARENT` was passed on the way (e.g. backward
        called through mpscope's ``Tensor.backward`` wrapper: the autograd engine's ops are the
        step's own, while a tensor hook the engine calls is the innermost frame and counts as
        mpscope's). Otherwise "hf", or "mpscope" / "flush" (a host-copy frame further out)."""
        frame = sys._getframe(2)
        api = False
        while frame is not None:
            label = self._label(frame.f_code)
            if label == "torch":
                pass
            elif label == "torch-api":
                api = True
            elif label is None:
                return None
            else:
                if api:
                    return None
                if label == "mpscope":
                    outer = frame.f_back
                    while outer is not None:
                        if self._label(outer.f_code) == "flush":
                            return "flush"
                        outer = outer.f_back
                return label
            frame = frame.f_back
        return None

    def _stack(self) -> str:
        frames = []
        frame = sys._getframe(2)
        while frame is not None and len(frames) < 6:
            if self._label(frame.f_code) not in (None, "torch", "torch-api"):
                frames.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} "
                              f"{frame.f_code.co_name}")
            frame = frame.f_back
        return " <- ".join(frames)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        who = self._who()
        leaves, _ = tree_flatten((args, kwargs))
        nbytes = 0 if func.is_view else sum(
            t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)
        )
        self.ops.setdefault(who, Counter())[name] += 1
        self.bytes[who] += nbytes
        if is_host_sync(func, args, kwargs):
            self.syncs.setdefault(who, Counter())[name] += 1
            if who is not None:
                self.sync_stacks.append(f"{name}: {self._stack()}")
        if is_blocking_h2d(func, args, kwargs):
            self.h2d.setdefault(who, Counter())[name] += 1
            if who is not None:
                self.h2d_stacks.append(f"{name}: {self._stack()}")
        return func(*args, **kwargs)

    def total_ops(self, who=...) -> int:
        """Ops of ``who`` (default: everyone)."""
        if who is ...:
            return sum(sum(c.values()) for c in self.ops.values())
        return sum(self.ops.get(who, Counter()).values())

    def total_syncs(self, who=...) -> int:
        if who is ...:
            return sum(sum(c.values()) for c in self.syncs.values())
        return sum(self.syncs.get(who, Counter()).values())

    def total_h2d(self, who=...) -> int:
        if who is ...:
            return sum(sum(c.values()) for c in self.h2d.values())
        return sum(self.h2d.get(who, Counter()).values())

    def total_bytes(self, who=...) -> int:
        if who is ...:
            return sum(self.bytes.values())
        return self.bytes.get(who, 0)
