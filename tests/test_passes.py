"""The pass rule (mpscope/recording/passes.py), one test per row of its decision table, driven by
hand-built event sequences: what the hooks would tell the ledger, with no model. The loops that
produce these sequences are tested end to end in test_recorder.py, test_ops.py and test_training_loops.py."""

from __future__ import annotations

import torch

from mpscope.recording.hook_state import HookState
from mpscope.recording.observer import Observer
from mpscope.recording.passes import (OUTSIDE, UNNUMBERED_EVAL, OpPasses, Pass, PassKind, PassLedger, StepFacts,
                                      backward_of, cast_of)
from mpscope.recording.step_buffer import LOG_PASS, LOG_ROW, StepBuffer
from mpscope.run import Run

OUT = -1  # graph task id outside any backward


def _ledger() -> PassLedger:
    return PassLedger(HookState({}, {}))


def _facts(**kw) -> StepFacts:
    base = dict(cut=False, final=False, after_first_step=False, follows_training=True, backward_count=0,
                optimizer_stepped=False, parameter_hooks_fire=True)
    return StepFacts(**(base | kw))


def _forward(ledger: PassLedger, grad: bool = True) -> Pass:
    ledger.forward_began(grad, OUT)
    p = ledger.state.pass_id
    ledger.forward_ended(False)
    return p


def _train(ledger: PassLedger, p: Pass, task: int) -> None:
    """A backward in graph task ``task`` reaches an output of ``p`` and gives a parameter its gradient."""
    ledger.hooked(p)
    ledger.gradient_reached(p, task)
    ledger.parameter_gradient(task)


def test_row1_a_step_cut_short_by_an_exception_keeps_every_pass():
    ledger = _ledger()
    _train(ledger, _forward(ledger), 7)
    _forward(ledger, grad=False)
    assert ledger.kept(_facts(cut=True, backward_count=1, optimizer_stepped=True)) is None


def test_row2_a_step_without_a_training_backward_keeps_every_pass():
    ledger = _ledger()
    p = _forward(ledger)
    ledger.gradient_reached(p, 3)  # (a saliency map's backward: no parameter got a gradient)
    _forward(ledger, grad=False)
    assert ledger.kept(_facts()) is None  # inference, or a custom loop that steps nothing
    assert ledger.kept(_facts(optimizer_stepped=True)) is not None  # (once the optimizer stepped, it trained)


def test_row3_evaluation_after_the_last_step_is_no_step():
    ledger = _ledger()
    p = _forward(ledger)
    ledger.gradient_reached(p, 4)  # a probe backpropagated after the last step
    e = _forward(ledger, grad=False)
    kept = ledger.kept(_facts(final=True, after_first_step=True))
    assert kept == frozenset() and p not in kept and e not in kept
    # (before any step ended, or in a recording of no training loop, it is a step of its own)
    assert ledger.kept(_facts(final=True, after_first_step=False)) is None
    assert ledger.kept(_facts(final=True, after_first_step=True, follows_training=False)) is None


def test_row4_a_training_task_keeps_its_backward_and_the_passes_it_reached():
    ledger = _ledger()
    train, probe = _forward(ledger), _forward(ledger)
    _train(ledger, train, 7)
    ledger.hooked(probe)
    ledger.gradient_reached(probe, 8)  # autograd.grad(val_loss, x): no parameter gradient
    kept = ledger.kept(_facts(backward_count=1, optimizer_stepped=True))
    assert kept == {train, Pass(PassKind.BACKWARD, task=7)}


def test_row4_a_whole_model_rerun_in_backward_is_a_pass_of_its_own():
    ledger = _ledger()
    first = _forward(ledger, grad=False)  # reentrant checkpointing: the first forward under no_grad
    ledger.forward_began(True, 9)  # the re-run, inside graph task 9
    rerun = ledger.rerun_pass(9)
    assert rerun is not None and rerun.kind is PassKind.FORWARD and ledger.state.pass_id is None
    assert ledger.rerun_pass(10) is None  # (another task's re-run of a part adds no rows)
    ledger.gradient_reached(rerun, 11)
    ledger.parameter_gradient(11)
    kept = ledger.kept(_facts(backward_count=1))
    assert rerun in kept and first not in kept


def test_row5_without_a_training_task_an_optimizer_step_keeps_what_gradients_reached():
    ledger = _ledger()
    p, q = _forward(ledger), _forward(ledger)
    ledger.hooked(p)
    ledger.gradient_reached(p, 3)  # torch.autograd.grad(loss, params); p.grad = g: nothing accumulates
    kept = ledger.kept(_facts(optimizer_stepped=True))
    assert kept == {p, Pass(PassKind.BACKWARD, task=3)} and q not in kept
    # no parameter requires grad: no hook can fire, every backward counted trains
    kept = ledger.kept(_facts(backward_count=1, parameter_hooks_fire=False))
    assert {p, Pass(PassKind.BACKWARD, task=3)} <= kept


