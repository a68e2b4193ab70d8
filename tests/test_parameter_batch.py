"""The step end's parameter batch kept as a plan between recorded steps: every change that alters
which rows the batch has or what they hold (a gradient appearing or gone, the optimizer's state
appearing, a parameter and its state cast in place, a parameter replaced) takes the general path
again, and each step's rows equal a fresh recorder's and the cast oracle's."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import mpscope
from mpscope import kernel
from mpscope.recording.observer import module_tree as _module_tree
from mpscope.recording.parameter_batch import _LOOKS, NO_GRAD, WITH_GRAD, ParameterPlan, gather
from test_stats import oracle

PARAM_ROLES = ("param_grad", "weight", "optimizer_state")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        # (no biases: aux's and frozen's tensors look alike, only their names tell them apart)
        self.aux = torch.nn.Linear(32, 32, bias=False)
        self.frozen = torch.nn.Linear(32, 32, bias=False)
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x, use_aux=True):
        h = self.norm(torch.relu(self.inp(x)))
        if use_aux:
            h = h + self.aux(h)
        return self.head(torch.tanh(self.frozen(h)))


def _change(k: int, model: Net, opt) -> None:
    """What happens to the model before step ``k`` (the same in every run)."""
    if k == 0:
        model.frozen.requires_grad_(False)  # no gradient, so no optimizer state, until step 2
    if k == 2:
        model.frozen.requires_grad_(True)
    if k == 7:  # the head and its optimizer state cast in place: the same objects, another dtype
        model.head.to(torch.bfloat16)
        for p in model.head.parameters():
            for v in opt.state[p].values():
                if v.dim():
                    v.data = v.data.to(torch.bfloat16)
    if k == 9:  # a parameter replaced by a new one (which the optimizer does not hold)
        model.norm.weight = torch.nn.Parameter(model.norm.weight.detach() * 1.5)
    if k == 10:
        model.frozen.requires_grad_(False)  # its optimizer state stays
    if k == 11:  # with aux left out: frozen's gradient in place of aux's, the same tensors' looks
        model.frozen.requires_grad_(True)
    if k == 12:  # the head wrapped (renamed "head.0"): the same parameters, the same form
        model.head = torch.nn.Sequential(model.head)


STEPS = 15
NO_AUX = (4, 11, 12, 13, 14)  # steps without a gradient for aux (not used in the forward)


def _head(model: Net) -> torch.nn.Linear:
    return model.head[0] if isinstance(model.head, torch.nn.Sequential) else model.head


def _step(k: int, model: Net, opt, scaler, data) -> None:
    x, y = data[k]
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x, use_aux=k not in NO_AUX).float(), y)
    scaler.scale(loss).backward()
    if k == STEPS - 1:  # optimizer.step() on the scaled gradients (no scaler.step): recorded scaled
        opt.step()
        return
    scaler.step(opt)
    scaler.update()


def _train(fused, fresh_each_step: bool, roles=None):
    """The rows of each step (parameter roles), one recorder for all steps or a new one per step,
    and the head's weight and optimizer state after each step."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]
    rows, after = [], []
    real, real_core = kernel.current, kernel.core
    kernel.current = lambda start=True: fused
    kernel.core = lambda: None  # (None: no fused kernel at all, the torch-op path)
    try:
        rec = None
        for k in range(STEPS):
            _change(k, model, opt)
            if fresh_each_step or rec is None:
                rec = mpscope.record(model, optimizer=opt, scaler=scaler, roles=roles)
                rec.__enter__()
            first = rec.step_index
            _step(k, model, opt, scaler, data)
            if fresh_each_step or k == STEPS - 1:
                rec.__exit__(None, None, None)
            if fresh_each_step:
                rows.append(_rows(rec.run.tensors, first))
            after.append({"weight": _head(model).weight.detach().clone(),
                          "exp_avg": opt.state[_head(model).weight]["exp_avg"].detach().clone(),
                          "norm.weight": model.norm.weight.detach().clone()})
        if not fresh_each_step:
            rows = [_rows(rec.run.tensors, k) for k in range(STEPS)]
    finally:
        kernel.current, kernel.core = real, real_core
    return rows, after


def _rows(tensors, step):
    t = tensors[(tensors.step == step) & tensors.role.isin(PARAM_ROLES)].drop(columns="step")
    # (a run's categorical columns have the categories it has seen: compared as values)
    return t.astype({c: str for c in t.columns if t[c].dtype == "category"}).reset_index(drop=True)


