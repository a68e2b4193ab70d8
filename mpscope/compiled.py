"""torch.compile'd models as the recorder sees them: the user's module names, where hooks go, and
an opaque op that records activations from inside a compiled graph.

``torch.compile(m)`` returns an ``OptimizedModule`` wrapper whose ``named_modules()`` puts
``_orig_mod.`` before every name of ``m``; ``m.compile()`` compiles ``m``'s call in place (names
unchanged). Dynamo traces the forward hooks it meets inside a compiled region: a hook that touches
the recorder's Python state turns that state into guards, and hooks that come and go between steps
recompile the model on every recorded step.

So inside a compiled region the recorder installs its hooks once and keeps them: each hook checks
one flag (dynamo guards on it: one graph with recording, one without, each compiled once) and
passes the module's output to ``mpscope::observe``, a custom op whose body dynamo does not trace
(it runs when the compiled graph runs, with the real tensor, and hands it to the recorder). The op
is marked as having a side effect, so no compiler removes it. Outside compiled regions (and on a
``torch.compile`` wrapper, whose hooks run outside its region) the usual hooks are used.

The op reads its input and changes no value, but the input must exist in memory, so the recorded
graph stores outputs that inductor would otherwise compute inside their consumers' kernels, and
fuses differently. Two of inductor's rules then give other last bits from the same inputs: a bf16
intermediate inside a fused kernel stays float32 (a stored one is rounded to bf16, as eager
rounds it) unless ``torch._inductor.config.emulate_precision_casts``; and the C++ backend picks a
reduction's vector width (hence its summation order) from the dtypes fused into its kernel. With
both turned off (``emulate_precision_casts=True``, ``cpp.simdlen=1``) recorded steps are bitwise
the unrecorded ones; with inductor's defaults they differ by about what inductor's own fusion
choices change, less than inductor differs from eager. The ``aot_eager`` backend fuses nothing:
bitwise equal.

Inside a compiled region a module output is no tensor ``register_hook`` can reach, so for the
activation gradients (role ``activation_grad``) the hook returns the output through
:class:`GradTap`, an autograd function whose forward copies the output (a copy, not a view: the
caller may write into it in place; inductor drops the copy) and whose backward hands the
gradient arriving there to ``mpscope::observe``; dynamo traces both into the forward and backward
graphs. Outputs in containers other than plain tuples, lists and dicts (named tuples, model-output
classes) are not rebuilt: their gradients are listed in meta ``unobserved`` (role -> module names)
when the compiled graph first runs, so that nothing is silently missing.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterator

import torch

from mpscope import distributed as _dist

_ORIG = "_orig_mod"
#: Sinks by id, for the op's body (the compiled graph can carry only ints, strings and bools): each
#: has ``traced(module, name, tensor, role, tapped, grad_enabled)`` (see :func:`traced_hook`).
_SINKS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_OP = None


def _optimized_module_type():
    try:
        from torch._dynamo.eval_frame import (
            OptimizedModule,  # dynamo: imported on use (see forget_compiled)
        )
    except Exception:  # a PyTorch build without dynamo: nothing is compiled
        return None
    return OptimizedModule


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under ``torch.compile(model)``'s wrapper(s) (``model`` itself if not wrapped)."""
    om = _optimized_module_type()
    while om is not None and isinstance(model, om):
        model = model._orig_mod
    return model


def user_name(name: str) -> str:
    """A ``named_modules()`` name without torch.compile's ``_orig_mod`` segments."""
    return ".".join(p for p in name.split(".") if p != _ORIG)


def _is_wrapper(mod) -> bool:
    om = _optimized_module_type()
    return om is not None and isinstance(mod, om)


