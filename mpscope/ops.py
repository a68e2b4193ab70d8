"""Op-level recording (``record(model, ops=True)``), the autocast audit and op-level findings.

Module hooks see what enters and leaves an ``nn.Module``; many mixed-precision failures happen
between those boundaries (the residual add, the mask add, the variance inside a norm, the log of a
softmax). :class:`OpRecorder` pushes a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that
sees every ATen op *after* autocast has chosen its dtypes (the Python dispatch key sits below the
Autocast and Autograd keys), in forward and in backward, and

* hands every floating output to the recorder (``recorder._observe(module, "op_output", name, t)``),
  which takes the same exact, sync-free stats as for module outputs. ``module`` is the innermost
  module of ``model.named_modules()`` running the op (in backward: the module whose forward created
  the autograd node being executed); ops outside every module (the loss, ``scaler.scale``) belong to
  the root ``""``. ``name`` is ``"<aten overload>#<k>"`` (``aten.add.Tensor#0``), ``k`` counting the
  calls of that overload in that module within the step; an op with several floating outputs gives
  ``"<overload>#<k>.<i>"`` for output ``i``.
* keeps, per step, two tables that :meth:`OpRecorder.__exit__` puts on the run:

  - ``run.tables["ops"]``, the **autocast audit**: one row per (step, phase, module, op, input dtypes,
    output dtype, flags) with a call count; see :data:`AUDIT_COLUMNS`.
  - ``run.tables["op_facts"]``: per-call facts that the stats of the output alone cannot give
    (non-finite counts of the inputs, input magnitudes, zeros fed to a log, integer collisions of a
    cast, scalar constants lost or overflowing in the op's dtype), kept only for the calls where
    one of them is notable; see :data:`FACT_COLUMNS`. Device values are gathered in one copy per
    recorded step (non-blocking into pinned memory on CUDA, read once it has landed).

:func:`op_findings` turns those rows into :class:`mpscope.advisor.Finding` objects
(``reduction_precision``, ``mask_overflow``, ``integer_precision``, ``log_of_zero``,
``norm_statistics`` for an epsilon lost inside a norm, and op-granularity ``forward_overflow`` /
``first_nonfinite``), judging reductions against the autocast policy of the *target* device.

Ops that are skipped: views (their output is an input's memory), ``empty*`` (uninitialised memory),
ops issued by mpscope itself, ops in
``optimizer.step()``, ops outside every module that neither run in backward nor take an input that
requires grad (bookkeeping such as ``scaler.unscale_`` or gradient clipping), and ops of
``AccumulateGrad`` (parameter gradients are recorded by the module-level recorder as ``param_grad``),
and :data:`PRESERVING` ops (copies, concatenations, gathers) of values that already have rows. With
``record(ops=[...])`` only the named ops get rows, and only in modules the ``modules=`` selection
takes; the audit counts every op. The dispatch mode is on the stack during recorded steps only.

The mode never changes what an op computes: it calls the op with the arguments it received and
returns its result untouched; everything it measures is read-only. It is popped on exit and on
exception (the recorder's ``__exit__`` always calls :meth:`OpRecorder.__exit__`).
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from mpscope import stats as _stats_mod
from mpscope import distributed as _dist
from mpscope.formats import FORMATS, dtype_name

LOW = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TAG = "mpscope_module"
_NO_SEQ = 2**64 - 1  # sequence number of AccumulateGrad nodes (never created by an op in forward)

#: Largest tensor whose distinct values are counted (a sort) when a floating tensor that does not
#: require grad (positions, not weights or activations) is cast to float16/bfloat16; integer-dtype
#: inputs (positions, ids) are counted up to ``_DISTINCT_MAX_INT`` elements.
_DISTINCT_MAX_FLOAT = 1 << 16
_DISTINCT_MAX_INT = 1 << 22

# --------------------------------------------------------------------------- op classification
#: Reductions (ATen overload packet -> the op name used by the autocast op lists). The matmul family
#: reduces over its inner dimension K.
REDUCTIONS = {
    "sum": "sum", "mean": "mean", "var": "var", "std": "std", "var_mean": "var", "std_mean": "std",
    "nansum": "sum", "nanmean": "mean", "prod": "prod", "cumsum": "cumsum", "cumprod": "cumprod",
    "logsumexp": "logsumexp", "logcumsumexp": "logcumsumexp",
    "_softmax": "softmax", "softmax": "softmax", "_log_softmax": "log_softmax",
    "log_softmax": "log_softmax", "_softmax_backward_data": "softmax",
    "_log_softmax_backward_data": "log_softmax",
    "norm": "norm", "linalg_vector_norm": "norm", "frobenius_norm": "norm",
    "native_layer_norm": "layer_norm", "native_layer_norm_backward": "layer_norm",
    "native_group_norm": "group_norm", "native_group_norm_backward": "group_norm",
    "native_batch_norm": "batch_norm", "_native_batch_norm_legit": "batch_norm",
    "_native_batch_norm_legit_functional": "batch_norm", "_native_batch_norm_legit_no_training": "batch_norm",
    "mm": "mm", "bmm": "bmm", "addmm": "addmm", "baddbmm": "baddbmm", "addbmm": "addbmm",
    "matmul": "matmul", "dot": "dot", "vdot": "dot", "mv": "mv", "addmv": "addmv",
    "_scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention": "scaled_dot_product_attention",
}
MATMULS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "dot", "vdot", "mv", "addmv"}
#: Reductions whose output can exceed the inputs' range (a long sum); mean/var/softmax/norm cannot
#: overflow through the length of the reduction alone (PyTorch accumulates them in float32).
SUMMING = MATMULS | {"sum", "nansum", "cumsum"}
_DIM_ARG = {"_softmax", "_log_softmax", "cumsum", "cumprod", "logcumsumexp", "softmax", "log_softmax"}

#: Ops that CUDA autocast runs in float32 ("CUDA Ops that can autocast to float32", PyTorch AMP docs,
#: ``docs/source/amp.rst``, torch 2.x). CPU autocast has no softmax/sum/pow/layer_norm entry: they
#: run in their input's dtype, so float16 in, float16 out (CASES.md, note on devices).
CUDA_FP32_OPS = frozenset({
    "pow", "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "softplus", "softmax", "softmin", "log_softmax",
    "cumprod", "cumsum", "dist", "pdist", "cdist", "renorm", "prod", "sum", "norm", "normalize",
    "layer_norm", "group_norm", "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "kl_div",
    "smooth_l1_loss", "binary_cross_entropy_with_logits", "cosine_similarity", "poisson_nll_loss",
})
#: Ops that CPU autocast runs in float32 ("CPU Ops that can autocast to float32", same document).
CPU_FP32_OPS = frozenset({
    "prod", "cdist", "trace", "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "kl_div",
    "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "poisson_nll_loss", "margin_ranking_loss", "soft_margin_loss", "multi_margin_loss",
    "quantile", "nanquantile", "stft", "polar",
})
#: Ops that autocast (CPU and CUDA) runs in the lower precision: an in-place / ``out=`` call of these
#: bypasses the cast (autocast does not apply to them).
AUTOCAST_LOWP_OPS = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "conv1d", "conv2d", "conv3d",
    "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "prelu", "addmv", "addr", "mv", "dot",
})
_CASTS = {"_to_copy", "copy_", "to", "_to_copy_"}
_NOT_RECORDED = frozenset({"detach", "lift_fresh", "alias", "empty", "empty_like", "empty_strided", "new_empty",
                           "new_empty_strided", "empty_permuted"})
#: Ops whose output holds only elements of their floating inputs, unchanged (copies, concatenations,
#: gathers, rearrangements). When the output has the inputs' dtype and every floating input already
#: has an ``op_output`` row this step, the output can hold no value (non-finite, subnormal, out of
#: range, integer collision) that those rows do not show first, so its row is skipped (see
#: :meth:`OpRecorder._skippable`); its stats are still taken if a later op needs them.
PRESERVING = frozenset({
    "clone", "contiguous", "_to_copy", "copy_", "cat", "stack", "hstack", "vstack", "index_select",
    "gather", "repeat", "flip", "roll", "narrow_copy", "expand_copy", "permute_copy", "t_copy",
    "transpose_copy", "unsqueeze_copy", "squeeze_copy", "view_copy", "alias_copy", "slice_copy",
    "select_copy", "unfold_copy", "_unsafe_view", "unbind_copy", "split_copy", "split_with_sizes_copy",
})
_LOGS = {"log", "log2", "log10", "log_", "log2_", "log10_"}
_MASKING = {"add", "add_", "sub", "sub_", "rsub", "masked_fill", "masked_fill_", "where", "addcmul"}
_FILLS = {"full", "full_like", "fill", "fill_", "scalar_tensor", "new_full", "masked_fill", "masked_fill_",
          "where"}
_NORM_TAIL = {"rsqrt", "sqrt", "reciprocal", "div", "native_layer_norm", "native_group_norm"}
#: Ops with a pole: the input value at which each returns -inf/inf/NaN from a finite input
#: (log(0), log1p(-1), x / 0, 1 / 0, rsqrt(0), atanh(+-1)); ``in_pole`` counts such inputs.
POLES = {"log": 0.0, "log_": 0.0, "log2": 0.0, "log2_": 0.0, "log10": 0.0, "log10_": 0.0,
         "log1p": -1.0, "log1p_": -1.0, "reciprocal": 0.0, "reciprocal_": 0.0, "rsqrt": 0.0, "rsqrt_": 0.0,
         "div": 0.0, "div_": 0.0, "atanh": 1.0, "atanh_": 1.0}
#: Periodic functions: an argument rounded by a low-precision cast shifts their phase.
PERIODIC = {"sin", "cos", "tan", "sin_", "cos_", "tan_"}
#: Boundary values a constant may round onto (besides 0, see ``scalar_lost``): 1 - eps -> 1.
_BOUNDARIES = (1.0, -1.0)


@dataclass(frozen=True)
class _OpInfo:
    """Static facts about one ATen overload (cached per OpOverload)."""

    name: str  # "aten.add.Tensor"
    packet: str  # "add"
    view: bool
    inplace: bool
    out_variant: bool
    reduction: str | None  # policy name, or None
    cast: bool
    log: bool
    masking: bool
    preserving: bool
    short: str  # packet without leading / trailing underscores ("softmax" for "_softmax", "add" for "add_")


_INFO: dict = {}


def _op_info(func) -> _OpInfo:
    info = _INFO.get(func)
    if info is None:
        schema = func._schema
        packet = func.overloadpacket.__name__
        rets = schema.returns
        alias = [r.alias_info for r in rets]
        view = bool(rets) and all(a is not None and not a.is_write for a in alias)
        out_variant = any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
                          for a in schema.arguments)
        inplace = not out_variant and packet.endswith("_") and any(a is not None and a.is_write for a in alias)
        info = _OpInfo(
            # views share an input's memory; empty* outputs are uninitialised memory: neither is recorded
            name=str(func), packet=packet, view=view or packet in _NOT_RECORDED,
            inplace=inplace, out_variant=out_variant, reduction=REDUCTIONS.get(packet),
            cast=packet in _CASTS, log=packet in _LOGS, masking=packet in _MASKING,
            preserving=packet in PRESERVING, short=op_short_name(packet),
        )
        _INFO[func] = info
    return info


def op_short_name(name: str) -> str:
    """``"softmax"`` for ``"_softmax"``, ``"add"`` for ``"add_"`` or ``"aten.add.Tensor"``: the name an
    op filter (``record(ops=[...])``) matches."""
    if name.startswith("aten."):
        name = name.split(".")[1]
    return name.strip("_")


def check_op_filter(ops) -> frozenset | None:
    """The op filter of ``record(ops=...)``: None (every op) for ``True``, else the set of short names.

    Raises:
        ValueError: a name that is no ATen operator, or an empty list.
    """
    if ops is True:
        return None
    names = [ops] if isinstance(ops, str) else list(ops)
    if not names:
        raise ValueError("ops= got an empty list; pass True for every op or names such as ops=['add', 'softmax'].")
    out = set()
    for n in names:
        if not isinstance(n, str):
            raise ValueError(f"ops= takes op names (str); got {n!r}.")
        short = op_short_name(n)
        if not any(hasattr(torch.ops.aten, c) for c in (short, "_" + short, short + "_")):
            raise ValueError(f"ops=: {n!r} is not an ATen operator; use names such as 'add', 'matmul', "
                             "'softmax', 'layer_norm' (as in torch.ops.aten, leading underscores optional).")
        out.add(short)
    return frozenset(out)


def _reduction_len(info: _OpInfo, args, out: torch.Tensor) -> int:
    """Number of values each output element reduces over (K for matmuls)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return 0
    p = info.packet
    if p in MATMULS:
        a = tensors[1] if p in ("addmm", "baddbmm", "addbmm", "addmv") and len(tensors) > 1 else tensors[0]
        return int(a.shape[-1]) if a.dim() else 1
    if p in _DIM_ARG and len(args) > 1 and isinstance(args[1], int) and tensors[0].dim():
        return int(tensors[0].shape[args[1]])
    if p.startswith("native_layer_norm") and len(args) > 1:
        return int(math.prod(args[1])) if p == "native_layer_norm" else int(math.prod(args[2]))
    return int(tensors[0].numel() // max(out.numel(), 1))


# --------------------------------------------------------------------------- the recorder
#: Columns of ``run.tables["ops"]`` (the autocast audit): one row per step, phase ("forward" /
#: "backward"), module, op overload, input dtypes (comma-joined, floating tensor inputs in argument
#: order), output dtype, autocast (autocast was enabled for the op's device when its module was
#: entered), inplace, out_variant, param_lowp (a float16/bfloat16 ``nn.Parameter`` fed the op while
#: autocast was on: a parameter cast by hand), reduction (policy name or ""), with ``calls``, ``numel``
#: (output elements, summed) and ``max_reduction_len``.
AUDIT_COLUMNS = ["step", "phase", "module", "op", "in_dtypes", "out_dtype", "autocast", "inplace",
                 "out_variant", "param_lowp", "reduction", "calls", "numel", "max_reduction_len"]
#: Columns of ``run.tables["op_facts"]``: ``seq`` is the output's position in execution order within
#: the step; counts are over the output (``out_*``) or all floating tensor inputs (``in_*``; a
#: non-finite Python scalar argument counts as one); ``in_absmax0/1`` are the largest |x| of the first
#: two floating tensor inputs (NaN when not measured); ``in_zero`` counts exact zeros of a log's
#: input; for casts to float16/bfloat16 ``int_valued`` (every finite input is an integer),
#: ``in_absmax``, ``changed`` (elements whose value the cast changed) and ``distinct_in`` /
#: ``distinct_out`` (distinct values, NaN above the size limit); ``scalar_lost`` / ``scalar_overflow``
#: are Python scalar arguments that round to 0 / to inf in the op's dtype, ``scalar_rounded`` one that
#: rounds onto +-1 without being it (``1 - 1e-6`` is 1.0 in float16 and bfloat16), ``scalar`` the first
#: Python number argument (e.g. the exponent of ``pow``); NaN if none. ``in_pole`` counts input elements
#: at a pole of the op (:data:`POLES`); ``cast_err`` is the largest |change| a cast to float16/bfloat16
#: made; ``periodic_src`` (on a sin/cos row) is the ``seq`` of the low-precision cast of non-integer
#: data (not weights or activations) whose values reach this op's input, NaN if none.
FACT_COLUMNS = ["step", "seq", "phase", "module", "name", "op", "out_dtype", "numel", "reduction",
                "reduction_len", "out_nan", "out_inf", "in_nan", "in_inf", "in_absmax0", "in_absmax1",
                "in_zero", "int_valued", "in_absmax", "changed", "distinct_in", "distinct_out",
                "in_pole", "cast_err", "scalar", "scalar_lost", "scalar_overflow", "scalar_rounded",
                "periodic_src"]
_DEV_FIELDS = ["out_nan", "out_inf", "in_nan", "in_inf", "in_absmax0", "in_absmax1", "in_zero",
               "int_valued", "in_absmax", "changed", "distinct_in", "distinct_out", "in_pole", "cast_err"]
#: Switch for the PRESERVING skip (tests compare findings with and without it).
SKIP_PRESERVING = True
_MPSCOPE_INTERNAL = ("mpscope.stats", "mpscope.recorder", "mpscope.ops", "mpscope.run", "mpscope.formats")
#: Python frames between an op's caller and ``__torch_dispatch__`` (torch wraps modes to disable dynamo).
_WRAPPER_FRAMES = frozenset({"mpscope.ops", "torch._compile", "torch._dynamo.eval_frame",
                             "torch.utils._python_dispatch"})


class _Mode(TorchDispatchMode):
    def __init__(self, owner: "OpRecorder"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        owner = self.owner
        if owner._enabled and owner.recorder.recording:
            try:
                owner._on_op(func, args, kwargs, out)
            except Exception as e:  # never break the user's training because of mpscope
                owner._fail(e)
        return out


class OpRecorder:
    """Op-level recording for one :class:`~mpscope.recorder.Recorder` (used by ``record(ops=True)``).

    Args:
        recorder: an object with ``model`` (the ``nn.Module``), ``run`` (the Run, whose ``tables``
            receive the audit), ``recording`` (bool: this step is recorded) and
            ``_observe(module, role, name, tensor)`` (takes the stats of one tensor).

    Use as a context manager; call :meth:`on_step_end` at every step boundary.
    """

    def __init__(self, recorder):
        self.recorder = recorder
        model = recorder.model
        self._names = {m: n for n, m in _dist.named_modules(model)}  # wrapper prefixes left out
        select = getattr(recorder, "_select", None)
        #: modules whose ops get rows (None: all), from the recorder's ``modules=`` selection
        self._modules = None if select is None else {n for m, n in self._names.items() if select(n, m)}
        #: short op names that get rows (None: all), from ``record(ops=[...])``
        self._op_set = getattr(recorder, "_op_filter", None)
        self._skipped = 0  # op outputs whose row the PRESERVING rule skipped
        self._device_type = _model_device_type(model)
        self._mode: _Mode | None = None
        self._handles: list = []
        self._module_handles: list = []
        self._pushed = False
        self._below = None  # the dispatch mode under ours when it left the stack
        self._enabled = False
        self._stack: list[tuple[str, int, bool]] = []  # (name, seq threshold, autocast on)
        self._root_autocast = False
        self._in_optimizer = 0
        self._step = 0
        self._failed = False
        self._audit_rows: list[tuple] = []
        self._fact_frames: list[pd.DataFrame] = []
        self._pending: list = []  # (step, records, sizes, copies) whose host copy may not have landed
        self._reset_step()

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> "OpRecorder":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles = [
            register_optimizer_step_pre_hook(self._opt_pre),
            register_optimizer_step_post_hook(self._opt_post),
        ]
        self._module_handles = [
            register_module_forward_pre_hook(self._pre_hook),
            register_module_forward_hook(self._post_hook, always_call=True),
        ]
        self._mode = _Mode(self)
        self._mode.__enter__()
        self._pushed = True
        self._enabled = True
        return self

    def set_recording(self, on: bool) -> None:
        """Called at each step's start: the dispatch mode and the global module hooks are present
        during recorded steps only, so the ops of the steps in between (``every=N``) take PyTorch's
        plain path. The mode leaves the stack only when it is on top and comes back only onto the
        stack it left (another mode entered meanwhile stays undisturbed: then this step's ops are
        not recorded, and ``run.meta["ops_missed_steps"]`` says so)."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if self._mode is None:
            return
        if not on and self._pushed and _get_current_dispatch_mode() is self._mode:
            self._mode.__exit__(None, None, None)
            self._pushed = False
            self._below = _get_current_dispatch_mode()
            for h in self._module_handles:
                h.remove()
            self._module_handles = []
        elif on and not self._pushed:
            if _get_current_dispatch_mode() is not self._below:
                self.recorder.run.meta.setdefault("ops_missed_steps", []).append(self._step)
                return
            self._module_handles = [
                register_module_forward_pre_hook(self._pre_hook),
                register_module_forward_hook(self._post_hook, always_call=True),
            ]
            self._mode.__enter__()
            self._pushed = True

    def __exit__(self, exc_type, exc, tb) -> None:
        self._enabled = False
        try:
            if self._mode is not None and self._pushed:
                self._mode.__exit__(None, None, None)
        finally:
            self._mode = None
            self._pushed = False
            for h in self._handles + self._module_handles:
                h.remove()
            self._handles = []
            self._module_handles = []
            self._stack.clear()
            if self._records:
                self._flush(self._step)
            self._publish()

    def on_step_end(self, step: int) -> None:
        """Close step ``step``: start the copy of its device facts to the host (one transfer), reset
        call indices."""
        enabled, self._enabled = self._enabled, False
        try:
            self._flush(step)
        finally:
            self._enabled = enabled
        self._step = step + 1

    # ----------------------------------------------------------------- hooks
    def _pre_hook(self, module, args) -> None:
        name = self._names.get(module)
        if name is None:
            return
        on = torch.is_autocast_enabled(self._device_type)
        if not self._stack:
            self._root_autocast = on
        self._stack.append((name, torch._C._autograd._get_sequence_nr(), on))

    def _post_hook(self, module, args, output) -> None:
        name = self._names.get(module)
        if name is None or not self._stack:
            return
        # pop to this module (a forward that raised may have left inner entries behind)
        while self._stack:
            top, threshold, _ = self._stack.pop()
            if top == name:
                break
        if self._enabled and torch.is_grad_enabled():
            _tag_graph(output, name, threshold)

    def _opt_pre(self, *args, **kwargs) -> None:
        self._in_optimizer += 1

    def _opt_post(self, *args, **kwargs) -> None:
        self._in_optimizer = max(0, self._in_optimizer - 1)

    # ----------------------------------------------------------------- per op
    def _reset_step(self) -> None:
        self._counters: dict = {}
        self._audit: dict = {}
        self._records: list = []  # host part of each recorded output
        self._dev: list = []  # device part of each record: _DevFacts, same order
        self._stats = WeakIdKeyDictionary()  # tensor -> its DeviceStats (one row) this step
        self._rowed = WeakIdKeyDictionary()  # tensors whose values op_output rows of this step show
        # outputs whose values come from a low-precision cast of non-integer data -> that cast's seq
        self._taint = WeakIdKeyDictionary()

    def _context(self, args):
        """(module, phase, autocast) for the op being run, or None to skip it."""
        if self._in_optimizer:
            return None
        f = sys._getframe(1)  # walk past _on_op, __torch_dispatch__ and torch's wrappers to the op's caller
        while f is not None and f.f_globals.get("__name__") in _WRAPPER_FRAMES:
            f = f.f_back
        if f is not None and f.f_globals.get("__name__", "").startswith(_MPSCOPE_INTERNAL):
            return None
        if self._stack:
            name, _, on = self._stack[-1]
            return name, "forward", on
        if torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            if node is None:
                return "", "backward", False
            if node.name().endswith("AccumulateGrad"):
                return None
            return node.metadata.get(_TAG, ""), "backward", False
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return "", "forward", self._root_autocast
        return None

    def _on_op(self, func, args, kwargs, out) -> None:
        info = _op_info(func)
        if info.view:
            # a view shares its base's memory: reuse the base's non-finite count (an upper bound for a
            # slice; it only matters once the base already holds inf/NaN, i.e. after the first one)
            if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
                base = self._stats.get(args[0])
                if base is not None:
                    self._stats[out] = base
                if args[0] in self._rowed:
                    self._rowed[out] = True
                src = self._taint.get(args[0]) if len(self._taint) else None
                if src is not None:
                    self._taint[out] = src
            return
        if isinstance(out, torch.Tensor):
            outs = [out] if out.dtype in FLOATS and out.numel() else []
            multi = False
        elif isinstance(out, (tuple, list)):
            outs = [o if isinstance(o, torch.Tensor) and o.dtype in FLOATS and o.numel() else None for o in out]
            multi = True
            if not any(o is not None for o in outs):
                return
        else:
            return
        if not outs:
            return
        ctx = self._context(args)
        if ctx is None:
            return
        module, phase, autocast = ctx
        key = (module, info.name)
        k = self._counters.get(key, 0)
        self._counters[key] = k + 1

        flat = list(args) + list(kwargs.values())
        # floating tensor inputs, also inside lists (cat, stack); out= targets are no input
        tin = [a for a in _tensor_args(args if info.out_variant else flat) if a.dtype in FLOATS and a.numel()]
        first = next(o for o in outs if o is not None)
        red_len = _reduction_len(info, args, first) if info.reduction else 0
        param_lowp = autocast and any(a.dtype in LOW and isinstance(a, torch.nn.Parameter) for a in tin)
        audit_key = (phase, module, info.name, ",".join(dtype_name(a.dtype) for a in tin),
                     dtype_name(first.dtype), bool(autocast), info.inplace, info.out_variant,
                     bool(param_lowp), info.reduction or "")
        agg = self._audit.get(audit_key)
        if agg is None:
            self._audit[audit_key] = [1, first.numel(), red_len]
        else:
            agg[0] += 1
            agg[1] += first.numel()
            agg[2] = max(agg[2], red_len)

        # taint: which tensors carry values of a low-precision cast of non-integer data (see _facts);
        # it flows through every op, also those the op filter or the PRESERVING rule give no row
        periodic_src = math.nan
        if len(self._taint):
            src = next((self._taint[a] for a in tin if a in self._taint), None)
            if src is not None:
                if info.packet in PERIODIC:
                    periodic_src = src
                if not info.reduction:  # elementwise ops, casts, cat, ...: the values flow on
                    for o in outs:
                        if o is not None:
                            self._taint[o] = src

        if (self._modules is not None and module not in self._modules) or \
                (self._op_set is not None and info.short not in self._op_set):
            return  # not selected (the audit above still counts it)
        if self._skippable(info, tin, outs):
            self._skipped += 1
            for o in outs:
                if o is not None:
                    self._rowed[o] = True
            return

        # host facts: python scalars that the op's dtype cannot hold, or that are inf / NaN
        scalar_lost = scalar_overflow = scalar_rounded = math.nan
        scalar_nan = scalar_inf = 0
        scalar = next((float(a) for a in flat if isinstance(a, (int, float)) and not isinstance(a, bool)), math.nan)
        lowp = first.dtype in LOW
        fmt = FORMATS[dtype_name(first.dtype)] if lowp else None
        for a in flat:
            if isinstance(a, float):
                if math.isnan(a):
                    scalar_nan += 1
                elif math.isinf(a):
                    scalar_inf += 1
                elif lowp and 0 < abs(a) <= fmt.underflow_threshold and math.isnan(scalar_lost):
                    scalar_lost = a
                elif lowp and abs(a) >= fmt.overflow_threshold and math.isnan(scalar_overflow):
                    scalar_overflow = a
                elif lowp and math.isnan(scalar_rounded) and abs(abs(a) - 1.0) <= fmt.eps \
                        and a not in _BOUNDARIES and _round_to(a, first.dtype) in _BOUNDARIES:
                    scalar_rounded = a

        if info.cast and phase == "forward" and first.dtype in LOW and len(outs) == 1:
            # a vector of non-integer data (timesteps, positions, angles; not weights or activations)
            x = args[1] if info.packet == "copy_" else (args[0] if args else None)
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != first.dtype \
                    and not x.requires_grad and x.numel() <= _DISTINCT_MAX_FLOAT \
                    and x.numel() == max(x.shape, default=1):
                self._taint[first] = len(self._records)  # this output's seq
        # device facts: views of stats taken anyway (the outputs' and the inputs' rows), plus a few
        # op-specific values; they stay on the device until the step's single copy
        in_stats = [self._stats_of(a) for a in tin]
        absmax_in = self._absmax_inputs(info, tin, in_stats) if lowp else ()
        for i, o in enumerate(outs):
            if o is None:
                continue
            name = f"{info.name}#{k}.{i}" if multi else f"{info.name}#{k}"
            if phase == "backward":  # gradients flow scaled by the loss scale, as activation_grad rows
                ds = self.recorder._observe(module, "op_output", name, o, scaled=True)
            else:
                ds = self.recorder._observe(module, "op_output", name, o)
            if ds is None:
                ds = self._stats_of(o)
            else:
                self._stats[o] = ds
                self._rowed[o] = True
            with torch.no_grad():
                fields, vals, host = self._facts(info, args, tin, o, lowp, phase, in_stats)
                vals = torch.stack([v.to(device=o.device, dtype=torch.float64) for v in vals]) if vals else None
            self._dev.append(_DevFacts(ds, in_stats, absmax_in, fields, vals))
            host["in_nan"] = scalar_nan
            host["in_inf"] = scalar_inf
            self._records.append(((len(self._records), phase, module, name, info.name, dtype_name(o.dtype),
                                   o.numel(), info.reduction or "", red_len, scalar, scalar_lost, scalar_overflow,
                                   scalar_rounded, periodic_src),
                                  host))

    def _skippable(self, info, tin, outs) -> bool:
        """A :data:`PRESERVING` op whose outputs keep their inputs' dtype and whose floating inputs
        all have rows this step (see :data:`PRESERVING`)."""
        if not (info.preserving and SKIP_PRESERVING and tin):
            return False
        dtype = tin[0].dtype
        return all(a.dtype == dtype and a in self._rowed for a in tin) and \
            all(o is None or o.dtype == dtype for o in outs)

    def _stats_of(self, t: torch.Tensor):
        """The DeviceStats (one row) of ``t`` this step: a recorded op's output, or taken now."""
        ds = self._stats.get(t)
        if ds is None:
            ds = _stats_mod.device_stats([t.detach()], False, getattr(self.recorder, "_fused", True))
            self._stats[t] = ds
        return ds

    @staticmethod
    def _absmax_inputs(info, tin, in_stats) -> tuple:
        """(k, DeviceStats) of the inputs whose largest |x| is ``in_absmax<k>`` for this op."""
        if not tin:
            return ()
        p = info.packet
        if info.reduction in SUMMING:
            j = [1, 2] if p in ("addmm", "baddbmm", "addbmm", "addmv") else [0, 1]
            j = j[: 2 if p in MATMULS else 1]
        elif p in _MASKING or p in ("mul", "mul_", "pow", "div", "div_", "square", "addcmul"):
            j = [0, 1]
        elif p in PERIODIC and tin[0].dtype in LOW:  # float_precision: the argument's largest |x|
            j = [0]
        else:
            return ()
        return tuple((k, in_stats[i]) for k, i in enumerate(j) if i < len(tin))

    def _facts(self, info, args, tin, o, lowp, phase, in_stats):
        """Extra device facts of one output: (field indices, device scalars, host values by field)."""
        F = _FIELD
        fields: list[int] = []
        vals: list[torch.Tensor] = []
        host: dict = {}

        def put(field, value):
            fields.append(F[field])
            vals.append(value)

        if info.log and tin:
            put("in_zero", (tin[0] == 0).sum())
        pole = POLES.get(info.packet)
        if pole is not None and tin and phase == "forward":
            x = tin[1] if info.packet in ("div", "div_") and len(tin) > 1 else tin[0]  # the divisor / the argument
            if info.packet in ("div", "div_") and len(tin) < 2:
                x = None  # a Python divisor: its zero is visible on the host
        else:
            x = None
        if x is not None:
            put("in_pole", (x.detach().abs() == 1).sum() if pole == 1.0 else (x.detach() == pole).sum())
        if o.dtype in LOW:
            src = None
            if info.cast:
                src = args[1] if info.packet == "copy_" else args[0]
                if not isinstance(src, torch.Tensor) or src.dtype == o.dtype or src.is_complex() \
                        or src.dtype == torch.bool:
                    src = None
            if src is not None and src.device.type == "cpu" and src.dtype in FLOATS and src.numel() \
                    and self._taint.get(o) != len(self._records) \
                    and _finite_absmax_on_host(self._stats_of(src)) <= 2.0 / FORMATS[dtype_name(o.dtype)].eps:
                # every finite value is below 2 / eps, where the target format holds every integer:
                # no integer can collide, and a constant this small cannot overflow (host read of a
                # CPU tensor: no device to wait for; on CUDA the facts below stay on the device).
                # A taint source (a short vector of non-integer data whose values may reach a sin/cos)
                # keeps them: float_precision reads its in_absmax, distinct values and cast_err.
                src = None
            if src is not None:
                x = src.detach()
                if x.is_floating_point():
                    fin = torch.isfinite(x)
                    put("int_valued", ((x == torch.round(x)) | ~fin).all())
                    put("in_absmax", torch.where(fin, x.abs(), 0).amax())
                    # weights, activations and gradients are not positions: no sort for them
                    limit = 0 if (phase == "backward" or src.requires_grad or isinstance(src, torch.nn.Parameter)) \
                        else _DISTINCT_MAX_FLOAT
                else:
                    host["int_valued"] = 1.0
                    put("in_absmax", x.abs().amax())
                    limit = _DISTINCT_MAX_INT
                if o.numel() == x.numel():
                    y = o.detach().reshape(x.shape)
                    put("changed", (y.to(x.dtype) != x).sum())
                    if x.is_floating_point() and limit:
                        put("cast_err", torch.where(torch.isfinite(x), (y.to(x.dtype) - x).abs(), 0).amax())
                    if x.numel() <= limit:
                        put("distinct_in", _distinct(x))
                        put("distinct_out", _distinct(y))
            elif info.packet == "arange":
                nums = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
                if all(float(a).is_integer() for a in nums) and o.numel() <= _DISTINCT_MAX_INT:
                    host["int_valued"] = 1.0
                    host["distinct_in"] = float(o.numel())
                    put("in_absmax", o.detach().abs().amax())  # the values asked for, as rounded
                    put("distinct_out", _distinct(o.detach()))
                    # elements whose value the low-precision arange changed: vs an exact float64 arange
                    ref = torch.arange(*nums, dtype=torch.float64, device=o.device)
                    if ref.numel() == o.numel():
                        put("changed", (o.detach().to(torch.float64) != ref).sum())
        return fields, vals, host

    def _flush(self, step: int) -> None:
        """End of a recorded step: store its audit rows and start the copy of its device facts to the
        host, two ``cat``s and one copy per device (on CUDA non-blocking into pinned memory,
        processed once it has landed: no host synchronisation; on the CPU at once)."""
        records, dev, audit = self._records, self._dev, self._audit
        self._reset_step()
        for key, (calls, numel, red_len) in audit.items():
            self._audit_rows.append((step, *key, calls, numel, red_len))
        if records:
            pieces: dict = {}  # (device, kind) -> list of tensors; kind 0: int64 counts, 1: float64

            def put(t: torch.Tensor, kind: int):
                lst = pieces.setdefault((t.device, kind), [])
                lst.append(t)
                return (t.device, kind, len(lst) - 1)

            where = []
            for d in dev:
                nf = lambda ds: put(ds.counts[0, _NAN : _INF + 1], 0)  # noqa: E731
                where.append((nf(d.out), [nf(x) for x in d.ins],
                              [(k, put(x.extrema[0, :2], 1), nf(x)) for k, x in d.absmax],
                              (d.fields, put(d.vals, 1)) if d.fields else None))
            copies = []
            for (device, kind), lst in pieces.items():
                packed = torch.cat(lst)
                sizes = [t.numel() for t in lst]
                if packed.device.type == "cuda":
                    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                    host.copy_(packed, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                    copies.append(((device, kind), host, sizes, event))
                else:
                    copies.append(((device, kind), packed, sizes, None))
            self._pending.append((step, records, where, copies))
        self._drain(block=False)

    def _drain(self, block: bool) -> None:
        """Turn the landed copies into ``op_facts`` rows (all of them, waiting, when ``block``)."""
        while self._pending:
            step, records, where, copies = self._pending[0]
            if not block and any(ev is not None and not ev.query() for *_, ev in copies):
                return
            for *_, ev in copies:
                if ev is not None:
                    ev.synchronize()
            self._pending.pop(0)
            self._process(step, records, where, copies)

    def _process(self, step, records, where, copies) -> None:
        got = {}
        for key, host, sizes, _ in copies:
            flat = host.numpy()
            got[key] = np.split(flat, np.cumsum(sizes)[:-1]) if len(sizes) > 1 else [flat]

        def val(loc):
            device, kind, i = loc
            return got[(device, kind)][i]

        values = np.full((len(records), len(_DEV_FIELDS)), np.nan)
        values[:, 2:4] = 0.0
        for i, ((_, host), (out, ins, absmax, extra)) in enumerate(zip(records, where)):
            values[i, 0:2] = val(out)
            for loc in ins:
                values[i, 2:4] += val(loc)
            for k, ext, nf in absmax:
                nan, inf = val(nf)
                values[i, _FIELD[f"in_absmax{k}"]] = math.nan if nan else (math.inf if inf else float(np.abs(val(ext)).max()))
            if extra is not None:
                values[i, extra[0]] = val(extra[1])
            for field, v in host.items():
                j = _FIELD[field]
                values[i, j] = values[i, j] + v if field in ("in_nan", "in_inf") else v
        rows = [r[0] for r in records]
        cols = ["seq", "phase", "module", "name", "op", "out_dtype", "numel", "reduction", "reduction_len",
                "scalar", "scalar_lost", "scalar_overflow", "scalar_rounded", "periodic_src"]
        frame = pd.DataFrame(rows, columns=cols)
        for j, c in enumerate(_DEV_FIELDS):
            frame[c] = values[:, j]
        frame.insert(0, "step", step)
        frame = frame[FACT_COLUMNS]
        keep = ((frame.out_nan + frame.out_inf) > 0) | (frame.in_zero > 0) \
            | frame.scalar_lost.notna() | frame.scalar_overflow.notna() | frame.scalar_rounded.notna() \
            | frame.periodic_src.notna() | frame.seq.isin(frame.periodic_src.dropna()) | (frame.in_pole > 0) \
            | _periodic_coarse(frame) \
            | ((frame.int_valued == 1) & (frame.changed > 0)) \
            | _may_overflow(frame)
        if keep.any():
            self._fact_frames.append(frame[keep].reset_index(drop=True))

    def _publish(self) -> None:
        self._drain(block=True)
        run = self.recorder.run
        audit = pd.DataFrame(self._audit_rows, columns=AUDIT_COLUMNS)
        facts = (pd.concat(self._fact_frames, ignore_index=True) if self._fact_frames
                 else pd.DataFrame({c: pd.Series(dtype=_fact_dtype(c)) for c in FACT_COLUMNS}))
        run.tables["ops"] = audit
        run.tables["op_facts"] = facts
        run.meta.setdefault("ops", True)

    def _fail(self, e: Exception) -> None:
        self._enabled = False
        if not self._failed:
            self._failed = True
            warnings.warn(f"mpscope: op-level recording stopped after an internal error: {e!r}. "
                          "Training continues unchanged; module-level recording is unaffected.",
                          RuntimeWarning, stacklevel=2)


_FIELD = {f: i for i, f in enumerate(_DEV_FIELDS)}
_NAN, _INF = _stats_mod.COUNT_NAMES.index("nan"), _stats_mod.COUNT_NAMES.index("inf")


class _DevFacts:
    """The device part of one op-output record: its stats, its floating inputs' stats, the inputs
    whose largest |x| is kept ((k, stats) for ``in_absmax<k>``), and extra facts (field indices,
    float64 values)."""

    __slots__ = ("out", "ins", "absmax", "fields", "vals")

    def __init__(self, out, ins, absmax, fields, vals):
        self.out, self.ins, self.absmax, self.fields, self.vals = out, ins, absmax, fields, vals


def _tensor_args(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _finite_absmax_on_host(ds) -> float:
    """Largest finite |x| from a CPU tensor's stats (reads host memory; no device involved)."""
    e = ds.extrema.numpy()[0]
    return float(max(abs(e[0]), abs(e[1]))) if np.isfinite(e[0]) else 0.0


def _fact_dtype(c: str):
    if c in ("phase", "module", "name", "op", "out_dtype", "reduction"):
        return object
    return "int64" if c in ("step", "seq", "numel", "reduction_len") else "float64"


def _distinct(t: torch.Tensor) -> torch.Tensor:
    """Number of distinct values of ``t`` (sort + adjacent differences; no host sync)."""
    s = torch.sort(t.reshape(-1))[0]
    if s.numel() < 2:
        return torch.tensor(float(s.numel()), dtype=torch.float64, device=t.device)
    return ((s[1:] != s[:-1]).sum() + 1).to(torch.float64)


def _may_overflow(frame: pd.DataFrame) -> pd.Series:
    """A forward summing reduction in float16/bfloat16 whose bound K * max|a| * max|b| reaches the
    format's max."""
    fmax = frame.out_dtype.map(lambda d: FORMATS[d].max if d in FORMATS else math.inf)
    bound = frame.reduction_len * frame.in_absmax0 * frame.in_absmax1.fillna(1.0)
    # forward only: an overflowing (scaled) gradient in backward is the GradScaler's to catch and skip
    return (frame.phase == "forward") & frame.reduction.ne("") & (bound >= fmax) \
        & frame.out_dtype.isin(["float16", "bfloat16"])


def _round_to(x: float, dtype: torch.dtype) -> float:
    """``x`` as ``dtype`` holds it (round to nearest even, as ``tensor.to(dtype)``)."""
    return float(torch.tensor(x, dtype=torch.float64).to(dtype))


#: float_precision: a sin/cos/tan argument held in float16/bfloat16 whose spacing (ulp) at its
#: largest magnitude reaches 2^-3 rad: neighbouring arguments then differ by up to 1/16 rad in phase.
PERIODIC_ULP = 2.0**-3


def _ulp(absmax: pd.Series, dtype: pd.Series) -> pd.Series:
    """Spacing of each row's format at |x| = absmax: 2^(floor(log2 absmax) - mantissa bits)."""
    mant = dtype.map(lambda d: FORMATS[d].mantissa_bits if d in FORMATS else np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.exp2(np.floor(np.log2(absmax.where(absmax > 0))) - mant)


def _periodic_coarse(frame: pd.DataFrame) -> pd.Series:
    """Forward sin/cos/tan rows whose low-precision argument has an ulp >= PERIODIC_ULP."""
    packet = frame.op.str.split(".").str[1]
    return packet.isin(PERIODIC) & (_ulp(frame.in_absmax0, frame.out_dtype) >= PERIODIC_ULP)


def _model_device_type(model: torch.nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    for b in model.buffers():
        return b.device.type
    return "cpu"


def _tag_graph(output, name: str, threshold: int) -> None:
    """Tag the autograd nodes created during this module's forward (sequence number >= threshold)."""
    stack = []
    for t in _flat_tensors(output):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        seq = node._sequence_nr()
        if seq < threshold or seq == _NO_SEQ:
            continue
        md = node.metadata
        if _TAG in md:
            continue
        md[_TAG] = name
        stack.extend(n for n, _ in node.next_functions)


def _flat_tensors(obj):
    from torch.utils._pytree import tree_flatten

    try:
        leaves, _ = tree_flatten(obj)
    except Exception:  # pragma: no cover - exotic containers (HF ModelOutput is a dict subclass)
        leaves = [obj]
    if not leaves and hasattr(obj, "values"):
        leaves = list(obj.values())
    return [t for t in leaves if isinstance(t, torch.Tensor)]


# --------------------------------------------------------------------------- the audit
def audit(run) -> pd.DataFrame:
    """Which ops ran in which dtype, per module: the autocast audit of a run recorded with ``ops=True``.

    Returns one row per (phase, module, op, in_dtypes, out_dtype) over all recorded steps, in first
    execution order, with ``calls`` (summed), ``max_reduction_len`` and three flags:

    * ``reduction_lowp``: a reduction (:data:`REDUCTIONS`) whose output is float16/bfloat16.
    * ``bypass``: an in-place or ``out=`` call of an op that autocast would cast
      (:data:`AUTOCAST_LOWP_OPS`) while autocast was on; autocast does not apply to those calls.
    * ``param_lowp``: a float16/bfloat16 ``nn.Parameter`` was an input while autocast was on
      (a parameter cast by hand with ``.half()``; autocast expects float32 parameters).

    Raises:
        ValueError: when the run has no audit table (it was not recorded with ``ops=True``).
    """
    table = run.tables.get("ops")
    if table is None:
        raise ValueError("this run has no op-level audit: record it with mpscope.record(model, ..., ops=True)")
    if table.empty:
        return pd.DataFrame(columns=["phase", "module", "op", "in_dtypes", "out_dtype", "calls",
                                     "max_reduction_len", "reduction_lowp", "bypass", "param_lowp"])
    t = table.copy()
    packet = t.op.str.split(".").str[1]
    t["reduction_lowp"] = t.reduction.ne("") & t.out_dtype.isin(["float16", "bfloat16"])
    t["bypass"] = t.autocast & (t.inplace | t.out_variant) & packet.isin(AUTOCAST_LOWP_OPS)
    keys = ["phase", "module", "op", "in_dtypes", "out_dtype"]
    out = t.groupby(keys, sort=False, observed=True).agg(
        calls=("calls", "sum"), max_reduction_len=("max_reduction_len", "max"),
        reduction_lowp=("reduction_lowp", "any"), bypass=("bypass", "any"), param_lowp=("param_lowp", "any"),
    )
    return out.reset_index()


# --------------------------------------------------------------------------- findings
_NOT_OVERFLOW = {"pow"} | set(POLES)  # inf from a finite input by a pole (1/0, log 0), not by exceeding the range


def _target_device(run, target_device):
    if target_device:
        return target_device
    meta = run.meta or {}
    return meta.get("autocast_device_type") or str(meta.get("device") or "cpu").split(":")[0]


def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "?"
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.3g}"


def _estimate(row) -> float:
    """Largest magnitude the op's exact result could have had (from its inputs' max |x|)."""
    p = row.op.split(".")[1]
    a, b, s = row.in_absmax0, row.in_absmax1, row.scalar
    if p.startswith("pow") and not math.isnan(s):
        return a ** s
    if p.startswith("mul") or p in ("square",):
        if p == "square":
            return a * a
        return a * (b if not math.isnan(b) else abs(s) if not math.isnan(s) else 1.0)
    if p in ("add", "add_", "sub", "sub_", "rsub"):
        return a + (b if not math.isnan(b) else abs(s) if not math.isnan(s) else 0.0)
    if p in _CASTS:
        return row.in_absmax
    return a


def op_findings(run, target_device: str | None = None) -> list:
    """Findings from the op-level rows of a run recorded with ``record(model, ..., ops=True)``.

    Args:
        run: a :class:`mpscope.Run` with ``run.tables["op_facts"]`` and ``run.tables["ops"]``
            (written by :class:`OpRecorder`); a run without them gives ``[]``.
        target_device: ``"cpu"`` or ``"cuda"``: whose autocast policy reductions are judged against.
            Default: ``run.meta["autocast_device_type"]``, else the recorded device's type.

    Returns:
        ``list[mpscope.advisor.Finding]`` in execution order (step, then call order), role
        ``"op_output"``, ``name`` the op row's name (``aten.add.Tensor#0``). Rules (``fmt`` = the
        op's output format from :mod:`mpscope.formats`, i.e. ``torch.finfo``):

        * ``first_nonfinite`` (error): the first forward op whose output holds inf/NaN that its
          inputs did not (inf from finite inputs, or NaN from NaN-free inputs), unless the advisor's
          own ``first_nonfinite`` already names the same op (it walks all rows; this rule skips ops
          fed an intentional ``-inf`` mask). value = non-finite elements, threshold 0.
        * ``mask_overflow`` (error): a finite constant became inf: a Python scalar at or above
          ``fmt.overflow_threshold`` (``masked_fill(m, -1e10)``, ``where(m, x, -1e10)``), an
          add/sub/where/masked_fill with an input of ``|x| >= fmt.max / 2`` (a ``finfo.min`` mask)
          whose output overflowed, or a cast of a value ``>= 256 * fmt.max``. value = the constant,
          threshold = ``fmt.max``.
        * ``forward_overflow`` (error): any other forward op whose finite inputs gave inf (the residual
          add, ``x * x`` inside a norm). value = the largest magnitude the exact result could have
          (from the inputs' max |x|: a·b for mul, a^p for pow, a+b for add), threshold ``fmt.max``.
        * ``reduction_precision`` (warning): (a) a summing reduction (sum, cumsum, the matmul family)
          overflowed in forward, value = reduction length K, threshold = ``floor(fmt.max / term)``;
          (b) a forward summing reduction whose bound ``K * max|a| * max|b|`` reaches ``fmt.max``,
          value = the bound (backward gradients are the GradScaler's to catch);
          (c) a reduction in :data:`REDUCTIONS` (not a matmul) whose forward output was
          float16/bfloat16, unless autocast was on and the target device's autocast runs that op in
          float32 (:data:`CUDA_FP32_OPS`, :data:`CPU_FP32_OPS`); one finding per op, value = the
          longest reduction, threshold NaN.
        * ``integer_precision`` (warning): a cast to float16/bfloat16 of integer values with
          ``max |x| > 2 / fmt.eps`` (2048 for float16, 256 for bfloat16: above it not every integer is
          representable) that changed some of them. value = max |x|, threshold = 2 / eps.
        * ``log_of_zero`` (error): a log whose input held exact zeros (an underflowed softmax /
          probability). value = fraction of zeros in the input, threshold 0.
        * ``norm_statistics`` (warning): a non-zero Python constant that rounds to 0 in the op's
          float16/bfloat16 dtype (``|c| <= fmt.min_subnormal / 2``) inside a module that also
          normalises (rsqrt / sqrt / reciprocal / div): a norm epsilon lost. value = the constant,
          threshold = ``fmt.min_subnormal`` (2^-24 for float16).
    """
    from mpscope.advisor import Finding

    facts = run.tables.get("op_facts")
    table = run.tables.get("ops")
    if facts is None or table is None:
        return []
    target = _target_device(run, target_device)
    found: list[tuple] = []  # (step, seq, Finding)

    def add(row, code, severity, value, threshold, message, fix, seq=None):
        found.append((int(row.step), int(row.seq) if seq is None else seq, Finding(
            code=code, severity=severity, module=str(row.module), role="op_output", name=str(row.name),
            step=int(row.step), value=float(value), threshold=float(threshold), message=message, fix=fix)))

    f = facts.sort_values(["step", "seq"], kind="stable")
    fwd = f[f.phase == "forward"]
    created_inf = (fwd.out_inf > 0) & (fwd.in_inf == 0) & (fwd.in_nan == 0)
    created_nan = (fwd.out_nan > 0) & (fwd.in_nan == 0)
    created = fwd[created_inf | created_nan]
    norm_modules = _norm_modules(table)
    seen: set = set()

    def once(key) -> bool:
        if key in seen:
            return False
        seen.add(key)
        return True

    if len(created) and not _same_as_first_row(run, next(created.itertuples(index=False))):
        r = next(created.itertuples(index=False))
        what = []
        if r.out_inf:
            what.append(f"{int(r.out_inf)} inf")
        if r.out_nan:
            what.append(f"{int(r.out_nan)} NaN")
        add(r, "first_nonfinite", "error", r.out_nan + r.out_inf, 0,
            f"The first non-finite value of step {int(r.step)} appears inside module '{r.module}': "
            f"{r.name} ({r.out_dtype}) produced {' and '.join(what)} from finite inputs"
            + ("" if r.in_inf == 0 else " (its inputs held inf but no NaN)") + ".",
            "See the finding for the same op below for the cause; everything downstream is a consequence.")

    for r in fwd[created_inf].itertuples(index=False):
        fmt = FORMATS.get(r.out_dtype)
        if fmt is None:
            continue
        p = r.op.split(".")[1]
        key = (r.module, r.op)
        big_input = np.nanmax([r.in_absmax0, r.in_absmax1, -1.0])
        if not math.isnan(r.scalar_overflow):
            if once(("mask",) + key):
                add(r, "mask_overflow", "error", r.scalar_overflow, fmt.max,
                    f"The constant {r.scalar_overflow:g} does not fit {r.out_dtype} (max {fmt.max:g}): "
                    f"{r.name} in '{r.module}' turned it into inf in {int(r.out_inf)} elements.",
                    f"Use torch.finfo({r.out_dtype}).min as the mask value (or build the mask in the "
                    "scores' dtype), e.g. scores.masked_fill(mask, torch.finfo(scores.dtype).min).")
        elif p in _MASKING and big_input >= fmt.max / 2:
            if once(("mask",) + key):
                add(r, "mask_overflow", "error", -big_input if p != "where" else big_input, fmt.max,
                    f"{r.name} in '{r.module}' added a mask constant of magnitude {big_input:g} (finfo.min "
                    f"of {r.out_dtype} is {-fmt.max:g}) to finite scores: {int(r.out_inf)} elements rounded "
                    "to -inf (finfo.min plus any further negative value overflows), and a fully masked row "
                    "then gives NaN in softmax.",
                    "Clamp after adding masks: torch.clamp(scores + mask, min=torch.finfo(scores.dtype).min), "
                    "combine causal and padding masks with torch.minimum instead of adding them, or "
                    "use masked_fill(mask, torch.finfo(dtype).min).")
        elif p in _CASTS and r.in_absmax >= fmt.max * 256:
            if once(("mask",) + key):
                add(r, "mask_overflow", "error", r.in_absmax, fmt.max,
                    f"{r.name} in '{r.module}' cast a constant of magnitude {r.in_absmax:.3g} to {r.out_dtype} "
                    f"(max {fmt.max:g}): it became inf in {int(r.out_inf)} elements (a mask built with "
                    "finfo(float32).min or 1e9 and cast under autocast).",
                    "Build the mask with torch.finfo(<compute dtype>).min, or in the dtype it is added in.")
        elif r.reduction and p in SUMMING:
            term = r.in_absmax0 * (1.0 if math.isnan(r.in_absmax1) else r.in_absmax1)
            thr = math.floor(fmt.max / term) if term > 0 and math.isfinite(term) else math.nan
            if once(("red",) + key):
                add(r, "reduction_precision", "warning", r.reduction_len, thr,
                    f"{r.name} in '{r.module}' sums {int(r.reduction_len)} values per output in "
                    f"{r.out_dtype}; terms reach {_fmt(term)}, so at most {_fmt(thr)} of them fit under "
                    f"{fmt.max:g}: {int(r.out_inf)} outputs overflowed to inf.",
                    "Scale before the long sum (divide by the length, or pre-scale q by 1/sqrt(d) before "
                    "Q·Kᵀ), or run this op in float32 / bfloat16.")
        elif p not in _NOT_OVERFLOW or (p == "pow" and not math.isnan(r.scalar) and r.scalar > 0):
            est = _estimate(r)
            if once(("fwd",) + key):
                norm = r.module in norm_modules.get(int(r.step), set())
                add(r, "forward_overflow", "error", est, fmt.max,
                    f"{r.name} in '{r.module}' produced {int(r.out_inf)} inf from finite {r.out_dtype} inputs: "
                    f"its exact result reaches about {_fmt(est)} > {fmt.max:g}"
                    + (" (inside a normalisation: the variance overflows, rsqrt gives 0 and the row's output "
                       "silently becomes 0)" if norm else "")
                    + ". A loss scale cannot fix a forward overflow.",
                    ("Compute the norm statistics in float32 (x.float().pow(2).mean(...), as LlamaRMSNorm "
                     "does), or keep this module in float32." if norm else
                     f"Keep '{r.module}' in float32, rescale its inputs, or train in bfloat16."))

    lost = f[f.scalar_lost.notna()]
    for r in lost.itertuples(index=False):
        if r.module not in norm_modules.get(int(r.step), set()):
            continue
        fmt = FORMATS[r.out_dtype]
        later = f[(f.step == r.step) & (f.module == r.module) & (f.seq > r.seq)]
        nans = int(later.out_nan.max()) if len(later) else 0
        if once(("eps", r.module, r.op)):
            add(r, "norm_statistics", "warning", r.scalar_lost, fmt.min_subnormal,
                f"The constant {r.scalar_lost:g} in {r.name} ('{r.module}') is below {r.out_dtype}'s smallest "
                f"subnormal {fmt.min_subnormal:.3g} and rounds to 0: a norm epsilon lost"
                + (f"; a zero-variance row then gives rsqrt(0) = inf and 0·inf = NaN ({nans} NaN)." if nans
                   else "; a zero-variance row would give rsqrt(0) = inf."),
                "Run the norm in float32 (the statistics and the epsilon), or use eps >= 1e-5.")

    for r in f[f.op.str.split(".").str[1].isin(_LOGS) & (f.in_zero > 0)].itertuples(index=False):
        if once(("log", r.module, r.op)):
            frac = r.in_zero / r.numel
            add(r, "log_of_zero", "error", frac, 0.0,
                f"{r.name} in '{r.module}' took the log of a tensor whose {100 * frac:.1f} % elements "
                f"({int(r.in_zero)} of {int(r.numel)}) are exactly 0 (underflowed probabilities): "
                f"{int(r.out_inf)} outputs are -inf.",
                "Use F.log_softmax / F.cross_entropy on the logits (in float32) instead of "
                "log(softmax(x)); never take the log of a float16 probability.")

    ints = f[(f.int_valued == 1) & (f.changed > 0) & (f.phase == "forward")]
    for r in ints.itertuples(index=False):
        fmt = FORMATS.get(r.out_dtype)
        if fmt is None:
            continue
        exact = 2.0 / fmt.eps
        if r.in_absmax > exact and once(("int", r.module, r.op)):
            distinct = ""
            if not math.isnan(r.distinct_out):
                distinct = (f"; {int(r.distinct_in)} distinct values became {int(r.distinct_out)}" if not
                            math.isnan(r.distinct_in) else f"; {int(r.distinct_out)} distinct values remain")
            add(r, "integer_precision", "warning", r.in_absmax, exact,
                f"{r.name} in '{r.module}' put integers up to {r.in_absmax:g} into {r.out_dtype}, which holds "
                f"every integer only up to {exact:g}: {int(r.changed)} of {int(r.numel)} values changed"
                f"{distinct}. Positions that collide make rotary/positional encodings identical.",
                "Compute positions and angles (arange, position_ids · inv_freq) in float32 with autocast "
                "disabled, and cast only the resulting cos/sin.")

    mo = f[_may_overflow(f) & (f.out_inf == 0)] if len(f) else f
    for r in mo.itertuples(index=False):
        fmt = FORMATS[r.out_dtype]
        bound = r.reduction_len * r.in_absmax0 * (1.0 if math.isnan(r.in_absmax1) else r.in_absmax1)
        if once(("red", r.module, r.op)):
            add(r, "reduction_precision", "warning", bound, fmt.max,
                f"{r.name} in '{r.module}' sums {int(r.reduction_len)} terms in {r.out_dtype} whose size reaches "
                f"{_fmt(bound / r.reduction_len)}: the sum can reach {_fmt(bound)} >= {fmt.max:g}.",
                "Scale before the long sum (divide first, or pre-scale q before Q·Kᵀ), or run it in float32.")

    found.extend(_policy_findings(table, target, Finding))
    found.sort(key=lambda x: (x[0], x[1]))
    return [x[2] for x in found]


_REDUCTION_FIX = {
    "softmax": "Ask for a float32 softmax: F.softmax(x, dim, dtype=torch.float32) (cast back after), ",
    "log_softmax": "Ask for a float32 log_softmax: F.log_softmax(x, dim, dtype=torch.float32), ",
    "sum": "Accumulate in float32: x.sum(dim, dtype=torch.float32), ",
    "mean": "Accumulate in float32: x.mean(dim, dtype=torch.float32) or x.float().mean(dim), ",
    "var": "Compute the statistics in float32: x.float().var(dim), ",
    "std": "Compute the statistics in float32: x.float().std(dim), ",
    "norm": "Compute the norm in float32: torch.linalg.vector_norm(x, dtype=torch.float32), ",
    "layer_norm": "Run the norm in float32: F.layer_norm(x.float(), ...).to(x.dtype), ",
    "group_norm": "Run the norm in float32: F.group_norm(x.float(), ...).to(x.dtype), ",
    "cumsum": "Accumulate in float32: x.cumsum(dim, dtype=torch.float32), ",
    "prod": "Multiply in float32: x.prod(dim, dtype=torch.float32), ",
}


def _same_as_first_row(run, r) -> bool:
    """True when the advisor's own (module-level) ``first_nonfinite`` rule already names op ``r``
    (it walks every row, op rows included, in execution order): no second finding for it."""
    try:
        from mpscope.advisor.findings import Context, first_nonfinite

        theirs = first_nonfinite(Context(run))
    except Exception:  # the advisor changed shape: report ours
        return False
    return any(f.role == "op_output" and f.module == str(r.module) and f.name == str(r.name) and
               f.step == int(r.step) for f in theirs)


def _norm_modules(table: pd.DataFrame) -> dict:
    """step -> modules whose forward contains a normalising op (rsqrt, sqrt, reciprocal, div, *_norm)."""
    if table.empty:
        return {}
    t = table[(table.phase == "forward") & table.op.str.split(".").str[1].isin(_NORM_TAIL)]
    return {int(s): set(g.module) for s, g in t.groupby("step")}


def _policy_findings(table: pd.DataFrame, target: str, Finding) -> list:
    if table.empty:
        return []
    fp32_ops = CUDA_FP32_OPS if target == "cuda" else CPU_FP32_OPS
    t = table[(table.phase == "forward") & table.reduction.ne("") & table.out_dtype.isin(["float16", "bfloat16"])]
    t = t[~t.op.str.split(".").str[1].isin(MATMULS | {k for k, v in REDUCTIONS.items() if "attention" in v})]
    t = t[~(t.autocast & t.reduction.isin(fp32_ops))]
    out = []
    for op, g in t.groupby("op", sort=False):
        first = g.iloc[0]
        modules = list(dict.fromkeys(g.module))
        shown = ", ".join(f"'{m}'" for m in modules[:5]) + (f" and {len(modules) - 5} more" if len(modules) > 5 else "")
        dtypes = "/".join(sorted(set(g.out_dtype)))
        policy = ""
        if not g.autocast.any():
            policy = (" Autocast was off for it: its inputs were already low precision (cast by hand), so it "
                      "runs in low precision on any device.")
        elif first.reduction in CUDA_FP32_OPS and target == "cpu":
            policy = (f" CPU autocast keeps {first.reduction} in its input's dtype (CUDA autocast would run it "
                      "in float32), so on the CPU it really runs in low precision.")
        msg = (f"{op} ran in {dtypes} in {len(modules)} module(s) ({shown}), reducing up to "
               f"{int(g.max_reduction_len.max())} values per output.{policy}")
        fix = _REDUCTION_FIX.get(first.reduction, f"Run {first.reduction} on float32 inputs (x.float()) ") + \
            "or keep these modules in float32."
        f = Finding(code="reduction_precision", severity="warning", module=str(first.module), role="op_output",
                    name=f"{op}#0", step=int(first.step), value=float(g.max_reduction_len.max()),
                    threshold=math.nan, message=msg, fix=fix)
        out.append((int(first.step), 1 << 60, f))
    return out
