"""The rank side of tests/test_distributed.py: real training loops on the demo GPT in two gloo
processes (torch.multiprocessing, file:// rendezvous). Each scenario records with ``out=`` and
saves, next to it, the oracle tensors the test compares with (captured with the loop's own hooks
or with FSDP's own gathering), so the parent process checks everything after the ranks are gone.
"""

from __future__ import annotations

import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mpscope
from mpscope.demo.data import CharDataset, load_text
from mpscope.demo.model import GPT, GPTConfig

GLOBAL_BATCH = 8
SEQ = 32
_TEXT = None


def gpt() -> tuple[GPT, CharDataset]:
    global _TEXT
    if _TEXT is None:
        _TEXT = load_text()[:200_000]
    data = CharDataset(_TEXT, SEQ)
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=data.vocab_size, d_model=32, n_layer=2, n_head=2, seq_len=SEQ)), data


def batch(data: CharDataset, step: int, rank: int):
    """Rank ``rank``'s half of the global batch of ``step``."""
    x, y = data.batch(GLOBAL_BATCH, data.generator(1000 + step))
    half = GLOBAL_BATCH // 2
    return x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]


def _capture_outputs(model, store):
    """Our own forward hooks: each module's output tensors (cloned), as mpscope names them."""
    handles = []
    for name, mod in model.named_modules():
        def hook(m, a, out, name=name):
            outs = [("output", out)] if isinstance(out, torch.Tensor) else [
                (f"output.{i}", o) for i, o in enumerate(out) if isinstance(o, torch.Tensor)]
            for k, o in outs:
                if o.is_floating_point():
                    store[(name, k)] = o.detach().clone()
        handles.append(mod.register_forward_hook(hook))
    return handles