def is_compiled(model: torch.nn.Module) -> bool:
    """True when ``model`` or any submodule runs compiled (``torch.compile`` or ``.compile()``)."""
    return any(_is_wrapper(m) or getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, module)`` for the user's modules: ``named_modules()`` without torch.compile's
    wrappers, names without ``_orig_mod``. Parameters live on these modules."""
    for name, mod in _dist.named_modules(model):  # without DDP / FSDP1 / checkpoint wrappers
        if not _is_wrapper(mod):
            yield user_name(name), mod


def hook_targets(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, bool]]:
    """Where forward hooks go: ``[(name, module, inside)]``; ``inside``: the hook runs inside a
    compiled region (traced by dynamo).

    A wrapper (``torch.compile(m)``) is hooked in place of ``m``: its hooks run outside the region,
    and ``m`` and everything below it are inside. A module compiled in place (``m.compile()``) runs
    its own hooks inside its region.
    """
    out, regions = [], []
    for name, mod in _dist.named_modules(model):  # without DDP / FSDP1 / checkpoint wrappers
        inside = any(name.startswith(p) for p in regions)
        if _is_wrapper(mod):
            regions.append(name + "." if name else "")
            out.append((user_name(name), mod, inside))
            continue
        if name.split(".")[-1] == _ORIG:
            continue  # the module a wrapper holds: the wrapper stands for it
        if getattr(mod, "_compiled_call_impl", None) is not None:
            regions.append(name + "." if name else "")
            inside = True
        out.append((user_name(name), mod, inside))
    return out


class Flag:
    """The one piece of recorder state a traced hook reads (dynamo guards on ``on``)."""

    __slots__ = ("on",)

    def __init__(self):
        self.on = False


def _observe_op():
    """``torch.ops.mpscope.observe(t, sink, module, name, role, tapped, grad_enabled) -> ()``,
    registered on first use; ``role``: ``"activation"`` or ``"activation_grad"``; ``tapped``: the
    activation's gradient is observed too (False: its container cannot be rebuilt); ``grad_enabled``:
    the region runs with grad (dynamo guards on grad mode)."""
    global _OP
    if _OP is None:
        from torch.fx.node import (
            has_side_effect,  # torch.fx: loaded only when a compiled model is recorded
        )

        @torch.library.custom_op("mpscope::observe", mutates_args=())
        def observe(t: torch.Tensor, sink: int, module: str, name: str, role: str, tapped: bool,
                    grad_enabled: bool) -> None:
            s = _SINKS.get(sink)
            if s is not None:
                s.traced(module, name, t, role, tapped, grad_enabled)

        @observe.register_fake
        def _(t, sink, module, name, role, tapped, grad_enabled):
            return None

        has_side_effect(torch.ops.mpscope.observe.default)  # keep it: it returns nothing
        _OP = torch.ops.mpscope.observe
    return _OP


class GradTap(torch.autograd.Function):
    """``GradTap.apply(t, sink, module, name)``: a copy of ``t`` (same shape, dtype, values)
    whose gradient, when backward reaches it, goes to ``mpscope::observe`` as ``activation_grad``
    of ``module``/``name`` and on unchanged."""

    @staticmethod
    def forward(ctx, t, sink: int, module: str, name: str):
        ctx.sink, ctx.module, ctx.name = sink, module, name
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        _observe_op()(grad, ctx.sink, ctx.module, ctx.name, "activation_grad", True, True)
        return grad, None, None, None


def _tap(obj, prefix: str, sink: int, module: str, untapped: list, depth: int = 0):
    """``obj`` with each floating tensor that requires grad passed through :class:`GradTap`
    (names as the recorder's flatten gives them); plain tuples, lists and dicts are rebuilt, other
    containers kept as they are with the names of their tensors appended to ``untapped``."""
    if isinstance(obj, torch.Tensor):
        return GradTap.apply(obj, sink, module, prefix) if obj.is_floating_point() and obj.requires_grad else obj
    if depth > 4:
        return obj
    if type(obj) in (tuple, list):
        return type(obj)(_tap(v, f"{prefix}.{i}", sink, module, untapped, depth + 1) for i, v in enumerate(obj))
    if type(obj) is dict:
        return {k: _tap(v, f"{prefix}.{k}", sink, module, untapped, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (tuple, list, dict)):
        untapped.append(prefix)  # a named tuple, a model-output class: not rebuilt
    return obj


def traced_hook(sink, flag: Flag, module_name: str, flatten: Callable, grads: bool) -> Callable:
    """A forward hook for a module inside a compiled region: while ``flag.on``, each floating
    output tensor goes to ``mpscope::observe`` (names as ``flatten(output, "output")`` gives), which
    hands it to ``sink.traced(module, name, tensor, role, tapped, grad_enabled)``, and, with
    ``grads``, the output comes back through :class:`GradTap` for its gradient (``sink`` is held
    weakly)."""
    op = _observe_op()
    _SINKS[id(sink)] = sink
    rid = id(sink)

    def hook(module, args, output):
        if not flag.on:
            return None
        untapped: list = []
        out = _tap(output, "output", rid, module_name, untapped) if grads else output
        for name, t in flatten(output, "output"):
            if t.is_floating_point():
                lost = grads and t.requires_grad and any(name == u or name.startswith(u + ".") for u in untapped)
                # dynamo guards on grad mode: a region traced under no_grad (evaluation) says so
                op(t, rid, module_name, name, "activation", not lost, torch.is_grad_enabled())
        return out if grads else None

    return hook


def forget_compiled(model: torch.nn.Module) -> None:
    """Drop dynamo's compiled code for the forwards of ``model``'s modules (and for the resume
    functions dynamo made from them at graph breaks), so that their next call compiles with the
    recorder's hooks: dynamo does not guard on module hooks
    (``torch._dynamo.config.skip_nnmodule_hook_guards``), so code compiled before the hooks were
    added would keep running without them. Other instances of the same module classes compile once
    more too."""
    try:
        # torch._dynamo: slow to import and absent from some builds, so looked up on use (as below)
        from torch._dynamo.convert_frame import input_codes
        from torch._dynamo.eval_frame import remove_from_cache
    except Exception:  # no dynamo: nothing compiled
        return
    codes = set()
    for m in model.modules():
        fwd = getattr(type(m), "forward", None)
        if not _is_wrapper(m) and hasattr(fwd, "__code__"):
            codes.add(fwd.__code__)
    files = {c.co_filename for c in codes}
    for ref in list(input_codes.seen):
        code = ref()
        if code is not None and (code in codes or (code.co_name.startswith("torch_dynamo_resume_in_")
                                                   and code.co_filename in files)):
            remove_from_cache(code)


def guard_hooks():
    """Make dynamo guard on module hooks from now on (code compiled for a module without the
    recorder's hooks then does not run for one with them); returns the previous setting for
    :func:`unguard_hooks`, None without dynamo."""
    try:
        import torch._dynamo.config as cfg  # see forget_compiled: imported on use
    except Exception:
        return None
    old = cfg.skip_nnmodule_hook_guards
    cfg.skip_nnmodule_hook_guards = False
    return old


def unguard_hooks(old) -> None:
    """Restore the setting :func:`guard_hooks` returned."""
    import torch._dynamo.config as cfg  # see forget_compiled: imported on use

    cfg.skip_nnmodule_hook_guards = old
