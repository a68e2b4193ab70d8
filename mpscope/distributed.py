"""Recording inside each rank of a ``torch.distributed`` job (DDP, FSDP2 ``fully_shard``, FSDP1).

What this module adds to a :class:`~mpscope.recorder.Recorder` running in one rank:

* **Names.** :func:`named_modules` walks the model like ``named_modules()`` but skips the wrapper
  modules (``DistributedDataParallel``, FSDP1's ``FullyShardedDataParallel``, the activation
  checkpoint / offload wrappers) and drops the attribute they hold the user's module in
  (``module.``, ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``): rows carry the user's
  module names, the same on every rank. FSDP2 (``fully_shard``) inserts no wrapper;
  ``torch.compile``'s wrapper is handled by :mod:`mpscope.compiled` on top of this walk.
* **Sharded parameters.** :func:`local_tensor` reads a ``DTensor`` (FSDP2 parameters, their
  ``.grad`` and optimizer state) as the rank's own shard (``to_local()``), so no stats pass ever
  issues a collective. The shards' stats add up to the full tensor's.
* **Local and reduced gradients.** Under DDP ``param_grad`` rows are ``.grad`` at the step's end,
  i.e. after the all-reduce (equal on every rank); role ``param_grad_local`` holds the gradient
  each rank computed before the all-reduce (a hook on the parameter, which fires with the local
  gradient before DDP's bucket reduction). Under FSDP1 / FSDP2 ``param_grad`` is the rank's shard
  of the reduce-scattered gradient; the local gradient is never materialised per parameter there.
* **The merge.** :class:`RankMerge` collects the rank's rows as they reach its Run and, at the end
  of every ``reduce_every``-th recorded step (and once when the block ends), merges them across the
  process group in three collectives, never inside a hook: a small MAX-reduced header (the window
  of steps, how many keys are new, the histogram range), a SUM-reduced and a MIN-reduced float64
  block (see :mod:`mpscope.merge`), plus an ``all_gather_object`` of the new keys on the
  exchanges where some rank saw a key for the first time. The collectives run in the background
  (``async_op=True``) and are finished by the next exchange, so a training step waits neither for
  the other ranks nor for the transfer; the last exchange, when the block ends, drains them. Rank 0
  of the group appends the result
  to the merged Run. Only counts and extrema cross ranks, never tensors.

**No collective without every rank.** When the block starts, the ranks of the group agree on who
records through the job's key-value store (``torch.distributed``'s default store: no collective, so
nothing interleaves with the training's own), waiting at most :data:`ATTACH_TIMEOUT_S`. Only when
every rank joined with the same settings does the merge run, and then over a gloo process group of
its own (never the training's group, so its collectives cannot interleave with DDP's or FSDP's),
every wait bounded by :data:`EXCHANGE_TIMEOUT_S`. Otherwise each rank records its own rows (as
``group=False``) with one warning that says why:

* a rank that does not call ``record()`` within the wait (only rank 0 records; a rank that attaches
  later finds the agreement closed and records alone too);
* ranks with different ``every=``, ``hist_every=``, ``reduce_every=``, ``max_steps=`` or ``roles=``.

When a block ends, its rank waits (at most :data:`ATTACH_TIMEOUT_S`, through the store) for every
rank to end its recording too; then the last exchange drains the merge. A rank whose block ends
first (its loop went on without it, it raised) leaves its exchange count in the store; the others
look there before each exchange and at each recorded step, and stop merging before an exchange it
will not join (warning), recording every parameter from then on (under DDP each rank records only
its share while merging). Cost of leaving early: under DDP the other ranks wait in the next
all-reduce for the leaving rank, which waits for them: every rank stalls once, for the bound (a
rank whose block raises does not wait). Merging that stops early leaves ``recorder.run`` the
rank's own Run; ``Run.load(out)`` merges the per-rank files. A wait that passes
:data:`EXCHANGE_TIMEOUT_S` (a rank gone) stops merging on that rank the same way. The environment
variable ``MPSCOPE_DIST_TIMEOUT`` (seconds) sets both bounds. ``group=False`` in a job: the rank's
own rows, under its own rank number, no store, no collective.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mpscope import merge as _merge
from mpscope.model_hooks import ModelHook
from mpscope.run import MERGED_DIR, STEP_COLUMNS, RankFiles, Run, RunFileError

#: Wrapper class name -> the attribute holding the wrapped module.
WRAPPERS = {
    "DistributedDataParallel": "module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",
    "CheckpointWrapper": "_checkpoint_wrapped_module",
    "OffloadWrapper": "_checkpoint_wrapped_module",
}
#: Roles whose tensor is the same on every rank under DDP (or with no wrapper): merged rows are
#: that tensor's own, not a sum over ranks.
REPLICATED_ROLES = ("weight", "param_grad", "optimizer_state")
_FAR = 1 << 60


def _wrapper_attr(module: torch.nn.Module) -> str | None:
    for cls in type(module).__mro__:
        attr = WRAPPERS.get(cls.__name__)
        if attr is not None and attr in module._modules:
            return attr
    return None


def named_modules(model: torch.nn.Module):
    """Yield ``(name, module)`` like ``model.named_modules()``, with wrapper modules left out and
    their attribute names removed from the names below them (``module.layers.0`` -> ``layers.0``)."""
    seen: set[int] = set()

    def walk(mod, prefix):
        if id(mod) in seen:
            return
        seen.add(id(mod))
        attr = _wrapper_attr(mod)
        if attr is None:
            yield prefix, mod
        for cname, child in mod._modules.items():
            if child is None:
                continue
            if cname == attr:
                yield from walk(child, prefix)
            else:
                yield from walk(child, f"{prefix}.{cname}" if prefix else cname)

    yield from walk(model, "")


def local_tensor(t):
    """The rank's own part of ``t``: ``t.to_local()`` for a DTensor, else ``t`` itself."""
    if isinstance(t, torch.Tensor) and hasattr(t, "to_local") and hasattr(t, "placements"):
        return t.to_local()
    return t


