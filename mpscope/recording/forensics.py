"""Precision forensics (``record(model, ops=True, shadow=True)``): every op of a recorded step, shadowed.

For each recorded step, :class:`Forensics` sees every ATen op the step runs (forward, the loss and
whatever else the loop computes outside the model, backward, the optimizer step, in-place updates
of the model's state such as an EMA) through op recording's dispatch mode, and keeps a data-flow
graph of it (:class:`Node`: the op, its inputs by identity and version, its module and its
``phase``). Along the graph it carries a **shadow** of every floating value, its evaluation in
higher precision (float64 for float32 values, float32 for 16-bit ones: :data:`SHADOW`; the method
of Herbgrind, Sanchez-Stern et al., PLDI 2018, and FPDebug, Benz et al., PLDI 2012):

* the **local error** of an op: its output against the op evaluated in higher precision on its own
  inputs cast up (the error the op adds by itself);
* the **global error** of a value: its output against the op evaluated on its inputs' shadows.

A collective (DDP's all-reduce, a comm hook's), and every op a DDP communication hook runs, is in
the ``communication`` phase; a collective is never run again: its shadow is its own output, or, where it made a non-finite value from finite inputs, the
input's shadow times the group size.

Shadows start from the values as they enter the step (the float32 master parameters, the batch as
the loop passed it, optimizer state, buffers); a cast has the uncast value as its shadow; random
ops (dropout masks, sampling) have their own output as shadow. Integer and boolean outputs (argmax,
topk indices, comparisons) are compared with the decision the shadow makes.

**Spots** (where error matters) are checked as the step runs: every non-finite value made from
finite inputs, every parameter's gradient as the optimizer receives it, every in-place update of a
parameter, buffer or optimizer state (the change it made against the change its shadow makes), the
factor between the gradients the optimizer steps on and the loss's gradients (loss-scale
bookkeeping), and decisions that flip. At the step's end :func:`mpscope.recording.root_cause.analyse`
walks back from each bad spot, names the mechanism and verifies fixes by replaying the graph; its
rows go to ``run.tables["forensics"]`` (:data:`mpscope.recording.root_cause.COLUMNS`).

Inside ``optimizer.step()`` only ops that touch a 16-bit value are traced: float32 optimizer math
(master weights, their gradients, Adam's moments) is what keeps 16-bit updates from being lost, and
its values are their own shadows where a 16-bit op reads them.

Memory: the graph holds the step's leaves (values from outside it: parameters, the batch, and a
copy of each one an in-place op then overwrites), random draws and collectives' outputs until the
step ends; every other value, and its shadow, only as long as the program holds the value (swept
every :data:`SWEEP_EVERY` ops). A step with a bad spot is then rebuilt from its leaves
(:meth:`Forensics.rebuild`: the graph run again, values and shadows) before the analysis, so only
such a step holds all its values at once, while it is analysed (benchmarks/forensics_overhead.py
measures the cost). Nothing here changes what an op computes: the higher-precision evaluations and
the rebuild run on copies, and any failure turns forensics off with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import warnings

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from mpscope.formats import dtype_name
from mpscope.recording.root_cause import (DOMAIN, MOVES, analyse, bad_fraction, collective, flatten, frame,
                                         mutated_args, mutated_positions, rel_l2, set_flips, tensors_of, unflatten,
                                         zeroed_inputs)

LOW = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: The format a value's shadow is kept in: float64 for float32 values; float32 for 16-bit values, whose
#: spacing is 2^13 (float16) and 2^16 (bfloat16) times float32's, so a float32 shadow measures their
#: error as well as a float64 one at half the memory and time.
SHADOW = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64,
          torch.float64: torch.float64}
#: Ops that only allocate: not traced (what later writes there is; until then the memory is no value).
EMPTY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
#: Ops whose output is drawn at random: their shadow is their own output (no error by definition).
RANDOM = frozenset({"rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "normal",
                    "normal_", "uniform_", "bernoulli", "bernoulli_", "multinomial", "exponential_", "geometric_",
                    "cauchy_", "log_normal_", "random_", "native_dropout", "dropout", "poisson"})
#: Ops that only change the format: their output's shadow is the input's shadow (the uncast value).
CASTS = frozenset({"_to_copy", "to", "copy_", "_convert_element_type", "clone", "contiguous"})
#: Ops whose integer or boolean outputs are decisions (compared with the shadow's decision).
DECISIONS = frozenset({"argmax", "argmin", "topk", "sort", "argsort", "max", "min", "kthvalue", "mode", "median",
                       "eq", "ne", "lt", "le", "gt", "ge", "isclose", "bucketize", "searchsorted", "sign"})
#: Decision ops whose integer output indexes their first argument: where the real op picks another
#: element than the shadow but both carry the same shadow value (a tie in exact arithmetic too, e.g.
#: padding zeros that an unstable sort orders either way), the pick is no flip.
INDEXING = frozenset({"argmax", "argmin", "topk", "sort", "argsort", "max", "min", "kthvalue", "mode", "median"})
#: A decision spot flips at least this fraction of its decisions (1 in 1000), or at least
#: DECISION_MIN_COUNT of them: a few flips among many are values at a threshold's rounding (a clamp's
#: mask at its eps), which changes nothing a step computes; a top-p mask that keeps 28 wrong tokens of
#: 32,000 is no such few.
DECISION_MIN_FLIPS = 1e-3
DECISION_MIN_COUNT = 16
#: In-place updates of a running value (a sum, an average, an EMA).
_RUNNING = frozenset({"add_", "sub_", "lerp_", "addcmul_", "addcdiv_", "mul_", "_foreach_lerp_", "_foreach_add_",
                      "_foreach_mul_"})
#: GradScaler's unscale of the gradients (in place, by the inverse scale; found_inf is its flag).
UNSCALE = "_amp_foreach_non_finite_check_and_unscale_"
#: A model output is a bad spot when its relative error (L2, against its shadow) exceeds this many
#: times the unit roundoff of the 16-bit format its forward computed in: a healthy network's output
#: is within a few (the demo GPT: 1.2x in bfloat16 and in float16); rounding amplified on its way
#: out (timesteps cast to bfloat16 before a sinusoidal embedding) puts it at 45x.
OUTPUT_TOLERANCE = 16.0
#: Ops traced between two sweeps for values the program let go of (Forensics._sweep).
SWEEP_EVERY = 32
#: The most nodes one step's graph keeps (a larger step is analysed up to there, and says so).
MAX_NODES = 200_000


class Node:
    """One op call of a forensic step.

    Attributes:
        seq: its place in the step (0, 1, ...); ``name``: the ATen overload (``aten.sqrt.default``);
        packet: the overload packet (``sqrt``); ``module``: the innermost module running it (in
            backward: the module whose forward made the autograd node; ``""``: outside the model);
        phase: ``forward`` | ``eval`` (a forward under no_grad) | ``loss`` | ``backward`` |
            ``optimizer`` | ``state``;
        func / spec / flat: the op and its arguments (tensors as the op saw them; the value an
            in-place op overwrote is a copy); ``prod``: for each entry of ``flat``, the seq and
            output index of the node that made it, or None (a value from outside the step);
        outs: the op's tensor outputs; ``shadows``: their shadows (:data:`SHADOW`) (None for non-floating
            outputs); ``local_bad`` / ``global_bad``: per output, the fraction of wrong elements against
            the local / global reference (:func:`~mpscope.recording.root_cause.bad_fraction`);
            ``abs_err``: per output, the largest
            absolute local error. While the step runs, ``outs`` and the entries of ``flat`` that the
            step made are None once traced (unless ``kept``), and a shadow is None once the program let
            go of its value; :meth:`Forensics.rebuild` fills them all again.
    """

    __slots__ = ("seq", "name", "packet", "module", "phase", "func", "spec", "flat", "prod", "outs", "shadows",
                 "local_bad", "global_bad", "abs_err", "inplace", "measured", "moved_from", "scaled", "kept")

    def __init__(self, seq, name, packet, module, phase, func, spec, flat, prod, inplace):
        self.seq, self.name, self.packet, self.module, self.phase = seq, name, packet, module, phase
        self.func, self.spec, self.flat, self.prod, self.inplace = func, spec, flat, prod, inplace
        self.outs: list = []
        self.shadows: list = []
        self.local_bad: list = []
        self.global_bad: list = []
        self.abs_err: list = []
        self.measured = False  # local_bad / global_bad / abs_err filled (Forensics.measure)
        self.moved_from = None  # a move: (seq, index) of the value it moved
        self.scaled = None  # in backward: the loss scale its outputs carry (None: none known)
        self.kept = False  # outputs held until the step ends (random draws, collectives: never run again)


class Spot:
    """A place where error matters, found bad: ``kind`` (``nonfinite`` | ``gradient`` | ``update`` |
    ``decision`` | ``loss_scale`` | ``output``), the node (seq) and output index it reads, its name (a parameter's
    name, an op's), the measured ``value`` (a fraction, a factor), and ``detail`` (numbers for the
    message)."""

    __slots__ = ("kind", "seq", "index", "name", "value", "detail", "shadow")

    def __init__(self, kind, seq, index, name, value, detail, shadow=None):
        self.kind, self.seq, self.index, self.name, self.value, self.detail = kind, seq, index, name, value, detail
        self.shadow = shadow


@functools.lru_cache(maxsize=None)
def _is_inplace(func) -> bool:
    """An op that writes its first argument (``add_``; also ``_amp_foreach_non_finite_check_and_unscale_``,
    which returns nothing)."""
    schema = func._schema
    if not func.overloadpacket.__name__.endswith("_"):
        return False
    if collective(func):  # (c10d's in-place collectives declare no aliasing: allreduce_ writes its tensors)
        return True
    first = schema.arguments[0].alias_info if schema.arguments else None
    return any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns) or \
        (first is not None and first.is_write)


def _float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in _FLOATS


class Forensics:
    """The forensic tracer of one recording (owned by the op recorder).

    Args:
        model: the recorded model (its parameters' and buffers' names label leaves and state updates).
        run: the Run (``tables["forensics"]`` at :meth:`publish`).
        place: ``place() -> (module, phase) or None`` for the op being run (None: mpscope's own op).
        loss_scale: ``loss_scale() -> float``: the factor the step's loss was multiplied by before its
            backward (1.0 without a GradScaler).
        scale_tensor: ``scale_tensor() -> Tensor | None``: the GradScaler's scale tensor, which
            ``scaler.scale(x)`` multiplies ``x`` by (None without an enabled GradScaler).
    """

    def __init__(self, model: torch.nn.Module, run, place, loss_scale, scale_tensor=None) -> None:
        self.model, self.run, self.place, self.loss_scale = model, run, place, loss_scale
        self.scale_tensor = scale_tensor
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.buffer_names = {id(b): n for n, b in model.named_buffers()}
        self.params = {id(p): p for p in model.parameters()}
        self.params_by_shape: dict = {}  # shape -> the parameters of that shape (their gradients' shape)
        for p in model.parameters():
            self.params_by_shape.setdefault(p.shape, []).append(p)
        self.state_names: dict = {}  # id(optimizer state tensor) -> ("<param name>.<state key>", module)
        self.stepped_optimizers: dict = {}  # id -> the optimizers that stepped while traced
        self.rows: list = []
        self.on = False
        self.failed = False
        self.busy = False  # computing its own spots: ops pass untraced
        self._bumped: set = set()  # ids of what the op being traced writes (see _trace)
        #: ``op_listener(func, out)`` after each traced op (the shadow's op rows, which read its shadows), or None
        self.op_listener = None
        self._reset()

    def _reset(self) -> None:
        #: id(output) -> [the output, [(seq, index, version, address key), ...]]: the step's values, held
        #: until the program lets go of them (:meth:`_sweep`)
        self.held: dict = {}
        self._since_sweep = 0
        for names, key, _ in getattr(self, "copies", ()):  # (the copies' names end with their step)
            names.pop(key, None)
        self.copies: list = []  # (names dict, id, copy) of the parameters and buffers copied before a write
        self.nodes: list[Node] = []
        self.forward_low: set = set()  # 16-bit formats the step's forward (and eval) passes computed in
        self.producer: dict = {}  # (id(tensor), version) -> (seq, output index)
        self.shadow: dict = {}  # id(tensor) -> (tensor, version, shadow)
        self.by_memory: dict = {}  # (data_ptr, shape, dtype) -> (seq, output index): values seen through aliases
        self.readers: dict = {}  # storage data_ptr -> seqs of the nodes that read or made values there
        self.spots: list[Spot] = []
        self.pending: list = []  # collectives whose result arrives later: (node, input shadows, work)
        self.grad_factor: dict = {}  # id(param) -> product of factors applied to its .grad outside backward
        self.truncated = False
        self.comm_codes: set = set()
        self.carries: dict = {}  # (id, version) of backward values carrying that scale -> the scale

    # ----------------------------------------------------------------- lifecycle
    def begin_step(self, recording: bool) -> None:
        self._reset()
        self.on = recording and not self.failed
        # DDP's communication hooks (register_comm_hook): the ops they run are the communication phase
        self.comm_codes = {getattr(getattr(h, "func", h), "__code__", None)
                           for m in self.model.modules() for h, _ in getattr(m, "_comm_hooks", ())} - {None}

    def end_step(self, step: int) -> None:
        """The step ended: analyse its spots, keep the rows, drop the graph."""
        if not self.on:
            return
        try:
            self._settle(force=True)
        except Exception as e:  # never break the user's training because of mpscope
            self._fail(e)
        self.on = False
        try:
            self._sweep()
            self._name_state()
            with torch.no_grad(), _no_autocast():  # (a step may end inside the loop's autocast region)
                self.rows.extend(analyse(self, step))
        except Exception as e:  # never break the user's training because of mpscope
            self._fail(e)
        finally:
            self._reset()

    def _name_state(self) -> None:
        """Update spots on optimizer state (made inside the first step) named ``<param>.<state key>``."""
        for opt in self.stepped_optimizers.values():
            for g in opt.param_groups:
                for p in g["params"]:
                    for k, v in opt.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor) and id(p) in self.param_names:
                            self.state_names[id(v)] = (f"{self.param_names[id(p)]}.{k}",
                                                       self.param_names[id(p)].rpartition(".")[0])
        for sp in self.spots:
            tid = sp.detail.get("target") if sp.kind == "update" else None
            if tid is not None and tid in self.state_names:
                sp.name, sp.detail["module"] = self.state_names[tid]
        # inside optimizer.step(), only parameters and optimizer state are updates that matter (Adam's
        # denominator, sqrt(v) + eps computed in place, is a temporary: eps lost there is as intended)
        self.spots = [sp for sp in self.spots if not (
            sp.kind == "update" and self.nodes[sp.seq].phase == "optimizer" and
            not any(sp.detail.get("target") in names for names in (self.param_names, self.buffer_names,
                                                                   self.state_names)))]

    def publish(self) -> None:
        self.run.tables["forensics"] = frame(self.rows)
        self.run.meta["forensics"] = True

    def _fail(self, e: Exception) -> None:
        self.on = False
        if not self.failed:
            self.failed = True
            warnings.warn(f"mpscope: precision forensics stopped after an internal error: {e!r}. Training continues "
                          "unchanged; the rest of the recording is unaffected.", RuntimeWarning, stacklevel=3)

    # ----------------------------------------------------------------- per op
    def optimizer_stepping(self, optimizer) -> None:
        """``optimizer.step()`` is about to run: its parameters' gradients as it receives them are spots
        (their error against the shadow), and so is the factor applied to them since backward."""
        if not self.on:
            return
        self.busy = True  # (its own ops are not the step's)
        try:
            self._settle(force=True)  # (the backward's all-reduces have finished)
            self._gradient_spots(optimizer)
        except Exception as e:  # never break the user's training because of mpscope
            self._fail(e)
        finally:
            self.busy = False

    def dispatch(self, func, args, kwargs, run_op, in_optimizer: bool):
        """Run one op through ``run_op`` and trace it."""
        if self.busy or not self.on or len(self.nodes) >= MAX_NODES:
            self.truncated = self.truncated or self.on
            return run_op(func, args, kwargs)
        if self.pending:
            try:
                self._settle()
            except Exception as e:  # never break the user's training because of mpscope
                self._fail(e)
                return run_op(func, args, kwargs)
        try:
            where = self.place()
        except Exception as e:  # never break the user's training because of mpscope
            self._fail(e)
            return run_op(func, args, kwargs)
        if where is None or func.overloadpacket.__name__ in EMPTY:  # mpscope's own op; memory to be written
            return run_op(func, args, kwargs)
        self._since_sweep += 1
        if self._since_sweep >= SWEEP_EVERY:
            self._sweep()
        inplace = _is_inplace(func)
        if in_optimizer and not _has_low((args, kwargs)):
            return self._untraced(func, args, kwargs, run_op, where, inplace)
        pre = None
        if (inplace or mutated_positions(func)) and args:
            try:
                targets = _written(func, args, inplace)
                self.before_write(targets)
                pre = [t.detach().clone() if _float(t) else t for t in targets]
            except Exception as e:  # never break the user's training because of mpscope
                self._fail(e)
                return run_op(func, args, kwargs)
        out = run_op(func, args, kwargs)
        if self.on:
            try:
                self._trace(func, args, kwargs, out, where, inplace, pre, in_optimizer)
                if self.op_listener is not None:
                    self.op_listener(func, out)
            except Exception as e:  # never break the user's training because of mpscope
                self._fail(e)
        return out

    def _untraced(self, func, args, kwargs, run_op, where, inplace):
        """An op of ``optimizer.step()`` on float32 (or wider) values alone (the master weights, their
        gradients and state): not traced, so its outputs are their own shadows where a 16-bit op reads
        them. Its spots are 16-bit ones (updates, state), and float32 optimizer math is what keeps
        them away. What it overwrites is measured first; an op that makes a 16-bit value is traced."""
        try:
            if inplace and args:
                self.before_write(_targets(args[0]))
        except Exception as e:  # never break the user's training because of mpscope
            self._fail(e)
        out = run_op(func, args, kwargs)
        if self.on and _has_low(out):
            try:
                self._trace(func, args, kwargs, out, where, inplace, None, True)
            except Exception as e:  # never break the user's training because of mpscope
                self._fail(e)
        return out

    def _phase(self, module, phase, func, args, inplace, in_optimizer) -> tuple[str, str]:
        if collective(func) or (phase == "backward" and self.comm_codes and self._in_comm_hook()):
            return module, "communication"
        if in_optimizer:
            return module, "optimizer"
        if inplace and args:
            t = _targets(args[0])[0] if _targets(args[0]) else None
            if isinstance(t, torch.Tensor):
                if id(t) in self.param_names or id(t) in self.buffer_names:
                    name = self.param_names.get(id(t)) or self.buffer_names.get(id(t))
                    return name.rpartition(".")[0], "state"
                if self._grad_of(t) is not None:
                    return module, "optimizer"  # gradient bookkeeping (unscale, clip) before the step
        if inplace and args and func.overloadpacket.__name__ in _RUNNING:
            t = _targets(args[0])
            if t and t[0].dtype in LOW and not t[0].requires_grad:
                return module, "state"  # a running value updated in the loop (an EMA copy, a metric)
        if phase in ("forward", "loss") and self._grad_read(args):
            return module, "optimizer"  # gradient bookkeeping (a clip's norm) before the step, in any grad mode
        if phase in ("forward", "loss") and not torch.is_grad_enabled():
            return module, "eval"  # (outside the model under no_grad: a sampler's, an evaluation's own ops)
        return module, phase

    def _in_comm_hook(self) -> bool:
        f = sys._getframe(2)
        while f is not None:
            if f.f_code in self.comm_codes:
                return True
            f = f.f_back
        return False

    def _grad_read(self, args) -> bool:
        """Whether an op reads a parameter's gradient (a clip's norm)."""
        return bool(args) and any(isinstance(t, torch.Tensor) and t.dtype in _FLOATS and self._grad_of(t) is not None
                                  for t in _targets(args[0]))

    def _trace(self, func, args, kwargs, out, where, inplace, pre, in_optimizer) -> None:
        module, phase = self._phase(*where, func, args, inplace, in_optimizer)
        packet = func.overloadpacket.__name__
        flat, spec = flatten((args, kwargs))
        outs_flat, written_args = _outputs(func, args, out, inplace)
        targets = _written(func, args, inplace) if args else []
        if not outs_flat:
            return
        written = {id(t): p for t, p in zip(targets, pre or ())}
        # what the op wrote has its version counter bumped once the op returns (autograd's
        # ADInplaceOrView kernel, above this dispatch mode); inference tensors have none
        self._bumped = set() if torch.is_inference_mode_enabled() else \
            {id(t) for t in targets + written_args if isinstance(t, torch.Tensor) and not t.is_inference()}
        # shadows of the inputs (an overwritten target: its shadow before the op, at its version still)
        shadow_in = [self._shadow_of(a, value=written.get(id(a))) if _float(a) else a for a in flat]
        prod = [self.producer.get((id(a), a._version)) if isinstance(a, torch.Tensor) else None for a in flat]
        if phase in ("loss", "eval") and any(q is not None and self.nodes[q[0]].phase == "optimizer" for q in prod):
            phase = "optimizer"  # (computed from gradient bookkeeping: a clip's norm summed, its coefficient)
        flat = [written.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in flat]
        seq = len(self.nodes)
        node = Node(seq, str(func), packet, module, phase, func, spec, flat, prod, inplace)
        node.kept = packet in RANDOM or collective(func)  # (a rebuild cannot draw or reduce them again)
        self.nodes.append(node)
        if self.scale_tensor is not None:
            self._scale_carried(node, flat, outs_flat)
        if packet == UNSCALE:
            self._factor(outs_flat, _inv_scale(flat))
        node.moved_from = next((q for q in prod if q is not None), None) if packet in MOVES and not inplace else None
        self._read(node, flat)
        for i, (o, s) in enumerate(zip(outs_flat, self._shadows(node, flat, shadow_in, outs_flat))):
            self._made(node, i, o, s)
            if o.dtype not in _FLOATS and node.moved_from is None:  # a decision: compare with the shadow's
                set_dim = _bound(func, spec, flat).get("dim") if packet == "topk" else None
                flips = _flips(o, s) if set_dim is None else set_flips(o, s, set_dim)
                if (flips >= DECISION_MIN_FLIPS or flips * o.numel() >= DECISION_MIN_COUNT) and \
                        (packet.rstrip("_") in DECISIONS or  # (or an index: a float cast to integers)
                         (packet in CASTS and flat and _float(flat[0]) and not o.is_floating_point())) and \
                        all(bool(torch.isfinite(a).all()) for a in flat if _float(a)):  # (NaN decides nothing)
                    self.spots.append(Spot("decision", seq, i, str(func), flips,
                                           {"numel": o.numel(), "set_dim": set_dim}))
        if collective(func):  # its result arrives when its work completes: shadow and spots then
            work = next((w for w in tree_flatten(out)[0] if hasattr(w, "is_completed")), None)
            self.pending.append((node, shadow_in, work))
            return
        if node.moved_from is None:  # (a move makes no value its inputs do not hold)
            self._op_spots(node, outs_flat, flat, pre, in_optimizer, len(written_args))
        self._let_go(node)

    def _shadows(self, node: Node, flat, shadow_in, outs) -> list:
        """The shadows of ``node``'s outputs ``outs`` from its inputs ``flat`` and their shadows
        ``shadow_in`` (the rules of the module docstring; :meth:`rebuild` applies them again). A move
        that cannot run on its shadows is evaluated as any op."""
        if node.packet == UNSCALE:  # GradScaler's unscale: the shadows follow
            inv = _inv_scale(flat)
            s_out = [s * inv for s in shadow_in[:len(outs)]]
        else:
            s_out = _evaluate(node.func, node.spec, shadow_in, node.packet, outs)
        if s_out is None:
            node.moved_from = None
        res = []
        for i, o in enumerate(outs):
            s = s_out[i] if s_out is not None and i < len(s_out) else None
            if o.dtype in _FLOATS:
                if s is None or s.shape != o.shape or not s.is_floating_point():
                    s = _up(o)
            elif node.packet in INDEXING and s is not None and flat and _float(flat[0]):
                s = _ties_resolved(node.func, node.spec, flat, shadow_in[0], o, s)
            res.append(s)
        return res

    def _let_go(self, node: Node) -> None:
        """The node holds its outputs, and the step's values it read, only while the program holds them:
        they are held once, in :attr:`held`, and dropped with their shadows when only that holds them
        (:meth:`_sweep`); the step's leaves stay (a rebuild starts from them). Random draws and
        collectives keep their outputs."""
        if node.kept:
            return
        node.outs = [None] * len(node.outs)
        node.flat = [None if p is not None else a for a, p in zip(node.flat, node.prod)]

    def _sweep(self) -> None:
        """Drop the held values that nothing but :attr:`held` references (no Python reference beyond its
        own, no C++ one: ``Tensor._use_count``), their shadows and their index entries (an id or an
        address is then free for a new value)."""
        self._since_sweep = 0
        probe = [torch.empty(0), []]  # (the references a held value has from here alone, whatever Python counts)
        t = probe[0]
        alone = sys.getrefcount(t)
        dead = []
        for oid, entry in self.held.items():
            t = entry[0]
            if t._use_count() == 1 and sys.getrefcount(t) <= alone:
                dead.append(oid)
        del t
        for oid in dead:
            for seq, i, version, mem in self.held.pop(oid)[1]:
                node = self.nodes[seq]
                if not node.kept and i < len(node.shadows):
                    node.shadows[i] = None
                if self.producer.get((oid, version)) == (seq, i):
                    del self.producer[(oid, version)]
                self.carries.pop((oid, version), None)
                if mem is not None and self.by_memory.get(mem) == (seq, i):
                    del self.by_memory[mem]
            self.shadow.pop(oid, None)

    def rebuild(self) -> None:
        """Every node's inputs, outputs and shadows again (:meth:`_let_go` dropped them), by running the
        step's graph from its leaves under the same shadow rules; random draws and collectives keep
        what they recorded. Called before the analysis of a step with a bad spot; a node that cannot
        run again is left without outputs (the analysis then passes it)."""
        vals: dict = {}
        shads: dict = {}
        for n in self.nodes:
            if any(p is not None and p not in vals for p in n.prod):
                n.outs, n.shadows = [], []
                continue
            flat = [vals[p] if p is not None else a for a, p in zip(n.flat, n.prod)]
            shadow_in = [shads[p] if p is not None else _up(a) if _float(a) else a for a, p in zip(flat, n.prod)]
            if n.kept:
                outs = n.outs
            else:
                try:
                    outs = _run_again(n, flat)
                except Exception:  # (an op that cannot run on its own again)
                    n.outs, n.shadows = [], []
                    continue
            if collective(n.func):
                shadows = _collective_shadow(shadow_in, outs)
            else:
                shadows = self._shadows(n, flat, shadow_in, outs)
            n.flat, n.outs, n.shadows = flat, outs, shadows
            for i, (o, sh) in enumerate(zip(outs, shadows)):
                vals[(n.seq, i)], shads[(n.seq, i)] = o, sh

    def _scale_carried(self, node: Node, flat, outs) -> None:
        """Loss-scale bookkeeping of gradients used as data: ``scaler.scale(x)`` multiplies by the
        GradScaler's scale tensor; backward ops that read it (the backward of that product) and those
        fed by them, in that step's backward, carry the scale; a forward or loss op that reads such a value is a spot, unless it
        divides the scale out (``g * (1 / scale)``, ``g / scale``): a gradient penalty computed from
        ``torch.autograd.grad(scaler.scale(out), x)`` as it comes is the scale times too large."""
        st = self.scale_tensor()
        if st is None:
            return
        ins = [a for a in flat if isinstance(a, torch.Tensor)]
        if node.phase == "backward":
            carried = next((self.carries[(id(a), a._version)] for a in ins if (id(a), a._version) in self.carries), None)
            if carried is None and any(a is st for a in ins):  # (the backward of scaler.scale's product)
                carried = float(st)
            if carried is not None:
                node.scaled = carried
                for o in outs:
                    self.carries[(id(o), self._after(o))] = carried
            return
        if node.phase not in ("forward", "loss", "eval") or not self.carries:
            return
        carried = next((self.carries[(id(a), a._version)] for a in ins if (id(a), a._version) in self.carries), None)
        if carried is None:
            return
        if node.packet in MOVES or node.packet in CASTS:  # (a view or a copy computes nothing: it carries on)
            for o in outs:
                self.carries[(id(o), self._after(o))] = carried
            return
        consts = [float(a) for a in flat[1:] if isinstance(a, (int, float)) and not isinstance(a, bool)] + \
                 [float(a) for a in ins[1:] if a.numel() == 1]
        if (node.packet == "mul" and any(abs(c * carried - 1) < 1e-6 for c in consts)) or \
                (node.packet == "div" and any(abs(c / carried - 1) < 1e-6 for c in consts)):
            return  # the scale divided out
        if not any(sp.kind == "scaled_use" for sp in self.spots):
            self.spots.append(Spot("scaled_use", node.seq, 0, node.name, carried,
                                   {"loss_scale": carried, "module": node.module, "phase": node.phase}))
        self.carries.clear()  # (one spot: what follows is its consequence)

    def _settle(self, force: bool = False) -> None:
        """Collectives whose work has completed (all of them with ``force``): their shadows from the
        reduced values (:func:`_collective_shadow`), and their non-finite spots."""
        waiting = []
        for node, shadow_in, work in self.pending:
            if not force and work is not None and not work.is_completed():
                waiting.append((node, shadow_in, work))
                continue
            shadows = _collective_shadow(shadow_in, node.outs)
            for i, (o, s) in enumerate(zip(node.outs, shadows)):
                if o.dtype in _FLOATS:
                    node.shadows[i] = s
                    hit = self.shadow.get(id(o))
                    if hit is not None and self.held.get(id(o), (None,))[0] is o:
                        self.shadow[id(o)] = (hit[0], s)
            if node.outs:
                self._nonfinite_spot(node, node.outs[0], node.flat)
        self.pending = waiting

    def _after(self, o: torch.Tensor) -> int:
        """``o``'s version once the op being traced returns (see ``_bumped`` in :meth:`_trace`)."""
        return o._version + (id(o) in self._bumped)

    def _made(self, node, i, o, s) -> None:
        """Output ``i`` of ``node`` is ``o``, its shadow ``s``: indexed by identity and version (and by
        address), and held in :attr:`held` until the program lets go of it (:meth:`_sweep`)."""
        version = self._after(o)
        mem = (o.data_ptr(), o.shape, o.dtype) if o.numel() else None
        self.held.setdefault(id(o), [o, []])[1].append((node.seq, i, version, mem))
        self.producer[(id(o), version)] = (node.seq, i)
        node.outs.append(o)
        node.shadows.append(s)
        if o.dtype in _FLOATS:
            self.shadow[id(o)] = (version, s)
        if o.dtype in LOW and node.phase in ("forward", "eval"):
            self.forward_low.add(o.dtype)
        if mem is not None:
            self.by_memory[mem] = (node.seq, i)
            self.readers.setdefault(o.untyped_storage().data_ptr(), []).append(node.seq)

    def _read(self, node, flat) -> None:
        """Note which memory the node read: an in-place write there measures it first (:meth:`measure`)."""
        for a in flat:
            if isinstance(a, torch.Tensor) and a.dtype in _FLOATS and a.numel():
                self.readers.setdefault(a.untyped_storage().data_ptr(), []).append(node.seq)

    def before_write(self, targets) -> None:
        """An in-place op is about to overwrite ``targets``: the nodes that read their memory as a value
        from outside the step (a parameter the optimizer step then updates, or a view of it) keep a copy
        of what they read, as do random draws and collectives that made it, so a rebuild or a replay
        runs on the values the step saw."""
        for t in targets:
            if isinstance(t, torch.Tensor) and t.numel():
                ptr = t.untyped_storage().data_ptr()
                snaps: dict = {}
                for seq in self.readers.pop(ptr, ()):
                    node = self.nodes[seq]
                    for k, (a, p) in enumerate(zip(node.flat, node.prod)):
                        if p is None and isinstance(a, torch.Tensor) and a.numel() and \
                                a.untyped_storage().data_ptr() == ptr:
                            if id(a) not in snaps:
                                snaps[id(a)] = a.detach().clone()
                                self._named_copy(a, snaps[id(a)])
                            node.flat[k] = snaps[id(a)]
                    if node.kept:  # (a random draw written next, as dropout's mask scaled in place)
                        node.outs = [o.detach().clone() if isinstance(o, torch.Tensor) and o.numel() and
                                     o.untyped_storage().data_ptr() == ptr else o for o in node.outs]

    def _named_copy(self, t, copy) -> None:
        """``copy`` of parameter or buffer ``t`` goes by its name until the step ends."""
        for names in (self.param_names, self.buffer_names):
            if id(t) in names:
                names[id(copy)] = names[id(t)]
                self.copies.append((names, id(copy), copy))

    def measure(self, node: Node) -> Node:
        """Fill the node's error measures (once): per output, the fraction of wrong elements against
        the op on its own inputs cast up (local) and against its shadow (global), and the largest absolute
        local error. A move has no error of its own and its input's global badness."""
        if node.measured:
            return node
        node.measured = True
        n = len(node.outs)
        if node.moved_from is not None or node.packet in MOVES:
            src = node.moved_from
            bad = 0.0
            if src is not None:
                m = self.measure(self.nodes[src[0]])
                bad = m.global_bad[src[1]] if src[1] < len(m.global_bad) else 0.0
            node.local_bad, node.global_bad, node.abs_err = [0.0] * n, [bad] * n, [0.0] * n
            return node
        exact_in = all(not _float(a) or q is None for a, q in zip(node.flat, node.prod))
        loc_out = None
        if not exact_in:
            loc_out = _evaluate(node.func, node.spec, [_up(a) if _float(a) else a for a in node.flat],
                                     node.packet, node.outs)
        for i, o in enumerate(node.outs):
            s = node.shadows[i] if i < len(node.shadows) else None
            if o.dtype not in _FLOATS or s is None:
                node.local_bad.append(0.0)
                node.global_bad.append(_flips(o, s))
                node.abs_err.append(0.0)
                continue
            loc = s if exact_in else (loc_out[i] if loc_out is not None and i < len(loc_out) else None)
            if loc is None or loc.shape != o.shape:
                loc = s
            g = bad_fraction(o, s)
            # (an op that carries an infinity of its input, inf + 1e-6, adds no error of its own)
            carried = loc is not s and any(_float(a) and not _all_finite(a) for a in node.flat)
            node.local_bad.append(g if loc is s else bad_fraction(o, loc, same_inf_right=carried))
            node.global_bad.append(g)
            node.abs_err.append(_abs_err(o, loc))
        return node

    def _shadow_of(self, a: torch.Tensor, value=None) -> torch.Tensor:
        """``a``'s shadow at its current version; a value from outside the step (or changed by an op not
        traced) is its own shadow (``value``'s, when given: the value an in-place op overwrote)."""
        s = self.shadow_now(a)
        return s if s is not None else _up(a if value is None else value)

    def shadow_now(self, t: torch.Tensor, just_made: bool = False):
        """``t``'s shadow if this step traced the op that made ``t`` at its current version, else None.
        ``just_made``: ``t`` is an output of the op traced last, inside its dispatch (the version
        counter of what it wrote is not bumped yet)."""
        hit = self.shadow.get(id(t))
        return hit[1] if hit is not None and self.held.get(id(t), (None,))[0] is t and \
            (just_made or hit[0] == t._version) else None

    # ----------------------------------------------------------------- spots
    def model_output(self, output) -> None:
        """The model's forward returned ``output``: each floating tensor of it whose relative error
        against its shadow exceeds :data:`OUTPUT_TOLERANCE` times the unit roundoff of the forward's
        16-bit format is a spot (a forward in float32 alone has none: its rounding is not the subject)."""
        if self.busy or not self.on:
            return
        low = self.forward_low
        if not low:
            return
        eps = max(torch.finfo(d).eps / 2 for d in low)  # unit roundoff: half the spacing at 1
        self._sweep()
        self.busy = True
        try:
            with torch.no_grad(), _no_autocast():
                for o in tree_flatten(output)[0]:
                    if not (isinstance(o, torch.Tensor) and o.dtype in _FLOATS and o.numel()):
                        continue
                    hit = self.producer.get((id(o), o._version))
                    if hit is None or any(sp.kind == "output" and sp.seq == hit[0] for sp in self.spots):
                        continue
                    s = self.nodes[hit[0]].shadows[hit[1]]
                    if s is None or s.shape != o.shape or not bool(torch.isfinite(o).all()):
                        continue  # (a non-finite output is the non-finite spot's)
                    rel = rel_l2(o, s)
                    if rel > OUTPUT_TOLERANCE * eps:
                        self.spots.append(Spot("output", hit[0], hit[1], self.nodes[hit[0]].name, rel,
                                               {"numel": o.numel(), "roundoff": eps,
                                                "dtype": dtype_name(max(low, key=lambda d: torch.finfo(d).eps))}))
        finally:
            self.busy = False

    def _op_spots(self, node: Node, outs, flat, pre, in_optimizer: bool, n_mut: int = 0) -> None:
        """Spots of one op: non-finite values made from finite inputs; in-place updates of state."""
        o = outs[0]
        self._nonfinite_spot(node, o, flat)
        for i in range(len(outs) - n_mut, len(outs)):  # (a running statistic that became non-finite)
            if i > 0:
                self._nonfinite_spot(node, outs[i], flat, i, self.buffer_names.get(id(outs[i])))
        if node.inplace and pre and node.phase in ("state", "optimizer") and o.dtype in LOW:
            self._update_spot(node, o, pre[0])
        if node.inplace and not in_optimizer and node.packet in ("mul_", "div_", "_foreach_mul_", "_foreach_div_") \
                and len(flat) > len(outs):
            c = flat[len(outs)]
            if isinstance(c, torch.Tensor) and c.numel() == 1:
                c = float(c)
            if isinstance(c, (int, float)) and c != 0:
                self._factor(outs, float(c) if "mul" in node.packet else 1.0 / float(c))

    def _update_spot(self, node: Node, target, before) -> None:
        """An in-place update of 16-bit state that loses more than a quarter of the changes its shadow
        makes (``before``: the value it overwrote)."""
        if not isinstance(before, torch.Tensor) or before.shape != target.shape:
            return
        b64 = before.double()
        s_change = node.shadows[0] - b64
        meant = s_change != 0
        n = int(meant.sum())
        if not n:
            return
        lost = int((meant & (target.detach().double() - b64 == 0)).sum())
        if lost / n <= 0.25:
            return
        name = self.param_names.get(id(target)) or self.buffer_names.get(id(target)) or \
            self.state_names.get(id(target), ("",))[0]
        module = name.rpartition(".")[0]
        if not name:  # a running value outside the model (an EMA copy, a metric): its shape
            name = f"<{dtype_name(target.dtype)} tensor {tuple(target.shape)}>"
        b, step = b64[meant], s_change[meant]
        gone = meant & (target.detach().double() - b64 == 0)
        tiny = torch.finfo(target.dtype).smallest_normal * torch.finfo(target.dtype).eps / 2  # half the least subnormal
        self.spots.append(Spot("update", node.seq, 0, name, lost / n, {
            "underflowed": float((s_change[gone].abs() < tiny).sum()) / lost, "least": 2 * tiny,
            "target": id(target), "module": module, "meant": n, "lost": lost, "dtype": dtype_name(target.dtype),
            "integers": bool((b == b.round()).all() and (step == step.round()).all()),
            "median_step": float(step.abs().median()), "median_value": float(b.abs().median())}))

    def _nonfinite_spot(self, node: Node, o, flat, index: int = 0, name: str | None = None) -> None:
        """A non-finite value made from finite inputs (not an infinity written on purpose - a mask's -inf -
        and, outside a domain op, only where the shadow stays finite; not GradScaler's probe)."""
        fins = [a for a in flat if _float(a)]
        if fins and o.dtype in _FLOATS and node.packet not in RANDOM and not _all_finite(o) \
                and all(bool(torch.isfinite(a).all()) for a in fins) and \
                not any(isinstance(a, float) and not math.isfinite(a) for a in flat) and \
                (bool(torch.isfinite(node.shadows[index][~torch.isfinite(o)]).any()) or
                 (node.packet.rstrip("_") in DOMAIN and self._from_16bit_leaf(node))):
            n = int((~torch.isfinite(o)).sum())
            if not n:  # (a float64 sum that overflowed on finite values)
                return
            scale = float(self.loss_scale()) if node.phase in ("backward", "communication") else 1.0
            carries = self.scale_tensor is None or self.scale_tensor() is None or node.scaled is not None
            if scale > 1 and carries and bool(torch.isfinite(node.shadows[index][~torch.isfinite(o)]).all()) \
                    and not zeroed_inputs(self.nodes, node):  # (an underflow onto a pole: no scale makes it)
                return  # gradients of a scaled loss, finite in higher precision: GradScaler's probe of its scale
                # (a value from saved activations alone, as x ** 3 in rsqrt's backward, carries no scale)
            self.spots.append(Spot("nonfinite", node.seq, index, name or node.name, n / o.numel(),
                                   {"count": n, "numel": o.numel(), "loss_scale": scale}))

    def _from_16bit_leaf(self, node: Node, limit: int = 16) -> bool:
        """Whether ``node`` reads, within ``limit`` ops up its inputs, a 16-bit value from outside the step
        (a buffer or parameter rounded before it): a pole its shadow meets too can then still be the
        format's doing. One its inputs reach only from exact values (integer positions, float32 data)
        is no precision error (T5's log of a relative position 0, which torch.where then discards)."""
        frontier, seen = [node], {node.seq}
        for _ in range(limit):
            nxt = []
            for n in frontier:
                for a, p in zip(n.flat, n.prod):
                    if p is None:
                        if isinstance(a, torch.Tensor) and a.dtype in LOW:
                            return True
                    elif p[0] not in seen:
                        seen.add(p[0])
                        nxt.append(self.nodes[p[0]])
            frontier = nxt
        return False

    def _grad_of(self, t: torch.Tensor):
        """id of the parameter whose ``.grad`` ``t`` is (also through ``.data`` or a detached alias), or None."""
        if not t.numel():
            return None
        ptr = t.data_ptr()
        return next((id(p) for p in self.params_by_shape.get(t.shape, ())
                     if p.grad is not None and p.grad.data_ptr() == ptr and p.grad.shape == t.shape), None)

    def _factor(self, targets, c: float) -> None:
        """``targets`` (tensors an op scaled in place by ``c`` outside optimizer.step) that are parameters'
        gradients carry the factor ``c`` to the optimizer (see :meth:`_gradient_spots`)."""
        for t in targets:
            pid = self._grad_of(t)
            if pid is not None:
                self.grad_factor[pid] = self.grad_factor.get(pid, 1.0) * c

    def _gradient_spots(self, optimizer) -> None:
        self._sweep()
        self.stepped_optimizers[id(optimizer)] = optimizer
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        factors = [self.grad_factor.get(id(p), 1.0) for p in params]
        scale = float(self.loss_scale())
        if params and all(f == factors[0] for f in factors):
            f = factors[0]
            net = f * scale
            if net > 0 and abs(math.log2(net)) >= 4 and float(math.log2(net)).is_integer():
                self.spots.append(Spot("loss_scale", -1, 0, "", net, {
                    "factor": f, "loss_scale": scale, "params": len(params)}))
        # a gradient counts as vanished only where its shadow is above float32's rounding noise of the
        # largest gradient (a mathematically zero gradient's float64 value is noise, e.g. a bias before a norm)
        gmax = max((float(p.grad.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()) for p in params if p.grad.numel()),
                   default=0.0)
        floor = gmax * torch.finfo(torch.float32).eps
        for p in params:
            g = p.grad
            hit = self.producer.get((id(g), g._version))
            if hit is None and g.numel():  # (AccumulateGrad keeps a detached alias of the last op's output)
                hit = self.by_memory.get((g.data_ptr(), g.shape, g.dtype))
            if hit is None:
                continue
            s = self.nodes[hit[0]].shadows[hit[1]]
            if s is None or s.shape != g.shape:
                continue
            frac = _lost_fraction(g, s, floor)
            if frac >= 0.01:
                name = self.param_names.get(id(p), "")
                self.spots.append(Spot("gradient", hit[0], hit[1], name, frac,
                                       {"numel": g.numel(), "lost": round(frac * g.numel()),
                                        "shadow_median": float(s[(g == 0) & (s.abs() > floor)].abs().median())
                                        if bool(((g == 0) & (s.abs() > floor)).any()) else math.nan,
                                        "floor": floor}, s))


