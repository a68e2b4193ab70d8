"""What a training cell started from, kept in host memory so that a re-run can start there again.

``%%mpscope MODEL`` takes a :class:`StartState` just before the cell runs, and
``%%mpscope MODEL --apply`` puts it back before the re-run, so that before and after start from the
same weights and the same random streams. It holds:

* the model's parameters, buffers, ``.grad`` and train/eval flags;
* each optimizer's per-parameter state and hyperparameters (by parameter position, as
  ``Optimizer.state_dict`` does), and the ``state_dict`` of each LR scheduler of those optimizers;
* each GradScaler's ``state_dict`` (scale, growth tracker, settings);
* the random streams: torch's CPU generator, the CUDA generators (when CUDA is initialised), Python's
  ``random``, NumPy's global one, and the ``torch.Generator`` / ``numpy.random.Generator`` objects
  passed in.

Cost: tensors are copied to host memory one at a time (never a second copy on the GPU), about a
second per GiB from a GPU; restoring copies them back into the same tensors in place where shape,
dtype and device still match. Above :data:`LIMIT_BYTES` of tensors nothing is kept (``kept`` is
False). Objects are held by weak reference: a StartState never keeps a replaced model, optimizer or
scaler alive.
"""

from __future__ import annotations

import copy
import random
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: Tensor bytes (parameters, buffers, gradients, optimizer state) above which nothing is kept.
#: 4 GiB: a model of about 350M float32 parameters trained with Adam (16 bytes per parameter with
#: its gradient) fits, which covers the models one iterates on in a notebook, and stays a small
#: part of a training host's memory; beyond it the copy would cost seconds and host memory the
#: training may need. Read at each :meth:`StartState.take`.
LIMIT_BYTES = 4 * 2**30