def grad_carriers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The leaf tensors into which a backward that trains ``model`` accumulates gradients: its
    parameters that require grad and, under FSDP1, each ``FullyShardedDataParallel`` unit's
    ``FlatParameter`` (with ``use_orig_params=True`` autograd accumulates into the flat parameter,
    never into the original parameters, which are views of it), each once."""
    out = {id(p): p for p in model.parameters() if p.requires_grad}
    for m in model.modules():
        if "FullyShardedDataParallel" in (c.__name__ for c in type(m).__mro__):
            flat = getattr(m, "_flat_param", None)  # FSDP1 keeps each unit's FlatParameter there
            if isinstance(flat, torch.Tensor) and flat.requires_grad:
                out.setdefault(id(flat), flat)
    return list(out.values())


def fresh_sibling(path: Path) -> Path:
    """``path-1``, ``path-2``, ...: the first that does not exist, beside ``path``."""
    k = 1
    while path.with_name(f"{path.name}-{k}").exists():
        k += 1
    return path.with_name(f"{path.name}-{k}")


def type_name(module: torch.nn.Module) -> str:
    """The class name of the user's module: FSDP2's ``fully_shard`` swaps a module's class for a
    subclass ``FSDP<Name>`` of (FSDPModule, Name); that subclass's other base is named."""
    cls = type(module)
    if any(b.__name__ == "FSDPModule" for b in cls.__bases__):
        cls = next((b for b in cls.__bases__ if b.__name__ != "FSDPModule"), cls)
    return cls.__name__


def wrapper_kind(model: torch.nn.Module) -> str | None:
    """``"ddp"``, ``"fsdp1"``, ``"fsdp2"`` or None, from the classes in the model tree."""
    names = {c.__name__ for m in model.modules() for c in type(m).__mro__}
    if "DistributedDataParallel" in names:
        return "ddp"
    if "FullyShardedDataParallel" in names:
        return "fsdp1"
    if "FSDPModule" in names:
        return "fsdp2"
    return None


@dataclass(frozen=True)
class Plan:
    """The process group a recorder merges over.

    Attributes:
        group: the ``ProcessGroup``; rank / world: this rank's index in it and its size;
        global_rank: the rank in the default group (names the per-rank files);
        ranks: the group's global ranks; wrapper: :func:`wrapper_kind`; backend: ``"gloo"``, ``"nccl"``...
    """

    group: object
    rank: int
    world: int
    global_rank: int
    ranks: tuple
    wrapper: str | None
    backend: str

    @property
    def replicated_roles(self) -> tuple:
        return () if self.wrapper in ("fsdp1", "fsdp2") else REPLICATED_ROLES


