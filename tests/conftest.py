"""Shared fixtures. The autouse fixture fails any test that leaves an mpscope hook or wrapper behind."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.utils.clip_grad as _clip

from mpscope import kernel

_ORIG_BACKWARD = torch.Tensor.backward
_ORIG_CLIP = (_clip.clip_grad_norm_, _clip.clip_grad_value_)
_CLIP_HELPERS = ("_get_total_norm", "_clip_grads_with_norm_", "_group_tensors_by_device_and_dtype")
_ORIG_HELPERS = tuple(getattr(_clip, n) for n in _CLIP_HELPERS)


def _mpscope_hooks(module: torch.nn.Module) -> list:
    found = []
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
        for fn in getattr(module, attr, {}).values():
            owner = getattr(fn, "__self__", None)
            if "mpscope" in (getattr(fn, "__module__", "") or "") or "mpscope" in type(owner).__module__:
                found.append((attr, fn))
    if hasattr(module, "_mpscope_recorder"):
        found.append(("_mpscope_recorder", module._mpscope_recorder))
    return found


@pytest.fixture(scope="module")
def fused():
    """The fused CPU stats kernel (built in the foreground if needed); skips the test where it
    cannot be built."""
    module = kernel.load()
    if module is None:
        pytest.skip("the fused kernel cannot be built here (no C++ compiler / ninja)")
    return module


@pytest.fixture(autouse=True)
def no_hooks_left(monkeypatch):
    """Track every nn.Module built in the test; after it, none may carry an mpscope hook, and
    torch.Tensor.backward / clip_grad_* must be PyTorch's own again."""
    created: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
    orig_init = torch.nn.Module.__init__

    def tracking_init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        created.add(self)

    monkeypatch.setattr(torch.nn.Module, "__init__", tracking_init)
    yield
    monkeypatch.undo()
    leftovers = [(type(m).__name__, h) for m in list(created) for h in _mpscope_hooks(m)]
    assert not leftovers, f"mpscope hooks left attached: {leftovers[:5]}"
    assert torch.Tensor.backward is _ORIG_BACKWARD, "torch.Tensor.backward is still wrapped"
    assert (_clip.clip_grad_norm_, _clip.clip_grad_value_) == _ORIG_CLIP, "clip_grad_* still wrapped"
    assert tuple(getattr(_clip, n) for n in _CLIP_HELPERS) == _ORIG_HELPERS, "clip_grad helpers still wrapped"
