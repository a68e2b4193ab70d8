"""Op recording's per-call facts (``run.tables["op_facts"]``) and autocast audit (``run.tables["ops"]``).

The stats of an op's output alone cannot say that a log was fed zeros, that a division met its
pole, that a cast made integers collide or a 16-bit running value lost its increments. Per recorded
call :class:`OpFacts` keeps the row's host columns and *device facts*: views of stats taken anyway
(the output's and the floating inputs' rows) plus a few values computed by the fact rules of the
op's packet (:func:`rules_for`: a registry of small functions). Everything stays on the device until
the step's one copy (non-blocking into pinned memory on CUDA, read once it has landed); only the
calls where a fact is notable become ``op_facts`` rows (:data:`FACT_COLUMNS`).

The audit counts every call (also those the op filter gives no row) per (step, phase, module, op,
input dtypes, output dtype, flags): :data:`~mpscope.schema.AUDIT_COLUMNS`.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np
import pandas as pd
import torch

from mpscope import stats as _stats_mod
from mpscope.formats import FORMATS, dtype_name
from mpscope.recording.autocast_policy import (BOUNDARIES, DISTINCT_MAX_FLOAT, DISTINCT_MAX_INT, MASKING, MATMULS,
                                               PERIODIC, SUMMING, may_overflow_values, periodic_coarse_values)
from mpscope.recording.op_tracker import renumbered
from mpscope.schema import AUDIT_COLUMNS, FACT_COLUMNS

LOW = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_has_data = _stats_mod.has_own_data
#: The device facts of an ``op_facts`` row, in this order.
DEV_FIELDS = ["out_nan", "out_inf", "in_nan", "in_inf", "in_absmax0", "in_absmax1", "in_zero",
              "int_valued", "in_absmax", "changed", "distinct_in", "distinct_out", "in_pole", "cast_err",
              "acc_increments", "acc_swamped"]
FIELD = {f: i for i, f in enumerate(DEV_FIELDS)}
_ABSMAX_COLS = (FIELD["in_absmax0"], FIELD["in_absmax1"])


class FactRecord(NamedTuple):
    """One recorded op output: the host columns of its ``op_facts`` row (:data:`ROW_COLUMNS`, the
    first 14 fields), then what the step's fact filter reads besides."""

    seq: int  #: its number in the step
    phase: str  #: "forward", "backward" or "eval"
    module: str
    name: str  #: its op_output row's name, ``<overload>#<k>``
    op: str  #: the ATen overload
    out_dtype: str
    numel: int
    reduction: str  #: the reduction policy's name, "" for none
    reduction_len: int
    scalar: float  #: the first Python number among the arguments (NaN: none)
    scalar_lost: float  #: the first float the output dtype flushes to zero (NaN: none)
    scalar_overflow: float  #: the first float that overflows it
    scalar_rounded: float  #: the first float that rounds onto a boundary it guards against
    periodic_src: "int | float"  #: the seq of the cast whose values reach this sin/cos/tan (NaN: none)
    scalar_nan: int  #: Python floats that are NaN
    scalar_inf: int  #: Python floats that are inf
    noted: bool  #: the fact filter looks at it whatever its device values
    call: int  #: its call's place in the step's call log (for renumbering)


#: host columns of an op_facts row, as kept per record
ROW_COLUMNS = list(FactRecord._fields[:14])
_NAN, _INF = _stats_mod.COUNT_NAMES.index("nan"), _stats_mod.COUNT_NAMES.index("inf")


class FactCall:
    """One output of one op call, as the fact rules see it: the op's ``info``, ``args``, ``kwargs``,
    floating inputs ``tin``, the output ``out``, its ``phase``, the running value ``before`` an
    in-place accumulation (or None), and what the rules found (:meth:`put` a device value,
    ``host`` a host value by field)."""

    __slots__ = ("facts", "info", "args", "kwargs", "tin", "out", "phase", "before", "fields", "vals", "host")

    def __init__(self, facts: "OpFacts", info, args, kwargs, tin, out, phase, before):
        self.facts, self.info, self.args, self.kwargs, self.tin, self.out = facts, info, args, kwargs, tin, out
        self.phase, self.before = phase, before
        self.fields: list[int] = []
        self.vals: list[torch.Tensor] = []
        self.host: dict = {}

    def put(self, field: str, value: torch.Tensor) -> None:
        self.fields.append(FIELD[field])
        self.vals.append(value)