def ddp(rank: int, out: Path) -> None:
    """Two fp32 steps of DDP; saves step 0's activations, local and reduced grads and weights."""
    model, data = gpt()
    net = DDP(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    acts, local = {}, {}
    handles = _capture_outputs(model, acts)
    for name, p in model.named_parameters():
        handles.append(p.register_hook(lambda g, name=name: local.__setitem__(name, g.detach().clone())))
    caps = {}
    with mpscope.record(net, optimizer=opt, out=out / "ddp") as rec:
        for step in range(2):
            x, y = batch(data, step, rank)
            _, loss = net(x, y)
            loss.backward()
            if step == 0:
                for h in handles:
                    h.remove()
                caps["reduced"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            if step == 0:
                caps["weight"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.zero_grad()
    caps["act"], caps["local"] = acts, local
    caps["bytes_sent"], caps["exchanges"] = rec._ranks.bytes_sent, rec._ranks.exchanges
    # recorder.run in memory: on rank 0 the merged Run, which reads the other ranks' rows from out=
    caps["own_rows"] = {r: len(rec.run.for_rank(r).tensors) for r in rec.run.ranks}
    # the same without out=: only rank 0's own rows are at hand in rank 0's process
    with mpscope.record(net, roles=["activation"]) as rec2:
        x, y = batch(data, 2, rank)
        net(x, y)
        rec2.step()
    caps["no_out"] = {"ranks": rec2.run.ranks, "rows": len(rec2.run.tensors),
                      "own_rows": len(rec2.run.for_rank(rank).tensors)}
    try:
        rec2.run.for_rank(1 - rank)
        caps["no_out"]["other"] = "no error"
    except ValueError as e:
        caps["no_out"]["other"] = str(e)
    torch.save(caps, out / f"ddp_caps_{rank}.pt")


def inf_on_rank1(rank: int, out: Path) -> None:
    """fp16 autocast + GradScaler under DDP; at step 1 rank 1's first block gets an inf input."""
    model, data = gpt()
    state = {"step": 0}

    def poison(m, args):
        if rank == 1 and state["step"] == 1:
            x = args[0].clone()
            x[0, 0, 0] = float("inf")
            return (x,)
        return None

    h = model.blocks[0].register_forward_pre_hook(poison)
    _amp_loop(model, data, rank, out / "inf", torch.amp.GradScaler("cpu"), state)
    h.remove()


def _amp_loop(model, data, rank: int, out: Path, scaler, state: dict | None = None, **record_kw) -> None:
    """Three fp16-autocast steps of DDP with a GradScaler; ``state["step"]`` follows the loop."""
    net = DDP(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = {} if state is None else state
    with mpscope.record(net, optimizer=opt, scaler=scaler, out=out, **record_kw):
        for step in range(3):
            state["step"] = step
            x, y = batch(data, step, rank)
            with torch.autocast("cpu", dtype=torch.float16):
                _, loss = net(x, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()


class WithAux(torch.nn.Module):
    """The GPT plus an auxiliary head that only some ranks use (an unused branch)."""

    def __init__(self, gpt_, vocab):
        super().__init__()
        self.gpt = gpt_
        self.aux = torch.nn.Linear(vocab, 1)

    def forward(self, x, y, use_aux: bool):
        logits, loss = self.gpt(x, y)
        if use_aux:
            loss = loss + self.aux(logits).square().mean()
        return loss


def skip_module(rank: int, out: Path) -> None:
    """Rank 0 never runs ``aux``; rank 1 does (DDP with find_unused_parameters)."""
    model, data = gpt()
    net = DDP(WithAux(model, data.vocab_size), find_unused_parameters=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with mpscope.record(net, optimizer=opt, out=out / "skip", reduce_every=2):
        for step in range(3):
            x, y = batch(data, step, rank)
            net(x, y, use_aux=(rank == 1)).backward()
            opt.step()
            opt.zero_grad()


def _plain_loop(net, opt, data, rank: int, out: Path, capture, steps: int = 2):
    """Two fp32 steps recording activations, weights and gradients; returns what ``capture()``
    gives after the last ``optimizer.step()`` (before ``zero_grad``)."""
    got = None
    with mpscope.record(net, optimizer=opt, out=out, roles=["activation", "weight", "param_grad"]):
        for step in range(steps):
            x, y = batch(data, step, rank)
            _, loss = net(x, y)
            loss.backward()
            opt.step()
            if step == steps - 1:
                got = capture()
            opt.zero_grad()
    return got


def fsdp2(rank: int, out: Path) -> None:
    """fully_shard on each block and the root; AdamW; saves the full weights and grads of step 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, data = gpt()
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    full = _plain_loop(model, opt, data, rank, out / "fsdp2", capture=lambda: {
        n: (p.full_tensor().detach().clone(), p.grad.full_tensor().detach().clone()) for n, p in model.named_parameters()})
    if rank == 0:
        torch.save(full, out / "fsdp2_full.pt")


def fsdp1(rank: int, out: Path) -> None:
    """FSDP1 (use_orig_params) wrapping each block; saves each rank's shards of step 1."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from mpscope.demo.model import Block

    model, data = gpt()
    net = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({Block}))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    shards = _plain_loop(net, opt, data, rank, out / "fsdp1", capture=lambda: {
        n.replace("_fsdp_wrapped_module.", ""): (p.detach().clone(), None if p.grad is None else p.grad.clone())
        for n, p in net.named_parameters()})
    torch.save(shards, out / f"fsdp1_shards_{rank}.pt")


def fsdp1_two_models(rank: int, out: Path) -> None:
    """FSDP1 (use_orig_params) GPT recorded while another model (a probe on the detached logits,
    not wrapped) trains with its own backward first in each step; saves this rank's GPT losses."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from mpscope.demo.model import Block

    model, data = gpt()
    net = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({Block}))
    probe = torch.nn.Linear(data.vocab_size, 1)
    opt, opt_probe = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(probe.parameters(), lr=0.1)
    losses = []
    with mpscope.record(net, optimizer=opt, out=out / "fsdp1_two", roles=["activation", "loss"]):
        for step in range(2):
            x, y = batch(data, step, rank)
            with torch.no_grad():
                logits, _ = net(x, y)  # an evaluation pass
            (probe(logits).square().mean() * 100).backward()  # another model's step
            opt_probe.step()
            opt_probe.zero_grad()
            _, loss = net(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    torch.save(losses, out / f"fsdp1_two_losses_{rank}.pt")


def idle_steps(rank: int, out: Path) -> None:
    """DDP and FSDP2 with ``every=4``: the ATen ops and ``torch.distributed`` calls mpscope issues
    during the three unrecorded steps 1-3 (ops by ``benchmarks/common.py``'s ``OpCounter``, which
    attributes each op to its caller from the Python stack); saved per wrapper with the steps table."""
    import importlib.util
    import json
    import sys

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "common.py"
    spec = importlib.util.spec_from_file_location("mpscope_bench_common", bench)
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    src = str(Path(mpscope.__file__).resolve().parent)
    calls = []
    names = ("all_reduce", "reduce", "all_gather", "all_gather_object", "broadcast", "barrier")
    originals = {n: getattr(dist, n) for n in names}

    def counted(name):
        def call(*args, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(src):
                calls.append(name)
            return originals[name](*args, **kwargs)
        return call

    result = {}
    for kind in ("ddp", "fsdp2"):
        model, data = gpt()
        if kind == "ddp":
            net = DDP(model)
        else:
            mesh = init_device_mesh("cpu", (2,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            net = fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        counter = common.OpCounter()
        calls.clear()
        with mpscope.record(net, optimizer=opt, every=4) as rec:
            for step in range(5):
                x, y = batch(data, step, rank)
                idle = step in (1, 2, 3)
                if idle:
                    for n in names:
                        setattr(dist, n, counted(n))
                    counter.__enter__()
                try:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        _, loss = net(x, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                finally:
                    if idle:
                        counter.__exit__(None, None, None)
                        for n in names:
                            setattr(dist, n, originals[n])
                if step == 3:
                    result[kind] = {"ops": dict(counter.ops.get("mpscope", {})), "flush": dict(counter.ops.get("flush", {})),
                                    "collectives": list(calls)}
        steps = rec.local_run.steps
        result[kind]["recorded"] = [bool(v) for v in steps.recorded]
        result[kind]["loss_known"] = [bool(v) for v in steps.loss.notna()]
    (out / f"idle_steps_{rank}.json").write_text(json.dumps(result))


def scaler_desync(rank: int, out: Path) -> None:
    """Each rank builds its GradScaler with another init_scale: their loss scales disagree."""
    model, data = gpt()
    _amp_loop(model, data, rank, out / "desync", torch.amp.GradScaler("cpu", init_scale=2.0 ** (16 - 6 * rank)), every=2)


def ordinary_skips(rank: int, out: Path) -> None:
    """fp16 DDP with a GradScaler whose first scales overflow the gradients: skipped steps, as
    GradScaler means them to be."""
    model, data = gpt()
    _amp_loop(model, data, rank, out / "skips", torch.amp.GradScaler("cpu", init_scale=2.0**18))


def crash(rank: int, out: Path) -> None:
    """Rank 1 raises in the middle of step 2 (after its forward); rank 0 then fails in backward."""
    model, data = gpt()
    net = DDP(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with mpscope.record(net, optimizer=opt, out=out / "crash"):
        for step in range(4):
            x, y = batch(data, step, rank)
            _, loss = net(x, y)
            if rank == 1 and step == 2:
                raise RuntimeError("rank 1 fails mid-step")
            loss.backward()
            opt.step()
            opt.zero_grad()


def _uneven(rank: int, out: Path, name: str, wrap, records, **record_kw) -> None:
    """Four SGD steps in which rank ``r`` records the steps ``records(r)`` (a contiguous range, or
    none) and raises at the end of its range when ``record_kw`` has ``raise_at_end``; the same loop
    without mpscope follows. Saves both final weights, the recording rank's own rows, the
    warnings, and the seconds each took."""
    import contextlib
    import json
    import os
    import time
    import warnings

    os.environ["MPSCOPE_DIST_TIMEOUT"] = "4"  # the bounded waits, short for the test
    raise_at_end = record_kw.pop("raise_at_end", False)
    late = record_kw.pop("late", {}).get(rank, 0.0)  # seconds this rank waits before its record()
    save_as = record_kw.pop("save_as", name)
    result = {}
    try:
        for recorded in (True, False):
            model, data = gpt()
            net = wrap(model)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            steps = records(rank) if recorded else range(0)
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rec, block, attach_s = None, contextlib.ExitStack(), None
                for step in range(4):
                    if step == (steps[0] if steps else -1):
                        time.sleep(late)
                        t1 = time.perf_counter()
                        rec = block.enter_context(mpscope.record(net, optimizer=opt, out=out / name, **record_kw))
                        attach_s = time.perf_counter() - t1
                    try:
                        x, y = batch(data, step, rank)
                        _, loss = net(x, y)
                        loss.backward()
                        opt.step()
                        opt.zero_grad()
                        if raise_at_end and steps and step == steps[-1]:
                            raise RuntimeError("a step of this rank fails")
                    except RuntimeError as e:
                        block.__exit__(type(e), e, e.__traceback__)
                    else:
                        if steps and step == steps[-1]:
                            block.close()
            result["recorded" if recorded else "plain"] = {
                "seconds": time.perf_counter() - t0,
                "attach_seconds": attach_s,  # the record() call itself (its bounded wait)
                "weights": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                            for n, p in model.named_parameters()},
                "warnings": [str(w.message) for w in caught if "mpscope" in str(w.message)],
                "steps": rec.run.steps.step.tolist() if rec is not None else None,
                "own_steps": rec.local_run.steps.step.tolist() if rec is not None else None,
                "ranks": rec.run.ranks if rec is not None else None,
            }
    finally:
        del os.environ["MPSCOPE_DIST_TIMEOUT"]
    torch.save(result, out / f"{save_as}_{rank}.pt")


def only_rank0_records(rank: int, out: Path) -> None:
    """DDP; only rank 0 wraps its loop in record()."""
    _uneven(rank, out, "only0", DDP, lambda r: range(4) if r == 0 else range(0))


def every_differs(rank: int, out: Path) -> None:
    """DDP; rank 0 records every step, rank 1 every other one."""
    _uneven(rank, out, "every", DDP, lambda r: range(4), every=1 + rank)


def rank1_leaves_early(rank: int, out: Path) -> None:
    """DDP; rank 1 leaves its record() block after step 1 and trains on unrecorded."""
    _uneven(rank, out, "leaves", DDP, lambda r: range(4) if r == 0 else range(2))


def rank1_raises(rank: int, out: Path) -> None:
    """DDP; rank 1's block ends with an exception after step 1 (caught outside it)."""
    _uneven(rank, out, "raises", DDP, lambda r: range(4) if r == 0 else range(2), raise_at_end=True)


def fsdp2_only_rank1_records(rank: int, out: Path) -> None:
    """FSDP2 (fully_shard on each block and the root); only rank 1 records."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def wrap(model):
        mesh = init_device_mesh("cpu", (2,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    _uneven(rank, out, "fsdp2_only1", wrap, lambda r: range(4) if r == 1 else range(0))


def group_false_shared_out(rank: int, out: Path) -> None:
    """DDP; both ranks record with group=False into the same out=."""
    _uneven(rank, out, "nogroup", DDP, lambda r: range(4), group=False)


def rank1_attaches_late(rank: int, out: Path) -> None:
    """DDP; rank 1 calls record() 6 s after rank 0 (past the 4 s bound)."""
    _uneven(rank, out, "late", DDP, lambda r: range(4), late={1: 6.0})


def both_record_after_them(rank: int, out: Path) -> None:
    """DDP; both ranks record every step (after the scenarios above, in the same processes)."""
    _uneven(rank, out, "both", DDP, lambda r: range(4))


def both_record_into_a_taken_out(rank: int, out: Path) -> None:
    """DDP; both ranks record again into the out= of the scenario above."""
    _uneven(rank, out, "both", DDP, lambda r: range(4), save_as="again")


SCENARIOS = {"main": (ddp, inf_on_rank1, skip_module, fsdp2, fsdp1, scaler_desync, fsdp1_two_models, idle_steps,
                      ordinary_skips),
             "crash": (crash,),
             "uneven": (only_rank0_records, every_differs, rank1_leaves_early, rank1_raises, fsdp2_only_rank1_records,
                        group_false_shared_out, rank1_attaches_late, both_record_after_them,
                        both_record_into_a_taken_out)}


def main(rank: int, world: int, init: str, out: str, scenario: str) -> None:
    """Run the scenarios of ``scenario`` in order; write ``status_<rank>.txt`` ("ok" or the error)."""
    out = Path(out)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=180))
    torch.set_num_threads(1)
    status = "ok"
    try:
        for fn in SCENARIOS[scenario]:
            fn(rank, out)
    except Exception:
        status = traceback.format_exc()
    finally:
        (out / f"status_{scenario}_{rank}.txt").write_text(status)
        if status == "ok":
            dist.destroy_process_group()
