"""Keeping mpscope's extra forwards (the fp32 shadow's reference and own-contribution passes) from
changing the training run: the state they may touch is saved before and put back after.

What a pass runs on, and what is put back (``scope`` is the modules the pass runs: the whole model
for the reference, the module's subtree for an own contribution):

* **RNGs** (:class:`RngState`): torch's default generator of the CPU and of the model's
  accelerator (what ``torch.random.fork_rng`` covers), Python's global ``random``, NumPy's legacy
  global ``np.random`` state (only when NumPy is imported), and every RNG object held as an
  attribute of a module in ``scope`` or of its class: ``torch.Generator`` (``get_state``/``set_state``),
  ``random.Random``, ``np.random.RandomState`` and ``np.random.Generator`` (its bit generator's
  state). Generators elsewhere (a global ``torch.Generator``, one inside a list) are not seen.
* **Module attributes** (:class:`ModuleState`): each module's ``__dict__`` (which names exist and
  the object each is bound to: a counter ``self.calls += 1``, a cache ``self.mask = ...``, an
  attribute added on the first call) and the contents of its lists, dicts, sets and deques
  (shallow: a feature list appended to, a dict cache filled, a buffer registered in ``forward``)
  are put back as they were. Tensors held as plain attributes (not parameters or buffers) are
  replaced by clones for the pass (:func:`protect_tensors`), as the buffers are, so in-place
  changes to them never reach the originals. Not covered: objects an attribute refers to (a
  custom object's own attributes, a tensor inside a dict cache, a list inside a list), closures
  and globals, files and other I/O.
* **Hooks** (:func:`foreign_hooks_off`): forward hooks and forward pre-hooks on the modules in
  ``scope`` run only when they are mpscope's or PyTorch's own (pruning, ``weight_norm``,
  ``spectral_norm``, lazy modules, FSDP: they compute the module's parameters, so the forward needs
  them); every other hook (the user's, another library's) is skipped, so its side effects (a
  feature list a distillation loss sums) happen once, in the real forward. A skipped hook that
  changes what the module computes (returns new inputs or outputs, changes them in place, rebinds
  the module's attributes) makes the reference differ from the real forward: the shadow checks for
  that in the real forward (:class:`Fingerprint`). Global hooks
  (``register_module_forward_hook``) are not filtered.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
import random
import sys

import torch
from torch.utils._pytree import tree_flatten

#: The hook dicts of ``nn.Module`` (never copied: a forward does not register hooks).
_HOOK_DICTS = frozenset(n for n in vars(torch.nn.Module()) if "hook" in n)
_MISSING = object()


# ---------------------------------------------------------------------------------------- RNGs
_RNG_TYPES: dict = {}  # type -> whether its instances are RNG objects (isinstance on torch.Generator is slow)


def _is_rng(obj) -> bool:
    t = type(obj)
    known = _RNG_TYPES.get(t)
    if known is None:
        np = sys.modules.get("numpy")
        known = _RNG_TYPES[t] = (issubclass(t, torch.Generator) or (
            issubclass(t, random.Random) and not issubclass(t, random.SystemRandom)) or (
            np is not None and issubclass(t, (np.random.RandomState, np.random.Generator))))
    return known


def _rng_getset(obj):
    """``(get, set)`` for an RNG object (see :func:`_is_rng`)."""
    if isinstance(obj, torch.Generator):
        return obj.get_state, obj.set_state
    if isinstance(obj, random.Random):
        return obj.getstate, obj.setstate
    np = sys.modules["numpy"]
    if isinstance(obj, np.random.RandomState):
        return obj.get_state, obj.set_state
    bits = obj.bit_generator  # np.random.Generator
    return (lambda: bits.state), (lambda s: setattr(bits, "state", s))


_CLASS_RNG_NAMES: dict = {}  # module class -> (class, attribute) pairs holding an RNG object


def _class_rngs(cls) -> list:
    """The RNG objects held as class attributes of ``cls`` or its bases (``gen = torch.Generator()``
    in a class body, read as ``self.gen``), ``torch.nn.Module`` and ``object`` aside."""
    names = _CLASS_RNG_NAMES.get(cls)
    if names is None:
        names = _CLASS_RNG_NAMES[cls] = [(c, n) for c in cls.__mro__ if c not in (torch.nn.Module, object)
                                         for n, v in vars(c).items() if _is_rng(v)]
    return [vars(c).get(n) for c, n in names]


class RngState:
    """Every RNG state a pass can draw from (see the module docstring), captured now;
    :meth:`restore` sets them all back."""

    def __init__(self, devices: list, scope: list):
        self.cpu = torch.get_rng_state()
        self.devices = [(d, torch.get_device_module(d.type).get_rng_state(d)) for d in devices]
        self.python = random.getstate()
        np = sys.modules.get("numpy")
        self.numpy = np.random.get_state() if np is not None else None
        seen, self.objects = set(), []
        for m in scope:
            for v in (*m.__dict__.values(), *_class_rngs(type(m))):
                if _is_rng(v) and id(v) not in seen:
                    seen.add(id(v))
                    get, set_ = _rng_getset(v)
                    self.objects.append((set_, get()))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, s in self.devices:
            torch.get_device_module(d.type).set_rng_state(s, d)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
        for set_state, s in self.objects:
            set_state(s)


# ----------------------------------------------------------------------------- module attributes
def _contents(v):
    """A shallow copy of a list / deque / dict / set's contents, or _MISSING for anything else."""
    if isinstance(v, (list, collections.deque, set)):
        return list(v)
    if isinstance(v, dict):
        return list(v.items())
    return _MISSING