def _lost_fraction(g: torch.Tensor, s: torch.Tensor, floor: float = 0.0) -> float:
    """The fraction of a gradient's elements that are exactly 0 where the shadow is a finite value above
    ``floor`` in magnitude: the gradient vanished there (not merely rounded). (A non-finite gradient is
    the non-finite spot's, at the op that made it from finite values.)"""
    if s.shape != g.shape or not g.numel():
        return 0.0
    lost = (g.detach() == 0) & (s.abs() > floor) & torch.isfinite(s)
    return float(lost.sum()) / g.numel()


def _evaluate(func, spec, flat, packet, outs):
    """The op in higher precision on ``flat`` (its inputs cast up, or their shadows): its tensor
    outputs as a list, or None when it cannot run so."""
    if packet in RANDOM:
        return [_up(o) if o.dtype in _FLOATS else o for o in outs]
    if collective(func):  # never run again (the other ranks would not take part)
        return _collective_shadow(flat, outs)
    if packet == UNSCALE:  # GradScaler's unscale: each gradient times the inverse scale
        inv = _inv_scale(flat)
        return ([a * inv for a in flat[:-2]] + [flat[-2]])[:len(outs)]  # (found_inf: an output too)
    args, kwargs = unflatten(flat, spec)
    kwargs = dict(kwargs)
    if kwargs.get("dtype") in _FLOATS:
        kwargs["dtype"] = SHADOW[kwargs["dtype"]]
    if packet in CASTS and args and isinstance(args[0], torch.Tensor) and packet != "copy_":
        # the uncast value, in the shadow format of the cast's output (a value cast to 16 bits is
        # shadowed in float32, so the ops it feeds run their shadow in float32, not float64); a
        # narrower shadow that is as fine as the output's format is kept (a 16-bit value cast up to
        # float32 keeps its float32 shadow: its error is the 16-bit one)
        src, out_dtype = args[0], outs[0].dtype
        fmt = SHADOW.get(out_dtype, torch.float64)
        if (src.dtype in _FLOATS and out_dtype in _FLOATS and src.element_size() < fmt.itemsize
                and torch.finfo(src.dtype).eps <= torch.finfo(out_dtype).eps):
            return [src]
        return [src if src.dtype == fmt else src.to(fmt)]
    if packet == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        src = args[1]
        src = src if src.dtype in SHADOW.values() else _up(src)
        return [src.expand_as(outs[0]).clone() if src.shape != outs[0].shape else src]
    if _is_inplace(func) and args and isinstance(args[0], torch.Tensor):  # (on a copy: a shadow may be shared)
        args = (args[0].clone(),) + tuple(args[1:])
    mpos = mutated_positions(func)
    if mpos:
        args = tuple(a.clone() if i in mpos and isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
    try:
        r = func(*args, **kwargs)
    except Exception:  # (ops that want one dtype, e.g. lerp_: every floating argument in float64)
        leaves, spec = flatten((args, kwargs))
        wide = [a.to(torch.float64) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in leaves]
        args, kwargs = unflatten(wide, spec)
        try:
            r = func(*args, **kwargs)
        except Exception:
            return None
    res = _outputs(func, args, r, _is_inplace(func))[0]
    return res if len(res) == len(outs) else None


def _run_again(n: Node, flat) -> list:
    """Node ``n``'s op on ``flat`` (its inputs, rebuilt): its tensor outputs in the trace's order; what
    it writes in place is a copy."""
    if n.inplace or mutated_positions(n.func):
        flat = [a.clone() if isinstance(a, torch.Tensor) else a for a in flat]
    args, kwargs = unflatten(flat, n.spec)
    return _outputs(n.func, args, n.func(*args, **kwargs), n.inplace)[0]


def _outputs(func, args, out, inplace: bool) -> tuple[list, list]:
    """(the tensors an op call made or wrote, in the trace's order; those of them that are arguments
    its schema marks written, as running statistics): the tensors of ``out``, or an in-place op's
    targets where it returns nothing (foreach ops), then the written arguments."""
    outs = tensors_of(out)
    if inplace and not outs and args:
        outs = _targets(args[0])
    written = mutated_args(func, args)
    return outs + written, written


def _collective_shadow(flat, outs) -> list:
    """A collective's shadow: its own output (the other ranks' shadows are not here), except where it
    is non-finite from a finite input: there the input's shadow times the group size, the sum had
    every rank's value been this one's (an estimate that shows the overflow of a 16-bit sum)."""
    ins = [a for a in flat if isinstance(a, torch.Tensor) and a.is_floating_point()]
    n = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    res = []
    for i, o in enumerate(outs):
        s = _up(o) if o.dtype in _FLOATS else o
        if o.dtype in _FLOATS and i < len(ins) and ins[i].shape == o.shape:
            bad = ~torch.isfinite(s) & torch.isfinite(ins[i])
            if bool(bad.any()):
                s = torch.where(bad, ins[i].to(s.dtype) * n, s)
        res.append(s)
    return res


def _written(func, args, inplace: bool) -> list:
    """The tensors an op overwrites: an in-place op's first argument (each tensor of a foreach list),
    and the arguments its schema marks written (:func:`mutated_positions`)."""
    return (_targets(args[0]) if inplace else []) + mutated_args(func, args)


def _inv_scale(flat) -> float:
    """The inverse scale of GradScaler's unscale (:data:`UNSCALE`), its last argument."""
    return float(flat[-1]) if isinstance(flat[-1], torch.Tensor) else 1.0


def _has_low(tree) -> bool:
    """Whether a tensor in ``tree`` (nested tuples, lists and dict values: an op's arguments or outputs)
    is 16-bit."""
    if isinstance(tree, torch.Tensor):
        return tree.dtype in LOW
    if isinstance(tree, (tuple, list)):
        return any(_has_low(a) for a in tree)
    return isinstance(tree, dict) and any(_has_low(a) for a in tree.values())


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite: its float64 sum is (NaN and inf carry through a sum, and
    finite values of any float format cannot overflow float64's) - one pass, no mask."""
    return t.numel() == 0 or math.isfinite(float(t.sum(dtype=torch.float64)))


def _no_autocast():
    """A context with autocast off on the CPU and, where present, CUDA: replays run in the formats they ask."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cpu", enabled=False))
    if torch.cuda.is_available():
        stack.enter_context(torch.autocast("cuda", enabled=False))
    return stack


def _up(t: torch.Tensor) -> torch.Tensor:
    """``t``'s value in its shadow format (:data:`SHADOW`), detached, never ``t`` itself."""
    return t.detach().to(SHADOW.get(t.dtype, torch.float64), copy=True)


def _abs_err(o, ref) -> float:
    if ref is None or ref.shape != o.shape or not o.numel():
        return 0.0
    d = (o.detach().to(ref.dtype) - ref).abs_().nan_to_num_(0.0, 0.0, 0.0)
    return float(d.max())


def _bound(func, spec, flat) -> dict:
    """The op's arguments by name, defaults from its schema included."""
    args, kwargs = unflatten(flat, spec)
    schema = func._schema.arguments
    bound = {a.name: a.default_value for a in schema if a.has_default_value()}
    bound.update(zip((a.name for a in schema), args), **kwargs)
    return bound


def _ties_resolved(func, spec, flat, xs, o, s):
    """The shadow's index decision ``s`` with the real one ``o`` taken wherever the two pick elements of
    equal shadow value (``xs``: the indexed input's shadow): ties in exact arithmetic are no flip."""
    if not isinstance(s, torch.Tensor) or s.shape != o.shape or o.dtype != torch.int64 or not o.numel():
        return s
    dim = _bound(func, spec, flat).get("dim")
    if not isinstance(dim, int):  # (argmax over all elements: a 0-dim index into the flattened input)
        xs, dim, oi, si = xs.reshape(-1), 0, o.reshape(1), s.reshape(1)
    elif o.dim() < xs.dim():  # (a reduction without keepdim)
        oi, si = o.unsqueeze(dim), s.unsqueeze(dim)
    else:
        oi, si = o, s
    if xs.dim() == 0:
        return s
    tie = (oi != si) & (xs.gather(dim, oi) == xs.gather(dim, si))
    return torch.where(tie.reshape(o.shape), o, s)


def _flips(o, s) -> float:
    if s is None or not isinstance(s, torch.Tensor) or s.shape != o.shape or not o.numel():
        return 0.0
    return float((o != s.to(o.dtype)).sum()) / o.numel()


def _targets(a) -> list:
    """The tensors an in-place op writes: its first argument, or each tensor of a list (foreach ops)."""
    if isinstance(a, torch.Tensor):
        return [a]
    if isinstance(a, (list, tuple)):
        return [t for t in a if isinstance(t, torch.Tensor)]
    return []


__all__ = ["Forensics", "Node", "Spot", "RANDOM", "CASTS"]
