"""Which module and which pass of the model each op belongs to (op recording's attribution).

Inside the model's forward an op belongs to the innermost module of ``model.named_modules()``
running it (a stack kept by global module hooks) and to the ledger's current pass. In backward it
belongs to the module whose forward made the autograd node being run: each module's forward hook
tags the nodes its forward created (sequence number at or above the one it started at) with its
name and pass, walking from its output and from the nodes its submodules' walks stopped at, so no
node is walked twice. Outside every module an op belongs to the pass one of its inputs that
requires grad comes from (by identity, else by its autograd graph), else to
:data:`~mpscope.recording.passes.OUTSIDE` (another model, bookkeeping: no row, no count). The rule
for which passes a step keeps is :func:`mpscope.recording.passes.kept_passes`.

A forward re-run in backward (activation checkpointing) gets no rows (the first forward's ops have
them), except a re-run of the whole model by reentrant checkpointing, a pass of its own. Ops are
numbered per (module, op) and step: ``aten.add.Tensor#k``; at a step's end the calls are numbered
again as if the passes that did not train had not run (:meth:`OpTracker.renumber`).
"""

from __future__ import annotations

import sys

import torch
from torch.utils._pytree import tree_flatten

from mpscope import distributed as _dist
from mpscope.recording.events import ForwardEvents
from mpscope.recording.hook_state import HookState
from mpscope.recording.op_marks import TensorMarks
from mpscope.recording.passes import OUTSIDE, OpPasses, Pass, PassKind, backward_of, cast_of, outside_forward_pass

LOW = (torch.float16, torch.bfloat16)
_TAG = "mpscope_module"
_PASS = "mpscope_pass"  # the model's forward pass that made an autograd node
_NO_SEQ = 2**64 - 1  # sequence number of AccumulateGrad nodes (never created by an op in forward)
#: Modules whose own ops (taking stats, copying rows) are not the user's: skipped.
_MPSCOPE_INTERNAL = ("mpscope.stats", "mpscope.recorder", "mpscope.recording", "mpscope.run", "mpscope.formats",
                     "mpscope.kernel", "mpscope.merge", "mpscope.distributed")
#: Python frames between an op's caller and ``__torch_dispatch__`` (torch wraps modes to disable dynamo).
_WRAPPER_FRAMES = frozenset({"mpscope.recording.op_recorder", "mpscope.recording.forensics", __name__, "torch._compile", "torch._dynamo.eval_frame",
                             "torch.utils._python_dispatch"})
#: Most autograd nodes :func:`_graph_pass` visits (an untagged chain outside the model's modules is
#: the loop's own few ops on the model's output; a longer walk would only cost time).
_GRAPH_WALK = 16


