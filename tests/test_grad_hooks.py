"""GradHooks registers gradient hooks the way Tensor.register_hook does: compared with PyTorch's own
register_hook on the same graphs (same gradients seen, same order among a user's hooks, user hooks
untouched by clear())."""

import torch

from mpscope.recording.grad_hooks import GradHooks


def _graph():
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    y = torch.tanh(x @ w)  # non-leaf
    a, b = y.split([2, 3], dim=1)  # outputs of a node with several outputs
    return x, w, y, a, b, (a.sum() * 2 + (b**2).sum())


def test_hooks_see_the_gradients_register_hook_sees_and_run_in_the_same_order_as_user_hooks():
    seen_ref, seen = [], []
    x, w, y, a, b, loss = _graph()
    for name, t in (("y", y), ("a", a), ("b", b), ("x", x)):
        t.register_hook(lambda g, name=name: seen_ref.append(("user1", name, g.clone())))
        t.register_hook(lambda g, name=name: seen_ref.append(("mine", name, g.clone())))
        t.register_hook(lambda g, name=name: seen_ref.append(("user2", name, g.clone())))
    loss.backward()

    x, w, y, a, b, loss = _graph()
    hooks = GradHooks()
    for name, t in (("y", y), ("a", a), ("b", b), ("x", x)):
        t.register_hook(lambda g, name=name: seen.append(("user1", name, g.clone())))
        assert hooks.add(t, lambda g, name=name: seen.append(("mine", name, g.clone())), name)
        t.register_hook(lambda g, name=name: seen.append(("user2", name, g.clone())))
    loss.backward()
    assert [s[:2] for s in seen] == [s[:2] for s in seen_ref]
    for (_, _, g), (_, _, r) in zip(seen, seen_ref):
        assert torch.equal(g, r)


def test_clear_removes_only_its_own_hooks_and_user_handles_keep_working():
    x, w, y, a, b, loss = _graph()
    hooks, calls = GradHooks(), []
    user = y.register_hook(lambda g: calls.append("user"))
    hooks.add(y, lambda g: calls.append("mine"), "y")
    hooks.add(x, lambda g: calls.append("mine-leaf"), "x")  # a leaf: its hooks live on the tensor
    later = y.register_hook(lambda g: calls.append("later"))
    assert len(hooks) == 2
    hooks.clear()
    assert len(hooks) == 0
    later.remove()
    loss.backward(retain_graph=True)
    assert calls == ["user"]
    user.remove()
    loss.backward()
    assert calls == ["user"]


def test_a_tag_hooks_a_tensor_once_until_cleared():
    x = torch.randn(3, requires_grad=True)  # a leaf keeps its hooks across backward passes
    hooks, calls = GradHooks(), []
    assert hooks.add(x, lambda g: calls.append(1), ("m", "output"))
    assert not hooks.add(x, lambda g: calls.append(2), ("m", "output"))
    assert hooks.add(x, lambda g: calls.append(3), ("parent", "output"))
    (x * 2).sum().backward()
    (x * 3).sum().backward()
    assert calls == [1, 3, 1, 3]
    hooks.clear()
    assert hooks.add(x, lambda g: calls.append(4), ("m", "output"))
    (x * 2).sum().backward()
    assert calls[-1] == 4 and len(calls) == 5


class _Sub(torch.Tensor):
    pass


def test_tensor_subclasses_go_through_register_hook():
    x = torch.randn(3, requires_grad=True)
    y = (x * 2).as_subclass(_Sub)
    hooks, got = GradHooks(), []
    hooks.add(y, lambda g: got.append(g.clone()), "y")
    y.sum().backward(retain_graph=True)
    assert len(got) == 1 and torch.equal(got[0], torch.ones(3))
    hooks.clear()
    y.sum().backward()
    assert len(got) == 1


def test_ids_taken_in_blocks_never_clash_with_register_hook_or_another_recording():
    """Two recordings' hooks and a user's, on the same tensors, past a block's end: every id is
    distinct, removing the user's handles leaves every recording hook, and clearing one recording
    leaves the other's."""
    from mpscope.recording.grad_hooks import ID_BLOCK

    x = torch.randn(3, requires_grad=True)
    ts = [x * (i + 1) for i in range(ID_BLOCK + 5)]  # more hooks than one block holds
    first, second = GradHooks(), GradHooks()
    user = []
    for i, t in enumerate(ts):
        assert first.add(t, lambda g: None, ("a", i))
        user.append(t.register_hook(lambda g: None))
        assert second.add(t, lambda g: None, ("b", i))
    ids = [hid for t in ts for hid in t._backward_hooks]
    assert len(ids) == len(set(ids)) == 3 * len(ts)
    for h in user:
        h.remove()
    assert all(len(t._backward_hooks) == 2 for t in ts)
    first.clear()
    assert all(len(t._backward_hooks) == 1 for t in ts) and len(second) == len(ts)
    assert torch.utils.hooks.RemovableHandle(ts[0]._backward_hooks).id not in ids  # a fresh id stays fresh
