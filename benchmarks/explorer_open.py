"""How long does the layer explorer take to open on a long run?

Builds a synthetic Run of ``--rows`` tensor rows (default 1,000,000: ``--modules`` modules × 10
tensors per module and step (activation, activation_grad, param_grad weight/bias, weight
weight/bias, optimizer_state exp_avg/exp_avg_sq for weight and bias) × as many steps as needed),
with exponent histograms every ``--hist-every`` steps for activations and activation gradients,
through ``mpscope.Run.from_frames``, then times ``mpscope.explore(run, advice)``: aggregation with
pandas, the advisor's loss-scale what-if, building the altair charts, and creating the ipywidgets /
JupyterChart widgets (what happens before anything is sent to the browser). ``advice`` is computed
once beforehand, as the ``%%mpscope`` cell does; the time of ``mpscope.advise(run)`` is printed too.

One-time costs of a fresh kernel are reported separately: importing altair and
``JupyterChart.enable_offline()`` (bundling vega-embed with vl-convert). The target is the
warm open time: median of ``--repeat`` opens < 2 s.

Run:  python benchmarks/explorer_open.py [--rows 1000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pandas as pd

TENSORS_PER_MODULE = (
    ("activation", "output"),
    ("activation_grad", "output"),
    ("param_grad", "weight"),
    ("param_grad", "bias"),
    ("weight", "weight"),
    ("weight", "bias"),
    ("optimizer_state", "weight.exp_avg"),
    ("optimizer_state", "weight.exp_avg_sq"),
    ("optimizer_state", "bias.exp_avg"),
    ("optimizer_state", "bias.exp_avg_sq"),
)


def synthetic_frames(n_rows: int = 1_000_000, n_modules: int = 100, hist_every: int = 50, seed: int = 0):
    """Frames with the Run schemas of docs/architecture.md ("Run"): (tensors, steps, histograms, meta).

    Values are random but plausible (activations near 2^0..2^8, gradients near 2^-20 scaled by
    2^16, a few skipped steps); the benchmark measures speed, not numbers.
    """
    rng = np.random.default_rng(seed)
    per_step = n_modules * len(TENSORS_PER_MODULE)
    n_steps = max(1, -(-n_rows // per_step))
    modules = [f"blocks.{i // 4}.{('attn.q', 'attn.proj', 'mlp.fc', 'mlp.proj')[i % 4]}" for i in range(n_modules)]
    mod_idx = np.tile(np.repeat(np.arange(n_modules), len(TENSORS_PER_MODULE)), n_steps)[:n_rows]
    kind_idx = np.tile(np.arange(len(TENSORS_PER_MODULE)), n_modules * n_steps)[:n_rows]
    step = np.repeat(np.arange(n_steps), per_step)[:n_rows]
    roles = np.array([r for r, _ in TENSORS_PER_MODULE])
    names = np.array([n for _, n in TENSORS_PER_MODULE])
    log2_absmax = rng.normal(2.0, 3.0, n_rows) - 18.0 * np.isin(kind_idx, [1, 2, 3])
    absmax = np.exp2(log2_absmax)
    frac = lambda scale: np.clip(rng.exponential(scale, n_rows), 0, 1)  # noqa: E731
    loss_scale = np.full(n_rows, 65536.0)
    tensors = pd.DataFrame({
        "step": step.astype(np.int64),
        "module": pd.Categorical.from_codes(mod_idx, categories=modules),
        "role": pd.Categorical(roles[kind_idx]),
        "name": pd.Categorical(names[kind_idx]),
        "dtype": pd.Categorical(np.where(np.isin(kind_idx, [0, 1]), "float16", "float32")),
        "numel": np.full(n_rows, 4096, dtype=np.int64),
        "min": -absmax, "max": absmax, "absmax": absmax,
        "absmin_nonzero": absmax * np.exp2(-rng.uniform(8, 20, n_rows)),
        "zero_frac": frac(0.01), "subnormal_frac": frac(0.001),
        "fp16_underflow_frac": frac(0.01), "fp16_subnormal_frac": frac(0.01),
        "fp16_overflow_frac": frac(0.0001), "bf16_underflow_frac": frac(0.0001),
        "bf16_subnormal_frac": frac(0.0001), "bf16_overflow_frac": np.zeros(n_rows),
        "nan_count": np.zeros(n_rows, dtype=np.int64), "inf_count": np.zeros(n_rows, dtype=np.int64),
        "loss_scale": loss_scale,
    })
    skipped = rng.random(n_steps) < 0.01
    steps = pd.DataFrame({
        "step": np.arange(n_steps), "loss": 4.0 * np.exp(-np.arange(n_steps) / n_steps) + rng.normal(0, 0.05, n_steps),
        "loss_scale": np.full(n_steps, 65536.0), "found_inf": skipped, "skipped": skipped,
        "scale_after": np.where(skipped, 32768.0, 65536.0), "recorded": np.ones(n_steps, dtype=bool),
    })
    hist_steps = np.arange(0, n_steps, hist_every)
    exps = np.arange(-30, 10)
    rows = []
    for r, centre in (("activation", 2), ("activation_grad", -18)):
        hs, hm, he = np.meshgrid(hist_steps, np.arange(n_modules), exps, indexing="ij")
        counts = (4096 * np.exp(-0.5 * ((he - centre) / 3.0) ** 2) / (3.0 * np.sqrt(2 * np.pi))).astype(np.int64)
        rows.append(pd.DataFrame({"step": hs.ravel(), "module": np.array(modules)[hm.ravel()], "role": r,
                                  "name": "output", "exponent": he.ravel(), "count": counts.ravel()}))
    histograms = pd.concat(rows, ignore_index=True)
    histograms = histograms[histograms["count"] > 0].reset_index(drop=True)
    meta = {"device": "cpu", "autocast_dtype": "float16", "autocast_device_type": "cpu",
            "scaler": {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                       "growth_interval": 2000, "enabled": True},
            "model": "Synthetic", "every": 1, "hist_every": hist_every}
    return tensors, steps, histograms, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--modules", type=int, default=100)
    ap.add_argument("--hist-every", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    t0 = time.perf_counter()
    import mpscope
    tensors, steps, histograms, meta = synthetic_frames(args.rows, args.modules, args.hist_every)
    run = mpscope.Run.from_frames(tensors, steps, histograms, meta)
    t_build = time.perf_counter() - t0

    t0 = time.perf_counter()
    import altair as alt
    import ipywidgets  # noqa: F401
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    alt.JupyterChart.enable_offline()
    t_offline = time.perf_counter() - t0

    from mpscope.widgets.explorer import explore

    t0 = time.perf_counter()
    try:
        advice = mpscope.advise(run)
        t_advise = time.perf_counter() - t0
    except Exception as exc:  # advisor missing: the explorer says "advisor unavailable"
        advice, t_advise = None, float("nan")
        print(f"mpscope.advise unavailable: {type(exc).__name__}: {exc}")

    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        widget = explore(run, advice=advice)
        times.append(time.perf_counter() - t0)
        widget.close()
    med = statistics.median(times)
    print(f"run: {len(run.tensors):,} tensor rows, {len(run.steps):,} steps, "
          f"{len(run.histograms):,} histogram rows, {args.modules} modules (built in {t_build:.2f} s)")
    print(f"one-time: import altair+ipywidgets {t_import:.2f} s, JupyterChart.enable_offline() {t_offline:.2f} s")
    print(f"mpscope.advise(run): {t_advise:.2f} s (explore(run) without advice= runs it first)")
    print(f"explore(run, advice) open time: median {med:.3f} s over {args.repeat} (all: "
          + ", ".join(f"{t:.3f}" for t in times) + ")")
    print(f"target 2.0 s -> ratio open/target = {med / 2.0:.2f}; "
          f"with advise: {(med + t_advise) / 2.0:.2f}")


if __name__ == "__main__":
    main()