class OpTracker:
    """Module and pass attribution of one recording's ops.

    Args:
        model: the recorded model; ``ledger``: its :class:`~mpscope.recording.passes.PassLedger`;
        state: the :class:`~mpscope.recording.hook_state.HookState` (``pass_id``: the current pass);
        marks: the step's :class:`~mpscope.recording.op_marks.TensorMarks` (``passes``, ``casts``).
    """

    def __init__(self, model: torch.nn.Module, state: HookState, ledger: ForwardEvents, marks: TensorMarks) -> None:
        self.state, self.ledger, self.marks = state, ledger, marks
        self.names = {m: n for n, m in _dist.named_modules(model)}  # wrapper prefixes left out
        self._params = {id(p) for p in model.parameters()}  # values of the model's outside any pass
        self.device_type = _model_device_type(model)
        # (name, seq threshold, autocast on, the nodes its submodules' graph walks stopped at (see
        # _tag_graph), the backward graph task it runs in: -1 outside backward, see context)
        self.stack: list[tuple[str, int, bool, list, int]] = []
        self._kinds: dict = {}  # id(module globals) -> (globals, kind), see _caller_kind
        self._root_autocast = False
        self.reset()

    def reset(self) -> None:
        """A step begins."""
        self._counters: dict = {}
        # every call counted in _counters, in call order: (counter key, pass, phase, outputs named
        # "#k.i": their number, else 0), and the passes among them; see renumber
        self._call_log: list[tuple] = []
        self._call_passes: set = set()
        self.final: list | None = None  # renumber's (phase, k) by call; None: as counted
        self.dropped: set = set()  # renumber's passes that did not train the model
        self.moved: set = set()  # renumber's casts of evaluation passes that a training pass used
        self._rerun = None  # (graph task, module) of the step's latest checkpointed re-run (see context)
        self._inner_of = None  # context's graph task that re-ran the checkpoint whose backward this op is in
        self._cast_users: dict = {}  # a cast's pass -> the passes of the ops using it

    # ----------------------------------------------------------------- the module stack
    def enter(self, module) -> None:
        """A module's forward starts (a global forward pre-hook)."""
        name = self.names.get(module)
        if name is None:
            return
        on = torch.is_autocast_enabled(self.device_type)
        if not self.stack:
            self._root_autocast = on
        self.stack.append((name, torch._C._autograd._get_sequence_nr(), on, [], torch._C._current_graph_task_id()))

    def leave(self, module, output, tag: bool) -> None:
        """A module's forward returned or raised (a global ``always_call`` forward hook); ``tag``:
        tag the autograd nodes its forward made."""
        name = self.names.get(module)
        if name is None or not self.stack:
            return
        # pop to this module (a forward that raised may have left inner entries behind)
        while self.stack:
            top, threshold, _, handed, _ = self.stack.pop()
            if top == name:
                break
        if tag:
            below = _tag_graph(output, name, threshold, self.state.pass_id, handed)
            if self.stack:  # the enclosing module's walk goes on from there
                self.stack[-1][3].extend(below)

    def model_inputs(self, args, kwargs) -> None:
        """The model's forward starts: an input that another model made (a GAN's generator feeding
        the recorded discriminator, positionally or as ``inputs_embeds=``) gets its autograd nodes
        tagged :data:`OUTSIDE` (:meth:`input_pass`), so that model's backward through it, which the
        model's loss runs, is not the model's."""
        for a in flat_tensors((args, kwargs)):
            if a.requires_grad and a.grad_fn is not None:
                self.input_pass(a)

    # ----------------------------------------------------------------- per op
    def _caller_kind(self, f) -> int:
        """0: a frame of torch's wrappers around ``__torch_dispatch__`` (or of op recording) or of a
        ``__torch_function__`` (a TorchFunctionMode's, such as the one ``with torch.device(...)`` and
        ``torch.set_default_device`` install, or a tensor subclass's: it passes on an op whose caller
        is below it), 1: a frame of mpscope's own code, 2: any other (the op's caller). Cached per
        module globals (the ``__torch_function__`` check per frame)."""
        g = f.f_globals
        hit = self._kinds.get(id(g))
        if hit is not None and hit[0] is g:
            kind = hit[1]
        else:
            name = g.get("__name__", "")
            kind = 0 if name in _WRAPPER_FRAMES else (1 if name.startswith(_MPSCOPE_INTERNAL) else 2)
            self._kinds[id(g)] = (g, kind)
        return 0 if kind == 2 and f.f_code.co_name == "__torch_function__" else kind

    def _caller(self):
        """(frame, kind) of the op's caller: past op recording, ``__torch_dispatch__`` and torch's
        wrappers (see :meth:`_caller_kind`)."""
        f = sys._getframe(2)
        kind = 0
        while f is not None:
            kind = self._caller_kind(f)
            if kind:
                break
            f = f.f_back
        return f, kind

    def place(self):
        """(module, phase) of the op being run for precision forensics, whatever its pass: inside a
        module ``forward``, in backward ``backward`` (the module whose forward made the node), else
        ``loss`` (the loop's own ops); None for mpscope's own ops."""
        f, kind = self._caller()
        if kind == 1:
            return None
        if self.stack:
            return self.stack[-1][0], "forward"
        if torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            return (node.metadata.get(_TAG) or "" if node is not None else ""), "backward"
        return "", "loss"

    def context(self, args, running: bool = False):
        """(module, phase, autocast) for the op being run, or None to skip it. ``running``: the op
        updates a running value in place (kept also outside every module: a metric in the loop)."""
        f, kind = self._caller()
        if kind == 1:
            return None
        if self.stack:
            name, _, on, _, task = self.stack[-1]
            if task != -1 and self.ledger.rerun_pass(task) is None:
                # a forward re-run in backward (checkpointing): the first forward's ops have the rows
                self._rerun = (task, name)
                return None
            return name, "forward", on
        task = torch._C._current_graph_task_id()
        if task != -1:
            return self._backward_context(f, kind, task)
        if running or (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            return "", "forward", self._root_autocast
        return None

    def _backward_context(self, f, kind: int, task: int):
        """:meth:`context` for an op run in graph task ``task`` outside every module (``f``: its
        caller's frame, of ``kind``)."""
        self._inner_of = None
        node = torch._C._current_autograd_node()
        if kind == 2 and _recomputing(f):  # a checkpointed function (no module) re-run: as above
            self._rerun = (task, node.metadata.get(_TAG, "") if node is not None else "")
            return None
        if node is None:
            return "", "backward", False
        if node.name().endswith("AccumulateGrad"):
            return None
        module = node.metadata.get(_TAG)
        if node.metadata.get(_PASS) is None and self._rerun is not None and self._rerun[0] != task \
                and _recomputing(f, inner=True):
            # the backward through a reentrant checkpoint's re-run: a graph task of its own
            # inside the backward that re-ran it, whose pass and module it takes (pass_of)
            self._inner_of = self._rerun[0]
            return (self._rerun[1] if module is None else module), "backward", False
        return module or "", "backward", False

    def pass_of(self, phase: str, args, outs) -> "Pass | None":
        """Which pass of the model an op belongs to: inside the model's forward, the ledger's current
        pass (an ``EVAL`` pass under no_grad); outside its modules, the pass some input that requires
        grad comes from (by its identity, else by its autograd graph: :func:`_graph_pass`), else
        :data:`OUTSIDE` (another model, bookkeeping); in backward ``BACKWARD(task)``, with the pass
        that made the node being run (``BACKWARD(task, of=pass)``; a node made by a pass that did not
        train the model, as autocast's cached weight casts made by the first forward of an autocast
        region, can run in the backward of one that did). An input of :data:`OUTSIDE` has the node
        that made it tagged so (:func:`_tag_outside`): the backward ops of another model that trains
        along (a teacher in the loss) are no pass's of the model either."""
        if phase == "backward":
            node = torch._C._current_autograd_node()
            p = node.metadata.get(_PASS) if node is not None else None
            task = torch._C._current_graph_task_id()
            if p is None:
                return self.ledger.backward(task) if self._inner_of is None else \
                    backward_of(task, self.ledger.backward(self._inner_of))
            return p if p == OUTSIDE else backward_of(task, p)
        if self.stack:
            p = self.state.pass_id
            if p is None:
                p = outside_forward_pass()  # (a submodule called directly under no_grad: evaluation)
        else:
            p = OUTSIDE
            for a in args:
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    q = self.input_pass(a)
                    if p == OUTSIDE:
                        p = q
        if p is None or p.kind is PassKind.FORWARD:
            marks = self.marks
            for o in outs:
                if o is not None:
                    marks.passes[marks.claim(o)] = p
        return p

    def input_pass(self, a: torch.Tensor) -> "Pass | None":
        """The pass of the model that ``a`` (a tensor that requires grad, entering an op outside the
        model's modules or the model itself) comes from: by its identity, else by its autograd graph
        (:func:`_graph_pass`); None for a parameter of the model (of no pass); :data:`OUTSIDE` when
        none, and then the nodes that made it are tagged so (:func:`_tag_outside`): their backward
        ops are another model's."""
        if id(a) in self._params:  # a parameter of the model (an EMA updated from it in the loop)
            return None
        i = self.marks.known(a)
        q = self.marks.passes.get(i, OUTSIDE) if i is not None else _graph_pass(a)
        if q == OUTSIDE:
            _tag_outside(a)
        return q

    def count(self, module: str, op: str, phase: str, pass_id, outs: int) -> tuple[int, int]:
        """Count a call of ``op`` in ``module``: its index ``k`` there this step (evaluation calls
        count apart: the training ops keep their names) and its place in the call log; ``outs``:
        its outputs named ``#k.i`` (0: one output, ``#k``)."""
        key = (module, op) if phase != "eval" else (module, op, "eval")
        k = self._counters.get(key, 0)
        self._counters[key] = k + 1
        call = len(self._call_log)
        self._call_log.append((key, pass_id, phase, outs))
        self._call_passes.add(pass_id)
        return k, call

    def cast_made(self, pass_id: Pass, module: str, out: torch.Tensor) -> Pass:
        """A cast autocast keeps for its region (also one made under no_grad) was made in
        ``pass_id``: its pass, ``CAST(of=pass_id)`` (the pass that uses it may be a later one)."""
        p = cast_of(pass_id)
        i = self.marks.claim(out)
        self.marks.casts[i] = (p, module, i)
        return p

    def casts_used(self, ids, pass_id) -> None:
        """An op of ``pass_id`` took the tensors of entries ``ids``: the casts among them are used by it."""
        casts = self.marks.casts
        if not casts:
            return
        for i in ids:
            c = casts.get(i)
            if c is not None and c[0] != pass_id:
                self._cast_users.setdefault(c[0], set()).add(pass_id)
                self.tag_cast(c)

    def tag_cast(self, cast) -> None:
        """Tag the autograd node of a cast autocast keeps (``cast``: its entry in ``marks.casts``),
        once it has one, with its module and pass, as a module's walk tags its nodes
        (:func:`_tag_graph`): one made under ``no_grad`` has autograd history but no module walked it."""
        t = self.marks.alive(cast[2])
        if t is not None and t.grad_fn is not None and _TAG not in t.grad_fn.metadata:
            t.grad_fn.metadata[_TAG], t.grad_fn.metadata[_PASS] = cast[1], cast[0]

    # ----------------------------------------------------------------- the step's end
    def passes(self) -> OpPasses:
        """The passes of this step's op calls, and who used each cast (for
        :func:`~mpscope.recording.passes.kept_passes`)."""
        return OpPasses(frozenset(self._call_passes), self._cast_users)

    def renumber(self, keep: frozenset) -> dict:
        """At the end of a step that trained the model, number the op calls of the passes the step
        keeps (``keep``, from :func:`~mpscope.recording.passes.kept_passes`) as if the others had
        not run: a forward with grad enabled whose output is never backpropagated (validation without
        ``no_grad``) leaves the training pass's ``#k`` names as they are in every other step. Its
        calls become ``"eval"`` calls (audit and ``op_facts``, numbered with those of the step's
        ``no_grad`` passes, in call order); backward calls of a graph task that did not train the
        model are numbered apart. An evaluation pass's cast that a kept pass used is a ``"forward"``
        call of the training calls.

        Returns ``{(pass, module, old name): new name}`` for the kept calls' ``op_output`` rows
        whose name changes (empty when every pass of the step trained the model)."""

        def dropped(p):
            return p is not None and p != OUTSIDE and p.kind is not PassKind.EVAL and p not in keep

        self.dropped = {p for p in self._call_passes if dropped(p)}
        # an evaluation pass's cast that a kept pass used: a training call (see _autocast_cached)
        self.moved = moved = {p for p in keep if p.kind is PassKind.CAST and p.of.kind is PassKind.EVAL}
        if not self.dropped and not moved:
            return {}
        before: dict = {}  # counter key -> calls so far, as counted (the names given)
        after: dict = {}  # the same, for the final groups
        final, rename = [], {}
        for key, p, phase, outs in self._call_log:
            k = before.get(key, 0)
            before[key] = k + 1
            group = key
            if p in self.dropped:  # a backward's calls are numbered apart
                group = (key[0], key[1], "eval" if phase == "forward" else phase)
                phase = "eval" if phase == "forward" else phase
            elif p in moved:
                phase, group = "forward", key[:2]
            j = after.get(group, 0)
            after[group] = j + 1
            final.append((phase, j))
            if len(group) == 2 and (j != k or group != key):  # a kept call's row (the others have none)
                for name in ([f"{key[1]}#{k}.{i}" for i in range(outs)] if outs else [f"{key[1]}#{k}"]):
                    rename[p, key[0], name] = renumbered(name, j)
        self.final = final
        return rename


def autocast_cached(args, out: torch.Tensor) -> bool:
    """The cast of an op that autocast runs (``autocast`` on where it runs) is one that autocast
    caches for the rest of its region, shared by every forward pass in it: a float32 leaf that
    requires grad (a weight) cast to the lower precision, with the cache enabled (the conditions of
    ``cached_cast`` in PyTorch's ``aten/src/ATen/autocast_mode.h``; under ``no_grad`` too, and the
    cast keeps its autograd history). A pass that did not train the model may have run it for one
    that did."""
    x = args[0] if args else None
    return (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.is_leaf and x.requires_grad
            and out.dtype in LOW and torch.is_autocast_cache_enabled())


def _recomputing(f, inner: bool = False) -> bool:
    """The op called from frame ``f`` (Python code running inside a backward, outside every module)
    is a checkpointed function's forward re-run by ``torch.utils.checkpoint``: a checkpoint frame
    is reached going up before a frame of ``torch.autograd`` (a custom Function's backward, or the
    backward of a reentrant checkpoint's re-run, is called by the autograd engine from there).
    ``inner``: the op is run by the autograd engine inside such a re-run's backward (a checkpoint
    frame is reached at all: reentrant checkpointing calls ``torch.autograd.backward`` itself)."""
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name == "torch.utils.checkpoint":
            return True
        if name.startswith("torch.autograd") and not inner:
            return False
        f = f.f_back
    return False


def renumbered(name: str, k: int) -> str:
    """``name`` (``"<overload>#<j>"`` or ``"<overload>#<j>.<i>"``) with call index ``k`` for ``j``."""
    base, _, rest = name.rpartition("#")
    _, dot, i = rest.partition(".")
    return f"{base}#{k}{dot}{i}"


def _model_device_type(model: torch.nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    for b in model.buffers():
        return b.device.type
    return "cpu"


def _tag_graph(output, name: str, threshold: int, pass_id=None, handed=()) -> list:
    """Tag the autograd nodes created during this module's forward (sequence number >= threshold)
    with the module's name and the model's forward pass (``pass_id``); return the untagged nodes
    the walk stopped at below ``threshold`` (made before this forward: its inputs' nodes).

    The walk starts at the output's nodes and at ``handed``, the nodes where the walks of the
    submodules this forward ran stopped, and stops at nodes already tagged (a submodule's, walked by
    it). A module whose forward ends in a submodule (``return self.proj(h)``) thus still tags its own
    ops behind the submodule's nodes, and no node is walked twice: each module's walk hands the
    nodes below its threshold up to its parent's (see :meth:`OpTracker.leave`)."""
    stack = []
    for t in flat_tensors(output):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
    stack.extend(handed)
    seen = set()
    below = []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        md = node.metadata
        if _TAG in md:
            continue
        seq = node._sequence_nr()
        if seq == _NO_SEQ:
            continue
        if seq < threshold:
            below.append(node)
            continue
        md[_TAG] = name
        md[_PASS] = pass_id
        stack.extend(n for n, _ in node.next_functions)
    return below


def _tag_outside(t: torch.Tensor) -> None:
    """Tag the autograd nodes that made ``t`` (an op's input of no pass of the model's, see
    :meth:`OpTracker.pass_of`) as :data:`OUTSIDE` the model, under the root's name: ``t.grad_fn`` and
    the untagged nodes above it (the ops of another model or of bookkeeping, on values of no pass:
    their inputs were of no pass either, or :func:`_graph_pass` would have found the model's tag),
    up to tagged nodes and leaves. In backward their ops belong to no pass of the model (a training
    step drops their rows). Each node is walked once: the next walk stops at its tag."""
    stack = [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        md = node.metadata
        if _TAG in md or node._sequence_nr() == _NO_SEQ:
            continue
        md[_TAG] = ""
        md[_PASS] = OUTSIDE
        stack.extend(n for n, _ in node.next_functions)


def _graph_pass(t: torch.Tensor) -> "Pass | None":
    """The pass of the model's forward that ``t`` comes from, read from the autograd graph: the tag
    :func:`_tag_graph` left on the nearest tagged node of the model at or above ``t.grad_fn`` (at most
    :data:`_GRAPH_WALK` nodes; None for a tag outside a numbered pass), else :data:`OUTSIDE`. For a
    tensor op recording has not seen by identity: a new Python object over the model's values, as
    ``Tensor.as_subclass`` makes (e.g. a module or the loop wrapping the model's output in a tensor
    subclass)."""
    todo, seen = [t.grad_fn], set()
    while todo and len(seen) < _GRAPH_WALK:
        node = todo.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        md = node.metadata
        if _TAG in md:
            p = md[_PASS]
            if p == OUTSIDE:
                continue  # no value of the model's above (see _tag_outside): another path may hold one
            return p
        todo.extend(n for n, _ in node.next_functions)
    return OUTSIDE


def flat_tensors(obj) -> list[torch.Tensor]:
    """The tensors in ``obj`` (a pytree, or a dict-like model output)."""
    try:
        leaves, _ = tree_flatten(obj)
    except Exception:  # pragma: no cover - exotic containers (HF ModelOutput is a dict subclass)
        leaves = [obj]
    if not leaves and hasattr(obj, "values"):
        leaves = list(obj.values())
    return [t for t in leaves if isinstance(t, torch.Tensor)]