def _zeros_into_log(c: FactCall) -> None:
    """``in_zero``: zeros fed to a log."""
    if c.tin:
        c.put("in_zero", (c.tin[0] == 0).sum())


def _pole_hits(c: FactCall) -> None:
    """``in_pole``: inputs at the op's pole in forward (the divisor of a division, the argument of
    log1p / atanh ...); a Python divisor's zero is visible on the host."""
    info, tin = c.info, c.tin
    if not tin or c.phase != "forward":
        return
    div = info.packet in ("div", "div_")
    if div and len(tin) < 2:
        return
    x = tin[1] if div else tin[0]
    pole = info.pole
    c.put("in_pole", (x.detach().abs() == 1).sum() if pole == 1.0 else (x.detach() == pole).sum())


def _cast_source(c: FactCall) -> None:
    """A float16/bfloat16 cast of a tensor: whether its source holds only integers (``int_valued``),
    its largest |x| (``in_absmax``), the elements the cast changed, the largest rounding error
    (``cast_err``) and, for short vectors of data (positions, timesteps), the distinct values before
    and after (``distinct_in`` / ``distinct_out``)."""
    info, o = c.info, c.out
    if o.dtype not in LOW:
        return
    src = c.args[1] if info.packet == "copy_" else c.args[0]
    if not isinstance(src, torch.Tensor) or src.dtype == o.dtype or src.is_complex() \
            or src.dtype == torch.bool or not _has_data(src):
        return
    facts = c.facts
    if src.device.type == "cpu" and src.dtype in FLOATS and src.numel():
        i = facts.marks.known(o)
        if (i is None or facts.marks.taint.get(i) != facts.seq) \
                and _finite_absmax_on_host(facts.stats_of(src)) <= 2.0 / FORMATS[dtype_name(o.dtype)].eps:
            # every finite value is below 2 / eps, where the target format holds every integer: no
            # integer can collide, and a constant this small cannot overflow (host read of a CPU
            # tensor: no device to wait for; on CUDA the facts below stay on the device). A taint
            # source (a short vector of non-integer data whose values may reach a sin/cos) keeps
            # them: float_precision reads its in_absmax, distinct values and cast_err.
            return
    x = src.detach()
    if x.is_floating_point():
        fin = torch.isfinite(x)
        c.put("int_valued", ((x == torch.round(x)) | ~fin).all())
        c.put("in_absmax", torch.where(fin, x.abs(), 0).amax())
        # weights, activations and gradients are not positions: no sort for them
        limit = 0 if (c.phase == "backward" or src.requires_grad or isinstance(src, torch.nn.Parameter)) \
            else DISTINCT_MAX_FLOAT
    else:
        c.host["int_valued"] = 1.0
        c.put("in_absmax", x.abs().amax())
        limit = DISTINCT_MAX_INT
    if o.numel() == x.numel():
        y = o.detach().reshape(x.shape)
        c.put("changed", (y.to(x.dtype) != x).sum())
        if x.is_floating_point() and limit:
            c.put("cast_err", torch.where(torch.isfinite(x), (y.to(x.dtype) - x).abs(), 0).amax())
        if x.numel() <= limit:
            c.put("distinct_in", _distinct(x))
            c.put("distinct_out", _distinct(y))


