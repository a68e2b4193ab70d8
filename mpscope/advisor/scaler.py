"""Loss-scale what-if, GradScaler replay, and the choice of GradScaler settings.

Three pure functions of a recorded :class:`mpscope.Run`:

* :func:`scale_whatif` shifts the recorded exponent histograms (``run.histograms``, exponents in
  unscaled units) by every candidate ``k`` and counts which fp16 class each gradient element would
  land in at loss scale ``2**k``.
* :func:`simulate_scaler` replays ``torch.amp.GradScaler``'s update rule
  (``torch._amp_update_scale_``, ATen ``AmpKernels``) over the run's per-step unscaled gradient maxima.
* :func:`choose_scaler` picks ``init_scale`` from the what-if and ``growth_interval`` by simulating
  candidates; it reports the prediction for its choice and for PyTorch's defaults side by side.

The fp16 limits all come from :mod:`mpscope.formats` (``torch.finfo``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import pandas as pd

from mpscope.advisor import _frames
from mpscope.formats import FP16
from mpscope.run import Run
from mpscope.schema import GRAD_ROLES, GRAD_SCALER_DEFAULTS, LOW_PRECISION

#: PyTorch's GradScaler defaults (``torch.amp.GradScaler.__init__``): an alias of
#: :data:`mpscope.schema.GRAD_SCALER_DEFAULTS` (GradScaler's own defaults, read from its signature).
TORCH_DEFAULTS = GRAD_SCALER_DEFAULTS

#: growth_interval candidates that :func:`choose_scaler` simulates.
GROWTH_INTERVALS = (100, 200, 500, 1000, 2000)

#: Underflow tolerance: a scale is "as good as the best" when its fraction of non-zero gradient
#: elements below fp16's normal range is within this absolute fraction of the minimum (1 in 1,000).
UNDERFLOW_TOL = 1e-3

#: Default candidate exponents of :func:`scale_whatif`: loss scales 2^-16 ... 2^48.
DEFAULT_KS = tuple(range(-16, 49))

# fp16 classes by binade of |x| * 2^k (floor(log2)), from formats.FP16:
#   >= 16 (max_exponent + 1)            -> overflow (inf)
#   -25 ... -15                         -> subnormal (below min_normal 2^-14)
#   <= -26 (min_subnormal_exponent - 2) -> flushed to zero
# Binades holding a rounding threshold are counted by their bulk (see scale_whatif's docstring).
_OVERFLOW_BINADE = FP16.max_exponent + 1  # 16
_NORMAL_BINADE = FP16.min_normal_exponent  # -14
_ZERO_BINADE = FP16.min_subnormal_exponent - 2  # -26


#: Range of candidate exponents: 2^k must be a finite, non-zero float64 (numpy.finfo(float64):
#: smallest subnormal 2^-1074, largest power of two 2^1023).
K_RANGE = (int(np.finfo(np.float64).minexp) - int(np.finfo(np.float64).nmant), int(np.finfo(np.float64).maxexp) - 1)


def _check_ks(ks) -> list[int]:
    """``ks`` as a list of ints, or TypeError / ValueError saying what to pass."""
    if isinstance(ks, (str, bytes)) or not isinstance(ks, Iterable):
        raise TypeError(f"ks must be an iterable of int exponents (loss scale 2**k), e.g. range(0, 25); got {ks!r}")
    out = []
    for k in ks:
        if not isinstance(k, numbers.Integral) or isinstance(k, (bool, np.bool_)):
            raise TypeError(f"ks must hold int exponents (loss scale 2**k); got {k!r} ({type(k).__name__}). "
                            "For a scale s pass k = log2(s), e.g. 16 for 65536")
        if not K_RANGE[0] <= int(k) <= K_RANGE[1]:
            raise ValueError(f"ks must lie in [{K_RANGE[0]}, {K_RANGE[1]}] (2**k finite and non-zero in float64); "
                             f"got {int(k)}")
        out.append(int(k))
    return out


def _check_roles_arg(roles) -> tuple[str, ...]:
    if isinstance(roles, str):
        roles = (roles,)
    if not isinstance(roles, Iterable) or not all(isinstance(r, str) for r in roles):
        raise TypeError(f"roles must be a role name or an iterable of role names, e.g. {GRAD_ROLES}; got {roles!r}")
    return tuple(roles)


def _classify(exponents: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s = exponents + k
    return s >= _OVERFLOW_BINADE, (s < _NORMAL_BINADE) & (s > _ZERO_BINADE), s <= _ZERO_BINADE


def underflow_error(exponents: np.ndarray, counts: np.ndarray, k: int) -> float:
    """Upper bound on the error fp16's underflow adds to a gradient at loss scale ``2**k``, relative
    to the gradient's L1 norm.

    An element of scaled binade ``b = e + k`` below fp16's normal range (``b <= -15``) is rounded to
    a multiple of the subnormal spacing ``2^-24`` (torch.finfo(float16).tiny * eps), or to 0: its
    error is at most ``2^min(-25, b + 1)`` (half a spacing, or all of an element below ``2^-25``).
    Normal elements add no underflow error (their rounding, at most ``2^-11`` relative, is fp16's
    own). The bound divides the summed errors by the smallest L1 norm the binades allow
    (``sum(count * 2^b)``). Under 1 %, many tiny elements change the gradient by under 1 % however
    many there are.

    Args:
        exponents: int binades ``floor(log2|x|)`` of non-zero finite elements, in unscaled units.
        counts: element counts per binade (same length).
        k: the loss scale's exponent.

    Returns a float >= 0 (NaN when there are no counts).
    """
    e = np.asarray(exponents, dtype=np.float64)
    c = np.asarray(counts, dtype=np.float64)
    if not c.sum():
        return float("nan")
    b = e + k
    top = b.max()  # everything relative to the largest binade: no overflow of 2**b at any exponent
    norm = (c * np.exp2(b - top)).sum()
    low = b < _NORMAL_BINADE
    half_spacing = _NORMAL_BINADE - FP16.mantissa_bits - 1  # -25
    err = (c[low] * np.exp2(np.minimum(half_spacing, b[low] + 1) - top)).sum()
    return float(err / norm)


def _grad_hist(run: Any, roles: Iterable[str]) -> pd.DataFrame:
    h = _frames.histograms(run)
    roles = _check_roles_arg(roles)
    bad = set(roles) - set(GRAD_ROLES) - {"activation", "weight", "optimizer_state", "loss"}
    if bad:
        raise ValueError(f"roles must be among {GRAD_ROLES} (or other recorded roles); got {sorted(bad)}")
    return h[h.role.isin(roles) & (h["count"] > 0)]


def scale_whatif(
    run: Run,
    ks: Iterable[int] | None = None,
    per_module: bool = False,
    roles: Iterable[str] = GRAD_ROLES,
) -> pd.DataFrame:
    """Predict, for loss scales ``2**k``, the fp16 fate of every recorded gradient element.

    Uses ``run.histograms`` (exponent = floor(log2|x|) of non-zero finite elements, in unscaled
    units), summed over all recorded steps. An element of binade ``e`` lands in binade ``e + k``
    after scaling; the class is decided by that binade with fp16's limits (``torch.finfo``):

    * overflow: ``e + k >= 16`` (|x|·2^k >= 65536 > 65504 = finfo.max);
    * subnormal: ``-25 <= e + k <= -15`` (below finfo.tiny = 2^-14, not flushed);
    * underflow (flush to zero): ``e + k <= -26`` (|x|·2^k < 2^-25, which rounds to 0).

    Approximation at the three binades that contain a rounding threshold, where a binade is
    counted by its bulk: binade 15 holds [65520, 65536), which overflows, but is counted finite;
    binade -25 holds exactly 2^-25, which rounds to 0, but is counted subnormal; binade -15 holds
    [2^-14 - 2^-25, 2^-14), which rounds up to normal, but is counted subnormal. Each slice is at
    most 1/2048 of its binade's width (1/32 for binade -15), so the error is small unless values
    pile up exactly there. Elements that were already 0 or non-finite in the recording are not in
    the histograms: a run recorded in fp16 at a too-small scale has lost its flushed gradients,
    so record the what-if source in fp32/bf16 or at a large enough scale.

    Args:
        run: an :class:`mpscope.Run` with histograms for the grad roles.
        ks: candidate exponents (default -16 ... 48).
        per_module: also break the fractions down per module.
        roles: roles counted as gradients (default activation_grad and param_grad).

    Returns:
        DataFrame with columns ``k`` (int), ``scale`` (2^k, float), ``overflow_frac``,
        ``subnormal_frac``, ``underflow_frac`` (fractions of non-zero finite recorded gradient
        elements, floats in [0, 1]), ``underflow_error`` (the bound on the error fp16's underflow
        adds, relative to their L1 norm, :func:`underflow_error`), ``count`` (that element count); with ``per_module`` a
        ``module`` column too, with one row per (module, k). Empty when nothing was recorded.

    Raises:
        TypeError: ``run`` is not a Run; ``ks`` holds a non-integer; ``per_module`` is not a bool.
        ValueError: a ``k`` outside :data:`K_RANGE` (2**k not a finite non-zero float64); an
            unknown role.
    """
    ks = _check_ks(DEFAULT_KS if ks is None else ks)
    if not isinstance(per_module, (bool, np.bool_)):
        raise TypeError(f"per_module must be True or False; got {per_module!r}")
    h = _grad_hist(run, roles)
    cols = ["k", "scale", "overflow_frac", "subnormal_frac", "underflow_frac", "underflow_error", "count"]
    if per_module:
        cols = ["module"] + cols
    if h.empty:
        return pd.DataFrame(columns=cols)
    groups = [("", h)] if not per_module else list(h.groupby("module", observed=True, sort=False))
    rows = []
    for module, g in groups:
        agg = g.groupby("exponent")["count"].sum()
        e = agg.index.to_numpy(dtype=np.int64)
        c = agg.to_numpy(dtype=np.float64)
        total = c.sum()
        for k in ks:
            over, sub, zero = _classify(e, int(k))
            row = {
                "k": int(k),
                "scale": math.ldexp(1.0, int(k)),
                "overflow_frac": float(c[over].sum() / total),
                "subnormal_frac": float(c[sub].sum() / total),
                "underflow_frac": float(c[zero].sum() / total),
                "underflow_error": underflow_error(e, c, int(k)),
                "count": int(total),
            }
            if per_module:
                row["module"] = str(module)
            rows.append(row)
    return pd.DataFrame(rows, columns=cols)


# --------------------------------------------------------------------------------------------
# per-step gradient maxima


def _relevant_grad_rows(t: pd.DataFrame) -> pd.DataFrame:
    """Gradient rows whose values live in fp16/bf16 during backward (those a loss scale protects).

    When the run computed in low precision, these are activation_grad rows in fp16/bf16 and
    param_grad rows that are fp16/bf16 or belong to a module whose activation is fp16/bf16 in the
    same step (autocast computes that weight gradient in low precision and casts it up). When the
    run computed in fp32 (a what-if source), every gradient row counts.
    """
    act = t[t.role == "activation"]
    low_act = act[act.dtype.isin(LOW_PRECISION)]
    g = t[t.role.isin(GRAD_ROLES)]
    if low_act.empty and not g.dtype.isin(LOW_PRECISION).any():
        return g
    keys = set(zip(low_act.step, low_act.module))
    in_low_module = np.fromiter(((s, m) in keys for s, m in zip(g.step, g.module)), bool, len(g))
    keep = g.dtype.isin(LOW_PRECISION).to_numpy() | ((g.role == "param_grad").to_numpy() & in_low_module)
    return g[keep]


def step_gradients(run: Any) -> pd.DataFrame:
    """Per-step evidence the scaler replay needs, one row per step of ``run.steps``.

    Columns: ``step``; ``grad_max`` (float: largest finite unscaled |gradient| over the rows of
    :func:`_relevant_grad_rows`, i.e. ``absmax / loss_scale``; NaN when the step was not recorded);
    ``grad_nonfinite`` (bool: some such row held inf/NaN); ``forced_inf`` (bool: the loss or a
    forward activation was non-finite, so every loss scale overflows); ``loss_scale`` and
    ``found_inf`` as recorded.
    """
    t = _frames.tensors(run)
    s = _frames.steps(run)
    g = _relevant_grad_rows(t)
    if s.empty:
        steps_idx = np.sort(t.step.unique())
        s = pd.DataFrame({"step": steps_idx, "loss": np.nan, "loss_scale": 1.0, "found_inf": False, "skipped": False})
    unscaled = g.absmax.astype(float) / g.loss_scale.astype(float).replace(0.0, np.nan)
    gmax = unscaled.groupby(g.step).max()
    nonfinite = ((g.nan_count + g.inf_count) > 0).groupby(g.step).any()
    act = t[t.role.isin(("activation", "loss"))]
    fwd_bad = ((act.nan_count + act.inf_count) > 0).groupby(act.step).any()
    out = pd.DataFrame({"step": s.step.to_numpy()})
    out["grad_max"] = out.step.map(gmax).astype(float)
    out["grad_nonfinite"] = out.step.isin(nonfinite.index[nonfinite.to_numpy(dtype=bool)])
    loss_bad = ~np.isfinite(s.loss.astype(float).to_numpy()) & s.loss.notna().to_numpy()
    out["forced_inf"] = out.step.isin(fwd_bad.index[fwd_bad.to_numpy(dtype=bool)]).to_numpy() | loss_bad
    out["loss_scale"] = s.loss_scale.to_numpy(dtype=float)
    out["found_inf"] = s.found_inf.to_numpy(dtype=bool)
    return out


def _effective_grad_max(ev: pd.DataFrame) -> np.ndarray:
    """Unscaled maxima made consistent with what the run's own scaler saw.

    A step that overflowed at its recorded scale S had a true max of at least 65520 / S (finite
    rows only show the survivors); a clean step had a max below 65520 / S. Unrecorded steps take
    the nearest earlier recorded max (then the next one), bounded the same way.
    """
    thr = FP16.overflow_threshold
    gm = ev.grad_max.copy()
    if gm.notna().sum() == 0:
        raise ValueError(
            "the run has no finite gradient rows: record with roles including 'activation_grad' "
            "or 'param_grad' (the default records all roles)"
        )
    gm = gm.ffill().bfill().to_numpy(dtype=float)
    scale = ev.loss_scale.to_numpy(dtype=float)
    overflowed = (ev.found_inf.to_numpy() | ev.grad_nonfinite.to_numpy()) & ~ev.forced_inf.to_numpy()
    bound = thr / scale
    gm = np.where(overflowed, np.maximum(gm, bound), np.minimum(gm, bound * (1 - 1e-9)))
    return gm


def update_scale(scale: np.float32, tracker: int, found_inf: bool, growth_factor: float,
                 backoff_factor: float, growth_interval: int) -> tuple[np.float32, int]:
    """One call of ``torch._amp_update_scale_`` (ATen AmpKernels), with the same rounding.

    The scale is a float32; each product is taken in double (the factors are doubles) and rounded
    to float32 once. On inf: scale *= backoff_factor, tracker = 0. Otherwise tracker += 1 and when
    it reaches growth_interval: scale *= growth_factor if the float32 result is finite, tracker = 0.
    """
    with np.errstate(over="ignore"):
        if found_inf:
            return np.float32(float(scale) * float(backoff_factor)), 0
        tracker += 1
        if tracker == growth_interval:
            new = np.float32(float(scale) * float(growth_factor))
            return (new if np.isfinite(new) else scale), 0
    return scale, tracker


def _validate_factors(init_scale, growth_factor, backoff_factor, growth_interval) -> None:
    for name, v in (("init_scale", init_scale), ("growth_factor", growth_factor), ("backoff_factor", backoff_factor)):
        if not isinstance(v, numbers.Real) or isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name} must be a float (as for torch.amp.GradScaler); got {v!r} ({type(v).__name__})")
    if not isinstance(growth_interval, numbers.Integral) or isinstance(growth_interval, (bool, np.bool_)):
        raise TypeError(f"growth_interval must be an int (steps); got {growth_interval!r} ({type(growth_interval).__name__})")
    if not (init_scale > 0 and math.isfinite(init_scale)):
        raise ValueError(f"init_scale must be a positive finite float; got {init_scale!r}")
    if not growth_factor > 1.0:
        raise ValueError(f"growth_factor must be > 1 (GradScaler's rule); got {growth_factor!r}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1); got {backoff_factor!r}")
    if int(growth_interval) != growth_interval or growth_interval < 1:
        raise ValueError(f"growth_interval must be a positive int; got {growth_interval!r}")


def _replay(gmax: np.ndarray, forced: np.ndarray, init_scale, growth_factor, backoff_factor, growth_interval):
    thr = FP16.overflow_threshold
    n = len(gmax)
    scales = np.empty(n, dtype=np.float64)
    after = np.empty(n, dtype=np.float64)
    found = np.empty(n, dtype=bool)
    scale, tracker = np.float32(init_scale), 0
    for i in range(n):
        scales[i] = float(scale)
        f = bool(forced[i]) or gmax[i] * float(scale) >= thr
        found[i] = f
        scale, tracker = update_scale(scale, tracker, f, growth_factor, backoff_factor, int(growth_interval))
        after[i] = float(scale)
    return scales, found, after


def simulate_scaler(
    run: Run,
    init_scale: float = GRAD_SCALER_DEFAULTS["init_scale"],
    growth_factor: float = GRAD_SCALER_DEFAULTS["growth_factor"],
    backoff_factor: float = GRAD_SCALER_DEFAULTS["backoff_factor"],
    growth_interval: int = GRAD_SCALER_DEFAULTS["growth_interval"],
) -> pd.DataFrame:
    """Replay ``torch.amp.GradScaler``'s dynamic loss scaling over a recorded run.

    Per step, the gradients overflow at scale S when the step's unscaled gradient maximum G
    satisfies ``G * S >= 65520`` (fp16's overflow threshold, max + ulp/2 from ``torch.finfo``),
    or unconditionally when the loss or a forward activation was non-finite. G is the largest
    ``absmax / loss_scale`` over the fp16/bf16 gradient rows (activation grads are recorded scaled,
    param grads after ``unscale_``); steps that overflowed in the run itself are known only to have
    ``G >= 65520 / S_run``, and that bound is used. The scale then follows
    ``torch._amp_update_scale_`` exactly (float32 scale; back off and reset the growth tracker on
    inf; grow after ``growth_interval`` consecutive clean steps, unless the result is inf). A step
    with inf is skipped (``optimizer.step()`` not run), as in ``GradScaler.step``.

    Args:
        run: an :class:`mpscope.Run` with gradient rows.
        init_scale, growth_factor, backoff_factor, growth_interval: as ``torch.amp.GradScaler``.

    Returns:
        DataFrame, one row per step of ``run.steps``: ``step`` (int), ``scale`` (float, the scale
        used for that step's backward), ``found_inf`` (bool), ``skipped`` (bool), ``scale_after``
        (float, after ``update()``).

    Raises:
        TypeError: a factor that is not a number, a ``growth_interval`` that is not an int.
        ValueError: factors out of GradScaler's ranges, or a run without finite gradient rows.
    """
    _validate_factors(init_scale, growth_factor, backoff_factor, growth_interval)
    ev = step_gradients(run)
    gmax = _effective_grad_max(ev)
    scales, found, after = _replay(gmax, ev.forced_inf.to_numpy(), init_scale, growth_factor, backoff_factor, growth_interval)
    return pd.DataFrame({"step": ev.step.to_numpy(), "scale": scales, "found_inf": found,
                         "skipped": found.copy(), "scale_after": after})


def scaler_agreement(run: Any, sim: pd.DataFrame | None = None) -> dict:
    """How well a replay with the run's own scaler settings matches what the real scaler did.

    Returns dict ``steps``, ``agree_frac`` (fraction of steps whose simulated ``skipped`` equals
    ``run.steps.skipped``), ``real_skipped``, ``sim_skipped`` (totals).

    Raises:
        ValueError: the run has no scaler settings in ``run.meta["scaler"]`` and no ``sim`` is given.
    """
    if sim is None:
        cfg = _frames.meta(run).get("scaler")
        if not cfg:
            raise ValueError("run.meta['scaler'] is empty: pass sim=simulate_scaler(run, ...) explicitly")
        sim = simulate_scaler(run, **{k: cfg[k] for k in GRAD_SCALER_DEFAULTS if k in cfg})
    s = _frames.steps(run)
    merged = s[["step", "skipped"]].merge(sim[["step", "skipped"]], on="step", suffixes=("_real", "_sim"))
    return {
        "steps": int(len(merged)),
        "agree_frac": float((merged.skipped_real == merged.skipped_sim).mean()) if len(merged) else float("nan"),
        "real_skipped": int(merged.skipped_real.sum()),
        "sim_skipped": int(merged.skipped_sim.sum()),
    }


# --------------------------------------------------------------------------------------------
# choosing the scaler


def _per_step_hist(run: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, exponents, counts[step, exponent]) of the gradient histograms."""
    h = _grad_hist(run, GRAD_ROLES)
    if h.empty:
        return np.array([], int), np.array([], int), np.zeros((0, 0))
    p = h.pivot_table(index="step", columns="exponent", values="count", aggfunc="sum", fill_value=0)
    return p.index.to_numpy(int), p.columns.to_numpy(int), p.to_numpy(dtype=float)


def _trajectory_fractions(sim: pd.DataFrame, hsteps, exps, counts) -> tuple[float, float]:
    """Mean underflow and subnormal fractions over histogram steps at the simulated scales."""
    if counts.size == 0:
        return float("nan"), float("nan")
    scale_by_step = dict(zip(sim.step.to_numpy(), sim.scale.to_numpy()))
    under, sub = [], []
    for i, st in enumerate(hsteps):
        sc = scale_by_step.get(st)
        if sc is None or not sc > 0:
            continue
        k = math.floor(math.log2(sc))
        _, s_mask, z_mask = _classify(exps, k)
        tot = counts[i].sum()
        if tot > 0:
            under.append(counts[i][z_mask].sum() / tot)
            sub.append(counts[i][s_mask].sum() / tot)
    if not under:
        return float("nan"), float("nan")
    return float(np.mean(under)), float(np.mean(sub))


def below_normal(prediction: dict) -> float:
    """A :func:`predict` result's mean fraction of gradient elements below fp16's normal range
    (flushed or subnormal)."""
    return prediction["underflow_frac"] + prediction["subnormal_frac"]


def predict(run: Any, config: dict, _hist=None) -> dict:
    """Predicted outcome of a GradScaler config on this run (a replay, see :func:`simulate_scaler`).

    Returns dict ``skipped`` (int), ``skip_rate`` (skipped / steps), ``underflow_frac`` and
    ``subnormal_frac`` (mean over recorded steps of the fraction of non-zero gradient elements
    flushed to zero / left subnormal at the simulated scale), ``final_scale``.
    """
    sim = simulate_scaler(run, **{k: config[k] for k in GRAD_SCALER_DEFAULTS})
    hsteps, exps, counts = _hist if _hist is not None else _per_step_hist(run)
    under, sub = _trajectory_fractions(sim, hsteps, exps, counts)
    n = len(sim)
    return {
        "skipped": int(sim.skipped.sum()),
        "skip_rate": float(sim.skipped.sum() / n) if n else 0.0,
        "underflow_frac": under,
        "subnormal_frac": sub,
        "final_scale": float(sim.scale_after.iloc[-1]) if n else float(config["init_scale"]),
    }


@dataclass(frozen=True)
class InitExponent:
    """The loss-scale exponent chosen from the what-if (:func:`choose_init_exponent`).

    Attributes:
        k: the chosen exponent (the GradScaler's ``init_scale`` is ``2**k``).
        lossy: the recording itself flushed gradients to zero (the histograms miss the smallest).
        k_max: the largest exponent that keeps every recorded gradient below 2^15.
        top_exponent: the highest recorded gradient binade (floor(log2|g|), unscaled).
        underflow_frac, subnormal_frac: share of non-zero gradient elements flushed to zero / left
            subnormal in fp16 at ``2**k``.
        min_underflow_frac: share flushed at ``2**k_max`` (large: the range is wider than fp16's).
        min_below_normal_frac: share flushed or subnormal at ``2**k_max``.
    """

    k: int
    lossy: bool
    k_max: int
    top_exponent: int
    underflow_frac: float
    subnormal_frac: float
    min_underflow_frac: float
    min_below_normal_frac: float

    def to_dict(self) -> dict:
        """Plain data (``Recommendation.evidence["whatif"]``)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ScalerChoice:
    """GradScaler settings chosen by :func:`choose_scaler`, with the replays behind them.

    Attributes:
        config: ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``.
        predicted: the replay of ``config`` (see :func:`predict`).
        pytorch_default: the replay of GradScaler's own defaults.
        candidates: one replay per ``growth_interval`` tried (dicts with that key).
        whatif: the :class:`InitExponent` behind ``init_scale``.
    """

    config: dict
    predicted: dict
    pytorch_default: dict
    candidates: list
    whatif: InitExponent


def choose_init_exponent(run: Any, lossy: bool = False) -> InitExponent:
    """The loss-scale exponent from the what-if.

    ``k = k_max = 14 - (highest recorded gradient binade)``: the largest scale that keeps every
    recorded gradient below 2^15, one binade (the documented headroom) under fp16's top binade
    (65504 lies in binade 15). The share of gradient elements below fp16's normal range (subnormal
    or flushed to zero: they keep fewer than fp16's 11 significant bits, or none) only falls as k
    grows, so ``k_max`` loses the fewest; any lower scale only pushes more gradients into
    subnormals, and a higher one overflows the largest recorded gradient. The GradScaler's own
    back-off handles gradients that grow later. ``lossy`` (the recording itself flushed gradients
    to zero, so the histograms miss the smallest ones) is reported, and changes nothing: the
    largest safe scale is also what such a run needs.

    Returns an :class:`InitExponent`. Raises ValueError without gradient histograms.
    """
    h = _grad_hist(run, GRAD_ROLES)
    if h.empty:
        raise ValueError("the run has no gradient histograms (roles activation_grad/param_grad): "
                         "record with hist_every >= 1 and those roles")
    top = _top_exponent(run, h)
    k_max = (_OVERFLOW_BINADE - 2) - top
    w = scale_whatif(run, ks=[k_max]).set_index("k")
    best = float((w.underflow_frac + w.subnormal_frac).loc[k_max])
    k = k_max
    return InitExponent(
        k=int(k),
        lossy=bool(lossy),
        k_max=int(k_max),
        top_exponent=int(top),
        underflow_frac=float(w.loc[k, "underflow_frac"]),
        subnormal_frac=float(w.loc[k, "subnormal_frac"]),
        min_underflow_frac=float(w.loc[k_max, "underflow_frac"]),
        min_below_normal_frac=best,
    )


def _top_exponent(run: Any, h: pd.DataFrame) -> int:
    """Highest binade of the gradients as backward produced them: param_grad rows of steps with a
    clip_grad_norm_ call are left out (they were recorded after the clip shrank them) and the
    largest |g| the clip saw before clipping (``run.steps.clip_grad_absmax``, divided by the loss
    scale when the clip saw scaled gradients) is used instead."""
    s = _frames.steps(run)
    top = None
    if len(s) and "clip_norm" in s.columns:
        clipped = set(s.step[s.clip_norm.notna()])
        h = h[~((h.role == "param_grad") & h.step.isin(clipped))]
        if "clip_grad_absmax" in s.columns:
            scaled = s.clipped_before_unscale.fillna(False).astype(bool) if "clipped_before_unscale" in s.columns else False
            raw = s.clip_grad_absmax.astype(float) / np.where(scaled, s.loss_scale.astype(float), 1.0)
            raw = raw[np.isfinite(raw) & (raw > 0)]
            if len(raw):
                top = int(np.floor(np.log2(float(raw.max()))))
    if len(h):
        top = int(h.exponent.max()) if top is None else max(top, int(h.exponent.max()))
    return top


def choose_scaler(run: Any, growth_intervals: Iterable[int] = GROWTH_INTERVALS, tol: float = UNDERFLOW_TOL,
                  lossy: bool = False) -> ScalerChoice:
    """GradScaler settings for fp16 from the run's data.

    ``init_scale`` = 2^k_max from :func:`choose_init_exponent`. ``growth_interval``: each candidate is
    replayed (:func:`simulate_scaler`) from that init_scale; among those whose mean below-normal
    fraction (subnormal or flushed) stays within ``tol`` of the best candidate's, the one with the fewest skipped steps
    wins (ties: PyTorch's 2000 if among them, else the largest). growth_factor 2.0 and
    backoff_factor 0.5 stay at PyTorch's defaults.

    Returns a :class:`ScalerChoice`.
    """
    init = choose_init_exponent(run, lossy)
    hist = _per_step_hist(run)
    init_scale = math.ldexp(1.0, init.k)
    cands = []
    for gi in growth_intervals:
        cfg = dict(GRAD_SCALER_DEFAULTS, init_scale=init_scale, growth_interval=int(gi))
        cands.append({"growth_interval": int(gi), **predict(run, cfg, hist)})
    unders = [below_normal(c) for c in cands if not math.isnan(below_normal(c))]
    best_u = min(unders) if unders else float("nan")
    pool = [c for c in cands if math.isnan(best_u) or math.isnan(below_normal(c)) or below_normal(c) <= best_u + tol]
    fewest = min(c["skipped"] for c in pool)
    tied = [c for c in pool if c["skipped"] == fewest]
    pick = next((c for c in tied if c["growth_interval"] == GRAD_SCALER_DEFAULTS["growth_interval"]), None)
    pick = pick or max(tied, key=lambda c: c["growth_interval"])
    config = dict(GRAD_SCALER_DEFAULTS, init_scale=init_scale, growth_interval=pick["growth_interval"])
    predicted = {k: v for k, v in pick.items() if k != "growth_interval"}
    return ScalerChoice(config=config, predicted=predicted, pytorch_default=predict(run, GRAD_SCALER_DEFAULTS, hist),
                        candidates=cands, whatif=init)
