"""Activations and their gradients: the hooks on the recorded model's modules.

* ``activation``: each selected module's forward output (tuple / list / dict outputs flattened to
  ``output.0``, ``output.key``, nested ``output.0.1``), from a forward hook (registered with
  ``prepend=True``, so mpscope sees the module's own output even when a user hook replaces it).
* ``activation_grad``: the gradient w.r.t. that output as it flows in backward (multiplied by the
  loss scale), from a hook on the output tensor itself (:class:`~mpscope.recording.grad_hooks.GradHooks`;
  ``register_full_backward_hook`` is not used: it breaks on in-place ops).

Forward hooks exist during recorded steps only (a module with hooks takes PyTorch's slower call
path): with ``every=N`` the steps in between run without them. The model's own pre- and post-hooks
tell the :class:`~mpscope.recording.passes.PassLedger` where each forward pass begins and ends. A
hook running inside backward (activation checkpointing re-running a forward) takes no activation
(the first forward did), except in a re-run of the whole model by reentrant checkpointing, which
is a pass of its own. Inside a ``torch.func`` transform the outputs are functorch's wrappers: their
values are measured and their gradients, which functorch computes without autograd's tensor hooks,
are listed as not measured. Modules inside a ``torch.compile``'d region get one hook for the whole
recording that hands their outputs to the custom op ``mpscope::observe`` (:mod:`mpscope.compiled`).

The usual case of both hooks runs in C++ once the kernel is loaded (``forward_hook`` and
``observe_now`` in ``mpscope/_kernel.cpp``, over the :class:`~mpscope.recording.hook_state.HookState`);
the methods here are the reference and take every other case.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Callable

import torch

from mpscope import compiled as _compiled
from mpscope import stats as _stats
from mpscope.formats import dtype_name
from mpscope.model_hooks import ModelHook
from mpscope.recording.events import ForwardEvents
from mpscope.recording.grad_hooks import GradHooks
from mpscope.recording.hook_state import HookState
from mpscope.recording.observer import (Observer, functorch_wrapped, legacy_batched, outside_transforms, shard, transform_level,
                                        unwrapped, zeros_facts)
from mpscope.recording.outputs import flatten_outputs as _flatten
from mpscope.recording.outputs import flatten_outputs_list as _flatten_list
from mpscope.recording.passes import UNNUMBERED_EVAL, PassKind

_tensor_facts = _stats.tensor_facts
_graph_task = torch._C._current_graph_task_id
_BATCHED_BACKWARD = "computed in a batched backward (autograd.grad with is_grads_batched=True or under vmap)"


class ActivationHooks:
    """The module hooks of one recording.

    Args:
        state: the :class:`~mpscope.recording.hook_state.HookState` (these hooks keep its ``names``,
            ``grad_hooks``, ``gradient``, ``autocast_seen`` and ``note_autocast``).
        ledger: the :class:`~mpscope.recording.passes.PassLedger` the root hooks report to.
        observer: the :class:`~mpscope.recording.observer.Observer` that takes the tensors.
        model, select: the recorded model and the ``modules=`` selection.
        device_type: the model's device type (whose autocast state is noted).
        guard: ``guard(where, fn, *args)`` runs a hook body so that an error never reaches
            training; ``fail(where, error)``: what it does on an error.
    """

    def __init__(self, state: HookState, ledger: ForwardEvents, observer: Observer, model: torch.nn.Module, select,
                 device_type: str, guard: Callable, fail: Callable) -> None:
        self.state, self.ledger, self.observer = state, ledger, observer
        self.model, self.select, self.device_type = model, select, device_type
        self.roles = observer.roles
        self.meta = observer.meta
        self.guard, self.fail = guard, fail
        self.grad_hooks = GradHooks()  # this step's gradient hooks on module outputs
        state.names = {}
        state.grad_hooks = self.grad_hooks
        state.gradient = self.gradient
        state.note_autocast = self.note_autocast
        self.fast = None  # the observer's (kernel, capsule) for this step: the hooks' C++ path
        self._last: tuple = (None, None, None)  # (pass, graph task, its gradients' pass) the ledger last heard of
        self._compiled = _compiled.is_compiled(model)
        self._flag = _compiled.Flag()  # read by the hooks inside compiled regions
        self._traced: set[int] = set()  # modules carrying such a hook (kept until detach)
        self._handles: list = []  # the root's pre-hook, hooks inside compiled regions
        self._module_handles: list = []  # forward hooks, present during recorded steps only
        self._root_post = None  # the model's forward hook ending a pass (recorded steps only)

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        """The model's forward pre-hook (a model compiled in place runs its hooks traced: none)."""
        if getattr(self.model, "_compiled_call_impl", None) is None:
            self._handles.append(self.model.register_forward_pre_hook(ModelHook(self.root_pre_hook)))

    def set_recording(self, on: bool) -> None:
        """Forward hooks on the selected modules during recorded steps only; modules created since the
        last recorded step (lazy submodules) get their names too."""
        self._flag.on = on  # hooks inside compiled regions stay; this flag switches them
        self.fast = self.observer.fast if on else None
        if not on:
            for h in self._module_handles:
                h.remove()
            self._module_handles.clear()
            if self._root_post is not None:
                self._root_post.remove()
                self._root_post = None
            return
        if self._root_post is None and getattr(self.model, "_compiled_call_impl", None) is None:
            # the end of the model's forward ends its pass (passes are numbered on recorded steps
            # only; a model compiled in place has no pre-hook numbering them)
            self._root_post = self.model.register_forward_hook(ModelHook(self.root_post_hook), always_call=True)
        if not self._module_handles and self.roles & {"activation", "activation_grad"}:
            self._hook_modules()

    def _hook_modules(self) -> None:
        added = False
        names = self.state.names
        for name, mod, traced in _compiled.hook_targets(self.model):
            names[id(mod)] = name
            if not self.select(name, mod):
                continue
            if not traced:
                self._module_handles.append(mod.register_forward_hook(ModelHook(self.forward_hook), prepend=True))
                continue
            if id(mod) not in self._traced:  # installed once: dynamo guards on the flag only
                self._traced.add(id(mod))
                grads = "activation_grad" in self.roles
                hook = _compiled.traced_hook(self, self._flag, name, _flatten_list, grads)
                self._handles.append(mod.register_forward_hook(ModelHook(hook), prepend=True))
                added = True
        if added:  # code compiled before these hooks existed would run without them
            _compiled.forget_compiled(self.model)

    def step_ended(self) -> None:
        """The step's gradient hooks are removed (a tensor still alive keeps none)."""
        self.grad_hooks.clear()
        self._last = (None, None, None)

    def remove(self) -> None:
        """Remove every hook (detach); safe to call twice."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.grad_hooks.clear()
        self.set_recording(False)

    # ------------------------------------------------------------------ the model's forward
    def root_pre_hook(self, module, args):
        return self.guard("forward pre-hook", self._begin_pass)

    def _begin_pass(self) -> None:
        self.note_autocast()
        if self.state.recording:  # (not an extra forward of mpscope's own, the shadow's)
            self.ledger.forward_began(torch.is_grad_enabled(), _graph_task())

    def root_post_hook(self, module, args, output):
        """The model's forward returned (or raised): its modules run from now on outside it (called
        directly, ``checkpoint_sequential`` running the children of a ``Sequential``) belong to no
        pass, not to this one. A forward that raised (``output`` None: the hook is registered with
        ``always_call``), or whose output holds no tensor that requires grad (all parameters frozen,
        ``functional_call`` on detached ones), trains nothing. Inside a ``torch.func`` transform the
        outputs are functorch's wrappers: not judged."""
        state = self.state
        if state.recording:
            p = state.pass_id
            nothing = p is not None and p in state.hookless and transform_level() is None \
                and not any(t.requires_grad for _, t in _flatten(output, "output"))
            self.ledger.forward_ended(nothing)
        return None

    def note_autocast(self) -> None:
        """Record the autocast in effect (meta ``autocast_dtype`` / ``autocast_device_type``) the
        first time a forward runs under it. Checked before the model's forward and in the modules'
        forward hooks: frameworks enter autocast inside the model's ``forward`` (Accelerate replaces
        ``model.forward`` with an autocast-wrapped one), where the root's pre-hook cannot see it."""
        if self.state.autocast_seen:
            return
        dev = self.device_type
        if torch.is_autocast_enabled(dev):
            self.meta["autocast_dtype"] = dtype_name(torch.get_autocast_dtype(dev))
            self.meta["autocast_device_type"] = dev
            self.state.autocast_seen = True

    # ------------------------------------------------------------------ a module's output
    def forward_hook(self, module, args, output):
        state = self.state
        if state.recording:
            try:
                fast = self.fast
                if fast is None or state.pass_id is None or not fast[0].forward_hook(state, fast[1], module, output):
                    self.on_forward(module, output)
            except Exception as e:  # (``guard`` written out: this runs once per module and pass)
                self.fail("forward hook", e)
        return None

    def on_forward(self, module, output) -> None:
        """A selected module returned ``output`` (the Python form of the forward hook)."""
        state, roles = self.state, self.roles
        task = _graph_task()
        if task == -1:
            if not state.autocast_seen:
                self.note_autocast()
            pass_id = state.pass_id
            if pass_id is None:  # a module run outside the model's forward
                pass_id = self.ledger.module_pass(torch.is_grad_enabled())
            take = "activation" in roles
        else:
            # a forward re-run in backward (activation checkpointing): the first forward took the
            # activation, and the re-run's gradients mark no pass; except in a re-run of the whole
            # model, a pass of its own (see PassLedger.forward_began)
            pass_id = self.ledger.rerun_pass(task)
            take = pass_id is not None and "activation" in roles
        mname = state.names.get(id(module), "?")
        # no gradient hooks in a pass under no_grad: what requires grad there (a Parameter or an
        # input returned as it is) gets its gradient from a training pass, which hooks it itself
        # (the hooks of a leaf are per (module, output) and step, see GradHooks.add)
        hook_grads = pass_id.kind is PassKind.FORWARD if pass_id is not None else "activation_grad" in roles
        # inside a torch.func transform (per-sample gradients: vmap(grad(...)) over functional_call)
        # the outputs are functorch's wrappers: their values are measured, their gradients noted
        inside = transform_level() is not None
        observer, facts = self.observer, self.observer.facts
        for name, t in (("output", output),) if output.__class__ is torch.Tensor else _flatten(output, "output"):
            v = t if t.__class__ is torch.Tensor else shard(t)  # (the gradient hooks go on t itself)
            if inside:
                v = unwrapped(v)
            f = facts(v, _tensor_facts)
            if f is None:
                v, f = zeros_facts(v)  # (an efficient zero tensor: its zeros; the gradient hooks go on t)
                if f is None:
                    if v.is_floating_point():
                        observer.note_unmeasured(mname, "activation", name, v)
                    continue
            if inside:
                if take:
                    with outside_transforms():
                        observer.observe_now(mname, "activation", name, v, f, False, pass_id)
                if hook_grads:
                    observer.note_unmeasured(mname, "activation_grad", name, v, "computed inside a torch.func transform")
                continue
            if take:
                observer.observe_now(mname, "activation", name, v, f, False, pass_id)
            if hook_grads and t.requires_grad:
                # a leaf output (a module returning a Parameter) keeps its hooks across the step's
                # micro-batches: hooked once per step (module, name), or its gradients would count twice
                if self.grad_hooks.add(t, partial(self.gradient, mname, name, pass_id), (mname, name)):
                    self.ledger.hooked(pass_id)

    def gradient(self, mname: str, name: str, pass_id, grad: torch.Tensor | None) -> None:
        """The gradient arriving at output ``name`` of module ``mname`` of pass ``pass_id`` (the
        tensor hooks are ``functools.partial`` of this; compiled graphs call it too)."""
        if grad is None:
            # an undefined gradient: the output of a compiled graph whose consumers (a loss computed
            # inside the same graph) were differentiated there, so no gradient flows into it
            return
        try:
            state = self.state
            # the row is the backward's: kept when that backward trained the model (kept_passes). The
            # ledger hears of each (pass, graph task) once in a row: a backward brings the gradients
            # of one pass's outputs one after another
            task, last = _graph_task(), self._last
            if last[0] is pass_id and last[1] == task:
                grad_pass = last[2]
            else:
                grad_pass = self.ledger.gradient_reached(pass_id, task)
                self._last = (pass_id, task, grad_pass)
            if "activation_grad" in self.roles and state.recording:
                fast = self.fast  # (the kernel's observe_now: None for a tensor it leaves to this path)
                if fast is not None and fast[0].observe_now(state, fast[1], mname, "activation_grad", name, grad, True,
                                                            grad_pass) is not None:
                    return
                self._gradient_row(mname, name, grad, grad_pass)
        except Exception as e:  # (``guard`` written out: this runs once per tensor)
            self.fail("gradient hook", e)

    def _gradient_row(self, mname: str, name: str, grad: torch.Tensor, grad_pass) -> None:
        observer = self.observer
        if grad.__class__ is not torch.Tensor:
            grad = shard(grad)
        try:
            f = observer.facts(grad, _tensor_facts)
            if f is None:
                grad, f = zeros_facts(grad)
            if f is not None:
                observer.observe_now(mname, "activation_grad", name, grad, f, True, grad_pass)
            elif grad.is_floating_point():
                observer.note_unmeasured(mname, "activation_grad", name, grad)
        except RuntimeError:
            if not (legacy_batched(grad) or functorch_wrapped(grad)):
                raise
            # a batched backward (torch.autograd.grad(..., is_grads_batched=True), or under
            # torch.func.vmap: rows of a Jacobian, not the training gradient) hands the hooks
            # vmap's batched tensors, which have no storage (data_ptr raises; checked here, off the
            # hot path)
            observer.note_unmeasured(mname, "activation_grad", name, grad, _BATCHED_BACKWARD)

    # ------------------------------------------------------------------ compiled regions
    def traced(self, module: str, name: str, tensor: torch.Tensor, role: str, tapped: bool,
               grad_enabled: bool) -> None:
        """``mpscope::observe``'s call (see :func:`mpscope.compiled.traced_hook`)."""
        self.guard("compiled-graph observer", self.observe_traced, module, name, tensor, role, tapped, grad_enabled)

    def observe_traced(self, module: str, name: str, tensor: torch.Tensor, role: str, tapped: bool,
                       grad_enabled: bool) -> None:
        """A tensor handed over by ``mpscope::observe`` from inside a compiled graph: a module's
        output (``role`` ``activation``; ``tapped``: its gradient is observed too; ``grad_enabled``:
        the region runs with grad) or the gradient arriving at it (``activation_grad``)."""
        if not self.state.recording:
            return
        if role == "activation_grad":
            self.gradient(module, name, None, tensor)
            return
        if not tapped:
            self._note_unobserved([module])
        # the pass the root's pre-hook numbered (a torch.compile wrapper's runs outside the region);
        # a model compiled in place has none: a region traced under no_grad is an evaluation
        pass_id = self.state.pass_id
        if pass_id is None and not grad_enabled:
            pass_id = UNNUMBERED_EVAL
        if _stats.is_recordable(tensor):
            self.note_autocast()
            self.observer.observe(module, "activation", name, tensor, pass_id=pass_id)

    def _note_unobserved(self, names: list[str]) -> None:
        """Modules inside compiled regions whose outputs come in a container the compiled-graph hook
        cannot rebuild (named tuples, model-output classes): their activations are recorded, their
        activation gradients cannot be; listed in meta ``unobserved`` (role -> module names) and
        warned about once instead of silently missing."""
        if "activation_grad" not in self.roles:
            return
        have = self.meta.setdefault("unobserved", {}).setdefault("activation_grad", [])
        new = [n for n in names if n not in have]
        if new:
            have.extend(new)
            warnings.warn(
                f"mpscope: {len(new)} module(s) run inside a torch.compile'd region return their outputs in a "
                f"container mpscope cannot rebuild there (a named tuple or a model-output class); their "
                f"activations are recorded, their activation gradients are not: "
                f"{', '.join(repr(n) for n in new[:6])}{' ...' if len(new) > 6 else ''}. Parameters, "
                "gradients and optimizer state are recorded as usual.",
                stacklevel=2,
            )
