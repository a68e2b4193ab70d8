"""Which passes of a step train the recorded model: the typed :class:`Pass`, the :class:`PassLedger`
that the hooks tell what they see, and :func:`kept_passes`, the one decision at a step's end.

Every row a step records belongs to a :class:`Pass` or to none (``None``: rows outside every pass of
the model, such as the loss or a module the loop calls inside an autograd Function's forward, are
always kept). In a step that trained the model, the rows of passes that did not train it
(evaluation, a probe, another model's forward and backward) are dropped before the host copy, so a
step's rows hold exactly its training batches. What trains the model is seen by effect:

* a *backward trains* the model when some parameter of the model accumulates a gradient during it
  (its autograd graph task is a *training task*; the parameters' post-accumulate-grad hooks say so);
* a *forward pass trains* the model when a gradient reaches one of its outputs in a training task.

The decision, :func:`kept_passes`, is this table (``t`` a graph task, ``p`` a pass; each row has a
test driven by hand-built events in ``tests/test_passes.py``):

===  ================================================================  =====================================
row  the step                                                          kept
===  ================================================================  =====================================
1    was cut short by an exception                                     every pass (no filtering)
2    saw no training backward, and no optimizer step after a           every pass (inference, custom loops)
     gradient reached a pass
3    is the recording's end after its last step, in a recording of     no pass (evaluation after the last
     training steps (an optimizer or GradScaler is known), with no     step is no step)
     training backward since
4    has training tasks                                                ``BACKWARD(t)`` for each training task
                                                                       ``t``; each ``FORWARD`` pass a gradient
                                                                       reached in one of them
5    has none, but the optimizer stepped (``torch.autograd.grad``      every ``FORWARD`` pass a gradient
     and ``p.grad = g``: nothing accumulates) or no parameter hook     reached; ``BACKWARD(t)`` for each task
     can fire (no parameter requires grad)                             a gradient reached a module output in
6    counted a training backward, and a grad-enabled pass got no       that pass (none of its outputs could
     gradient hook (its modules are not recorded)                      tell whether a gradient reached it)
7    ran op recording where no parameter hook can fire                 every ``BACKWARD`` op pass
8    ran a backward op on an autograd node made by pass ``p``          ``BACKWARD(t, of=p)`` when
                                                                       ``BACKWARD(t)`` or ``p`` is kept
9    used a weight cast autocast keeps for its region                  ``CAST(of=p)`` when ``p``, a pass that
     (``CAST(of=p)``, made in pass ``p``)                              used it, or an op of no pass used it
10   ran ``EVAL`` passes (no_grad, inference_mode) or ops              never kept (in a filtered step)
     ``OUTSIDE`` the model
11   has rows of no pass (``None``)                                    always kept
===  ================================================================  =====================================

A forward that raised, or whose outputs need no gradient, is no pass of row 6. A forward of the
whole model re-run inside a backward (reentrant checkpointing) is a ``FORWARD`` pass of its own,
kept by row 4 when a gradient reaches it; a part of the model re-run there adds no rows. A module
run outside the model's forward is a ``FORWARD`` pass of its own with grad enabled (the loop
training through ``model.encoder``), an ``EVAL`` pass under ``no_grad``, and of no pass inside an
autograd Function's forward (``checkpoint_sequential``).

Not covered, by this rule: a probe whose ``backward()`` accumulates into the parameters before
``zero_grad()``, or a GAN's generator step through an unfrozen discriminator, trains the model; in a
step trained by ``torch.autograd.grad`` (no parameter hook fires) a second ``autograd.grad`` probe
is a training pass too; a grad-enabled forward of a model compiled in place whose output is never
backpropagated is kept; op recording gives the ops of a module called outside the model's forward
with grad no pass (their rows are kept).
"""

from __future__ import annotations

import enum
import sys
from typing import Iterable, NamedTuple

import torch


class PassKind(enum.IntEnum):
    """What a :class:`Pass` is (an ``IntEnum``: hashed and compared in C)."""

    FORWARD = 1  #: a forward of the model with grad enabled: trains it when a training backward reaches it
    EVAL = 2  #: a forward under ``no_grad`` / ``inference_mode`` (or a module run so outside it): never trains
    BACKWARD = 3  #: a backward (autograd graph task ``task``); ``of``: the pass that made the node an op runs
    CAST = 4  #: a weight cast autocast keeps for its region, made in pass ``of``
    OUTSIDE = 5  #: ops outside the model on none of its values (another model, bookkeeping)


class Pass(NamedTuple):
    """One pass of a step. ``number``: the model's forward calls counted over the recording
    (``FORWARD`` / ``EVAL``; 0 for an evaluation that no call of the model numbered); ``task``: the
    autograd graph task (``BACKWARD``); ``of``: the pass a ``BACKWARD`` op's node or a ``CAST`` came
    from."""

    kind: PassKind
    number: int = 0
    task: int = -1
    of: "Pass | None" = None

    @property
    def trains(self) -> bool:
        """A forward with grad enabled: the passes gradient hooks are put on."""
        return self.kind is PassKind.FORWARD