@dataclass
class _Saved:
    """A tensor's host copy and the device it came from."""

    tensor: torch.Tensor
    device: torch.device


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _to_host(obj: Any) -> Any:
    """``obj`` with every tensor replaced by its host copy (dicts, lists and tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return _Saved(obj.detach().to("cpu", copy=True), obj.device)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_host(v) for v in obj)
    return copy.deepcopy(obj)


def _back(obj: Any) -> Any:
    """The inverse of :func:`_to_host`: new tensors on their original devices."""
    if isinstance(obj, _Saved):
        return obj.tensor.to(obj.device, copy=True)
    if isinstance(obj, dict):
        return {k: _back(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_back(v) for v in obj)
    return copy.deepcopy(obj)


def _into(current: Any, saved: Any) -> Any:
    """``saved`` put back: copied into ``current`` in place when it is a tensor of the same shape,
    dtype and device, else a new value."""
    if (isinstance(saved, _Saved) and isinstance(current, torch.Tensor) and current.shape == saved.tensor.shape
            and current.dtype == saved.tensor.dtype and current.device == saved.device):
        with torch.no_grad():
            current.copy_(saved.tensor)
        return current
    return _back(saved)


def _ref(obj: Any):
    """A weak reference to ``obj``; a strong one for objects that take none (a NumPy Generator)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class StartState:
    """The state a training cell started from; see the module docstring.

    Attributes:
        kept: False when the tensors exceeded the limit and nothing was kept.
        nbytes: bytes of tensors (parameters, buffers, gradients, optimizer state) counted.
        limit: the limit in effect when it was taken, in bytes.
        notes: sentences on what is not kept (objects used by the cell that were not found).
    """

    def __init__(self, nbytes: int, limit: int):
        self.kept = False
        self.nbytes = nbytes
        self.limit = limit
        self.notes: list[str] = []
        self._weights: dict[str, _Saved] = {}
        self._grads: dict[str, _Saved | None] = {}
        self._buffer_copies: dict[str, _Saved | None] = {}
        self._modes: dict[str, bool] = {}
        #: kind -> {name: (weakref, ...)}: "optimizers": (group sizes, per-parameter state, group
        #: settings), "schedulers": (state_dict on host), "scalers": (state_dict), "generators": (state)
        self._kept: dict[str, dict[str, tuple]] = {"optimizers": {}, "schedulers": {}, "scalers": {}, "generators": {}}
        self._streams: dict[str, Any] = {}

    # ------------------------------------------------------------------ taking
    @classmethod
    def take(cls, model: torch.nn.Module, optimizers: dict | None = None, scalers: dict | None = None,
             schedulers: dict | None = None, generators: dict | None = None, limit: int | None = None) -> "StartState":
        """Copy ``model``'s state, the given objects' state and the random streams to host memory.

        Args:
            model: the model the cell trains.
            optimizers, scalers, schedulers: ``{name: object}``: torch optimizers, GradScalers and LR
                schedulers whose state to keep (names are for messages).
            generators: ``{name: torch.Generator | numpy.random.Generator}`` the cell draws from.
            limit: bytes of tensors above which nothing is kept (default :data:`LIMIT_BYTES`).

        Returns:
            A StartState; ``kept`` is False (and nothing is copied) when the tensors exceed ``limit``.
        """
        optimizers, scalers = optimizers or {}, scalers or {}
        schedulers, generators = schedulers or {}, generators or {}
        limit = LIMIT_BYTES if limit is None else int(limit)
        params = dict(model.named_parameters())
        nbytes = (_nbytes(list(params.values())) + _nbytes([p.grad for p in params.values() if p.grad is not None])
                  + _nbytes([b for _, b in model.named_buffers()])
                  + sum(_nbytes([dict(o.state.get(p, {})) for g in o.param_groups for p in g["params"]])
                        + _nbytes([{k: v for k, v in g.items() if k != "params"} for g in o.param_groups])
                        for o in optimizers.values()))
        state = cls(nbytes, limit)
        if nbytes > limit:
            return state
        state._weights = {n: _to_host(p) for n, p in params.items()}
        state._grads = {n: None if p.grad is None else _to_host(p.grad) for n, p in params.items()}
        state._buffer_copies = {n: None if b is None else _to_host(b) for n, b in model.named_buffers()}
        state._modes = {n: m.training for n, m in model.named_modules()}
        for name, o in optimizers.items():
            plist = [p for g in o.param_groups for p in g["params"]]
            state._kept["optimizers"][name] = (
                _ref(o), [len(g["params"]) for g in o.param_groups],
                [_to_host(dict(o.state[p])) if p in o.state else None for p in plist],
                [_to_host({k: v for k, v in g.items() if k != "params"}) for g in o.param_groups])
        for name, s in schedulers.items():
            state._kept["schedulers"][name] = (_ref(s), _to_host(s.state_dict()))
        for name, s in scalers.items():
            state._kept["scalers"][name] = (_ref(s), copy.deepcopy(s.state_dict()))
        for name, g in generators.items():
            saved = g.get_state() if isinstance(g, torch.Generator) else copy.deepcopy(g.bit_generator.state)
            state._kept["generators"][name] = (_ref(g), saved)
        state._streams = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state._streams["cuda"] = torch.cuda.get_rng_state_all()
        state.kept = True
        return state

    def keep_scalers(self, keep) -> None:
        """Forget the GradScalers that are not in ``keep`` (compared by identity)."""
        ids = {id(s) for s in keep}
        self._kept["scalers"] = {n: v for n, v in self._kept["scalers"].items() if id(v[0]()) in ids}

    def forget(self, names) -> None:
        """Forget the optimizers, schedulers and scalers kept under ``names`` (replaced by the cell)."""
        for table in (self._kept["optimizers"], self._kept["schedulers"], self._kept["scalers"]):
            for n in names:
                table.pop(n, None)

    def objects(self, kind: str) -> dict:
        """``{name: object}`` of what is kept and still alive; ``kind``: ``"optimizers"``,
        ``"schedulers"``, ``"scalers"`` or ``"generators"``."""
        table = self._kept[kind]
        return {n: v[0]() for n, v in table.items() if v[0]() is not None}

    def describe(self) -> str:
        """What is kept, in a few words."""
        parts = ["the model's weights, buffers and gradients"]
        for kind, word in (("optimizers", "optimizer"), ("schedulers", "LR scheduler"), ("scalers", "GradScaler"),
                           ("generators", "generator")):
            names = list(self._kept[kind])
            if names:
                parts.append(f"{word}{'s' if len(names) > 1 else ''} " + ", ".join(f"`{n}`" for n in names))
        streams = ["torch"] + (["CUDA"] if "cuda" in self._streams else []) + ["random", "NumPy"]
        return ", ".join(parts) + " and the random streams (" + ", ".join(streams) + ")"

    # ------------------------------------------------------------------ putting back
    def restore(self, model: torch.nn.Module) -> list[str]:
        """Put back everything but the random streams (:meth:`restore_random`, right before the cell).

        Returns:
            Sentences naming what could not be put back (an object gone, a parameter whose shape changed).
        """
        problems = []
        if not self.kept:
            return problems
        params = dict(model.named_parameters())
        shapes = {n: s.tensor.shape for n, s in self._weights.items()}
        if {n: p.shape for n, p in params.items()} != shapes:
            problems.append("the model's parameters differ from the ones the last run started with (names or "
                            "shapes), so its weights were not restored")
        else:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(self._weights[n].tensor)
                    g = self._grads[n]
                    if g is None:
                        p.grad = None
                    elif p.grad is not None and p.grad.shape == g.tensor.shape:
                        p.grad.copy_(g.tensor)
                    else:
                        p.grad = g.tensor.to(device=p.device, dtype=p.dtype, copy=True)
            for n, b in model.named_buffers():
                saved = self._buffer_copies.get(n)
                if saved is not None and b.shape == saved.tensor.shape:
                    with torch.no_grad():
                        b.copy_(saved.tensor)
                elif saved is not None:
                    problems.append(f"buffer `{n}` changed shape, so it was not restored")
            for n, m in model.named_modules():
                if n in self._modes:
                    m.training = self._modes[n]
        for name, (ref, sizes, states, groups) in self._kept["optimizers"].items():
            o = ref()
            if o is None:
                problems.append(f"optimizer `{name}` is gone, so its state was not restored")
                continue
            if [len(g["params"]) for g in o.param_groups] != sizes:
                problems.append(f"optimizer `{name}` has other parameter groups now, so its state was not restored")
                continue
            plist = [p for g in o.param_groups for p in g["params"]]
            for p, saved in zip(plist, states):
                if saved is None:
                    o.state.pop(p, None)
                else:
                    current = o.state.get(p, {})
                    o.state[p] = {k: _into(current.get(k), v) for k, v in saved.items()}
            for g, saved in zip(o.param_groups, groups):
                for k, v in saved.items():
                    g[k] = _into(g.get(k), v)
        for name, (ref, saved) in self._kept["schedulers"].items():
            s = ref()
            if s is None:
                problems.append(f"LR scheduler `{name}` is gone, so its state was not restored")
            else:
                s.load_state_dict(_back(saved))
        for name, (ref, saved) in self._kept["scalers"].items():
            s = ref()
            if s is None:
                problems.append(f"GradScaler `{name}` is gone, so its state was not restored")
            elif saved and s.is_enabled():
                s.load_state_dict(dict(saved))
        return problems

    def restore_random(self) -> None:
        """Put back the random streams (call it last, right before the cell runs)."""
        if not self.kept:
            return
        for ref, saved in self._kept["generators"].values():
            g = ref()
            if isinstance(g, torch.Generator):
                g.set_state(saved)
            elif g is not None:
                g.bit_generator.state = copy.deepcopy(saved)
        torch.set_rng_state(self._streams["torch"])
        random.setstate(self._streams["python"])
        np.random.set_state(self._streams["numpy"])
        if "cuda" in self._streams and torch.cuda.is_initialized():
            torch.cuda.set_rng_state_all(self._streams["cuda"])
