"""The fused kernel writing into preallocated rows (``fused_stats_into``, the recorder's per-tensor
path on the CPU) against the cast oracle, the allocating entry point and the torch-op path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import mpscope
from mpscope import kernel, stats
from mpscope.recording.step_buffer import RowTables
from test_stats import BF16_BOUNDARIES, FP16_BOUNDARIES, SPECIAL, frexp_histogram, oracle

WIDTH = RowTables.WIDTH
NC = len(stats.COUNT_NAMES)


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Log-uniform magnitudes over every binade of float32 (so subnormals, fp16/bf16 under- and
    overflow), with the rounding boundaries, zeros, inf and NaN mixed in."""
    g = torch.Generator().manual_seed(seed)
    exps = torch.randint(-150, 129, (n,), generator=g).double()
    x = (1 + torch.rand(n, generator=g, dtype=torch.float64)) * torch.pow(2.0, exps)
    x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
    special = torch.tensor(FP16_BOUNDARIES + BF16_BOUNDARIES + SPECIAL, dtype=torch.float64)
    k = min(n, len(special))
    x[torch.randperm(n, generator=g)[:k]] = special[:k]
    if n > 200:
        x[::97] = 0.0
        x[5::89] = torch.randn(len(x[5::89]), generator=g, dtype=torch.float64) * 0.02  # a common binade
    return x.to(dtype)


def _into(fused, tensors, hist, row=3, rows=None):
    rows = rows or row + len(tensors) + 2
    counts = torch.full((rows, WIDTH), -7, dtype=torch.int64)
    extrema = torch.full((rows, 3), -7.0, dtype=torch.float64)
    kernel.fused_stats_into(fused, tensors, hist, counts, extrema, row)
    return counts, extrema


def _row_stats(counts: torch.Tensor, extrema: torch.Tensor, i: int, n: int) -> dict:
    """One row as the oracle's columns (fractions of ``n`` elements, NaN extrema when none)."""
    r = stats.host_rows(counts[i : i + 1, :NC].numpy(), extrema[i : i + 1].numpy())
    out = {f"{c}_frac": float(r[f"{c}_count"][0]) / n for c in stats.COUNT_NAMES if c not in ("nan", "inf")}
    out.update(nan_count=int(r["nan_count"][0]), inf_count=int(r["inf_count"][0]))
    out.update({k: float(r[k][0]) for k in ("max", "min", "absmax", "absmin_nonzero")})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 2**15 + 3, 5 * 2**15 + 11, 2**20])
def test_rows_equal_the_cast_oracle_and_the_other_paths(fused, dtype, n):
    t = _values(n, dtype, seed=n)
    counts, extrema = _into(fused, [t], True)
    assert (counts[:3] == -7).all() and (counts[4:] == -7).all() and (extrema[4:] == -7).all()  # one row written
    want = oracle(t)
    got = _row_stats(counts, extrema, 3, n)
    for k, v in want.items():
        assert (math.isnan(v) and math.isnan(got[k])) or got[k] == v, f"{dtype} n={n} {k}: {got[k]} vs oracle {v}"
    hist = counts[3, NC:].numpy()
    assert {int(j) + stats.EXP_MIN: int(c) for j, c in enumerate(hist) if c} == frexp_histogram(t)
    alloc_counts, alloc_extrema = kernel.fused_stats(fused, [t], True)
    torch_path = stats._torch_stats([t], True)
    for c, e in ((alloc_counts, alloc_extrema), (torch_path.counts, torch_path.extrema)):
        assert torch.equal(counts[3:4], c) and torch.equal(extrema[3:4], e)