#: An evaluation that no call of the model numbered: a submodule run directly under ``no_grad``, or
#: a region of a model compiled in place traced under ``no_grad``.
UNNUMBERED_EVAL = Pass(PassKind.EVAL)
#: Ops outside the model on none of its values.
OUTSIDE = Pass(PassKind.OUTSIDE)


def forward(number: int, grad_enabled: bool) -> Pass:
    """The ``number``-th forward of the model: ``FORWARD`` with grad enabled, else ``EVAL``."""
    return Pass(PassKind.FORWARD if grad_enabled else PassKind.EVAL, number)


def cast_of(p: Pass) -> Pass:
    """The pass of a weight cast autocast keeps for its region, made in pass ``p``."""
    return Pass(PassKind.CAST, of=p)


def backward_of(task: int, p: "Pass | None") -> Pass:
    """A backward op of graph task ``task`` on a node made by ``p`` (None: by no pass)."""
    return Pass(PassKind.BACKWARD, task=task, of=p)


def outside_forward_pass(frame=None) -> "Pass | None":
    """The pass of a module run outside the model's forward and outside backward: None with grad
    enabled (the module hooks give such a call a pass of its own; op recording none) and in the
    forward of an autograd Function (reentrant checkpointing's first forward,
    ``checkpoint_sequential``: the Function runs it under ``no_grad``; no pass, its rows kept), else
    :data:`UNNUMBERED_EVAL`. ``frame``: where to start looking for the Function (default: the
    caller's)."""
    if torch.is_grad_enabled():
        return None
    f = frame if frame is not None else sys._getframe(1)
    while f is not None:
        if f.f_globals.get("__name__", "") in ("torch.autograd.function", "torch.utils.checkpoint"):
            return None
        f = f.f_back
    return UNNUMBERED_EVAL


class StepFacts(NamedTuple):
    """What the step's end knows besides the ledger (the inputs of :func:`kept_passes`)."""

    cut: bool  #: the step was cut short by an exception
    final: bool  #: the recording ends (the block's end), not a step boundary
    after_first_step: bool  #: a step ended before this one
    follows_training: bool  #: an optimizer or GradScaler is known or adopted, or ``auto``
    backward_count: int  #: training backwards counted this step
    optimizer_stepped: bool
    parameter_hooks_fire: bool  #: some parameter's gradient hook fired (False: none can)


class OpPasses(NamedTuple):
    """The passes of a step's op calls, from op recording (``record(ops=True)``)."""

    calls: frozenset  #: the passes of the step's op calls
    cast_users: dict  #: ``CAST`` pass -> the passes of the ops that used that cast


