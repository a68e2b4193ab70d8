"""Small real training loops shared by tests (CPU fp16 autocast + GradScaler)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mpscope


def record_fp16(model, opt, scaler, batches, **record_kw):
    """Train ``model`` on the (x, y) ``batches`` (MSE, CPU autocast float16, GradScaler) under
    ``mpscope.record`` and return the Run."""
    with mpscope.record(model, optimizer=opt, scaler=scaler, **record_kw) as rec:
        for x, y in batches:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return rec.run


def record_fp16_mlp(steps: int = 3, activation=torch.nn.ReLU, optimizer=torch.optim.Adam, lr: float = 1e-2, **record_kw):
    """Train Linear(8,16) -> activation -> Linear(16,1) for ``steps`` steps on one batch and
    return the Run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), activation(), torch.nn.Linear(16, 1))
    opt = optimizer(model.parameters(), lr=lr)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    return record_fp16(model, opt, torch.amp.GradScaler("cpu"), [(x, y)] * steps, **record_kw)


class ReturnsItsParameter(torch.nn.Module):
    """A module whose output is its own Parameter of ``shape`` (a learned query or position table
    returned as it is): a leaf that requires grad even under no_grad, reused by every pass."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(*shape))

    def forward(self, x):
        return self.weight


def _tensors_in(out, path="output"):
    """``(path, tensor)`` of each tensor in a module's output (tensors, tuples, lists, dicts)."""
    if isinstance(out, torch.Tensor):
        yield path, out
    elif isinstance(out, (tuple, list)):
        for i, o in enumerate(out):
            yield from _tensors_in(o, f"{path}.{i}")
    elif isinstance(out, dict):
        for k, o in out.items():
            yield from _tensors_in(o, f"{path}.{k}")


class GradientTap:
    """An oracle built from plain PyTorch hooks: a forward hook on every module of ``model`` puts a
    ``Tensor.register_hook`` on each floating output that requires grad (once per output tensor object
    and step, removed at the step's end); each time a gradient arrives there, that output's values (cloned when the module
    returned it) and the gradient are kept under the module's name. So it sees exactly the outputs
    that gradients flowed through (the forward that trained the model), and each gradient autograd
    computed for them. :meth:`take` returns ``{module: (outputs, gradients)}`` and starts a new step."""

    def __init__(self, model: torch.nn.Module):
        self._names = {id(m): n for n, m in model.named_modules()}
        self._handles = [m.register_forward_hook(self._forward) for m in model.modules()]
        self._hooked: set = set()
        self._alive: list = []  # the hooked outputs, alive until take() (so no id is reused)
        self._got: dict = {}
        self._tensor_hooks: list = []

    def _forward(self, module, args, out):
        name = self._names[id(module)]
        for path, t in _tensors_in(out):
            if not (t.is_floating_point() and t.requires_grad) or (name, path, id(t)) in self._hooked:
                continue
            self._hooked.add((name, path, id(t)))
            self._alive.append(t)
            value = t.detach().clone()

            def arrived(g, name=name, value=value):
                outs, grads = self._got.setdefault(name, ([], []))
                outs.append(value)
                grads.append(g.detach().clone())

            self._tensor_hooks.append(t.register_hook(arrived))

    def take(self) -> dict:
        for h in self._tensor_hooks:  # a leaf (a Parameter) would keep them into the next step
            h.remove()
        got, self._got, self._hooked, self._alive, self._tensor_hooks = self._got, {}, set(), [], []
        return got

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def assert_rows_match_tap(tensors, step: int, got: dict) -> None:
    """Each module the tap saw has, at ``step``, activation rows holding exactly the tap's outputs
    and activation-gradient rows holding exactly its gradients (element counts, min, max, |x| max,
    over all the module's outputs); and no other module of the tap's model has such rows."""
    rows = tensors[tensors.step == step]
    for role, which in (("activation", 0), ("activation_grad", 1)):
        r = rows[rows.role == role]
        assert set(r.module) == set(got), (role, sorted(set(r.module) ^ set(got)))
        for module, pair in got.items():
            mine = r[r.module == module]
            flat = torch.cat([x.double().reshape(-1) for x in pair[which]])
            assert mine.numel.sum() == flat.numel(), (role, module, int(mine.numel.sum()), flat.numel())
            assert mine["max"].max() == float(flat.max()), (role, module)
            assert mine["min"].min() == float(flat.min()), (role, module)
            assert mine.absmax.max() == float(flat.abs().max()), (role, module)


def train_with_tap(model, params, steps, loss_of):
    """Train with AdamW on ``params``, CPU float16 autocast and a GradScaler, one optimizer step per
    item of ``steps`` (a list of micro-batches, each backpropagated: ``loss_of(batch)`` computed under
    autocast), recording ``model`` under a :class:`GradientTap`; returns the Run's tensors frame and
    the tap's ``take()`` of each step."""
    opt = torch.optim.AdamW(params, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    tap, taps = GradientTap(model), []
    with mpscope.record(model, opt, scaler) as rec:
        for micro in steps:
            opt.zero_grad()
            for batch in micro:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = loss_of(batch)
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            taps.append(tap.take())
    tap.remove()
    return rec.run.tensors, taps
