"""Merging the rows of several ranks into one, through sums and minima only.

Every statistic that crosses ranks is one whose merge is an element-wise SUM or MIN (a MAX is the
MIN of the negated value): element counts (numel, zero, NaN, inf, subnormal / underflow / overflow
for each format, exponent-histogram bins) add; min, max, absmax and the smallest non-zero |x|
combine exactly. Fractions are never merged: they are computed from the merged counts when read.

A merge covers a window of steps. Each rank *packs* its rows of the window into two dense float64
blocks over the same (step, key) grid, the blocks are reduced element-wise across ranks (by
``torch.distributed.all_reduce`` during training, by NumPy when per-rank files are read back), and
:func:`unpack` turns the reduced blocks into merged rows. float64 holds every count exactly up to
2^53 elements.

Rules (for a (step, key) cell):

* a rank that has no row for the key contributes nothing (zeros to SUM, +inf to MIN): keys a rank
  did not see merge as empty, and a cell nobody filled yields no row;
* *partitioned* keys (activations, gradients of each rank's own batch, shards of a sharded
  parameter) add up: the merged row describes the concatenation of the ranks' tensors;
* *replicated* keys (a DDP parameter, its all-reduced gradient, its optimizer state: the same
  tensor on every rank) are divided by the number of ranks that contributed, so the merged row is
  that tensor's own row (if the copies differ, the counts are their mean, rounded);
* step rows (:data:`STEP_RULES`): ``loss`` and the clip norms are the mean over the ranks that had
  the step; ``loss_scale``, ``scale_after`` and ``grad_reset`` the smallest; booleans
  (``found_inf``, ``skipped``, ...) are true if any rank's is, other numbers the largest; where ``loss_scale``, ``found_inf``, ``skipped`` or ``scale_after`` differ
  between ranks a disagreement row is returned (a desynchronised GradScaler);
* a cell with NaN or inf elements also gives the lowest rank that saw them and how many did.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpscope.schema import COUNT_NAMES

#: Columns of a (step, key) cell in the SUM block (then the histogram window's bins).
SUM_CELL = ("numel", "contributors", "nonfinite_ranks") + tuple(f"{n}_count" for n in COUNT_NAMES)
#: Columns of a (step, key) cell in the MIN block.
MIN_CELL = ("neg_max", "min", "absmin_nonzero", "loss_scale", "first_nonfinite_rank")
#: How a step-table column merges: the mean over the ranks that had the step, the smallest, or
#: (every other column, booleans included: true if any rank's is) the largest.
STEP_RULES = {"step": "step", "loss": "mean", "clip_norm": "mean", "clip_norm_fp32": "mean",
              "loss_scale": "min", "scale_after": "min", "grad_reset": "min"}
#: Step-table columns compared across ranks (a GradScaler must agree on all of them).
SCALER_COLUMNS = ("loss_scale", "found_inf", "skipped", "scale_after")
_NS, _NM = len(SUM_CELL), len(MIN_CELL)
_NC = 3  # counts start here in a SUM cell


@dataclass(frozen=True)
class Window:
    """The grid one merge covers, identical on every rank.

    Attributes:
        row_steps: sorted step numbers that may hold tensor rows (length R).
        first_step, last_step: the step-table rows covered (S = last - first + 1; empty if last < first).
        nkeys: number of agreed keys K.
        hist_lo, hist_hi: exponent range of the histogram bins carried (none if hist_hi < hist_lo).
        step_columns: names of the step table's columns (each is summed and min/max-ed).
    """

    row_steps: tuple
    first_step: int
    last_step: int
    nkeys: int
    hist_lo: int
    hist_hi: int
    step_columns: tuple

    @property
    def nbins(self) -> int:
        return max(0, self.hist_hi - self.hist_lo + 1)

    @property
    def nsteps(self) -> int:
        return max(0, self.last_step - self.first_step + 1)

    @property
    def sum_shape(self) -> tuple:
        return (len(self.row_steps), self.nkeys, _NS + self.nbins)

    @property
    def min_shape(self) -> tuple:
        return (len(self.row_steps), self.nkeys, _NM)

    def sizes(self) -> tuple[int, int]:
        """Elements of the SUM and MIN blocks (step rows included)."""
        r, k, w = self.sum_shape
        nsc = len(self.step_columns)
        return r * k * w + self.nsteps * (1 + nsc), r * k * _NM + self.nsteps * 2 * nsc


def pack(window: Window, rows: list[dict], hists: list[dict], steps: list[tuple], key_slot: np.ndarray,
         replicated: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """One rank's rows of ``window`` as flat float64 SUM and MIN blocks.

    Args:
        rows: tensor-row column dicts (``step, key, numel, min, max, absmin_nonzero, loss_scale``
            and ``<name>_count`` for each count name) with local keys.
        hists: histogram column dicts (``step, key, exponent, count``) with local keys.
        steps: step-table tuples in ``window.step_columns`` order.
        key_slot: int array mapping a local key to its agreed index (-1: not agreed, dropped).
        replicated: bool array over the agreed keys.
        rank: this rank (for the lowest rank that saw a non-finite value).
    """
    s = np.zeros(window.sum_shape)
    m = np.full(window.min_shape, np.inf)
    steps_arr = np.asarray(window.row_steps, dtype=np.int64)  # sorted: a step's position by bisection
    for c in rows:
        ok = np.isin(c["step"], window.row_steps)
        k = key_slot[np.asarray(c["key"])[ok]]
        ok[ok] = k >= 0
        if not ok.any():
            continue
        r = np.searchsorted(steps_arr, np.asarray(c["step"])[ok])
        k = key_slot[np.asarray(c["key"])[ok]]
        counts = np.stack([np.asarray(c[f"{n}_count"])[ok] for n in COUNT_NAMES], axis=1).astype(np.float64)
        bad = (counts[:, COUNT_NAMES.index("nan")] + counts[:, COUNT_NAMES.index("inf")]) > 0
        np.add.at(s, (r, k, 0), np.asarray(c["numel"])[ok].astype(np.float64))
        np.maximum.at(s, (r, k, 1), 1.0)
        np.maximum.at(s, (r, k, 2), bad.astype(np.float64))
        np.add.at(s, (r, k, slice(_NC, _NS)), counts)
        cell = np.stack([-np.asarray(c["max"])[ok], np.asarray(c["min"])[ok], np.asarray(c["absmin_nonzero"])[ok],
                         np.asarray(c["loss_scale"])[ok], np.where(bad, float(rank), np.inf)], axis=1)
        cell = np.where(np.isnan(cell), np.inf, cell.astype(np.float64))
        np.minimum.at(m, (r, k), cell)
    if window.nbins:
        for h in hists:
            e = np.asarray(h["exponent"]).astype(np.int64)
            ok = np.isin(h["step"], window.row_steps) & (e >= window.hist_lo) & (e <= window.hist_hi)
            k = key_slot[np.asarray(h["key"])[ok]]
            keep = k >= 0
            r = np.searchsorted(steps_arr, np.asarray(h["step"])[ok][keep])
            np.add.at(s, (r, k[keep], _NS + e[ok][keep] - window.hist_lo), np.asarray(h["count"])[ok][keep])
    nsc = len(window.step_columns)
    ss = np.zeros((window.nsteps, 1 + nsc))
    sm = np.full((window.nsteps, 2 * nsc), np.inf)
    for row in steps:
        i = int(row[0]) - window.first_step
        if 0 <= i < window.nsteps:
            v = np.array([float(x) for x in row])
            ss[i, 0] += 1
            ss[i, 1:] += v
            v = np.where(np.isnan(v), np.inf, v)
            sm[i] = np.minimum(sm[i], np.concatenate([v, -v]))
    return np.concatenate([s.reshape(-1), ss.reshape(-1)]), np.concatenate([m.reshape(-1), sm.reshape(-1)])


def reduce_blocks(blocks: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The element-wise SUM and MIN of several ranks' packed blocks (what the collectives compute)."""
    return np.sum([b[0] for b in blocks], axis=0), np.min([b[1] for b in blocks], axis=0)