class PassLedger:
    """The passes of the current step, as the hooks report them.

    ``state``: the :class:`~mpscope.recording.hook_state.HookState` whose ``pass_id`` (the model's
    forward running now, None outside one) and ``hookless`` (grad-enabled passes none of whose
    outputs got a gradient hook) this ledger keeps, shared with the hooks' C++ path.
    """

    def __init__(self, state) -> None:
        self.state = state
        self._seq = 0  # forward passes numbered so far (over the recording)
        self._backward: dict[int, Pass] = {}  # graph task -> its BACKWARD pass (one object per task)
        self.reset()

    def reset(self) -> None:
        """A step begins."""
        self.state.pass_id = None
        self.state.hookless = set()
        self.reached: set[tuple[Pass, int]] = set()  # (pass, graph task) of gradients that reached a pass's outputs
        self.training_tasks: set[int] = set()  # graph tasks in which a parameter of the model got its gradient
        self.grad_tasks: set[int] = set()  # graph tasks in which a gradient reached a module's output
        self._rerun: tuple[int, Pass] | None = None  # (graph task, pass) of the latest re-run of the whole model
        self._backward.clear()

    # ------------------------------------------------------------------ events
    def forward_began(self, grad_enabled: bool, task: int) -> None:
        """The model's forward starts (its root pre-hook), in graph task ``task`` (-1: not in a backward).

        Outside backward it is a new pass: ``FORWARD`` with grad enabled (a *hookless* pass until one
        of its outputs gets a gradient hook), else ``EVAL``. Inside backward it is a re-run
        (activation checkpointing): with grad enabled, of the whole model by reentrant checkpointing,
        a ``FORWARD`` pass of its own (:meth:`rerun_pass`); no pass is current meanwhile."""
        state = self.state
        if task != -1:
            state.pass_id = None
            if grad_enabled:
                self._seq += 1
                self._rerun = (task, forward(self._seq, True))
            return
        self._seq += 1
        p = state.pass_id = forward(self._seq, grad_enabled)
        if grad_enabled:
            state.hookless.add(p)

    def forward_ended(self, trains_nothing: bool) -> None:
        """The model's forward returned or raised (its root's ``always_call`` post-hook);
        ``trains_nothing``: it raised, or none of its outputs requires grad: not a hookless pass."""
        state = self.state
        if trains_nothing and state.pass_id is not None:
            state.hookless.discard(state.pass_id)
        state.pass_id = None

    def module_pass(self, grad_enabled: bool, frame=None) -> "Pass | None":
        """The pass of a module's output outside the model's forward and outside backward: a
        ``FORWARD`` pass of its own with grad enabled (the loop training through ``model.encoder``),
        else :func:`outside_forward_pass`."""
        p = outside_forward_pass(frame)
        if p is None and grad_enabled:
            self._seq += 1
            p = forward(self._seq, True)
        return p

    def rerun_pass(self, task: int) -> "Pass | None":
        """The pass of a forward re-run inside graph task ``task``: the re-run of the whole model
        with grad (see :meth:`forward_began`), else None (a checkpointed part re-run for the first
        forward's graph adds no rows)."""
        rerun = self._rerun
        return rerun[1] if rerun is not None and rerun[0] == task else None

    def gradient_reached(self, p: "Pass | None", task: int) -> "Pass | None":
        """A gradient reached an output of pass ``p`` in graph task ``task``; returns the pass of its
        ``activation_grad`` row: the backward's (``BACKWARD(task)``), None outside any backward."""
        if p is not None and p.kind is PassKind.FORWARD:
            self.reached.add((p, task))
        self.grad_tasks.add(task)
        if task == -1:
            return None
        b = self._backward.get(task)  # (backward() inlined: this runs once per activation gradient)
        return b if b is not None else self.backward(task)

    def backward(self, task: int) -> Pass:
        """``BACKWARD(task)`` (one object per task and step)."""
        b = self._backward.get(task)
        if b is None:
            b = self._backward[task] = Pass(PassKind.BACKWARD, task=task)
        return b

    def parameter_gradient(self, task: int) -> None:
        """A parameter of the model accumulated its gradient in graph task ``task``: a training task."""
        self.training_tasks.add(task)

    def hooked(self, p: "Pass | None") -> None:
        """An output of pass ``p`` got a gradient hook: not a hookless pass."""
        hookless = self.state.hookless
        if hookless:
            hookless.discard(p)

    def kept(self, facts: StepFacts, ops: "OpPasses | None" = None) -> "frozenset | None":
        """The passes the step keeps (:func:`kept_passes` over this ledger)."""
        return kept_passes(facts, self.reached, self.training_tasks, self.grad_tasks, self.state.hookless, ops)


def kept_passes(facts: StepFacts, reached: Iterable[tuple[Pass, int]], training_tasks: set, grad_tasks: set,
                hookless: set, ops: "OpPasses | None" = None) -> "frozenset | None":
    """The passes whose rows a step keeps, by the table of this module's docstring; None: every row
    (rows 1 and 2). ``reached``: ``(pass, graph task)`` of the gradients that reached a pass's
    outputs; ``training_tasks``: graph tasks in which a parameter got its gradient; ``grad_tasks``:
    those in which a gradient reached a module output; ``hookless``: grad-enabled passes none of
    whose outputs got a gradient hook; ``ops``: the passes of the step's op calls."""
    reached = set(reached)
    trained = facts.backward_count or (facts.optimizer_stepped and reached)
    if facts.cut or not (trained or (facts.final and facts.after_first_step and facts.follows_training)):
        return None  # rows 1, 2
    if training_tasks:  # row 4
        passes, tasks = {p for p, t in reached if t in training_tasks}, training_tasks
    elif facts.optimizer_stepped or not facts.parameter_hooks_fire:  # row 5
        passes, tasks = {p for p, _ in reached}, grad_tasks
    else:  # row 3 (a probe backpropagated after the last step trained nothing)
        passes, tasks = set(), set()
    keep = passes | {Pass(PassKind.BACKWARD, task=t) for t in tasks}
    if facts.backward_count:  # row 6
        keep |= hookless
    if ops is not None:
        if not facts.parameter_hooks_fire:  # row 7
            keep |= {p for p in ops.calls if p is not None and p.kind is PassKind.BACKWARD}
        # row 9: a cast is kept when its pass, or a pass (or no pass) that used it, is kept
        keep |= {c for c, users in ops.cast_users.items() if c.of in keep or any(u is None or u in keep for u in users)}
        # row 8: a backward op on a node of pass p is kept when its backward or p is
        keep |= {p for p in ops.calls if p is not None and p.kind is PassKind.BACKWARD and p.of is not None
                 and (Pass(PassKind.BACKWARD, task=p.task) in keep or p.of in keep)}
    return frozenset(keep)