def _trained_like(seed: int) -> torch.Tensor:
    """Values as training makes them: most elements in a few binades around a random scale (the
    kernel's one-pass path, whose window covers 16 binades below a chunk's top), with what breaks
    that path's guesses mixed in by chance: a stretch at another scale (the next chunk's window
    starts too high or too low), the rounding boundaries with inf and NaN, zeros, float32
    subnormals, and magnitudes just above fp16's underflow threshold 2^-25 (a threshold inside a
    binade). Sizes cross the 2^15-element chunks and the 512-element blocks."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 5 * 2**15, (1,), generator=g)) if seed % 3 else int(torch.randint(1, 3000, (1,), generator=g))
    x = torch.randn(n, generator=g, dtype=torch.float64) * 2.0 ** float(torch.randint(-40, 20, (1,), generator=g))
    r = torch.rand(5, generator=g)
    if r[0] < 0.5:
        lo = int(torch.randint(0, n, (1,), generator=g))
        x[lo : lo + 2**14] *= 2.0 ** float(torch.randint(-30, 30, (1,), generator=g))
    if r[1] < 0.5:
        special = torch.tensor(FP16_BOUNDARIES + BF16_BOUNDARIES + SPECIAL, dtype=torch.float64)
        where = torch.randint(0, n, (min(n, 40),), generator=g)
        x[where] = special[torch.randint(0, len(special), (len(where),), generator=g)]
    if r[2] < 0.3:
        x[::7] = 0.0
    if r[3] < 0.3:
        where = torch.randint(0, n, (min(n, 50),), generator=g)
        x[where] = torch.rand(len(where), generator=g, dtype=torch.float64) * 2.0**-130
    if r[4] < 0.2:
        x = x.abs() + 2.0**-25
    return x


@pytest.mark.parametrize("seed", range(24))
def test_rows_of_training_like_values_equal_the_cast_oracle(fused, seed):
    x = _trained_like(seed)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = x.to(dtype)
        counts, extrema = _into(fused, [t], True)
        got, want = _row_stats(counts, extrema, 3, t.numel()), oracle(t)
        for k, v in want.items():
            assert (math.isnan(v) and math.isnan(got[k])) or got[k] == v, f"{dtype} seed={seed} {k}: {got[k]} vs {v}"
        hist = counts[3, NC:].numpy()
        assert {int(j) + stats.EXP_MIN: int(c) for j, c in enumerate(hist) if c} == frexp_histogram(t), (dtype, seed)
        no_hist, no_hist_ext = _into(fused, [t], False)
        assert torch.equal(no_hist[3, :NC], counts[3, :NC]) and torch.equal(no_hist_ext[3], extrema[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("signs", ["positive", "negative", "one positive", "one negative", "zeros", "signed zeros"])
def test_extrema_of_one_signed_tensors_equal_torch(fused, dtype, signs):
    """Max, min and the smallest non-zero magnitude when every element (or all but one) has one
    sign, with +0.0 / -0.0 mixed in: the vector lanes track the signs' cases apart. Sizes end inside
    the first 64 elements, inside a 512-element block and in a later chunk. Oracle: torch's own
    reductions of the same values in float64."""
    g = torch.Generator().manual_seed(len(signs))
    for n in (1, 63, 64, 600, 2**15 + 77):
        x = torch.randn(n, generator=g, dtype=torch.float64).abs() * 0.02 + 1e-4
        if signs in ("negative", "one positive"):
            x = -x
        if signs.startswith("one"):
            x[int(torch.randint(n, (1,), generator=g))] *= -1
        if signs in ("zeros", "signed zeros"):
            x[::3] = 0.0
            if signs == "signed zeros":
                x = -x
        t = x.to(dtype)
        _, extrema = _into(fused, [t], False)
        v = t.double()
        nonzero = v.abs()[v != 0]
        want = [v.max().item(), v.min().item(), nonzero.min().item() if len(nonzero) else math.inf]
        assert extrema[3].tolist() == want, f"{dtype} {signs} n={n}"


def test_batch_of_mixed_dtypes_noncontiguous_and_empty(fused):
    """Several tensors in one call (rows row..row+n-1): transposed, strided, sliced and empty ones,
    each row equal to the torch-op path's (itself tested against the oracle)."""
    base = _values(3 * 2**15, torch.float32, seed=11).reshape(3, 2**15)
    ts = [base.t(), base.to(torch.bfloat16)[:, ::3], base.to(torch.float16)[1, 100:5000],
          torch.empty(0, dtype=torch.float16), _values(2**17 + 3, torch.bfloat16, seed=12)[1::2],
          torch.tensor([math.nan, -math.inf, 0.0], dtype=torch.float32)]
    assert not ts[0].is_contiguous() and not ts[1].is_contiguous()
    for hist in (True, False):
        counts, extrema = _into(fused, ts, hist, row=5)
        for i, t in enumerate(ts):
            if t.numel():
                want = stats._torch_stats([t], hist)
                assert torch.equal(counts[5 + i, : want.counts.shape[1]], want.counts[0]), (i, hist)
                assert torch.equal(extrema[5 + i], want.extrema[0]), (i, hist)
            if not hist:  # the histogram columns are left as they were
                assert (counts[5 + i, NC:] == -7).all()
        # the empty tensor: no element in any class, no extrema
        assert (counts[8, :NC] == 0).all() and extrema[8].tolist() == [-math.inf, math.inf, math.inf]