def job_rank() -> tuple[int, int] | None:
    """``(rank, world size)`` of this process in a ``torch.distributed`` job of more than one
    process, else None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.get_rank(), dist.get_world_size()


def plan(model: torch.nn.Module, group=None) -> Plan | None:
    """The merge plan for ``model`` in this process, or None for a single-process recording.

    Args:
        group: None (the default process group when ``torch.distributed`` is initialised with
            more than one rank), False (never merge), a ``ProcessGroup``, or a one-dimensional
            ``DeviceMesh`` (e.g. ``mesh["dp"]``, the data-parallel dimension).

    Raises:
        ValueError: ``group`` given while ``torch.distributed`` is not initialised, or a mesh with
            more than one dimension.
        TypeError: ``group`` of another type.
    """
    if group is False:
        return None
    available = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not available:
        if group is not None:
            raise ValueError(
                "group= was given but torch.distributed is not initialised in this process; call "
                "torch.distributed.init_process_group(...) first (torchrun does it for you), or drop group=."
            )
        return None
    if group is None:
        group = dist.group.WORLD
    elif hasattr(group, "get_group") and hasattr(group, "ndim"):
        if group.ndim != 1:
            raise ValueError(
                f"group= got a {group.ndim}-dimensional DeviceMesh; pass its data-parallel dimension, "
                "e.g. group=mesh['dp']."
            )
        group = group.get_group()
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group= must be None, False, a torch.distributed.ProcessGroup or a 1-D DeviceMesh; got {type(group).__name__}."
        )
    world = dist.get_world_size(group)
    if world < 2:
        return None
    return Plan(group, dist.get_rank(group), world, dist.get_rank(), tuple(dist.get_process_group_ranks(group)),
                wrapper_kind(model), str(dist.get_backend(group)))


#: Seconds a rank waits, when its block starts, for every rank of the group to start recording.
ATTACH_TIMEOUT_S = 30.0
#: Seconds one of mpscope's collectives may wait for the other ranks (the gloo group's timeout).
EXCHANGE_TIMEOUT_S = 300.0
#: Environment variable that sets both bounds (seconds, > 0).
TIMEOUT_VARIABLE = "MPSCOPE_DIST_TIMEOUT"
_SESSIONS: dict[tuple, int] = {}  # group ranks -> the last recording over them this process joined
#: group ranks -> mpscope's gloo group over them, made by the first recording that merges over them
#: and kept for the next ones (a group over the same ranks has the same name: it cannot be made
#: twice); None where an exchange over it failed (its ranks are out of step: it is not used).
_GROUPS: dict[tuple, object] = {}


def timeouts() -> tuple[float, float]:
    """``(attach, exchange)`` bounds in seconds: :data:`ATTACH_TIMEOUT_S` and
    :data:`EXCHANGE_TIMEOUT_S`, or both ``$MPSCOPE_DIST_TIMEOUT``.

    Raises:
        ValueError: the variable is set but is not a positive number of seconds.
    """
    v = os.environ.get(TIMEOUT_VARIABLE)
    if v is None:
        return ATTACH_TIMEOUT_S, EXCHANGE_TIMEOUT_S
    try:
        seconds = float(v)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{TIMEOUT_VARIABLE}={v!r}: set it to a positive number of seconds (e.g. 60), or unset it.")
    return seconds, seconds


def agree(store, prefix: str, ranks: tuple, me: int, payload: dict, wait_s: float) -> tuple[dict | None, list]:
    """Whether every rank of ``ranks`` joins the agreement under ``prefix`` in the store:
    ``({rank: payload}, [])`` when all joined, or ``(None, ranks that did not)`` when one had not
    within ``wait_s`` seconds, or when a rank had closed the agreement (:func:`close_agreement`).

    No collective: each rank writes its ``payload`` (JSON) and adds one to a counter; the rank
    that completes the count marks the agreement open, a rank whose wait ends first marks it closed
    (``compare_set``: the first mark wins, so every rank reads the same). A rank arriving after the
    close reads "closed" at once.
    """
    store.set(f"{prefix}rank{me}", json.dumps(payload))
    if store.add(f"{prefix}joined", 1) >= len(ranks):
        state = store.compare_set(f"{prefix}state", "", "open")
    else:
        try:
            store.wait([f"{prefix}state"], timedelta(seconds=wait_s))
            state = store.get(f"{prefix}state")
        except RuntimeError:  # the wait ended (DistStoreError / RuntimeError "Wait timeout")
            state = close_agreement(store, prefix)
    if state != b"open":
        return None, [r for r in ranks if not store.check([f"{prefix}rank{r}"])]
    return {r: json.loads(store.get(f"{prefix}rank{r}")) for r in ranks}, []


def close_agreement(store, prefix: str) -> bytes:
    """Mark the agreement under ``prefix`` closed unless it is open already; returns its state."""
    return store.compare_set(f"{prefix}state", "", "closed")


class RankMerge:
    """Collects one rank's rows and merges them across the group at recorded step ends.

    Args:
        builder: the :class:`~mpscope.run.RunBuilder` of the rank's own Run (this merge listens to
            its appended rows; the per-rank files too, with ``out``).
        model, select: the recorded model and its ``modules=`` selection (DDP local gradients).
        observer: the recording's :class:`~mpscope.recording.observer.Observer` (``observe``).
        settings: what every rank must record alike (``every``, ``hist_every``, ``reduce_every``,
            ``max_steps``, ``roles``).
        scaled: ``scaled()``: gradients are multiplied by a GradScaler's scale.
        drain: ``drain()``: the recording's host copies, all landed (before an exchange).
        plan_: the group (:func:`plan`), or None for one process writing ``out``.

    Attributes:
        merged: the merged :class:`~mpscope.run.Run` (on the group's rank 0; None elsewhere).
        exchanges: how many merges ran; bytes_sent: bytes this rank contributed to collectives
            (headers, blocks and key lists), for the cost figures.
    """

    def __init__(self, builder, model, select, observer, settings: dict, scaled, drain, plan_: Plan | None, out=None,
                 reduce_every: int = 1):
        self.builder, self.model, self.select, self.observer = builder, model, select, observer
        self.settings, self.scaled, self.drain = settings, scaled, drain
        self.plan, self.reduce_every = plan_, reduce_every
        self.out = Path(out) if out is not None else None
        self.files: RankFiles | None = None
        self.merged: Run | None = None  # (made at attach on the group's rank 0)
        self._merged_builder = None
        self._rows: list[dict] = []
        self._hist: list[dict] = []
        self._steps: list[tuple] = []
        self._agreed: list[tuple] = []
        self._agreed_index: dict[tuple, int] = {}
        self._slot = np.zeros(0, dtype=np.int64)
        self._grad_handles: list = []
        self.exchanges = 0
        self.bytes_sent = 0
        self.seconds = 0.0  # wall time the training thread spent in exchanges (packing, waiting, unpacking)
        self._header: tuple | None = None  # rows whose header all-reduce is in flight
        self._blocks: tuple | None = None  # window whose SUM / MIN reductions are in flight
        self.closed = False
        self.failed = False  # set when the block ends with an exception: no more collectives
        self.stopped = False  # merging ended (every rank's block ended, or one left or timed out)
        self._store = None  # the job's key-value store (the agreements)
        self._alone_key: str | None = None  # set while this rank records alone after others did not come
        self._prefix = ""  # this recording's keys in it
        self._whole = True  # every exchange ran with every rank until this rank's block ended
        self._group_key: tuple = ()  # the ranks naming mpscope's group in _GROUPS
        self._share: tuple[tuple, list] = ((), [])  # (parameter ids, this rank's share of them)

    # ---------------------------------------------------------------- lifecycle
    def attach(self) -> None:
        """Register as the local Run's listener, write the meta, start the rank's files, and agree
        with the other ranks on who records (bounded wait, no collective; see the module docstring)."""
        meta = self.builder.run.meta
        job = job_rank()
        rank = self.plan.global_rank if self.plan is not None else (job[0] if job else 0)
        problem = RankFiles.problem(self.out, rank) if self.out is not None else None
        if self.plan is None and problem:  # one process: the recording goes next to out=, never stops the run
            asked, self.out = self.out, fresh_sibling(self.out)
            problem = None
            warnings.warn(f"mpscope: out={str(asked)!r} cannot take this recording ({RankFiles.problem(asked, rank)}); "
                          f"it is written to {str(self.out)!r} instead.", RuntimeWarning, stacklevel=4)
        if self.plan is None and job is not None:  # group=False in a job: this rank's own rows, named so
            meta["rank"], meta["ranks"] = rank, [rank]
            meta["distributed"] = {"wrapper": wrapper_kind(self.model), "world_size": job[1],
                                   "backend": str(dist.get_backend()), "group_ranks": [], "replicated_roles": [],
                                   "reduce_every": self.reduce_every, "replicated_split": False, "merged": False,
                                   "alone": "group=False"}
        if self.plan is not None:
            p = self.plan
            meta["rank"] = p.global_rank
            meta["ranks"] = [p.global_rank]
            meta["distributed"] = {
                "wrapper": p.wrapper, "world_size": p.world, "backend": p.backend, "group_ranks": list(p.ranks),
                "replicated_roles": list(p.replicated_roles), "reduce_every": self.reduce_every,
                "replicated_split": p.wrapper == "ddp",  # each rank records its share (replicated_share)
            }
            self.plan = self._join(problem)
            if self.plan is None:  # this rank records alone: every parameter, no merge
                meta["distributed"].update(replicated_split=False, merged=False)
            elif self.plan.rank == 0:
                self.merged = Run()
                self._merged_builder = self.merged.builder()
        self.builder.add_listener(self)
        if self.out is not None:
            self.files = RankFiles(self.out, rank, self.builder)
            self.builder.add_listener(self.files)

    def _join(self, problem: str | None) -> Plan | None:
        """The plan to merge with (over mpscope's own gloo group), or None when this rank records
        alone. Every rank reads the same agreement, so every rank raises the same error or none does."""
        p = self.plan
        attach_s, exchange_s = timeouts()
        mine = dict(self.settings, wrapper=p.wrapper)
        self._store = dist.distributed_c10d._get_default_store()
        # the recordings over these ranks are numbered 1, 2, ...: this rank joins the first after its
        # last one that no rank has closed (a rank that recorded alone closed its own), unless a rank
        # still records alone in a closed one: then this rank came late to that one
        base, n = f"mpscope/{'-'.join(map(str, p.ranks))}/", _SESSIONS.get(p.ranks, 0) + 1
        while self._store.check([f"{base}{n}/start/state"]) and self._store.get(f"{base}{n}/start/state") == b"closed":
            early = [r for r in p.ranks if self._store.check([f"{base}{n}/alone/{r}"])]
            if early:
                _SESSIONS[p.ranks], self._prefix = n, f"{base}{n}/"
                return self._alone(f"rank(s) {early} started recording alone before this rank called record()",
                                   "call mpscope.record(...) at the same point on every rank")
            n += 1
        _SESSIONS[p.ranks] = n
        self._prefix = f"{base}{n}/"
        sibling = str(fresh_sibling(Path(self.out))) if problem else None
        gathered, missing = agree(self._store, self._prefix + "start/", p.ranks, p.global_rank,
                                  {"settings": mine, "problem": problem, "sibling": sibling}, attach_s)
        if gathered is None:
            self._store.set(f"{self._prefix}alone/{p.global_rank}", "1")  # (deleted when its block ends)
            self._alone_key = f"{self._prefix}alone/{p.global_rank}"
            return self._alone(f"rank(s) {missing} of the group {list(p.ranks)} did not start recording within "
                               f"{attach_s:g} s", "call mpscope.record(...) with the same arguments on every rank")
        problems = [(r, g) for r, g in gathered.items() if g["problem"]]
        if problems:  # the recording goes beside out= on every rank: the first free sibling any rank saw
            asked = self.out
            self.out = max((Path(g["sibling"]) for _, g in problems), key=lambda q: int(q.name.rsplit("-", 1)[1]))
            again = RankFiles.problem(self.out, p.global_rank)
            if again:
                raise ValueError(f"rank {p.global_rank}: {again}")
            warnings.warn(f"mpscope: out={str(asked)!r} cannot take this recording (rank {problems[0][0]}: "
                          f"{problems[0][1]['problem']}); every rank writes to {str(self.out)!r} instead.",
                          RuntimeWarning, stacklevel=6)
        first = gathered[p.ranks[0]]["settings"]
        bad = [(r, g["settings"]) for r, g in gathered.items() if g["settings"] != first]
        if bad:
            return self._alone(f"the ranks record with different settings (rank {p.ranks[0]}: {first}; rank "
                               f"{bad[0][0]}: {bad[0][1]})", "pass the same every=, hist_every=, reduce_every=, "
                               "max_steps= and roles= on every rank")
        if p.ranks not in _GROUPS:
            try:  # only the group's ranks take part (they all agreed); its name comes from the ranks
                _GROUPS[p.ranks] = dist.new_group(list(p.ranks), backend="gloo", timeout=timedelta(seconds=exchange_s),
                                                  use_local_synchronization=True)
            except Exception as e:  # no gloo in this build, a rank gone meanwhile: record alone
                _GROUPS[p.ranks] = None
                return self._alone(f"mpscope's own process group could not be made ({type(e).__name__}: {e})",
                                   "check that this PyTorch build has the gloo backend")
        group, self._group_key = _GROUPS[p.ranks], p.ranks
        if group is None:
            return self._alone("an earlier exchange over these ranks failed in this process",
                               "start a new process")
        return replace(p, group=group, rank=dist.get_rank(group), ranks=tuple(dist.get_process_group_ranks(group)))

    def _alone(self, why: str, how: str) -> None:
        self.builder.run.meta["distributed"]["alone"] = why
        warnings.warn(f"mpscope: {why}; rank {self.plan.global_rank} records its own rows only (as group=False, no "
                      f"collective with the other ranks). To merge every rank, {how}; to record one rank without "
                      "waiting, pass group=False.", RuntimeWarning, stacklevel=6)
        return None

    def step_end(self, index: int, recorded: bool) -> None:
        """Called by the recorder when step ``index`` has been queued for the host."""
        if self.plan is None or not recorded or self.failed or self.stopped:
            return
        if (index // self.settings["every"] + 1) % self.reduce_every == 0:
            self.exchange()

    def close(self) -> "Run | None":
        """End of the block: a last merge when the block ended normally, then the files. Returns,
        on the group's rank 0, the merged Run (written to ``out/merged/`` too; the recorder's
        ``run`` from now on), else None."""
        if self.closed:
            return None
        self.closed = True
        own = self.builder.run
        ok = not self.failed
        self.hook_grads(False)
        try:
            if self.plan is not None and not self.stopped:
                if ok:
                    self._end_together()
                else:  # the other ranks learn at their next exchange that this one merges no more
                    self._whole = False
                    try:
                        end = self._prefix + "end/"
                        self._store.set(f"{end}rank{self.plan.global_rank}", json.dumps({"exchanges": self.exchanges}))
                        self._store.add(f"{end}joined", 1)
                        close_agreement(self._store, end)
                    except Exception:  # the store went with the job: the others' waits are bounded anyway
                        pass
            ok = ok and self._whole
        finally:
            if self._alone_key is not None:
                try:
                    self._store.delete_key(self._alone_key)
                except Exception:  # the store went with the job
                    pass
            self.builder.remove_listener(self)
            if self.files is not None:
                self.builder.remove_listener(self.files)
                self.files.close()
        if ok and "distributed" not in own.meta and self.out is not None:  # one process: its rows are the whole run
            self._save_merged(own)
        if not (ok and self.merged is not None):
            return None
        m = self.merged
        m.meta.update({k: v for k, v in own.meta.items() if k not in ("rank", "ranks")})
        m.meta["ranks"] = list(self.plan.ranks)
        m.meta["distributed"] = dict(m.meta.get("distributed", {}), exchanges=self.exchanges,
                                     bytes_sent_rank0=self.bytes_sent)
        m.tables.update({k: v for k, v in own.tables.items() if k not in m.tables})
        # this rank's own rows (m.for_rank(rank)), and where the others' are
        self._merged_builder.rank_sources(self.out, {self.plan.global_rank: own})
        if self.out is not None:
            self._save_merged(m)
        return m

    def _save_merged(self, run: Run) -> None:
        """Write ``out/merged``; a failure warns (the per-rank files hold every row, and
        ``Run.load(out)`` merges them) and never ends the training run."""
        try:
            run.save(self.out / MERGED_DIR)
        except (OSError, RunFileError) as e:
            warnings.warn(f"mpscope: could not write the merged run to {self.out / MERGED_DIR} ({type(e).__name__}: "
                          f"{e}); every rank's rows are in {self.out / 'ranks'}, and mpscope.Run.load({str(self.out)!r}) "
                          "merges them.", RuntimeWarning, stacklevel=4)

    # ---------------------------------------------------------------- the Run's listener interface
    def rows(self, cols: dict) -> None:
        if self.plan is not None:
            self._rows.append(cols)

    def hist(self, cols: dict) -> None:
        if self.plan is not None:
            self._hist.append(cols)

    def step(self, row: tuple) -> None:
        if self.plan is not None:
            self._steps.append(row)

    def replicated_share(self, params: list[tuple]) -> list[tuple]:
        """The ``(module, name, parameter)`` items whose replicated rows (weight, all-reduced
        gradient, optimizer state) this rank records.

        Under DDP these are the same tensors on every rank (DDP broadcasts the weights at
        construction and all-reduces the gradients, so every rank's optimizer applies the same
        update), so recording them on every rank computes the same statistics ``world`` times. Each
        rank records only its share instead: the parameters are dealt out by size, largest first,
        each to the rank holding the fewest elements so far (ties: the lower rank, then the earlier
        parameter), which every rank computes identically from the same shapes. The merge divides a
        replicated cell by the number of ranks that contributed it, so each merged row is its one
        recording rank's row. FSDP (each rank holds its own shards), a group without a wrapper, and
        one process record every parameter, and so does a rank once merging stops (another rank's
        recording ended: its share would be missing).
        """
        p = self.plan
        if p is None or p.wrapper != "ddp" or p.world < 2 or self.stopped or self._ended_elsewhere(quiet=True):
            return params  # (merging stopped, or stops at this step's exchange: no rank covers the others)
        ids = tuple(id(x[2]) for x in params)
        if self._share[0] != ids:
            load = [0] * p.world
            mine = []
            for i in sorted(range(len(params)), key=lambda i: (-params[i][2].numel(), i)):
                r = min(range(p.world), key=lambda j: (load[j], j))
                load[r] += params[i][2].numel()
                if r == p.rank:
                    mine.append(i)
            self._share = (ids, [params[i] for i in sorted(mine)])
        return self._share[1]

    # ---------------------------------------------------------------- local gradients (DDP)
    def hook_grads(self, on: bool) -> None:
        """Hooks on the selected parameters for recorded steps (DDP only): each sees this rank's
        gradient before the all-reduce and records it as ``param_grad_local``."""
        if not on:
            for h in self._grad_handles:
                h.remove()
            self._grad_handles.clear()
            return
        if self._grad_handles or "param_grad_local" not in self.settings["roles"]:
            return
        seen: set[int] = set()
        for mname, mod in named_modules(self.model):
            if not self.select(mname, mod):
                continue
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                self._grad_handles.append(p.register_hook(ModelHook(self._local_grad_hook(mname, pname))))

    def _local_grad_hook(self, mname: str, pname: str):
        observe, scaled = self.observer.observe, self.scaled

        def hook(grad):
            observe(mname, "param_grad_local", pname, grad, scaled=scaled())
            return None

        return hook

    # ---------------------------------------------------------------- the merge
    def _end_together(self) -> bool:
        """At the block's end: when every rank ends its recording with the same number of exchanges
        (within :data:`ATTACH_TIMEOUT_S`, through the store), the last exchange drains the merge;
        otherwise this rank merges no more (warning). True when the merge is whole."""
        p = self.plan
        try:
            gathered, missing = agree(self._store, self._prefix + "end/", p.ranks, p.global_rank,
                                      {"exchanges": self.exchanges}, timeouts()[0])
        except Exception as e:  # the store is gone (the job is ending): no drain
            gathered, missing = None, f"(unknown: the store failed, {type(e).__name__}: {e})"
        counts = {g["exchanges"] for g in gathered.values()} if gathered else set()
        if gathered is None or len(counts) > 1:
            self.stopped = True
            self._stop_merging(f"rank(s) {missing} did not end their recording with this rank" if gathered is None
                               else f"the ranks ended after different numbers of exchanges ({sorted(counts)})",
                               broken=gathered is not None)
            return False
        self.exchange(final=True)
        return self._whole

    def exchange(self, final: bool = False) -> None:
        """Start merging the rows collected since the last exchange (every rank calls it).

        The exchange is pipelined so that no training step waits for the other ranks: its
        collectives are started here without waiting (``async_op=True``) and finished by the next
        exchange, while the steps in between compute. Each call (1) finishes the SUM / MIN blocks
        started by the previous call and, on the group's rank 0, appends the merged rows; (2) waits
        for the previous call's header (by then long arrived), agrees on new keys if some rank saw
        any (the one blocking collective, only on such exchanges), packs the previous call's rows
        and starts their SUM and MIN reductions; (3) starts the header of the rows collected now.
        With ``final`` (every rank's block ends: :meth:`_end_together`) the pipeline is drained:
        everything collected is merged before it returns. Before anything, a rank that finds in the
        store that another rank's recording ended merges no more (warning), and so does a rank whose
        wait fails or passes :data:`EXCHANGE_TIMEOUT_S`: no collective is ever started that another
        rank will not join.
        """
        if self.stopped:
            return
        t0 = time.perf_counter()
        try:
            if not final and self._ended_elsewhere():
                close_agreement(self._store, self._prefix + "end/")  # the leaving rank stops waiting for us
                self.stopped = True
                self._stop_merging("another rank's recording ended (its block was left, or it raised)")
                return
            self._finish_blocks()
            self._start_blocks()
            self._start_header()
            if final:
                self._finish_blocks()
                self._start_blocks()
                self._finish_blocks()
                self.stopped = True
        except Exception as e:  # a rank gone, a timeout: this rank goes on alone
            self.stopped = True
            self._stop_merging(f"an exchange with the other ranks failed ({type(e).__name__}: {str(e)[:300]})",
                               broken=True)
        finally:
            self.seconds += time.perf_counter() - t0

    def _ended_elsewhere(self, quiet: bool = False) -> bool:
        """Whether a rank has ended its recording (joined the end agreement) after no more
        exchanges than this rank has started: the next one would have no partner there. ``quiet``:
        False, not an error, when the store cannot be read."""
        end, me = self._prefix + "end/", self.plan.global_rank
        try:
            if not self._store.check([f"{end}joined"]):  # (one store round trip)
                return False
        except Exception:
            if quiet:
                return False
            raise
        counts = [json.loads(self._store.get(f"{end}rank{r}"))["exchanges"] for r in self.plan.ranks
                  if r != me and self._store.check([f"{end}rank{r}"])]
        return bool(counts) and self.exchanges >= min(counts)

    def _stop_merging(self, why: str, broken: bool = False) -> None:
        """Warn that this rank merges no more. Its collectives in flight were started by every rank
        (a rank stops before starting an exchange the others did not), so they are waited for and
        mpscope's group stays usable; when ``broken`` (a wait failed, or the ranks' exchanges
        differ) they are left to fail on their own and the group is not used again in this process."""
        self._whole = False
        header, blocks, self._header, self._blocks = self._header, self._blocks, None, None
        started = ([header[-1]] if header else []) + ([blocks[3], blocks[4]] if blocks else [])
        if not broken:
            try:
                for _, work in started:
                    work.wait()
            except Exception:
                broken = True
        if broken:
            _GROUPS[self._group_key] = None
        warnings.warn(f"mpscope: {why}; rank {self.plan.global_rank} merges no more and keeps recording its own rows "
                      "(recorder.run is this rank's own Run" + (f"; mpscope.Run.load({str(self.out)!r}) merges the "
                                                                "per-rank files" if self.out is not None else "") +
                      ").", RuntimeWarning, stacklevel=5)

    def _start_header(self) -> None:
        """Take the collected rows and start the MAX all-reduce of their header (step window,
        number of keys some rank sees for the first time, histogram exponent range)."""
        self.drain()  # on CUDA: this step's rows have reached the host
        rows, hists, steps = self._rows, self._hist, self._steps
        self._rows, self._hist, self._steps = [], [], []
        table = self.builder.key_rows
        if len(self._slot) < len(table):
            self._slot = np.concatenate([self._slot, np.full(len(table) - len(self._slot), -1, dtype=np.int64)])
        local_keys = np.unique(np.concatenate([np.asarray(c["key"], dtype=np.int64) for c in rows + hists]
                                              or [np.zeros(0, np.int64)]))
        new = [table[k] for k in local_keys if self._slot[k] < 0]
        row_steps = np.concatenate([np.asarray(c["step"], dtype=np.int64) for c in rows] or [np.zeros(0, np.int64)])
        step_ids = [int(s[0]) for s in steps]
        lo, hi = _merge.hist_range(hists, np.unique(row_steps))
        header = np.array([
            -(row_steps.min() if len(row_steps) else _FAR), row_steps.max() if len(row_steps) else -_FAR,
            -(min(step_ids) if step_ids else _FAR), max(step_ids) if step_ids else -_FAR,
            len(new), -lo if hi >= lo else -_FAR, hi if hi >= lo else -_FAR,
        ], dtype=np.int64)
        self._header = (rows, hists, steps, local_keys, new, self._start(header, dist.ReduceOp.MAX, all_ranks=True))
        self.exchanges += 1

    def _start_blocks(self) -> None:
        """Finish the pending header, agree on new keys, pack its rows and start the SUM and MIN
        reductions of the blocks (to the group's rank 0)."""
        if self._header is None:
            return
        p = self.plan
        (rows, hists, steps, local_keys, new, started), self._header = self._header, None
        header = self._finish(*started)
        r0, r1, s0, s1, n_new, hlo, hhi = (int(-header[0]), int(header[1]), int(-header[2]), int(header[3]),
                                           int(header[4]), int(-header[5]), int(header[6]))
        if n_new:
            table = self.builder.key_rows
            gathered = [None] * p.world
            dist.all_gather_object(gathered, new, group=p.group)
            self.bytes_sent += sum(len(repr(k)) for k in new)
            for keys in gathered:
                for k in keys:
                    if k not in self._agreed_index:
                        self._agreed_index[k] = len(self._agreed)
                        self._agreed.append(tuple(k))
            for k in local_keys:
                self._slot[k] = self._agreed_index.get(table[k], -1)
        if r1 < r0 and s1 < s0:
            return
        window = _merge.Window(tuple(range(r0, r1 + 1, self.settings["every"])) if r1 >= r0 else (), s0 if s1 >= s0 else 0,
                               s1 if s1 >= s0 else -1, len(self._agreed), hlo, hhi, tuple(STEP_COLUMNS))
        replicated = np.array([k[1] in p.replicated_roles for k in self._agreed], dtype=bool)
        s, m = _merge.pack(window, rows, hists, steps, self._slot, replicated, p.rank)
        self._blocks = (window, replicated, list(self._agreed),
                        self._start(s, dist.ReduceOp.SUM), self._start(m, dist.ReduceOp.MIN))

    def _finish_blocks(self) -> None:
        """Wait for the pending SUM and MIN blocks; on the group's rank 0 append the merged rows."""
        if self._blocks is None:
            return
        (window, replicated, agreed, s, m), self._blocks = self._blocks, None
        s, m = self._finish(*s), self._finish(*m)
        if self.merged is not None:
            self._merged_builder.append_merged(_merge.unpack(window, s, m, replicated), agreed)

    def _start(self, arr: np.ndarray, op, all_ranks: bool = False) -> tuple:
        """Start reducing ``arr`` with ``op`` over the group (to every rank, or to the group's
        rank 0) without waiting; :meth:`_finish` waits and returns the result."""
        p = self.plan
        t = torch.from_numpy(arr)  # mpscope's own group is gloo: host tensors, whatever the training's backend
        self.bytes_sent += arr.nbytes
        if all_ranks:
            work = dist.all_reduce(t, op=op, group=p.group, async_op=True)
        else:
            work = dist.reduce(t, dst=p.ranks[0], op=op, group=p.group, async_op=True)
        return t, work

    @staticmethod
    def _finish(t: torch.Tensor, work) -> np.ndarray:
        work.wait()
        return t.cpu().numpy()
