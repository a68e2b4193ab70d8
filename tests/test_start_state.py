"""StartState: a training cell's start copied to host memory and put back (mpscope.start_state)."""

from __future__ import annotations

import gc
import random

import numpy as np
import torch

from mpscope.start_state import StartState


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    return model, opt, sched, scaler


def _train(model, opt, sched, scaler, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        scaler.scale(model(torch.randn(16, 4)).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()


def test_restore_puts_every_part_back_in_place():
    model, opt, sched, scaler = _setup()
    _train(model, opt, sched, scaler, steps=1)  # Adam state, running stats, a gradient and a grown scale exist
    model.eval()
    gen = torch.Generator().manual_seed(7)
    expect = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    adam = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    lr, sched_state, scaler_state = opt.param_groups[0]["lr"], sched.state_dict(), scaler.state_dict()
    start = StartState.take(model, {"opt": opt}, {"scaler": scaler}, {"sched": sched}, {"gen": gen})
    draws = (torch.rand(3), random.random(), np.random.rand(), torch.rand(2, generator=gen))
    state_tensors = [id(t) for s in opt.state.values() for t in s.values()]

    model.train()
    _train(model, opt, sched, scaler)
    for p in model.parameters():
        p.grad = None
    assert not torch.equal(model.state_dict()["0.weight"], expect["0.weight"])
    assert start.restore(model) == []
    start.restore_random()

    assert all(torch.equal(v, expect[k]) for k, v in model.state_dict().items())  # BatchNorm stats too
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert not model.training and not model[1].training
    now = opt.state_dict()
    assert now["state"].keys() == adam.keys()
    assert all(torch.equal(now["state"][i][k], v) for i, s in adam.items() for k, v in s.items())
    assert [id(t) for s in opt.state.values() for t in s.values()] == state_tensors  # copied in place
    assert opt.param_groups[0]["lr"] == lr and sched.state_dict() == sched_state
    assert scaler.state_dict() == scaler_state
    again = (torch.rand(3), random.random(), np.random.rand(), torch.rand(2, generator=gen))
    assert torch.equal(again[0], draws[0]) and again[1:3] == draws[1:3] and torch.equal(again[3], draws[3])
    assert "optimizer `opt`" in start.describe() and "GradScaler `scaler`" in start.describe()


def test_optimizer_state_made_after_the_start_is_dropped_and_gradients_none_stay_none():
    model, opt, sched, scaler = _setup()
    start = StartState.take(model, {"opt": opt})
    _train(model, opt, sched, scaler)
    assert len(opt.state) == 6
    start.restore(model)
    assert len(opt.state) == 0 and all(p.grad is None for p in model.parameters())


def test_over_the_limit_nothing_is_kept_or_put_back():
    model, opt, sched, scaler = _setup()
    _train(model, opt, sched, scaler, steps=1)
    params = sum(p.numel() * 4 for p in model.parameters())
    start = StartState.take(model, {"opt": opt}, limit=params)  # weights fit, with gradients and Adam state not
    assert not start.kept and start.nbytes > params and start.limit == params
    trained = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, sched, scaler)
    moved = [p.detach().clone() for p in model.parameters()]
    assert start.restore(model) == []
    assert all(torch.equal(p, m) for p, m in zip(model.parameters(), moved))
    assert not all(torch.equal(t, m) for t, m in zip(trained, moved))


def test_objects_are_held_weakly_and_a_gone_one_is_named():
    model, opt, sched, scaler = _setup()
    start = StartState.take(model, {"opt": opt}, {"scaler": scaler})
    del opt, sched
    gc.collect()
    assert start.objects("optimizers") == {} and list(start.objects("scalers")) == ["scaler"]
    assert start.restore(model) == ["optimizer `opt` is gone, so its state was not restored"]