def _check_oracle(row, t):
    want = oracle(t)
    assert row["dtype"] == str(t.dtype).removeprefix("torch.") and row["numel"] == t.numel()
    for k, v in want.items():
        got = row[k]
        assert (math.isnan(v) and math.isnan(got)) or got == v, (k, got, v)


# without weights, frozen's gradient in place of aux's (step 11) changes no tensor's looks: only the
# batch's form tells the plan no longer holds. Both ways of taking the statistics: the fused kernel
# into the step's host rows, and device_stats passes (the path of CUDA tensors; here the torch-op
# path, as without the kernel)
@pytest.mark.parametrize("path", ["host rows", "device_stats"])
@pytest.mark.parametrize("roles", [None, ("param_grad", "optimizer_state")])
def test_the_plan_is_remade_when_the_batch_changes_and_rows_equal_a_fresh_recorder(fused, monkeypatch, roles, path):
    fused = fused if path == "host rows" else None
    held, ways = [], []
    holds = ParameterPlan.holds

    def spy(self, params, form, tensors, rows, kernel=None):
        assert (kernel is not None) == (path == "host rows")  # (the kernel's check on that path)
        held.append(holds(self, params, form, tensors, rows, kernel))
        ways.append({b[-1] for b in self.batches})  # (fused: the last field)
        return held[-1]

    monkeypatch.setattr(ParameterPlan, "holds", spy)
    rows, after = _train(fused, fresh_each_step=False, roles=roles)
    assert ways and all(w == {path == "host rows"} for w in ways)
    # steps 1..14: kept, except after each change (2: frozen's gradient and state appear; 4: aux has
    # no gradient; 5: it has again; 7: the head cast; 9: norm.weight replaced; 10: frozen has no
    # gradient; 11: frozen's instead of aux's; 12: the head renamed)
    assert held == [True, False, True, False, False, True, False, True, False, False, False, False, True, True]
    monkeypatch.setattr(ParameterPlan, "holds", holds)
    fresh, _ = _train(fused, fresh_each_step=True, roles=roles)
    for k in range(STEPS):
        assert len(rows[k]) and rows[k].equals(fresh[k]), f"step {k}"
    # the changes show in the rows as the cast oracle has them
    for k in (6, 7, 9, 11, 12):
        t = rows[k].set_index(["module", "role", "name"])
        head = "head.0" if k >= 12 else "head"
        _check_oracle(t.loc[(head, "optimizer_state", "weight.exp_avg")], after[k]["exp_avg"])
        if roles is None:
            _check_oracle(t.loc[(head, "weight", "weight")], after[k]["weight"])
            _check_oracle(t.loc[("norm", "weight", "weight")], after[k]["norm.weight"])
    assert rows[7].set_index(["module", "role", "name"]).loc[("head", "optimizer_state", "weight.exp_avg"), "dtype"] == "bfloat16"
    frozen = [("frozen", "param_grad", "weight") in set(zip(r.module, r.role, r.name)) for r in rows]
    assert frozen == [k not in (0, 1, 10) for k in range(STEPS)]
    aux = [("aux", "param_grad", "weight") in set(zip(r.module, r.role, r.name)) for r in rows]
    assert aux == [k not in NO_AUX for k in range(STEPS)]
    assert [("head" in set(r.module), "head.0" in set(r.module)) for r in rows[11:13]] == [(True, False), (False, True)]
    grads = rows[STEPS - 1][rows[STEPS - 1].role == "param_grad"]
    assert (grads.loss_scale == 2.0**8).all() and (rows[STEPS - 2][rows[STEPS - 2].role == "param_grad"].loss_scale == 1).all()