def test_rows_outside_the_tables_are_refused(fused):
    counts = torch.zeros(4, WIDTH, dtype=torch.int64)
    extrema = torch.zeros(4, 3, dtype=torch.float64)
    t = torch.ones(3)
    with pytest.raises(RuntimeError, match="outside the tables"):
        kernel.fused_stats_into(fused, [t, t], True, counts, extrema, 3)
    with pytest.raises(RuntimeError, match="contiguous CPU int64"):
        kernel.fused_stats_into(fused, [t], True, counts[:, :NC], extrema, 0)
    assert (counts == 0).all()


def _train_many_modules(current, steps: int = 2, hist_every: int = 2):
    """A model of 264 small modules: over 512 observed tensors per step (the host tables grow
    inside the first recorded step), aliased outputs (Identity) and steps with and without
    histograms (``hist_every``)."""
    torch.manual_seed(0)
    layers = []
    for i in range(132):
        layers += [torch.nn.Linear(8, 8), torch.nn.Identity() if i % 2 else torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    real, real_core = kernel.current, kernel.core
    kernel.current = current
    kernel.core = lambda: None  # (a current returning None: the torch-op path, no fused kernel at all)
    try:
        with mpscope.record(model, optimizer=opt, hist_every=hist_every) as rec:
            for k in range(steps):
                x = torch.randn(16, 8, generator=g) * 10.0 ** (4 * k - 4)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x).float().square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        kernel.current, kernel.core = real, real_core
    return rec


def test_recorded_rows_through_growing_tables_equal_the_torch_path(fused):
    got = _train_many_modules(lambda start=True: fused)
    want = _train_many_modules(lambda start=True: None)
    assert got.run.meta["fused_kernel_from_step"] == 0 and want.run.meta["fused_kernel_from_step"] is None
    assert len(got._steps.host_tables.host_counts) > 512  # the tables grew
    per_step = got.run.tensors.groupby("step").size()
    assert (per_step > 512).all() and len(per_step) == 2
    assert got.run.tensors.equals(want.run.tensors)
    assert got.run.histograms.equals(want.run.histograms)
    assert sorted(got.run.histograms.step.unique()) == [0]  # hist_every=2
    # the first Linear's activation has a row at each step, measured (finite extrema)
    t = got.run.tensors
    first = t[(t.module == "0") & (t.role == "activation")].sort_values("step")
    assert np.isfinite(first["max"]).all() and len(first) == 2


