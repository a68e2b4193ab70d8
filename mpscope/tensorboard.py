"""TensorBoard export of a Run: ``run.to_tensorboard(logdir)`` (or :func:`write_tensorboard`).

Needs the ``tensorboard`` package (``pip install 'mpscope[tensorboard]'``); it is imported only when
events are written, so ``import mpscope`` stays light. Events go to one new event file in
``logdir`` through ``torch.utils.tensorboard.SummaryWriter``, with ``global_step`` = the run's step.
Open them with ``tensorboard --logdir DIR`` (one sub-directory per run compares runs).

Tags (stable; ``<module>`` is the qualified module name, ``(root)`` for the root module, and any
``/`` in a module or tensor name is written ``_`` so every tag has the same depth), per step:

* ``mpscope/loss``: ``run.steps.loss`` (unscaled; NaN / inf written as they are);
* ``mpscope/loss_scale``: ``run.steps.loss_scale`` (1.0 without a GradScaler);
* ``mpscope/skipped``: ``run.steps.skipped`` as 0 / 1 (the optimizer step did not run);
* ``mpscope/<role>/<module>/fp16_underflow_frac`` and ``.../fp16_overflow_frac`` (a float16 run):
  the fraction of the module's elements in that role that become 0 / inf when cast to float16;
  ``.../bf16_underflow_frac`` and ``.../bf16_overflow_frac`` for a bfloat16 run; a float32 run:
  see below;
* ``mpscope/<role>/<module>/<name>/exponent``: the exponent histogram of ``run.histograms``.

The step scalars are written for every row of ``run.steps`` (the unrecorded steps of
``record(every=N)`` included: their loss and scale are known), a tag only when it holds a number
(a run whose loss was never seen writes no ``mpscope/loss``). The fractions and histograms exist
for the recorded steps.

**Which format's fractions.** The format the run computed in (:func:`run_format`): its autocast
dtype, else the 16-bit dtype of its parameters (``model.half()``), else the 16-bit dtype most of
its recorded elements had. A float16 run writes the ``fp16_*`` tags, a bfloat16 run the ``bf16_*``
ones, never those of a format it did not use. A float32 run casts nothing: it writes both, named
as what-ifs so that they are not read as something that happened (as the framework callbacks of
:mod:`mpscope.integrations` name them): ``hypothetical_fp16_underflow_frac``,
``hypothetical_fp16_overflow_frac``, ``hypothetical_bf16_underflow_frac``,
``hypothetical_bf16_overflow_frac``.

Each fraction is over all elements the module recorded in that role at that step, every tensor
name and dtype together: ``sum(frac * numel) / sum(numel)`` of its ``run.tensors`` rows (the
counts the fractions were made of), so a 1-element bias does not weigh as much as the weight
beside it. As in ``run.tensors``, gradients are judged as recorded, i.e. multiplied by the loss
scale in effect (the rows' ``loss_scale``).

**Histograms.** ``run.histograms`` counts, per step, module, role and name, the non-zero finite
elements whose exponent is ``e = floor(log2|x|)`` (unscaled units). Each becomes one TensorBoard
histogram (``SummaryWriter.add_histogram_raw``) whose x axis is ``log2|x|``: one bucket per
exponent from the lowest to the highest seen, bucket ``[e, e + 1)`` holding exactly the count of
exponent ``e`` (empty exponents in between are empty buckets), ``min`` = the lowest ``e``, ``max``
= the highest ``e`` + 1, ``num`` = the elements counted, ``sum`` / ``sum_squares`` = the sums of
``e`` and ``e²`` over them. So an x of -24 is float16's smallest subnormal, 15 its top binade, -133
bfloat16's smallest subnormal. A name recorded in two dtypes in one step has their counts added.
(Bucket limits at the powers of two themselves, ``2^(e+1)``, would be as exact, but TensorBoard
draws a linear x axis, on which every bucket below 1 would collapse onto 0.)

A merged multi-rank Run writes the merged values (what ``run.tensors`` holds); ``rank=N`` writes
rank N's own rows (:meth:`mpscope.Run.for_rank`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from mpscope.run import as_path, as_run, run_format, select_rank
from mpscope.schema import LOW_PRECISION, SHORT_NAMES, module_label

__all__ = ["write_tensorboard", "run_format", "fraction_tags", "summary_writer_class", "INSTALL_HINT"]

#: What to run when the ``tensorboard`` package is missing.
INSTALL_HINT = "pip install 'mpscope[tensorboard]'"
#: The first part of every tag.
PREFIX = "mpscope"
#: ``run.steps`` column -> tag.
STEP_TAGS: dict[str, str] = {"loss": f"{PREFIX}/loss", "loss_scale": f"{PREFIX}/loss_scale",
                             "skipped": f"{PREFIX}/skipped"}
#: The last part of a histogram's tag.
HIST_SUFFIX = "exponent"
#: Prefix of the fraction tags' last part in a float32 run (the fractions of a cast it did not make).
HYPOTHETICAL = "hypothetical_"


def summary_writer_class():
    """``torch.utils.tensorboard.SummaryWriter``.

    Raises:
        ImportError: the ``tensorboard`` package is missing; the message says to
            ``pip install 'mpscope[tensorboard]'``.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter  # optional dependency: the "tensorboard" extra
    except ImportError as e:
        raise ImportError(f"writing TensorBoard events needs the tensorboard package: {INSTALL_HINT} "
                          f"(or pip install tensorboard) ({type(e).__name__}: {e})") from e
    return SummaryWriter