def _looks_changes():
    """(what changed, tensors, the looks taken before the change) for :func:`_LOOKS`: each change a
    parameter can go through while staying the same object, and a few that replace it."""
    def fresh():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(4, 3)), torch.randn(5), torch.zeros(2, 1, 3, dtype=torch.bfloat16)]

    def case(name, change):
        ts = fresh()
        looks = [_LOOKS(t) for t in ts]
        change(ts)
        return name, ts, looks

    def set_data(i, value):
        def change(ts):
            ts[i].data = value(ts[i].data)
        return change

    yield case("unchanged", lambda ts: None)
    yield case("values changed in place", lambda ts: ts[0].data.mul_(2))
    yield case("cast in place (module.to)", set_data(0, lambda d: d.to(torch.float16)))
    yield case("reshaped in place", set_data(1, lambda d: d.reshape(1, 5)))
    yield case("resized", set_data(1, lambda d: torch.zeros(6)))
    yield case("size-1 dimension dropped", set_data(2, lambda d: d.reshape(2, 3)))
    yield case("replaced by its sparse form", lambda ts: ts.__setitem__(1, ts[1].to_sparse()))
    yield case("replaced by its copy on another device", lambda ts: ts.__setitem__(1, ts[1].to("meta")))
    yield case("replaced by a subclass", lambda ts: ts.__setitem__(1, torch.nn.Parameter(ts[1])))
    yield case("replaced by a Buffer-like plain tensor", lambda ts: ts.__setitem__(0, ts[0].detach()))
    yield case("one more tensor", lambda ts: ts.append(torch.zeros(1)))
    yield case("one fewer tensor", lambda ts: ts.pop())
    yield case("not a tensor", lambda ts: ts.__setitem__(1, 3.0))
    yield case("nested", lambda ts: ts.__setitem__(1, torch.nested.nested_tensor([torch.zeros(5)])))


@pytest.mark.parametrize("name, tensors, looks", list(_looks_changes()), ids=lambda x: x if isinstance(x, str) else "")
def test_the_kernels_looks_check_answers_as_the_python_one(fused, name, tensors, looks):
    """``same_looks`` (the fused kernel's form of the plan's check) against the Python form it
    stands in for (``_LOOKS`` of each tensor compared with the looks taken before): the same answer
    for every change, and True only where nothing that decides a row changed."""
    try:
        want = list(map(_LOOKS, tensors)) == looks
    except (RuntimeError, AttributeError):  # (a nested tensor has no shape; a float no dtype)
        want = False
    assert fused.same_looks(tensors, looks) is want
    assert want == (name in ("unchanged", "values changed in place"))


def _tree_changes():
    """(what changed, modules walked before, their tree before): each change a model's module tree
    can go through (kept objects, new ones, renames, dicts replaced)."""
    def case(name, change):
        torch.manual_seed(0)
        model = Net()
        mods = list(model.modules())
        tree = _module_tree(mods)
        change(model)
        return name, mods, tree

    yield case("unchanged", lambda m: None)
    yield case("trained in place", lambda m: m.inp.weight.data.add_(1))
    yield case("parameter replaced", lambda m: setattr(m.norm, "weight", torch.nn.Parameter(m.norm.weight.detach())))
    yield case("parameter replaced in the dict (FSDP2's swap)",
               lambda m: m.aux._parameters.__setitem__("weight", torch.nn.Parameter(m.aux.weight.detach())))
    yield case("parameter removed", lambda m: m.inp._parameters.pop("bias"))
    yield case("parameter set to None", lambda m: m.inp.register_parameter("bias", None))
    yield case("child replaced", lambda m: setattr(m, "head", torch.nn.Linear(32, 1)))
    yield case("child wrapped (renamed inside)", lambda m: setattr(m, "head", torch.nn.Sequential(m.head)))
    yield case("child added", lambda m: m.add_module("extra", torch.nn.Linear(2, 2)))
    yield case("children reordered", lambda m: m._modules.move_to_end("inp") if hasattr(m._modules, "move_to_end")
               else m._modules.update({"inp": m._modules.pop("inp")}))
    yield case("child renamed, same order", lambda m: setattr(m, "_modules", {("input" if k == "inp" else k): v
                                                                              for k, v in m._modules.items()}))
    yield case("a module dict replaced by a list", lambda m: setattr(m.aux, "_parameters", [m.aux.weight]))


@pytest.mark.parametrize("name, mods, tree", list(_tree_changes()), ids=lambda x: x if isinstance(x, str) else "")
def test_the_kernels_module_tree_check_answers_as_the_python_one(fused, name, mods, tree):
    """``same_module_tree`` (the kernel's form of the recorder's check that its parameter plan still
    holds) against ``_module_tree(mods) == tree``: the same answer for every change (a dict that is
    no longer a dict: the Python form raises, which the recorder takes as changed), True only for
    the unchanged tree and values changed in place."""
    try:
        want = _module_tree(mods) == tree
    except Exception:
        want = False
    got = fused.same_module_tree(mods, tree)
    assert got is want or (got is None and name == "a module dict replaced by a list")  # (None: ask Python)
    assert want == (name in ("unchanged", "trained in place"))