def _changed(v, saved: list) -> bool:
    if len(v) != len(saved):
        return True
    if isinstance(v, dict):
        return any(v.get(k, _MISSING) is not x for k, x in saved)
    if isinstance(v, set):
        return any(x not in v for x in saved)
    return not all(map(operator.is_, v, saved))


def _same_dict(d: dict, saved: dict) -> bool:
    """Whether ``d`` has the same names as ``saved``, bound to the same objects (in the same order:
    a name removed and added again counts as a change, which only costs a restore)."""
    return d.keys() == saved.keys() and all(map(operator.is_, d.values(), saved.values()))


def _refill(v, saved: list) -> None:
    v.clear()
    if isinstance(v, (list, collections.deque)):
        v.extend(saved)
    else:  # dict (items), set
        v.update(saved)


class ModuleState:
    """The plain Python state of the modules in ``scope``, captured now: each ``__dict__`` (names and
    the objects bound to them) and the contents of its containers (shallow). :meth:`restore` puts
    both back: rebinding and refilling, never an in-place write to a tensor."""

    def __init__(self, scope: list):
        self.entries = []
        for m in scope:
            attrs = dict(m.__dict__)
            contents = {}
            for k, v in attrs.items():
                if k not in _HOOK_DICTS and (c := _contents(v)) is not _MISSING:
                    contents[k] = c
            self.entries.append((m, attrs, contents))

    def restore(self) -> None:
        for m, attrs, contents in self.entries:
            d = m.__dict__
            if not _same_dict(d, attrs):
                d.clear()
                d.update(attrs)
            for k, saved in contents.items():
                if _changed(attrs[k], saved):
                    _refill(attrs[k], saved)


def protect_tensors(scope: list) -> None:
    """Rebind every tensor held as a plain attribute of a module in ``scope`` to a clone (a
    :class:`ModuleState` taken before puts the originals back)."""
    for m in scope:
        d = m.__dict__
        for k, v in list(d.items()):
            if isinstance(v, torch.Tensor):
                d[k] = v.clone()


# ---------------------------------------------------------------------------------------- hooks
def _origin(hook) -> str:
    """The Python module that defined ``hook`` (a function, bound method, partial or callable object)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return getattr(hook, "__module__", None) or type(hook).__module__ or ""


def is_own_hook(hook) -> bool:
    """True for mpscope's and PyTorch's own hooks: the ones that run in the extra passes."""
    return _origin(hook).split(".")[0] in ("torch", "mpscope")


def hook_name(hook) -> str:
    while isinstance(hook, functools.partial):
        hook = hook.func
    name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    return f"{_origin(hook)}.{name}"


def foreign_hooks(module) -> tuple[list, list]:
    """``(forward pre-hooks, forward hooks)`` on ``module`` that are neither mpscope's nor PyTorch's."""
    return ([h for h in module._forward_pre_hooks.values() if not is_own_hook(h)],
            [h for h in module._forward_hooks.values() if not is_own_hook(h)])


@contextlib.contextmanager
def foreign_hooks_off(scope: list):
    """Inside the block, the modules in ``scope`` run only mpscope's and PyTorch's own forward hooks
    and pre-hooks (their hook dicts are rebound to filtered copies, and back after)."""
    swapped = []
    for m in scope:
        for name in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = m.__dict__.get(name)
            if hooks and not all(is_own_hook(h) for h in hooks.values()):
                m.__dict__[name] = collections.OrderedDict((k, h) for k, h in hooks.items() if is_own_hook(h))
                swapped.append((m, name, hooks))
    try:
        yield
    finally:
        for m, name, hooks in reversed(swapped):
            m.__dict__[name] = hooks


class Fingerprint:
    """What a module's hooks can change, taken now: the floating and other leaves of ``value`` (a
    call's inputs or its output: which objects, and each tensor's version) and, with ``module``,
    which object each of its attributes is bound to. :meth:`same` compares with another."""

    def __init__(self, value, module=None):
        self.leaves = tree_flatten(value)[0]
        self.versions = [x._version if isinstance(x, torch.Tensor) and not x.is_inference() else None
                         for x in self.leaves]
        self.attrs = dict(module.__dict__) if module is not None else None

    def same(self, other: "Fingerprint") -> bool:
        if len(self.leaves) != len(other.leaves) or self.versions != other.versions:
            return False
        if not all(map(operator.is_, self.leaves, other.leaves)):
            return False
        return self.attrs is None or other.attrs is None or _same_dict(other.attrs, self.attrs)