def fraction_tags(fmt: str | None) -> dict[str, str]:
    """``run.tensors`` fraction column -> the last part of its tag, for a run in format ``fmt``
    (:func:`run_format`): the format's underflow and overflow fractions; both formats', prefixed
    ``hypothetical_``, for a float32 run (None)."""
    if fmt is not None and fmt not in SHORT_NAMES:
        raise ValueError(f"fmt must be one of {sorted(SHORT_NAMES)} or None (float32); got {fmt!r}")
    formats, prefix = ([fmt], "") if fmt else (list(SHORT_NAMES), HYPOTHETICAL)
    return {f"{SHORT_NAMES[f]}_{kind}_frac": f"{prefix}{SHORT_NAMES[f]}_{kind}_frac"
            for f in formats for kind in ("underflow", "overflow")}


def _part(text: object) -> str:
    """A module or tensor name as one part of a tag: ``(root)`` for the root module, ``/`` as ``_``."""
    return module_label(text).replace("/", "_")


def fraction_tag(role: str, module: str, column: str, fmt: str | None) -> str:
    """The tag of ``column`` (e.g. ``fp16_underflow_frac``) of ``module`` in ``role``."""
    return f"{PREFIX}/{role}/{_part(module)}/{fraction_tags(fmt)[column]}"


def histogram_tag(role: str, module: str, name: str) -> str:
    """The tag of the exponent histogram of tensor ``name`` of ``module`` in ``role``."""
    return f"{PREFIX}/{role}/{_part(module)}/{_part(name)}/{HIST_SUFFIX}"


def exponent_histogram(exponents, counts) -> dict:
    """The ``add_histogram_raw`` arguments (less tag and step) of exponent counts: one bucket
    ``[e, e + 1)`` per exponent from the lowest to the highest with a count > 0 (see the module
    docstring). Exponents may repeat (their counts are added); counts of 0 are left out.

    Raises:
        ValueError: no count > 0.
    """
    e = np.asarray(exponents, dtype=np.int64)
    c = np.asarray(counts, dtype=np.int64)
    keep = c > 0
    e, c = e[keep], c[keep]
    if not len(e):
        raise ValueError("an exponent histogram needs at least one count > 0")
    lo, hi = int(e.min()), int(e.max())
    dense = np.zeros(hi - lo + 1, dtype=np.int64)
    np.add.at(dense, e - lo, c)
    return {"min": float(lo), "max": float(hi + 1), "num": int(c.sum()), "sum": float((e * c).sum()),
            "sum_squares": float((e * e * c).sum()), "bucket_limits": [float(x) for x in range(lo + 1, hi + 2)],
            "bucket_counts": [int(x) for x in dense]}