@dataclass
class Merged:
    """Merged rows of one window.

    Attributes:
        rows: tensor-row columns (``step, key`` = agreed index, ``numel, min, max,
            absmin_nonzero, loss_scale`` and the counts), like :meth:`Run._append_rows` takes.
        hist: histogram columns ``step, key, exponent, count``.
        steps: step-table tuples.
        nonfinite: ``step, key, first_rank, ranks`` for cells holding NaN / inf.
        disagreement: ``(step, column, min, max)`` where ranks' GradScaler columns differ.
    """

    rows: dict
    hist: dict
    steps: list
    nonfinite: dict
    disagreement: list


def unpack(window: Window, sum_block: np.ndarray, min_block: np.ndarray, replicated: np.ndarray) -> Merged:
    """Merged rows from reduced blocks (see the module docstring for the rules)."""
    ntab = int(np.prod(window.sum_shape))
    s = sum_block[:ntab].reshape(window.sum_shape)
    m = min_block[: int(np.prod(window.min_shape))].reshape(window.min_shape)
    r, k = np.nonzero(s[:, :, 0] > 0)
    cell = s[r, k]
    div = np.where(replicated[k], np.maximum(cell[:, 1], 1.0), 1.0)
    steps = np.asarray(window.row_steps, dtype=np.int64)[r]

    def fin(x):
        return np.where(np.isinf(x), np.nan, x)

    mm = m[r, k]
    rows = {"step": steps, "key": k.astype(np.int64), "numel": np.rint(cell[:, 0] / div).astype(np.int64),
            "min": fin(mm[:, 1]), "max": fin(-mm[:, 0]), "absmin_nonzero": fin(mm[:, 2]), "loss_scale": mm[:, 3]}
    for j, name in enumerate(COUNT_NAMES):
        rows[f"{name}_count"] = np.rint(cell[:, _NC + j] / div).astype(np.int64)
    bad = cell[:, 2] > 0
    nonfinite = {"step": steps[bad], "key": k[bad].astype(np.int64),
                 "first_rank": mm[bad, 4].astype(np.int64), "ranks": cell[bad, 2].astype(np.int64)}
    hist = {"step": np.zeros(0, np.int64), "key": np.zeros(0, np.int64), "exponent": np.zeros(0, np.int64),
            "count": np.zeros(0, np.int64)}
    if window.nbins:
        h = np.rint(cell[:, _NS:] / div[:, None]).astype(np.int64)
        i, j = np.nonzero(h)
        hist = {"step": steps[i], "key": k[i].astype(np.int64), "exponent": j + window.hist_lo, "count": h[i, j]}
    nsc = len(window.step_columns)
    ss = sum_block[ntab:].reshape(window.nsteps, 1 + nsc)
    sm = min_block[int(np.prod(window.min_shape)):].reshape(window.nsteps, 2 * nsc)
    out_steps, disagreement = [], []
    for i in np.nonzero(ss[:, 0] > 0)[0]:
        row = []
        for j, col in enumerate(window.step_columns):
            lo, hi = sm[i, j], -sm[i, nsc + j]
            rule = STEP_RULES.get(col, "max")
            if rule == "step":
                row.append(int(window.first_step + i))
            elif rule == "mean":
                row.append(float(ss[i, 1 + j] / ss[i, 0]))
            else:  # NaN (no value on any rank) came in as the reduction's identity
                v = lo if rule == "min" else hi
                row.append(float(v) if np.isfinite(v) else np.nan)
            if col in SCALER_COLUMNS and lo != hi and np.isfinite(lo) and np.isfinite(hi):
                disagreement.append((int(window.first_step + i), col, float(lo), float(hi)))
        out_steps.append(tuple(row))
    return Merged(rows, hist, out_steps, nonfinite, disagreement)


def hist_range(hists: list[dict], row_steps) -> tuple[int, int]:
    """Smallest and largest exponent among histogram rows of ``row_steps`` ((1, 0) if none)."""
    lo, hi = 1 << 30, -(1 << 30)
    for h in hists:
        e = np.asarray(h["exponent"])[np.isin(h["step"], row_steps)]
        if len(e):
            lo, hi = min(lo, int(e.min())), max(hi, int(e.max()))
    return (lo, hi) if hi >= lo else (1, 0)
