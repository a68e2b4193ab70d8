"""``mpscope.apply(model, recommendation)``: run an unchanged training loop with a Recommendation applied.

Inside the ``with`` block:

* **dtype**: every ``torch.autocast(device_type, dtype=...)`` the loop enters for the model's device
  type uses the recommended dtype (``float32``: autocast disabled), and each forward of ``model``
  runs under autocast in that dtype when the loop has none (autocast per forward, never around
  ``optimizer.step()``; not inside the float32 reference forward of ``record(..., shadow=True)``);
* **parameters**: with ``param_dtype="float32"`` float16/bfloat16 parameters (and their ``.grad``)
  and floating buffers become float32 on entry (the master weights autocast expects). They stay
  float32 after the block: the optimizer's state was built on them;
* **fp32_modules**: inside each listed module autocast is disabled, floating inputs are cast to
  float32 and floating outputs cast back to the dtype of the module's first floating input when
  that was float16/bfloat16;
* **GradScaler**: each ``torch.amp.GradScaler`` created inside the block gets the recommended
  ``init_scale, growth_factor, backoff_factor, growth_interval`` (``grad_scaler=None``: created
  disabled, so ``scale()`` / ``step()`` / ``update()`` pass through); so does each enabled scaler
  passed with ``scalers=`` (made before the block), on entry: its scale becomes ``init_scale``;
  ``clip_grad_norm_`` called while such a scaler's gradients are still scaled clips at
  ``max_norm * scale``, which is exactly ``unscale_`` then clip.

Everything is undone on exit, on exception and on KeyboardInterrupt (parameters excepted, see above;
a scaler passed with ``scalers=`` gets its own settings back and keeps the scale training left it).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import pandas as pd
import torch
import torch.nn.utils.clip_grad as cg

from mpscope.advisor import Recommendation, advise
from mpscope.model_hooks import ModelHook
from mpscope.recording.patches import PatchSet
from mpscope.recording.shadow import reference_pass_active


class ApplyError(ValueError):
    """Bad arguments to :func:`apply` (not a module, not a Recommendation, unknown fp32 module)."""


def _to(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(_to(v, dtype) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, dtype) for v in x)
    if isinstance(x, dict):
        return type(x)((k, _to(v, dtype)) for k, v in x.items())
    return x


def _first_float(args, kwargs) -> torch.dtype | None:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.dtype
    return None


class Applied:
    """The context manager :func:`apply` returns.

    Attributes:
        model: the model.
        recommendation: the :class:`~mpscope.advisor.Recommendation` applied.
        device_type: ``"cpu"`` / ``"cuda"``: the autocast device type acted on (the model's).
        scalers: the GradScalers configured as recommended: those passed with ``scalers=``, then
            those created inside the block.
        converted: names of parameters and buffers turned into float32 on entry.
    """

    def __init__(self, model: torch.nn.Module, recommendation: Recommendation | dict, scalers=()):
        if not isinstance(model, torch.nn.Module):
            raise ApplyError(f"apply() needs the torch.nn.Module you train; got {type(model).__name__}.")
        if isinstance(recommendation, dict):
            try:
                recommendation = Recommendation.from_dict(recommendation)
            except ValueError as e:
                raise ApplyError(f"the recommendation cannot be applied: {e}") from None
        if not isinstance(recommendation, Recommendation):
            raise ApplyError("apply() needs an mpscope.Recommendation (from mpscope.advise(run)) or its to_dict(); "
                             f"got {type(recommendation).__name__}.")
        names = dict(model.named_modules())
        missing = [m for m in recommendation.fp32_modules if m not in names]
        if missing:
            raise ApplyError(f"fp32_modules {missing} are not modules of this model (its modules: "
                             f"{list(names)[:8]} ...); apply the recommendation made for this model.")
        self.model = model
        self.recommendation = recommendation
        p = next(model.parameters(), None)
        self.device_type = p.device.type if p is not None else "cpu"
        bad = [type(sc).__name__ for sc in scalers if not isinstance(sc, torch.amp.GradScaler)]
        if bad:
            raise ApplyError(f"scalers= takes torch.amp.GradScaler objects; got {', '.join(bad)}.")
        self._existing = list(scalers)
        self.scalers: list = []
        self.converted: list[str] = []
        self._undo: list = []  # hook removals
        self._patches = PatchSet()
        self._stack: list = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Applied":
        try:
            self._install()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._restore()

    def _restore(self) -> None:
        while self._undo:
            self._undo.pop()()
        self._patches.restore()  # in any order of exit among apply blocks and recorders
        for ctx in reversed(self._stack):
            if ctx is not None:
                ctx.__exit__(None, None, None)
        self._stack.clear()

    def _patch(self, obj, attr: str, new) -> None:
        self._patches.replace(obj, attr, new)

    def _install(self) -> None:
        rec = self.recommendation
        if rec.param_dtype == "float32":
            self._master_weights()
        self._patch_autocast()
        if rec.dtype != "float32":
            self._autocast_forward()
        for name in rec.fp32_modules:
            self._fp32_module(name, self.model.get_submodule(name))
        for scaler in self._existing:
            self._configure_scaler(scaler)
        self._patch_scaler()
        self._patch_clip()

    # ------------------------------------------------------------------ pieces
    def _master_weights(self) -> None:
        low = (torch.float16, torch.bfloat16)
        with torch.no_grad():
            for mname, mod in self.model.named_modules():
                for pname, p in mod.named_parameters(recurse=False):
                    if p.dtype in low:
                        p.data = p.data.float()
                        if p.grad is not None:
                            p.grad = p.grad.float()
                        self.converted.append(f"{mname}.{pname}".lstrip("."))
                for bname, b in list(mod._buffers.items()):
                    if b is not None and b.dtype in low:
                        mod._buffers[bname] = b.float()
                        self.converted.append(f"{mname}.{bname}".lstrip("."))

    def _target(self) -> tuple[bool, torch.dtype | None]:
        d = self.recommendation.dtype
        return (d != "float32"), (getattr(torch, d) if d != "float32" else None)

    def _patch_autocast(self) -> None:
        cls = torch.amp.autocast_mode.autocast
        orig = cls.__init__
        dev = self.device_type
        on, dtype = self._target()

        def __init__(ac, device_type, dtype_=None, enabled=True, cache_enabled=None, **kw):
            if "dtype" in kw:
                dtype_ = kw.pop("dtype")
            if device_type == dev:
                if not on:
                    enabled = False
                elif enabled:
                    dtype_ = dtype
            orig(ac, device_type, dtype=dtype_, enabled=enabled, cache_enabled=cache_enabled, **kw)

        __init__.__signature__ = inspect.signature(orig)
        __init__.__wrapped__ = orig
        self._patch(cls, "__init__", __init__)

    def _autocast_forward(self) -> None:
        dev = self.device_type
        _, dtype = self._target()

        def pre(module, args):
            # the fp32 shadow's reference forward stays float32: it turned the loop's autocast off
            need = not (torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == dtype) \
                and not reference_pass_active()
            ctx = torch.autocast(dev, dtype=dtype) if need else None
            if ctx is not None:
                ctx.__enter__()
            self._stack.append(ctx)

        def post(module, args, output):
            if self._stack:
                ctx = self._stack.pop()
                if ctx is not None:
                    ctx.__exit__(None, None, None)

        h1 = self.model.register_forward_pre_hook(ModelHook(pre))
        h2 = self.model.register_forward_hook(ModelHook(post), always_call=True)
        self._undo.append(h1.remove)
        self._undo.append(h2.remove)

    def _fp32_module(self, name: str, module: torch.nn.Module) -> None:
        dev = self.device_type
        forward = module.forward

        def fp32_forward(*args, **kwargs):
            if not torch.is_autocast_enabled(dev):
                return forward(*args, **kwargs)
            back = _first_float(args, kwargs)
            with torch.autocast(dev, enabled=False):
                out = forward(*_to(args, torch.float32), **_to(kwargs, torch.float32))
            return _to(out, back) if back in (torch.float16, torch.bfloat16) else out

        self._patch(module, "forward", fp32_forward)

    def _configure_scaler(self, scaler) -> None:
        """A scaler made before the block: the recommended settings now, its own back on exit."""
        if not scaler.is_enabled():  # as one created disabled inside the block: left disabled
            return
        gs = self.recommendation.grad_scaler
        own = scaler.state_dict()
        if gs is None:
            # PyTorch's own flag (GradScaler has no public switch): scale() / step() / update() pass
            # through, as in a scaler created disabled
            setattr(scaler, "_enabled", False)
            self._undo.append(lambda: setattr(scaler, "_enabled", True))
        else:
            scaler.load_state_dict({"scale": float(gs["init_scale"]), "growth_factor": float(gs["growth_factor"]),
                                    "backoff_factor": float(gs["backoff_factor"]),
                                    "growth_interval": int(gs["growth_interval"]), "_growth_tracker": 0})

            def undo():
                trained = scaler.state_dict()
                scaler.load_state_dict({**trained, **{k: own[k] for k in
                                                      ("growth_factor", "backoff_factor", "growth_interval")}})

            self._undo.append(undo)
        self.scalers.append(scaler)

    def _patch_scaler(self) -> None:
        cls = torch.amp.GradScaler
        orig = cls.__init__
        sig = inspect.signature(orig)
        gs = self.recommendation.grad_scaler
        me = self

        def __init__(scaler, *args, **kwargs):
            bound = sig.bind(scaler, *args, **kwargs)
            bound.apply_defaults()
            a = dict(bound.arguments)
            a.pop("self", None)
            a.pop(next(iter(sig.parameters)), None)
            if gs is None:
                a["enabled"] = False
            else:
                a.update({k: gs[k] for k in ("init_scale", "growth_factor", "backoff_factor")})
                a["growth_interval"] = int(gs["growth_interval"])
            orig(scaler, **a)
            me.scalers.append(scaler)

        __init__.__signature__ = sig
        __init__.__wrapped__ = orig
        self._patch(cls, "__init__", __init__)

    def _patch_clip(self) -> None:
        # the helper clip_grad_norm_ looks up at every call: seen whatever name the loop imported
        orig = cg._clip_grads_with_norm_
        me = self

        def _clip_grads_with_norm_(parameters, max_norm, total_norm, *args, **kwargs):
            scale = me._pending_scale()
            if scale is not None:
                max_norm = float(max_norm) * scale  # clip the scaled gradients as if unscaled first
            return orig(parameters, max_norm, total_norm, *args, **kwargs)

        _clip_grads_with_norm_.__wrapped__ = orig
        _clip_grads_with_norm_.accounts_for_loss_scale = lambda: self._pending_scale() is not None
        self._patch(cg, "_clip_grads_with_norm_", _clip_grads_with_norm_)

    def _pending_scale(self) -> float | None:
        """The scale of a block-made GradScaler whose gradients are scaled and not yet unscaled."""
        for s in self.scalers:
            if not s.is_enabled() or getattr(s, "_scale", None) is None:
                continue
            states = getattr(s, "_per_optimizer_states", {}).values()
            if any(getattr(st.get("stage"), "name", "") != "READY" for st in states):
                continue
            return float(s.get_scale())
        return None


def apply(model: torch.nn.Module, recommendation: Recommendation | dict, scalers=()) -> Applied:
    """Apply a :class:`~mpscope.advisor.Recommendation` to an unchanged training loop.

    Use as ``with mpscope.apply(model, advice): <the training loop>``; see :mod:`mpscope.applying`
    for what changes. With the recommendation equal to the loop's own settings the training is
    bitwise unchanged.

    Args:
        model: the ``torch.nn.Module`` the loop trains (the one the recommendation was made for).
        recommendation: a Recommendation, or its ``to_dict()``.
        scalers: GradScalers made before the block that the loop uses: configured as recommended on
            entry (scalers the loop creates inside the block are configured without being named).

    Raises:
        ApplyError: ``model`` is not a module, ``recommendation`` is not a Recommendation (a dict
            with a field that breaks :meth:`Recommendation.from_dict`'s rules, e.g. a GradScaler
            ``init_scale`` that is inf, NaN or <= 0), or an ``fp32_modules`` name is not a module of
            ``model``, or ``scalers`` holds something that is not a ``torch.amp.GradScaler``.
    """
    return Applied(model, recommendation, scalers)


def round_trip(before, after, before_advice=None, after_advice=None):
    """Two runs of the same loop side by side (before / after applying a recommendation).

    Returns a pandas DataFrame indexed by ``metric``: ``steps``, ``skipped steps``, ``non-finite
    tensor rows`` (rows holding inf/NaN), ``first loss``, ``last loss``, ``error findings`` (their
    codes), with columns ``before`` and ``after``, plus the row ``errors cleared`` (codes present
    before and gone after) in ``after``.
    """
    before_advice = before_advice or advise(before)
    after_advice = after_advice or advise(after)

    def facts(run, advice):
        s, t = run.steps, run.tensors
        loss = s.loss.astype(float).to_numpy() if len(s) else []
        return {
            "steps": int(len(s)),
            "skipped steps": int(s.skipped.sum()) if len(s) else 0,
            "non-finite tensor rows": int(((t.nan_count + t.inf_count) > 0).sum()),
            "first loss": float(loss[0]) if len(loss) else math.nan,
            "last loss": float(loss[-1]) if len(loss) else math.nan,
            "error findings": ", ".join(sorted({f.code for f in advice.errors})) or "none",
        }

    b, a = facts(before, before_advice), facts(after, after_advice)
    gone = sorted({f.code for f in before_advice.errors} - {f.code for f in after_advice.errors})
    rows = [(k, b[k], a[k]) for k in b] + [("errors cleared", "", ", ".join(gone) or "none")]
    return pd.DataFrame(rows, columns=["metric", "before", "after"]).set_index("metric")