def _step_scalars(steps: pd.DataFrame) -> list[tuple[int, str, float]]:
    out = []
    if not len(steps):
        return out
    for column, tag in STEP_TAGS.items():
        values = steps[column].astype(np.float64).to_numpy()
        if np.isnan(values).all():
            continue  # never seen (a loop that handed no loss to the recorder)
        out.extend((int(s), tag, float(v)) for s, v in zip(steps["step"].to_numpy(), values))
    return out


def _fraction_scalars(tensors: pd.DataFrame, fmt: str | None) -> list[tuple[int, str, float]]:
    if not len(tensors):
        return []
    columns = fraction_tags(fmt)
    numel = tensors["numel"].to_numpy(np.float64)
    frame = pd.DataFrame({"step": tensors["step"].to_numpy(np.int64), "module": tensors["module"].astype(str),
                          "role": tensors["role"].astype(str), "numel": numel})
    for c in columns:  # the counts each fraction was made of (frac = count / numel)
        frame[c] = np.where(numel > 0, np.rint(tensors[c].to_numpy(np.float64) * numel), 0.0)
    sums = frame.groupby(["step", "role", "module"], sort=True).sum()
    sums = sums[sums["numel"] > 0]
    out = []
    for (step, role, module), row in sums.iterrows():
        for c in columns:
            out.append((int(step), fraction_tag(role, module, c, fmt), float(row[c] / row["numel"])))
    return out


def _histograms(hist: pd.DataFrame) -> list[tuple[int, str, dict]]:
    if not len(hist):
        return []
    h = hist[hist["count"] > 0]
    frame = pd.DataFrame({"step": h["step"].to_numpy(np.int64), "role": h["role"].astype(str),
                          "module": h["module"].astype(str), "name": h["name"].astype(str),
                          "exponent": h["exponent"].to_numpy(np.int64), "count": h["count"].to_numpy(np.int64)})
    out = []
    for (step, role, module, name), g in frame.groupby(["step", "role", "module", "name"], sort=True):
        out.append((int(step), histogram_tag(role, module, name),
                    exponent_histogram(g["exponent"].to_numpy(), g["count"].to_numpy())))
    return out


def write_tensorboard(run, logdir, rank: int | None = None) -> Path:
    """Write ``run`` as TensorBoard events into ``logdir`` (made if missing) and return it.

    What is written, under which tags, and how exponent histograms are encoded: see the module
    docstring. Each call writes a new event file; write each run into its own directory (writing
    one run twice into one directory shows its curves twice).

    Args:
        run: an :class:`mpscope.Run` or the directory of a saved run.
        logdir: the TensorBoard log directory of this run.
        rank: write rank ``rank``'s own rows of a multi-rank run; None: the run as given (a merged
            Run: the merged values).

    Raises:
        ImportError: the ``tensorboard`` package is missing (``pip install 'mpscope[tensorboard]'``).
        TypeError: ``run`` is neither a Run nor a path, or ``logdir`` is no path.
        ValueError, RunFileError: see :meth:`mpscope.Run.for_rank`.
    """
    d = as_path(logdir, "write TensorBoard events to")
    SummaryWriter = summary_writer_class()
    run = select_rank(as_run(run), rank)
    fmt = run_format(run)
    by_step: dict[int, list] = {}
    for step, tag, value in _step_scalars(run.steps) + _fraction_scalars(run.tensors, fmt):
        by_step.setdefault(step, []).append((tag, value, None))
    for step, tag, histogram in _histograms(run.histograms):
        by_step.setdefault(step, []).append((tag, None, histogram))
    d.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(log_dir=str(d))
    try:
        for step in sorted(by_step):
            for tag, value, histogram in by_step[step]:
                if histogram is None:
                    writer.add_scalar(tag, value, step)
                else:
                    writer.add_histogram_raw(tag, global_step=step, **histogram)
    finally:
        writer.close()
    return d