def _train_with_an_evaluation_in_between(current, between: str):
    """Two steps, each: a training forward on ``x1``; an evaluation forward under no_grad on
    ``x2`` (the next micro-batch) before ``x1``'s backward; then a training forward and backward
    on ``x2``. The selected module (``Dropout(p=0)``) returns its input, so the kept observation
    of ``x2`` reuses the host-table row of the dropped evaluation one, and a kept row written
    later sits between them: the loss (``between="loss"``) or the activation gradient
    (``"activation_grad"``: the inputs require grad, as embeddings computed outside the selection do)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Dropout(0.0), torch.nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    roles = {"activation", "loss"} if between == "loss" else {"activation", "activation_grad"}
    g = torch.Generator().manual_seed(2)
    inputs = []
    real, real_core = kernel.current, kernel.core
    kernel.current = current
    kernel.core = lambda: None  # (a current returning None: the torch-op path, no fused kernel at all)
    try:
        with mpscope.record(model, optimizer=opt, modules=r"^0$", roles=roles) as rec:
            for _ in range(2):
                x1 = torch.randn(8, 16, generator=g).requires_grad_(between != "loss")
                x2 = (torch.randn(8, 16, generator=g) * 1e5).requires_grad_(between != "loss")  # fp16 overflow
                inputs.append((x1, x2))
                opt.zero_grad()
                loss = model(x1).square().mean()
                with torch.no_grad():
                    model(x2)
                loss.backward()
                model(x2).square().mean().backward()
                opt.step()
    finally:
        kernel.current, kernel.core = real, real_core
    return rec, inputs


@pytest.mark.parametrize("between", ["loss", "activation_grad"])
def test_a_kept_row_reusing_a_dropped_evaluation_row_keeps_its_place(fused, between):
    got, inputs = _train_with_an_evaluation_in_between(lambda start=True: fused, between)
    want, _ = _train_with_an_evaluation_in_between(lambda start=True: None, between)
    assert got.run.meta["fused_kernel_from_step"] == 0 and want.run.meta["fused_kernel_from_step"] is None
    assert got.run.tensors.equals(want.run.tensors)
    assert got.run.histograms.equals(want.run.histograms)
    t = got.run.tensors
    for step, (x1, x2) in enumerate(inputs):  # the trained inputs, not the evaluation pass's twice
        row = t[(t.step == step) & (t.module == "0") & (t.role == "activation")].iloc[0]
        o = oracle(torch.cat([x1.detach().flatten(), x2.detach().flatten()]))
        assert row["numel"] == 2 * x1.numel() and o["fp16_overflow_frac"] > 0
        for k in ("max", "min", "absmin_nonzero", "fp16_overflow_frac", "fp16_underflow_frac"):
            assert row[k] == o[k], (step, k, row[k], o[k])


def _hist_pieces(fused, seed: int):
    """Stats of tensors of every dtype, written with histograms into rows of a table the way the
    recorder writes them (table rows out of order, some left unread) plus a dense block as a copied
    buffer holds it. Returns (table, dense, tensors in table-row order, tensors of the dense block)."""
    g = torch.Generator().manual_seed(seed)
    made = []
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16] * 4):
        n = int(torch.randint(1, 3000, (1,), generator=g))
        made.append(_values(n, dtype, seed=seed * 100 + i))
    made.append(torch.zeros(40, dtype=torch.bfloat16))  # no bin at all
    table = torch.zeros(len(made) + 4, WIDTH, dtype=torch.int64)
    extrema = torch.zeros(len(made) + 4, 3, dtype=torch.float64)
    kernel.fused_stats_into(fused, made, True, table, extrema, 2)
    dense = [_values(500, torch.float32, seed=seed + 7), torch.randn(300).bfloat16()]
    counts, _ = kernel.fused_stats(fused, dense, True)
    return table.numpy(), counts.numpy(), made, dense


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("repeat_keys", [False, True])
def test_histogram_bins_of_host_rows_equal_frexp_with_and_without_the_kernel(fused, seed, repeat_keys):
    """The host copy's non-zero histogram bins (``_hist_nonzero``: the kernel's one pass over rows
    read in place, and its NumPy path) per key, against NumPy's frexp of the tensors themselves:
    table rows taken out of order and by slice, with a dense block after them, keys unique or
    repeated (micro-batches: their bins add up)."""
    from collections import Counter

    from mpscope.recording.step_buffer import _Groups, _hist_nonzero

    table, dense, made, dense_tensors = _hist_pieces(fused, seed)
    order = np.random.default_rng(seed).permutation(len(made) - 3)  # made[-3], made[-2] are not read
    pieces = [(table, order + 2), (table, slice(len(made) + 1, len(made) + 4)), (dense, slice(0, 2))]
    tensors = [made[i] for i in order] + made[-1:] + [None] * 2 + dense_tensors  # rows past the end: empty
    keys = [10 + (i % 5 if repeat_keys else i) for i in range(len(tensors))]
    want: dict[int, Counter] = {}
    for k, t in zip(keys, tensors):
        want.setdefault(k, Counter()).update(frexp_histogram(t) if t is not None else {})
    for kern in (fused, None):
        for pcs in (pieces, pieces[:1]):  # several pieces, and one piece read in place
            n = len(order) if len(pcs) == 1 else len(keys)
            groups = _Groups(keys[:n])
            entry, bins, count = _hist_nonzero(pcs, groups, kern)
            assert np.all(np.diff(entry) >= 0) and np.all(count > 0)
            got = {int(k): Counter() for k in groups.keys}
            for e, b, c in zip(entry, bins, count):
                got[int(groups.keys[e])][int(b) + stats.EXP_MIN] += int(c)
            sub = {}
            for k, t in zip(keys[:n], tensors[:n]):
                sub.setdefault(k, Counter()).update(frexp_histogram(t) if t is not None else {})
            assert got == sub, (kern is None, len(pcs))
            assert list(groups.keys) == list(dict.fromkeys(keys[:n]))
    assert sum(want.values(), Counter())  # the oracle saw bins


def test_histogram_rows_out_of_range_are_refused(fused):
    table = np.zeros((4, WIDTH), dtype=np.int64)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.hist_nonzero(fused, table, NC, stats.NHIST, np.array([0, 4]), None, 2)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.hist_nonzero(fused, table, NC, stats.NHIST, np.array([0, 1]), np.array([0, 2]), 2)


def test_histogram_bins_refuse_bad_columns_groups_and_dtypes_without_touching_memory(fused):
    """Arguments whose products or sums overflow int64 (columns past the row, a group count whose
    accumulator size wraps to a small number) and tables or rows that are not integers are refused
    with an error, not read or written out of bounds, nor truncated to other rows; integer arrays
    that are not int64 or not C-contiguous are read as they are."""
    table = np.zeros((4, WIDTH), dtype=np.int64)
    table[:, NC:] = 1
    rows = np.array([1, 2])
    with pytest.raises(RuntimeError, match="bad table or columns"):
        kernel.hist_nonzero(fused, table, 2**62, 2**62, rows, None, 0)  # col0 + nbins wraps negative
    with pytest.raises(RuntimeError, match="bad table or columns"):
        kernel.hist_nonzero(fused, table, NC, 2**63 - 1, rows, None, 0)
    wraps = pow(stats.NHIST, -1, 2**64) * 3 % 2**64  # ngroups * NHIST == 3 (mod 2**64)
    assert 0 < wraps < 2**63 and wraps * stats.NHIST % 2**64 == 3
    for ngroups in (wraps, -1):
        with pytest.raises(RuntimeError, match="groups"):
            kernel.hist_nonzero(fused, table, NC, stats.NHIST, rows, np.array([0, abs(ngroups) - 1]), ngroups)
    with pytest.raises(TypeError):
        kernel.hist_nonzero(fused, table.astype(np.float64) + 0.5, NC, stats.NHIST, rows, None, 0)
    with pytest.raises(TypeError):
        kernel.hist_nonzero(fused, table, NC, stats.NHIST, np.array([1.7, 2.2]), None, 0)  # not rows 1, 2
    # lossless conversions and copies still work: int32 tables, strided rows
    entry, bins, count = kernel.hist_nonzero(fused, table.astype(np.int32), NC, stats.NHIST,
                                             np.array([3, 9, 1, 9])[::2], None, 0)
    assert entry.tolist() == [0] * stats.NHIST + [1] * stats.NHIST and (count == 1).all()
    assert bins.tolist() == list(range(stats.NHIST)) * 2
