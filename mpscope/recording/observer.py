"""The observer: a tensor seen in a role becomes a row of the step, its stats taken on its own device
without a host sync and kept in the :class:`~mpscope.recording.step_buffer.StepBuffer` until the
step's one host copy.

A tensor seen before in this step (the same object, unchanged: same version counter and data
pointer) reuses its stats; like autograd, this cannot see in-place writes made through ``.data``.
An ``activation`` seen again under the same (module, name, dtype) in the same pass with no
parameter gradient accumulated since (the same output of one forward pass) is not logged again:
one row per tensor, as autograd gives it one gradient. Repeated (module, role, name) within a step
merge when the step is copied: counts add, min / max combine.

The step end's parameters, gradients and optimizer state are observed in batches
(:meth:`Observer.record_parameters`, planned by :mod:`~mpscope.recording.parameter_batch`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict, defaultdict
from functools import partial

import torch

from mpscope import compiled as _compiled
from mpscope import distributed as _dist
from mpscope import kernel as _kernel
from mpscope import stats as _stats
from mpscope.recording import parameter_batch as _batch
from mpscope.recording.hook_state import HookState
from mpscope.recording.passes import PassKind
from mpscope.recording.step_buffer import LOG_AT, LOG_ENTRY, LOG_KEY, LOG_PASS, Observation

#: The dtypes the fused CPU kernel takes (float64 goes through the torch-op path).
_FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
_measurable = _stats.recordable_dtype
_tensor_facts = _stats.tensor_facts
_FUSED_STATS_INTO = _kernel.fused_stats_into  # (the kernel's own; see Observer.begin_step)
#: Largest number of elements concatenated into one batched stats pass (bounds the extra memory).
BATCH_ELEMENTS = 1 << 24

_functorch = getattr(torch._C, "_functorch", None)
#: The level of the ``torch.func`` transform (``vmap``, ``grad``, ``jacrev`` ...) running now, None
#: outside any (one call per forward hook).
transform_level = getattr(_functorch, "maybe_current_level", lambda: None)
#: Runs mpscope's own ops on plain tensors outside the transforms' dispatch (a ``grad`` transform
#: refuses an in-place write, such as a staging copy, into a tensor made outside it).
outside_transforms = getattr(torch._C, "_DisableFuncTorch", contextlib.nullcontext)
#: Whether a tensor is one of functorch's wrappers (``vmap``'s ``BatchedTensor``, ``grad``'s
#: ``GradTrackingTensor``), and one of the batched tensors of ``torch.autograd.grad(...,
#: is_grads_batched=True)``.
functorch_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", lambda t: False)
legacy_batched = getattr(_functorch, "is_legacy_batchedtensor", lambda t: False)


#: A tensor observed this step (``HookState.seen``, by its ``(id, version, data pointer)``): a plain
#: tuple of these fields, in this order (checked by the kernel's C++ path, which makes them too; see
#: :data:`~mpscope.recording.step_buffer.LOG_ENTRY`). ``ref``: a weak reference to the tensor (alive:
#: its id was not reused); ``src``: its row of the step's tables (an int) or its Observation;
#: ``key`` and ``pass_id``: those of its first observation; ``tick``: ``HookState.grad_tick`` then.
SEEN = ("ref", "src", "key", "pass_id", "tick")
SEEN_REF, SEEN_SRC, SEEN_KEY, SEEN_PASS, SEEN_TICK = range(len(SEEN))


def shard(t: torch.Tensor) -> torch.Tensor:
    """What the stats of an observed tensor are taken of: a DTensor's own shard (a tensor-parallel
    module's output or its gradient; no stats pass may issue a collective, as for parameters), taken
    without an autograd node (under no_grad ``to_local()`` returns the shard itself, the same object
    each time); a ``__torch_dispatch__`` wrapper subclass's values copied into a plain tensor; any
    other tensor as it is. (Only called for tensors whose class is not Tensor.)"""
    with torch.no_grad():
        t = _dist.local_tensor(t)
        if t.__class__ is not torch.Tensor and isinstance(t, torch.Tensor) and _stats.python_dispatch(t) \
                and _measurable(t) is not None:  # (not a nested jagged tensor: listed as not measured)
            # a __torch_dispatch__ wrapper subclass (a quantized tensor: torchao's float8 and NF4
            # tensors) has no storage of its own: its values as every op computes with them, copied
            # into a plain tensor (what the staging copy of a run on an accelerator takes too)
            t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
        return t


def zeros_facts(t: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
    """For a tensor whose facts are None: an efficient zero tensor (no data) as the zeros it stands
    for and their :func:`~mpscope.stats.tensor_facts` (None for zeros the stats take no more than the
    tensor: an integer dtype, empty); any other tensor as it is, with None."""
    z = _stats.zeros_of(t)
    return (t, None) if z is None else (z, _tensor_facts(z))


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """A tensor seen inside a ``torch.func`` transform as the plain tensor that holds its values: its
    wrappers (``BatchedTensor`` under ``vmap``, ``GradTrackingTensor`` under ``grad``) peeled off. Under
    ``vmap`` that is every sample's values at once (the batch dimension is the plain tensor's own),
    as a batched forward without the transform holds them."""
    while functorch_wrapped(t):
        t = _functorch.get_unwrapped(t)
    return t


class Observer:
    """Turns observed tensors into the step's rows.

    Args:
        state: the recording's :class:`~mpscope.recording.hook_state.HookState` (this observer keeps
            its ``key_index``, ``seen``, ``obs``, ``rows``, ``staged``, ``hist_now`` and ``observe_now``).
        builder: the :class:`~mpscope.run.RunBuilder` of the recording's own Run (its keys).
        steps: the :class:`~mpscope.recording.step_buffer.StepBuffer` holding the step's rows.
        model: the recorded model; ``roles``: the roles recorded; ``select(name, module)``: the
            ``modules=`` selection.
    """

    def __init__(self, state: HookState, builder, steps, model: torch.nn.Module, roles: frozenset, select) -> None:
        self.state = state
        self.builder = builder
        self.steps = steps
        self.model = model
        self.roles = roles
        self.select = select
        self.meta = builder.run.meta
        state.key_index = builder.key_index
        state.observe_now = self.observe_now
        self._seen_again: set = set()
        #: the fused kernel for this step's CPU stats (None: the torch-op path)
        self.fused = None
        #: the kernel this recorded step found loaded, any device (None: not loaded)
        self.kern = None
        self.facts = _tensor_facts  # the kernel's tensor_facts once it is loaded (the same answers)
        #: (kernel, hook_state capsule): the hooks' usual path in C++, once the kernel is loaded
        self.fast = None
        self._param_plan = None  # (modules, their tree, selected parameters, all parameters) of the last walk
        self._batch_plan = None  # the step end's parameter batch as last observed (a ParameterPlan)

    # ------------------------------------------------------------------ per step
    def begin_step(self, recording: bool, hist: bool, device_type: str, defer_build: bool, step: int,
                   op_recording: bool) -> None:
        """A step begins: the kernel and the tables its single-tensor rows go to. On the CPU one
        implementation takes the whole step: the PyTorch extension once it is ready, else
        mpscope._core (compiled at install), else the torch ops. A single tensor's stats go into
        rows of the step: written by the fused kernel on the CPU, staged and taken in batches on an
        accelerator (with op recording, which reads each one's stats itself, they are Observations)."""
        state = self.state
        kern = self.kern = _kernel.current(start=not defer_build) if recording else None
        self.facts = _tensor_facts if kern is None else kern.tensor_facts
        self.fast = None if kern is None else (kern, self._hook_constants(kern))
        if recording and device_type == "cpu":
            self.fused = kern or _kernel.core()
            if kern is not None and self.meta.get("fused_kernel_from_step") is None:
                self.meta["fused_kernel_from_step"] = step
        steps = self.steps
        rowed = recording and not op_recording
        steps.use_staged(rowed)
        state.staged = steps.staged if rowed else None
        if state.staged is not None:  # (the same copy with or without the kernel)
            state.staged.copier = kern.stage_copy if kern is not None else None
        state.rows = steps.tables if (rowed and state.staged is None and self.fused is not None) else None
        state.hist_now = hist
        steps.tables.hist = hist  # (the rows it logs there)
        steps.host_tables.kernel = kern if self.fused is not None else None  # (its hist_nonzero)

    def _hook_constants(self, kern) -> object:
        """The constants the kernel's ``forward_hook`` and ``observe_now`` take for this step (see
        mpscope/_kernel.cpp): which roles they record, the stats' bit patterns, :mod:`mpscope.kernel`
        and its own ``fused_stats_into`` (a replacement found there is called instead of the kernel,
        as here), the kernel module, ``functools.partial`` and ``OrderedDict`` (what
        :class:`GradHooks` puts in a tensor's ``_backward_hooks``), the class of the state, the fields
        of a log entry and of a seen record, and the kind of a pass that hooks gradients."""
        return kern.hook_state(("activation" in self.roles, "activation_grad" in self.roles, _kernel.HOOK_BITS,
                                _kernel, _FUSED_STATS_INTO, kern, partial, OrderedDict, HookState, LOG_ENTRY, SEEN,
                                PassKind.FORWARD))

    def observed(self) -> bool:
        """Some tensor was observed since the last host copy."""
        return bool(self.state.obs or self.steps.tables.log)

    def take(self) -> list[Observation]:
        """Hand over the observations waiting for the host copy (and forget this step's tensors)."""
        state = self.state
        obs, state.obs = state.obs, []
        state.seen = {}
        self._seen_again = set()
        return obs

    # ------------------------------------------------------------------ one tensor
    def observe(self, module: str, role: str, name: str, tensor, scaled: bool = False, pass_id=None):
        """Take the stats of ``tensor`` (module ``module``, role ``role``, name ``name``) for this
        step's rows, on its device, without a host sync. ``scaled``: it is multiplied by the
        current loss scale (gradients before ``unscale_``); ``pass_id``: its pass (None: of no pass).

        Returns the tensor's :class:`~mpscope.stats.DeviceStats` (one row, on its device), or None
        when nothing was recorded (the step is not recorded, the role is not, no tensor)."""
        if not self.state.recording or role not in self.roles or not isinstance(tensor, torch.Tensor):
            return None
        if tensor.__class__ is not torch.Tensor:
            tensor = shard(tensor)
        facts = self.facts(tensor, _tensor_facts)
        if facts is None:
            tensor, facts = zeros_facts(tensor)
            if facts is None:
                return None
        o = self.observe_now(module, role, name, tensor, facts, scaled, pass_id)
        if o.__class__ is int:
            return self.steps.tables.stats(o, 1, self.state.hist_now)
        return o.ds if o.src is None else o.src.ds

    def observe_now(self, module: str, role: str, name: str, tensor: torch.Tensor, facts: tuple,
                    scaled: bool, pass_id):
        """:meth:`observe` after its checks (``facts``: the tensor's :func:`~mpscope.stats.tensor_facts`,
        not None): the per-tensor host path, kept to a few dict lookups (its usual cases run in C++:
        the kernel's ``observe_now``). Returns the tensor's row of the step buffer's rows (an int,
        logged as a :data:`LOG_ENTRY`: the fused CPU kernel wrote its stats into a host row, or the
        tensor is staged on its device) or the :class:`Observation` appended."""
        state = self.state
        dtype, numel, ident, fused_cpu = facts
        key = state.key_index.get((module, role, name, dtype))
        if key is None:
            key = self.builder.key(module, role, name, dtype)
        # ident: (id, version counter, data pointer); None for an inference tensor, which has no
        # version counter (it cannot be told apart from a changed one). A write through `.data`
        # bumps no version counter; replacing `.data` changes the data pointer
        seen = state.seen.get(ident) if ident is not None else None
        if seen is not None and seen[SEEN_REF]() is tensor:  # alive, so id() was not reused
            return self._again(seen, ident, key, role, numel, dtype, scaled, pass_id)
        tables = state.rows
        if tables is not None and fused_cpu:
            # the fused kernel writes the row in place: nothing allocated per tensor
            o = tables.take(1)
            _kernel.fused_stats_into(self.fused, [tensor], state.hist_now, tables.counts, tables.extrema, o)
            tables.log.append((key, o, numel, scaled, pass_id, len(state.obs)))
        elif (staged := state.staged) is not None and dtype != "float64" and tensor.device == staged.device:
            # staged on its device: one copy kernel now, the stats in batches (StagedRows)
            o = staged.stage(tensor, numel)
            staged.log.append((key, o, numel, scaled, pass_id, len(state.obs)))
        else:
            ds = _stats.device_stats([tensor], state.hist_now, self.fused)
            o = Observation([key], [numel], [dtype], [scaled], ds, state.hist_now, None, pass_id)
            state.obs.append(o)
        if ident is not None:
            state.seen[ident] = (weakref.ref(tensor), o, key, pass_id, state.grad_tick)
        return o

    def _again(self, seen: tuple, ident, key: int, role: str, numel: int, dtype: str, scaled: bool, pass_id):
        """A tensor seen before in this step, unchanged (``seen``: its :data:`SEEN` record): its stats
        are its first observation's."""
        state = self.state
        src = seen[SEEN_SRC]
        if role == "activation":
            # the same output of the same module again in one forward pass (no parameter gradient
            # arrived since): one activation, as autograd gives it one gradient
            tick = state.grad_tick
            if seen[SEEN_KEY] == key and seen[SEEN_PASS] == pass_id and seen[SEEN_TICK] == tick:
                return src
            # (with src, the first observation of this very tensor: a tensor that took a dead one's
            # identity, as id and allocator reuse give it, gets a row of its own and no repeat of the
            # dead tensor's)
            again = (ident, key, pass_id, tick, src)
            if again in self._seen_again:
                return src
            self._seen_again.add(again)
        if src.__class__ is int:
            self.steps.tables.log.append((key, src, numel, scaled, pass_id, len(state.obs)))
            return src
        o = Observation([key], [numel], [dtype], [scaled], None, state.hist_now, src, pass_id)
        state.obs.append(o)
        return o

    def note_unmeasured(self, module: str, role: str, name: str, t: torch.Tensor, reason: str | None = None) -> None:
        """Record in ``run.meta["not_measured"]`` a tensor the stats pass cannot read (sparse, nested,
        quantized, meta) or the recorder cannot see (``reason``, e.g. a gradient computed inside a
        ``torch.func`` transform): ``"<role> <module>/<name>" -> reason`` (at most 100 entries)."""
        reason = reason or _stats.unmeasurable_reason(t)
        if reason is None or role not in self.roles:
            return
        notes = self.meta.setdefault("not_measured", {})
        if len(notes) < 100:
            notes.setdefault(f"{role} {module}/{name}", reason)

    # ------------------------------------------------------------------ the passes a step keeps
    def keep(self, keep: frozenset, rename: dict) -> None:
        """Drop this step's observations from passes not in ``keep`` (see
        :func:`~mpscope.recording.passes.kept_passes`); observations of no pass stay. A kept row that
        reused a dropped one's stats takes them over (a table row stays where it is). ``rename``:
        ``{(pass, module, name): new name}`` of kept ``op_output`` rows
        (:meth:`~mpscope.recording.op_recorder.OpRecorder.renumber`)."""
        state = self.state
        log = self.steps.tables.log
        if rename:
            rows, intern = self.builder.key_rows, self.builder.key

            def renamed(key: int, pass_id) -> int:
                module, role, name, dtype = rows[key]
                new = rename.get((pass_id, module, name)) if role == "op_output" else None
                return key if new is None else intern(module, role, new, dtype)

            for o in state.obs:
                o.keys = [renamed(k, o.pass_id) for k in o.keys]
            log[:] = [e[:LOG_KEY] + (renamed(e[LOG_KEY], e[LOG_PASS]),) + e[LOG_KEY + 1:] for e in log]
        if {e[LOG_PASS] for e in log} <= keep | {None} and all(o.pass_id is None or o.pass_id in keep for o in state.obs):
            return
        flags = [o.pass_id is None or o.pass_id in keep for o in state.obs]
        kept = [o for o, f in zip(state.obs, flags) if f]
        for o in kept:
            if o.src is not None and not (o.src.pass_id is None or o.src.pass_id in keep):
                o.ds, o.src = o.src.ds, None
        state.obs = kept
        before = [0]  # kept observations before each original position (the log's ``at``)
        for f in flags:
            before.append(before[-1] + f)
        log[:] = [e[:LOG_AT] + (before[e[LOG_AT]],) for e in log if e[LOG_PASS] is None or e[LOG_PASS] in keep]

    # ------------------------------------------------------------------ the step end's batch
    def record_parameters(self, optimizer, scaled: bool, share=None, grads: bool = True) -> None:
        """Observe the selected parameters, their gradients (``scaled``: still multiplied by the loss
        scale; none with ``grads=False``) and ``optimizer``'s state (an optimizer, or a list of
        optimizers: the state of each) in one batch. ``share(params)``: the parameters this rank
        records (DDP: see :meth:`~mpscope.distributed.RankMerge.replicated_share`). A step whose
        batch has the form and tensor layout of the last one reuses its plan (keys, sizes, batch
        split: :class:`~mpscope.recording.parameter_batch.ParameterPlan`)."""
        roles = self.roles
        want_g = grads and "param_grad" in roles
        if not (want_g or roles & {"weight", "optimizer_state"}):
            return
        want_w = "weight" in roles
        state = {}
        if "optimizer_state" in roles and isinstance(optimizer, list):
            for o in optimizer:
                state.update(o.state)
        elif optimizer is not None and "optimizer_state" in roles:
            state = optimizer.state
        params = self.selected_parameters()
        if share is not None:
            params = share(params)
        tensors, form = _batch.gather(params, want_g, want_w, state, self.kern)
        plan, rows = self._batch_plan, self.state.rows is not None
        if plan is not None and plan.holds(params, form, tensors, rows, self.kern):
            hist = self.state.hist_now
            for start, end, keys, numels, dtypes, grads, unscaled, fused in plan.batches:
                part, sc = tensors[start:end], grads if scaled else unscaled
                if fused:
                    self._fused_rows(part, keys, numels, dtypes, sc)
                else:
                    self.state.obs.append(Observation(keys, numels, dtypes, sc,
                                                      _stats.device_stats(part, hist, self.fused), hist))
            return
        items = _batch.items(params, form, tensors, want_w, scaled)
        first = len(self.state.obs)
        if items:
            self._observe_batch(items)
        self._batch_plan = _batch.ParameterPlan.make(params, form, items, self.state.obs[first:], rows)

    def record_gradients(self, params: list, scaled: bool, share=None) -> None:
        """Observe now the gradients (``param_grad``; ``scaled``: still multiplied by the loss scale)
        of those of ``params`` that the selected modules hold and whose ``.grad`` is set, in one
        batch (rows of no pass: always kept). ``share``: as for :meth:`record_parameters`. The same
        parameter observed twice in a step (an optimizer stepped twice) merges, as every repeated
        row of a step does."""
        if not self.state.recording or "param_grad" not in self.roles:
            return
        ids = {id(p) for p in params}
        chosen = [t for t in self.selected_parameters() if id(t[2]) in ids]
        if share is not None:
            chosen = share(chosen)
        items = []
        for module, pname, p in chosen:
            g = p.grad
            if g is not None:
                z = _stats.zeros_of(g)  # (an efficient zero tensor's values: zeros)
                items.append((module, "param_grad", pname, g if z is None else z, scaled))
        if items:
            self._observe_batch(items)

    def _observe_batch(self, items: list[tuple[str, str, str, torch.Tensor, bool]]) -> None:
        """Stats of many tensors in batched passes, grouped by device and carrier format."""
        groups = defaultdict(list)
        for module, role, name, t, scaled in items:
            if t.__class__ is not torch.nn.Parameter and t.__class__ is not torch.Tensor:
                t = shard(t)  # (a DTensor's own shard, a wrapper subclass's values: see shard)
            if not isinstance(t, torch.Tensor) or _measurable(t) is None:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self.note_unmeasured(module, role, name, t)
                continue
            if role in self.roles:
                groups[t.device].append((module, role, name, t, scaled))  # device_stats splits float64 itself
        for group in groups.values():
            batch, size = [], 0
            for item in group + [None]:
                if item is None or (batch and size + item[3].numel() > BATCH_ELEMENTS):
                    if batch:
                        self._observe_together(batch)
                    batch, size = [], 0
                if item is not None:
                    batch.append(item)
                    size += item[3].numel()

    def _observe_together(self, batch: list[tuple[str, str, str, torch.Tensor, bool]]) -> None:
        """One stats pass over the tensors of ``batch`` (recordable, on one device)."""
        tensors = [b[3] for b in batch]
        dtypes = [_stats.RECORDABLE_NAMES[t.dtype] for t in tensors]
        index, key = self.state.key_index, self.builder.key
        keys = []
        for (m, r, n, _, _), d in zip(batch, dtypes):
            k = index.get((m, r, n, d))
            keys.append(key(m, r, n, d) if k is None else k)
        numels = [t.numel() for t in tensors]
        scaled = [b[4] for b in batch]
        if self.state.rows is not None and all(t.is_cpu and t.dtype in _FUSED_DTYPES for t in tensors):
            self._fused_rows(tensors, keys, numels, dtypes, scaled)
            return
        hist = self.state.hist_now
        self.state.obs.append(Observation(keys, numels, dtypes, scaled, _stats.device_stats(tensors, hist, self.fused),
                                          hist))

    def _fused_rows(self, tensors: list[torch.Tensor], keys: list[int], numels: list[int], dtypes: list[str],
                    scaled: list[bool]) -> None:
        """The fused kernel's stats of CPU float16/bfloat16/float32 ``tensors`` into the next rows of the
        step's host tables (``HookState.rows``), kept as one observation of those rows."""
        state = self.state
        tables = state.rows
        row = tables.take(len(tensors))
        _kernel.fused_stats_into(self.fused, tensors, state.hist_now, tables.counts, tables.extrema, row)
        state.obs.append(Observation(keys, numels, dtypes, scaled, None, state.hist_now, row=row))

    def selected_parameters(self) -> list[tuple[str, str, torch.nn.Parameter]]:
        """``(module, parameter name, parameter)`` of the selected modules' own parameters, each
        parameter once (under its first module). Kept while the model's module tree and parameters
        are the same objects: checked on each call over the modules found the last time (the same
        children and parameters under the same names, in the same order, at each of them is the
        same tree): four tuples per module, compared by the kernel's ``same_module_tree`` when it is
        loaded (the same answer without making them)."""
        if self._module_tree_holds():
            return self._param_plan[2]
        out, seen = [], set()
        for name, mod in _compiled.modules(self.model):
            if not self.select(name, mod):
                continue
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, pname, p))
        try:
            mods = list(self.model.modules())
            self._param_plan = (mods, module_tree(mods), out, all_parameters(self.model))
        except Exception:  # module dicts that do not iterate as dicts (torch.jit.trace): no caching
            self._param_plan = None
        return out

    def all_parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter of the model (:func:`all_parameters`), from the last walk while the module
        tree holds."""
        return self._param_plan[3] if self._module_tree_holds() else all_parameters(self.model)

    def _module_tree_holds(self) -> bool:
        """Whether the model's module tree is still the one :meth:`selected_parameters` last walked
        (``self._param_plan``: its modules, their tree, the selected parameters and all of the
        model's): the same children and parameters under the same names, in the same order, at each
        module. Compared by the kernel's ``same_module_tree`` when it is loaded (no tuples made; it
        leaves a module dict that is not a plain dict, such as a reordered OrderedDict, to the
        Python form)."""
        plan = self._param_plan
        if plan is None:
            return False
        mods, tree = plan[0], plan[1]
        try:
            same = None if self.kern is None else self.kern.same_module_tree(mods, tree)
            # (None: a module dict that is not a plain dict, an OrderedDict: the Python form answers)
            return (module_tree(mods) == tree) if same is None else same
        except Exception:  # a module dict replaced by something else: walk the tree again
            return False


def module_tree(mods: list[torch.nn.Module]) -> list[tuple]:
    """What ``modules()`` and ``named_parameters()`` see of each of ``mods``: its children's and its own
    parameters' names and identities (``mods`` holds the modules, so no identity is reused)."""
    return [(tuple(m._modules), tuple(map(id, m._modules.values())), tuple(m._parameters),
             tuple(map(id, m._parameters.values()))) for m in mods]


def all_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters ``model.parameters()`` yields (each module and parameter once; the order may
    differ), by a walk of the modules' ``_modules`` / ``_parameters`` dicts: about 35 against 80 us
    on the demo GPT's 69 parameters (hot loop)."""
    out, seen_p, seen_m, stack = [], set(), {id(model)}, [model]
    while stack:
        m = stack.pop()
        for p in m._parameters.values():
            if p is not None and id(p) not in seen_p:
                seen_p.add(id(p))
                out.append(p)
        for c in m._modules.values():
            if c is not None and id(c) not in seen_m:
                seen_m.add(id(c))
                stack.append(c)
    return out