def test_the_kernels_module_tree_check_leaves_an_ordered_dict_to_python(fused):
    """A module whose ``_modules`` is an OrderedDict (set by hand, as older code does) with a child
    moved to the end: ``modules()`` and ``named_parameters()`` follow the OrderedDict's own order,
    not its dict's, so the tree changed; the kernel does not answer True (None: the Python form,
    which sees the move, answers)."""
    from collections import OrderedDict

    model = Net()
    model._modules = OrderedDict(model._modules)
    mods = list(model.modules())
    tree = _module_tree(mods)
    assert fused.same_module_tree(mods, tree) in (True, None)  # (None: the Python form answers, True)
    model._modules.move_to_end("inp")
    assert _module_tree(mods) != tree
    assert fused.same_module_tree(mods, tree) in (None, False)


OPTIMIZERS = {
    "AdamW (step a 0-dim tensor)": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "RMSprop centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True, momentum=0.9),
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "Adafactor (a 1-dim step and factored rows)": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "no optimizer": None,
}


@pytest.mark.parametrize("want_grad, want_weight", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_the_kernels_gather_makes_the_lists_of_the_python_one(fused, opt_name, want_grad, want_weight):
    """The step end's batch gathered by the kernel's ``gather`` and by the Python form: the same
    tensors (the same objects) in the same order and the same form, for real optimizers' state after
    a step (``step`` entries left out, also one with a dimension),
    gradients set and not set, odd state entries added by hand (a non-string key, a non-tensor
    value, a 0-dim tensor); a state that is not a dict is left to the Python form (None)."""
    torch.manual_seed(0)
    model = Net()
    make = OPTIMIZERS[opt_name]
    opt = make(model.parameters()) if make else None
    F.mse_loss(model(torch.randn(4, 16)), torch.randn(4, 1)).backward()
    if opt is not None:
        opt.step()
        extra = opt.state[model.inp.weight]
        extra[7] = torch.ones(2)  # (a key that is no string)
        extra["note"] = "text"
        extra["scalar"] = torch.tensor(1.0)
        opt.state[model.head.weight]["step"] = torch.ones(3)  # (a step with a dimension: left out too)
    model.aux.weight.grad = None  # (one parameter without a gradient)
    params = [(n.rpartition(".")[0], n.rpartition(".")[2], p) for n, p in model.named_parameters()]
    state = opt.state if opt is not None else {}
    got = fused.gather(params, want_grad, want_weight, state, WITH_GRAD, NO_GRAD)
    want = gather(params, want_grad, want_weight, state)
    assert got is not None and got[1] == want[1] and len(got[0]) == len(want[0])
    assert all(a is b for a, b in zip(got[0], want[0]))
    assert gather(params, want_grad, want_weight, state, fused)[1] == want[1]
    n_state = sum(k not in (WITH_GRAD, NO_GRAD) for k in want[1])
    assert n_state == (0 if opt is None else sum(
        1 for st in opt.state.values() for k, v in st.items() if k != "step" and torch.is_tensor(v) and v.dim()))
    if opt is not None:
        assert 7 in want[1] and not {"scalar", "note", "step"} & {k for k in want[1] if isinstance(k, str)}
        odd = {model.inp.weight: [torch.ones(2)]}  # (a parameter's state that is no dict)
        assert fused.gather(params, want_grad, want_weight, odd, WITH_GRAD, NO_GRAD) is None
    assert fused.gather(params, want_grad, want_weight, list(state.items()), WITH_GRAD, NO_GRAD) is None


def test_the_kernels_gather_keeps_an_ordered_dict_state_in_its_order(fused):
    """A parameter's optimizer state that is an OrderedDict whose entries were moved
    (``move_to_end``): ``items()`` follows the OrderedDict's order, not its dict's; the kernel's
    ``gather`` gives the Python form's lists (it leaves such a state to the Python form)."""
    from collections import OrderedDict

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    F.mse_loss(model(torch.randn(4, 16)), torch.randn(4, 1)).backward()
    opt.step()
    w = model.inp.weight
    opt.state[w] = OrderedDict(opt.state[w])
    opt.state[w].move_to_end("exp_avg")  # (exp_avg_sq now comes first)
    params = [(n.rpartition(".")[0], n.rpartition(".")[2], p) for n, p in model.named_parameters()]
    want = gather(params, True, True, opt.state)
    assert want[1][:3] == [WITH_GRAD, "exp_avg_sq", "exp_avg"]
    got = gather(params, True, True, opt.state, fused)
    assert got[1] == want[1] and all(a is b for a, b in zip(got[0], want[0], strict=True))


def test_the_kernels_gather_with_a_grad_property_that_changes_the_lists(fused):
    """A parameter subclass whose ``.grad`` (a property) empties the parameter list and the optimizer
    state while the kernel's ``gather`` reads them: the same lists as the Python form (which stops
    where the list ends), and no crash (run in a child process under ``-X dev``)."""
    code = """if True:
        import gc, torch
        from mpscope import kernel
        from mpscope.recording.parameter_batch import NO_GRAD, WITH_GRAD, gather
        k = kernel.load()
        def run(use_kernel):
            params, state = [], {}
            class P(torch.nn.Parameter):
                @property
                def grad(self):
                    params.clear(); state.clear(); gc.collect()
                    return None
            for _ in range(40):
                p = P(torch.randn(100))
                params.append(("m", "w", p))
                state[p] = {"exp_avg": torch.zeros(100)}
            ts, form = gather(params, True, True, state, k if use_kernel else None)
            return [t.shape for t in ts], [f if isinstance(f, str) else f is WITH_GRAD for f in form]
        assert run(True) == run(False) == ([torch.Size([100])], [False]), (run(True), run(False))
        print("same")
    """
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-X", "dev", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "same", out.stderr[-2000:]


def test_the_kernels_gather_asks_a_tensor_subclass_its_dim_as_python_does(fused):
    """Optimizer state values of tensor subclasses whose ``dim()`` is their own (a method
    overridden; a ``__torch_function__`` that answers or raises): the kernel's ``gather`` takes
    or leaves them, or raises, as the Python form (``v.dim()`` called from Python) does."""

    class OneNumber(torch.Tensor):  # (a tensor that reports itself a scalar)
        def dim(self):
            return 0

    class Refusing(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.dim:
                raise ValueError("no dim here")
            return super().__torch_function__(func, types, args, kwargs or {})

    p = torch.nn.Parameter(torch.zeros(3))
    params = [("m", "w", p)]
    state = {p: {"exp_avg": torch.ones(3), "scale": torch.ones(4).as_subclass(OneNumber)}}
    want = gather(params, False, True, state)
    assert want[1] == [NO_GRAD, "exp_avg"]
    got = gather(params, False, True, state, fused)
    assert got[1] == want[1] and all(a is b for a, b in zip(got[0], want[0], strict=True))
    state[p]["odd"] = torch.ones(2).as_subclass(Refusing)
    for kern in (None, fused):
        with pytest.raises(ValueError, match="no dim here"):
            gather(params, False, True, state, kern)


def test_a_recording_with_a_reordered_ordered_module_dict_equals_the_python_forms(fused):
    """A model whose ``_modules`` is an OrderedDict with children moved between steps
    (``move_to_end``): ``named_modules()`` follows the move, so the recorded rows (module order)
    change; a recording with the kernel's step-end checks equals one with their Python forms."""
    from collections import OrderedDict

    def run(kern):
        torch.manual_seed(0)
        model = Net()
        model._modules = OrderedDict(model._modules)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        real, real_core = kernel.current, kernel.core
        kernel.current = lambda start=True: kern
        kernel.core = lambda: None  # (None: no fused kernel at all, the torch-op path)
        try:
            with mpscope.record(model, optimizer=opt, roles=PARAM_ROLES) as rec:
                for k in range(4):
                    if k in (1, 3):
                        model._modules.move_to_end("inp" if k == 1 else "aux")
                    opt.zero_grad()
                    F.mse_loss(model(torch.randn(4, 16)), torch.randn(4, 1)).backward()
                    opt.step()
        finally:
            kernel.current, kernel.core = real, real_core
        return rec.run.tensors

    got, want = run(fused), run(None)
    assert list(got.module[got.step == 3]) == list(want.module[want.step == 3])
    assert list(want.module[want.step == 0].unique())[:2] == ["inp", "norm"]
    assert list(want.module[want.step == 3].unique())[:2] == ["norm", "frozen"]
    pd.testing.assert_frame_equal(got, want)