def _arange_values(c: FactCall) -> None:
    """A float16/bfloat16 ``arange`` of integers: the values asked for against those made."""
    o = c.out
    if o.dtype not in LOW:
        return
    nums = [a for a in c.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if all(float(a).is_integer() for a in nums) and o.numel() <= DISTINCT_MAX_INT:
        c.host["int_valued"] = 1.0
        c.host["distinct_in"] = float(o.numel())
        c.put("in_absmax", o.detach().abs().amax())  # the values asked for, as rounded
        c.put("distinct_out", _distinct(o.detach()))
        # elements whose value the low-precision arange changed: vs an exact float64 arange
        ref = torch.arange(*nums, dtype=torch.float64, device=o.device)
        if ref.numel() == o.numel():
            c.put("changed", (o.detach().to(torch.float64) != ref).sum())


def _lost_increments(c: FactCall) -> None:
    """An in-place update of a 16-bit running value: the increments it took and those it lost."""
    if c.before is not None and c.out is c.args[0]:
        increments, swamped = _swamped(c.info, c.args, c.kwargs, c.before, c.out)
        c.put("acc_increments", increments)
        c.put("acc_swamped", swamped)


_RULES: dict[str, tuple[Callable, ...]] = {}


def rules_for(info) -> tuple[Callable, ...]:
    """The fact rules of an op (cached by its packet): each ``rule(call: FactCall)`` puts the
    device facts it finds."""
    rules = _RULES.get(info.packet)
    if rules is None:
        rules = _RULES[info.packet] = tuple(r for r, on in (
            (_zeros_into_log, info.log), (_pole_hits, info.pole is not None), (_cast_source, info.cast),
            (_arange_values, info.packet == "arange"), (_lost_increments, info.accumulating)) if on)
    return rules


class OpFacts:
    """The ``op_facts`` records and the audit of one recording.

    Args:
        marks: the step's :class:`~mpscope.recording.op_marks.TensorMarks` (``ds``, ``taint``).
        fused: ``fused()``, the fused kernel the stats of an op's input are taken with.
    """

    def __init__(self, marks, fused: Callable) -> None:
        self.marks, self.fused = marks, fused
        self._audit_rows: list[tuple] = []
        # kept op_facts rows, per step: (step, host columns by row, (rows, fields) values, whether a
        # record of the step had no periodic_src: the column is float then, as a frame of them all)
        self._fact_parts: list[tuple] = []
        self._pending: list = []  # (step, records, sizes, copies) whose host copy may not have landed
        self.reset()

    def reset(self) -> None:
        """A step begins."""
        self._audit: dict = {}
        # One entry per recorded output, in flat lists (few objects for the garbage collector to
        # track): its FactRecord, its host facts by record (only where there are some), and the device part:
        # the output's DeviceStats, its floating inputs' (record, DeviceStats), the inputs whose
        # largest |x| is kept (record, column, DeviceStats), extra device facts (record, fields,
        # float64 values).
        self._rows: list[tuple] = []
        self._hosts: dict[int, dict] = {}
        self._out_ds: list = []
        self._in_rec: list[int] = []
        self._in_ds: list = []
        self._ab_rec: list[int] = []
        self._ab_col: list[int] = []
        self._ab_ds: list = []
        self._extra: list[tuple] = []
        self.periodic_srcs: set = set()  # seqs that some recorded sin/cos/tan's periodic_src names

    @property
    def seq(self) -> int:
        """The number of the next record this step."""
        return len(self._rows)

    def count(self, phase: str, module: str, op: str, in_dtypes: tuple, out_dtype, autocast: bool, inplace: bool,
              out_variant: bool, param_lowp: bool, reduction: str, pass_id, numel: int, red_len: int) -> None:
        """One call for the audit (:data:`~mpscope.schema.AUDIT_COLUMNS`): its row's phase, module, op,
        input dtypes, output dtype and flags, the pass it belongs to (a pass found at the step's end
        not to train the model counts as ``"eval"``), its output's elements and reduction length."""
        key = (phase, module, op, in_dtypes, out_dtype, autocast, inplace, out_variant, param_lowp, reduction, pass_id)
        agg = self._audit.get(key)
        if agg is None:
            self._audit[key] = [1, numel, red_len]
        else:
            agg[0] += 1
            agg[1] += numel
            agg[2] = max(agg[2], red_len)

    def stats_of(self, t: torch.Tensor):
        """The DeviceStats (one row) of ``t`` this step: a recorded op's output, or taken now."""
        marks = self.marks
        i = marks.claim(t)
        ds = marks.ds.get(i)
        if ds is None:
            ds = marks.ds[i] = _stats_mod.device_stats([t.detach()], False, self.fused())
        return ds

    @staticmethod
    def absmax_inputs(info, tin, in_stats) -> tuple:
        """(column of ``in_absmax<k>``, DeviceStats) of the inputs whose largest |x| this op's row keeps."""
        if not tin:
            return ()
        p = info.packet
        if info.reduction in SUMMING:
            j = [1, 2] if p in ("addmm", "baddbmm", "addbmm", "addmv") else [0, 1]
            j = j[: 2 if p in MATMULS else 1]
        elif p in MASKING or p in ("mul", "mul_", "pow", "div", "div_", "square", "addcmul"):
            j = [0, 1]
        elif info.periodic and tin[0].dtype in LOW:  # float_precision: the argument's largest |x|
            j = [0]
        else:
            return ()
        return tuple((_ABSMAX_COLS[k], in_stats[i]) for k, i in enumerate(j) if i < len(tin))

    def device_facts(self, rules, info, args, kwargs, tin, o, phase, before) -> tuple:
        """``rules`` applied to output ``o``: (field indices, float64 values on ``o``'s device or
        None, host values by field)."""
        c = FactCall(self, info, args, kwargs, tin, o, phase, before)
        with torch.no_grad():
            for rule in rules:
                rule(c)
            vals = torch.stack([v.to(device=o.device, dtype=torch.float64) for v in c.vals]) if c.vals else None
        return c.fields, vals, c.host

    def add(self, row: FactRecord, ds, in_stats: list, absmax_in: tuple, fields, vals, host) -> None:
        """Keep one record (``ds``: the output's stats; ``in_stats``: its floating inputs'; ``absmax_in``:
        the inputs whose largest |x| it keeps; ``fields`` / ``vals`` / ``host``: its device facts)."""
        seq = len(self._rows)
        self._out_ds.append(ds)
        self._in_rec.extend([seq] * len(in_stats))
        self._in_ds.extend(in_stats)
        for col, x in absmax_in:
            self._ab_rec.append(seq)
            self._ab_col.append(col)
            self._ab_ds.append(x)
        if fields:
            self._extra.append((seq, fields, vals))
        if host:
            self._hosts[seq] = host
        if not isinstance(row.periodic_src, float):
            self.periodic_srcs.add(row.periodic_src)
        self._rows.append(row)

    # ----------------------------------------------------------------- the step's end
    def flush(self, step: int, final: list | None, dropped: set, moved: set) -> None:
        """End of a recorded step: store its audit rows (the calls of ``dropped`` passes as
        ``"eval"``, of ``moved`` casts as ``"forward"``) and start the copy of its device facts to the
        host: the non-finite counts and extrema of every distinct stats row the records point at, and
        the extra facts, in two ``cat``s and one copy per device (on CUDA non-blocking into pinned
        memory, processed once it has landed: no host synchronisation; on the CPU at once).
        ``final``: each call's (phase, k) after renumbering (None: as counted)."""
        rows, hosts, audit, periodic = self._rows, self._hosts, self._audit, self.periodic_srcs
        out_ds, in_rec, in_ds, ab_rec, ab_col, ab_ds, extra = (self._out_ds, self._in_rec, self._in_ds, self._ab_rec,
                                                               self._ab_col, self._ab_ds, self._extra)
        self.reset()
        self._audit_rows.extend(_audit_rows(step, audit, dropped, moved))
        if final is not None:  # renumber's names and phases
            rows = [r._replace(phase=final[r.call][0], name=renumbered(r.name, final[r.call][1])) for r in rows]
        if rows:
            plan, copies = _copy_to_host(rows, out_ds, in_rec, in_ds, ab_rec, ab_col, ab_ds, extra)
            self._pending.append((step, rows, hosts, plan, copies, periodic))
        self.drain(block=False)

    def drain(self, block: bool) -> None:
        """Turn the landed copies into ``op_facts`` rows (all of them, waiting, when ``block``)."""
        while self._pending:
            step, rows, hosts, plan, copies, periodic = self._pending[0]
            events = [ev for *_, evs in copies for ev in evs]
            if not block and any(not ev.query() for ev in events):
                return
            for ev in events:
                ev.synchronize()
            self._pending.pop(0)
            values = _values(rows, hosts, plan, copies)
            keep = _notable(rows, values, periodic)
            if keep.any():
                idx = np.flatnonzero(keep)
                self._fact_parts.append((step, [rows[i][:14] for i in idx], values[idx],
                                         any(isinstance(r.periodic_src, float) for r in rows)))

    def publish(self, run) -> None:
        """Every copy landed, the tables ``ops`` and ``op_facts`` onto ``run``."""
        self.drain(block=True)
        audit = pd.DataFrame(self._audit_rows, columns=AUDIT_COLUMNS)
        facts = (_facts_frame(self._fact_parts) if self._fact_parts
                 else pd.DataFrame({c: pd.Series(dtype=_fact_dtype(c)) for c in FACT_COLUMNS}))
        run.tables["ops"] = audit
        run.tables["op_facts"] = facts
        run.meta.setdefault("ops", True)


def _audit_rows(step: int, audit: dict, dropped: set, moved: set) -> list[tuple]:
    """The step's audit rows: the passes summed, those that did not train as "eval"."""
    merged: dict = {}
    for (phase, *rest, p), (calls, numel, red_len) in audit.items():
        key = ("eval" if p in dropped else ("forward" if p in moved else phase), *rest)
        agg = merged.get(key)
        merged[key] = [calls, numel, red_len] if agg is None else [agg[0] + calls, agg[1] + numel,
                                                                   max(agg[2], red_len)]
    return [(step, phase, module, op, ",".join(dtype_name(d) for d in in_dtypes), dtype_name(out_dtype), *flags,
             calls, numel, red_len)
            for (phase, module, op, in_dtypes, out_dtype, *flags), (calls, numel, red_len) in merged.items()]


def _copy_to_host(rows, out_ds, in_rec, in_ds, ab_rec, ab_col, ab_ds, extra) -> tuple:
    """Start the copy of the records' device facts: ``(plan, copies)``, where ``plan`` says which
    landed row each record's stats are and ``copies`` holds per device ``(device, counts, their
    order, floats, their order, events)``."""
    stats: list = []  # distinct DeviceStats, first seen first
    where: dict = {}  # id(DeviceStats) -> position in stats
    for ds in (*out_ds, *in_ds, *ab_ds):
        if id(ds) not in where:
            where[id(ds)] = len(stats)
            stats.append(ds)
    by_device: dict = {}  # device -> positions in stats
    for p, ds in enumerate(stats):
        by_device.setdefault(ds.counts.device, []).append(p)
    row = np.empty(len(stats), dtype=np.int64)  # position in stats -> row of the host arrays
    copies, base = [], 0
    for device, ps in by_device.items():
        counts, order = _first_rows([stats[p].counts for p in ps], _NAN, _INF + 1)
        extrema, order_e = _first_rows([stats[p].extrema for p in ps], 0, 2)
        vals = [v for _, _, v in extra if v.device == device]
        floats = torch.cat([extrema.reshape(-1), *vals]) if vals else extrema.reshape(-1)
        row[ps] = base + np.arange(len(ps))
        base += len(ps)
        (c, ev), (f, ev2) = _stats_mod.to_host_async(counts.reshape(-1)), _stats_mod.to_host_async(floats)
        copies.append((device, c, order, f, order_e, [e for e in (ev, ev2) if e is not None]))

    def at(lst):
        return row[np.fromiter((where[id(ds)] for ds in lst), dtype=np.int64, count=len(lst))]

    plan = (at(out_ds), np.asarray(in_rec, dtype=np.int64), at(in_ds), np.asarray(ab_rec, dtype=np.int64),
            np.asarray(ab_col, dtype=np.int64), at(ab_ds), [(i, f, v.device, v.numel()) for i, f, v in extra])
    return plan, copies


def _values(rows, hosts, plan, copies) -> np.ndarray:
    """Every record's facts as a (records, fields) array, from the landed copies."""
    out_at, in_rec, in_at, ab_rec, ab_col, ab_at, extra = plan
    counts, extrema, vals = [], [], {}
    for device, c, order, f, order_e, _ in copies:
        n = len(order)
        c_rows, e_rows = np.empty((n, 2)), np.empty((n, 2))
        c_rows[order] = c.numpy().reshape(n, 2)  # back to first-seen order
        e_rows[order_e] = f.numpy()[: 2 * n].reshape(n, 2)
        counts.append(c_rows)
        extrema.append(e_rows)
        vals[device] = f.numpy()[2 * n:]
    counts = np.concatenate(counts)  # (distinct stats, 2): nan, inf
    extrema = np.concatenate(extrema)  # (distinct stats, 2): largest, smallest finite
    n = len(rows)
    values = np.full((n, len(DEV_FIELDS)), np.nan)
    values[:, 0:2] = counts[out_at]
    inputs = np.zeros((n, 2))  # the inputs' non-finite counts, then the Python scalars'
    np.add.at(inputs, in_rec, counts[in_at])
    values[:, 2:4] = inputs + np.array([(r.scalar_nan, r.scalar_inf) for r in rows], dtype=np.float64).reshape(n, 2)
    if len(ab_rec):
        with np.errstate(invalid="ignore"):
            a = np.where(counts[ab_at, 1] > 0, np.inf, np.abs(extrema[ab_at]).max(axis=1))
        values[ab_rec, ab_col] = np.where(counts[ab_at, 0] > 0, np.nan, a)
    offset = dict.fromkeys(vals, 0)
    for i, fields, device, m in extra:
        values[i, fields] = vals[device][offset[device]: offset[device] + m]
        offset[device] += m
    for i, host in hosts.items():
        for field, v in host.items():
            values[i, FIELD[field]] = v
    return values


def _notable(rows, values: np.ndarray, periodic: set) -> np.ndarray:
    """The fact filter: the records with a notable device value, and those with a host fact
    (``noted``: a lost / overflowing / rounded constant, a sin/cos/tan, a forward reduction in
    float16/bfloat16), on which the frame-level rules decide."""
    F, v = FIELD, values
    with np.errstate(invalid="ignore"):
        keep = (v[:, F["out_nan"]] + v[:, F["out_inf"]] > 0) | (v[:, F["in_zero"]] > 0) | (v[:, F["in_pole"]] > 0) \
            | ~np.isnan(v[:, F["acc_increments"]]) | ((v[:, F["int_valued"]] == 1) & (v[:, F["changed"]] > 0))
    noted = np.flatnonzero([r.noted or r.seq in periodic for r in rows])
    if len(noted):
        sub = [rows[i] for i in noted]
        host_fact = np.array([not (math.isnan(r.scalar_lost) and math.isnan(r.scalar_overflow)
                                   and math.isnan(r.scalar_rounded))
                              or not isinstance(r.periodic_src, float) or r.seq in periodic for r in sub])
        dtypes = [r.out_dtype for r in sub]
        keep[noted] |= host_fact \
            | periodic_coarse_values([r.op.split(".")[1] in PERIODIC for r in sub], v[noted, F["in_absmax0"]], dtypes) \
            | may_overflow_values([r.phase == "forward" for r in sub], [r.reduction != "" for r in sub], dtypes,
                                  np.array([r.reduction_len for r in sub]), v[noted, F["in_absmax0"]],
                                  v[noted, F["in_absmax1"]])
    return keep


def scalar_facts(flat: list, dtype: torch.dtype) -> tuple:
    """The Python scalars among an op's arguments ``flat`` against its output ``dtype``: ``(scalar,
    lost, overflow, rounded, nans, infs)``: the first number, the first float that ``dtype`` flushes
    to zero, that overflows it, that rounds onto a boundary (1, -1) it guards against (NaN for
    none), and how many floats are NaN / inf."""
    lost = overflow = rounded = math.nan
    nans = infs = 0
    scalar = next((float(a) for a in flat if isinstance(a, (int, float)) and not isinstance(a, bool)), math.nan)
    low = dtype in LOW
    fmt = FORMATS[dtype_name(dtype)] if low else None
    for a in flat:
        if isinstance(a, float):
            if math.isnan(a):
                nans += 1
            elif math.isinf(a):
                infs += 1
            elif low and 0 < abs(a) <= fmt.underflow_threshold and math.isnan(lost):
                lost = a
            elif low and abs(a) >= fmt.overflow_threshold and math.isnan(overflow):
                overflow = a
            elif low and math.isnan(rounded) and abs(abs(a) - 1.0) <= fmt.eps \
                    and a not in BOUNDARIES and _round_to(a, dtype) in BOUNDARIES:
                rounded = a
    return scalar, lost, overflow, rounded, nans, infs


def _round_to(x: float, dtype: torch.dtype) -> float:
    """``x`` as ``dtype`` holds it (round to nearest even, as ``tensor.to(dtype)``)."""
    return float(torch.tensor(x, dtype=torch.float64).to(dtype))


def _first_rows(tensors: list[torch.Tensor], lo: int, hi: int) -> tuple[torch.Tensor, np.ndarray]:
    """Columns ``lo:hi`` of the first row of each (rows, columns) tensor, one row each, and which
    tensor each row comes from (tensors of one shape are concatenated by one op, so rows come grouped
    by shape)."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(tuple(t.shape), []).append(i)
    parts, order = [], []
    for shape, idx in groups.items():
        g = torch.cat([tensors[i] for i in idx]) if len(idx) > 1 else tensors[idx[0]]
        if shape[0] != 1:
            g = g.reshape(len(idx), shape[0], shape[1])[:, 0]
        parts.append(g[:, lo:hi])
        order.extend(idx)
    return (torch.cat(parts) if len(parts) > 1 else parts[0]), np.asarray(order, dtype=np.int64)


def _finite_absmax_on_host(ds) -> float:
    """Largest finite |x| from a CPU tensor's stats (reads host memory; no device involved)."""
    e = ds.extrema.numpy()[0]
    return float(max(abs(e[0]), abs(e[1]))) if np.isfinite(e[0]) else 0.0


def _facts_frame(parts: list[tuple]) -> pd.DataFrame:
    """``run.tables["op_facts"]`` from the kept rows of every step (see ``OpFacts._fact_parts``)."""
    frame = pd.DataFrame([r for _, rows, _, _ in parts for r in rows], columns=ROW_COLUMNS)
    if any(p[3] for p in parts):
        frame["periodic_src"] = frame["periodic_src"].astype(np.float64)
    values = np.concatenate([p[2] for p in parts])
    for j, c in enumerate(DEV_FIELDS):
        frame[c] = values[:, j]
    frame.insert(0, "step", np.concatenate([np.full(len(rows), step, dtype=np.int64) for step, rows, _, _ in parts]))
    return frame[FACT_COLUMNS]


def _fact_dtype(c: str):
    if c in ("phase", "module", "name", "op", "out_dtype", "reduction"):
        return "str"  # (what pandas infers for the text columns of a frame of rows)
    return "int64" if c in ("step", "seq", "numel", "reduction_len") else "float64"


def _swamped(info, args, kwargs, before: torch.Tensor, after: torch.Tensor):
    """(increments, swamped) of one in-place update ``before -> after`` of a running value: the
    elements whose exact update (computed in float64) changes the value, and those of them the
    low-precision update left equal to ``before``."""
    old = before.to(torch.float64)
    x = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("end"))
    x = x.to(torch.float64) if isinstance(x, torch.Tensor) else float(x)
    if info.packet == "lerp_":
        w = args[2] if len(args) > 2 else kwargs.get("weight")
        w = w.to(torch.float64) if isinstance(w, torch.Tensor) else float(w)
        exact = old + w * (x - old)
    else:
        alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
        exact = old + (alpha if info.packet == "add_" else -alpha) * x
    moved = (exact != old).expand(old.shape)
    return moved.sum().to(torch.float64), (moved & (after == before)).sum().to(torch.float64)


def _distinct(t: torch.Tensor) -> torch.Tensor:
    """Number of distinct values of ``t`` (sort + adjacent differences; no host sync)."""
    s = torch.sort(t.reshape(-1))[0]
    if s.numel() < 2:
        return torch.tensor(float(s.numel()), dtype=torch.float64, device=t.device)
    return ((s[1:] != s[:-1]).sum() + 1).to(torch.float64)