def test_row6_a_grad_enabled_pass_without_gradient_hooks_is_kept_by_a_training_backward():
    ledger = _ledger()
    train, hookless = _forward(ledger), _forward(ledger)
    _train(ledger, train, 7)
    kept = ledger.kept(_facts(backward_count=1))
    assert hookless in kept
    # a forward that raised, or whose outputs need no gradient, is no such pass
    ledger.forward_began(True, OUT)
    raised = ledger.state.pass_id
    ledger.forward_ended(True)
    assert raised not in ledger.kept(_facts(backward_count=1))
    assert hookless not in ledger.kept(_facts(optimizer_stepped=True))  # (no backward counted)


def test_row7_without_parameter_hooks_every_backward_op_pass_is_kept():
    ledger = _ledger()
    p = _forward(ledger)
    ops = OpPasses(frozenset({Pass(PassKind.BACKWARD, task=5), backward_of(5, p), p}), {})
    kept = ledger.kept(_facts(backward_count=1, parameter_hooks_fire=False), ops)
    assert {Pass(PassKind.BACKWARD, task=5), backward_of(5, p)} <= kept


def test_row8_a_backward_op_is_kept_with_its_backward_or_its_node_s_pass():
    ledger = _ledger()
    train, evaluation = _forward(ledger), _forward(ledger, grad=False)
    _train(ledger, train, 7)
    of_train_elsewhere = backward_of(8, train)  # a node of the training pass run by another backward
    of_eval_here = backward_of(7, evaluation)  # a node of an evaluation pass (a cached cast) in the training one
    of_eval_elsewhere = backward_of(8, evaluation)
    ops = OpPasses(frozenset({of_train_elsewhere, of_eval_here, of_eval_elsewhere}), {})
    kept = ledger.kept(_facts(backward_count=1), ops)
    assert of_train_elsewhere in kept and of_eval_here in kept and of_eval_elsewhere not in kept


def test_row9_a_cached_weight_cast_is_kept_with_its_pass_or_a_pass_that_used_it():
    ledger = _ledger()
    evaluation, train, other = _forward(ledger, grad=False), _forward(ledger), _forward(ledger)
    _train(ledger, train, 7)
    used_by_training = cast_of(evaluation)  # made by the evaluation pass first, used by the training one
    made_by_training = cast_of(train)  # (used by a pass that did not train)
    unused = cast_of(Pass(PassKind.EVAL, 99))  # made and used by passes that did not train
    used_by_no_pass = cast_of(Pass(PassKind.EVAL, 98))
    users = {used_by_training: {train}, made_by_training: {other}, unused: {other}, used_by_no_pass: {None}}
    ops = OpPasses(frozenset({used_by_training, made_by_training, unused, used_by_no_pass}), users)
    ledger.hooked(other)
    kept = ledger.kept(_facts(backward_count=1), ops)
    assert {used_by_training, made_by_training, used_by_no_pass} <= kept and unused not in kept


def test_row10_evaluation_passes_and_ops_outside_the_model_are_never_kept():
    ledger = _ledger()
    train, evaluation = _forward(ledger), _forward(ledger, grad=False)
    _train(ledger, train, 7)
    ledger.gradient_reached(evaluation, 7)  # (an evaluation pass's output in a training backward)
    ops = OpPasses(frozenset({OUTSIDE, UNNUMBERED_EVAL, evaluation}), {})
    kept = ledger.kept(_facts(backward_count=1), ops)
    assert evaluation.kind is PassKind.EVAL and not kept & {evaluation, OUTSIDE, UNNUMBERED_EVAL}


def test_row11_rows_of_no_pass_are_always_kept_and_rows_of_dropped_passes_go():
    """The observer applies the decision to the step's rows: a row of no pass (None) stays, a row
    of a dropped pass goes, and a kept row's place among the step's observations is renumbered."""
    run = Run()
    builder = run.builder()
    state = HookState(run.meta, builder.key_index)
    steps = StepBuffer(builder)
    observer = Observer(state, builder, steps, torch.nn.Linear(1, 1), frozenset({"activation"}), lambda n, m: True)
    keep, drop = Pass(PassKind.FORWARD, 1), Pass(PassKind.FORWARD, 2)
    log = steps.tables.log
    log += [(0, 0, 4, False, None, 0), (1, 1, 4, False, drop, 0), (2, 2, 4, False, keep, 0)]  # (LOG_ENTRY)
    observer.keep(frozenset({keep}), {})
    assert [e[LOG_PASS] for e in log] == [None, keep]
    assert [e[LOG_ROW] for e in log] == [0, 2]
