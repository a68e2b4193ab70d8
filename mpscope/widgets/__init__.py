"""Notebook views of a Run: :mod:`mpscope.widgets.charts` (pure DataFrame -> altair chart) and
:mod:`mpscope.widgets.explorer` (the ipywidgets layer explorer, ``explore(run)``).

Nothing heavy is imported here, so ``import mpscope.widgets`` stays free of altair and ipywidgets.
The small helpers below are shared by the explorer and :mod:`mpscope.report`.
"""

from __future__ import annotations

import os


def explore(run, advice=None):
    """See :func:`mpscope.widgets.explorer.explore` (imported on first use)."""
    from mpscope.widgets.explorer import explore as _explore

    return _explore(run, advice=advice)


def _as_run(run):
    """``run`` itself if it looks like an mpscope.Run, ``Run.load(run)`` for a path; else TypeError."""
    if isinstance(run, (str, os.PathLike)):
        from mpscope.run import Run

        return Run.load(run)
    missing = [a for a in ("tensors", "steps", "histograms", "meta") if not hasattr(run, a)]
    if missing:
        raise TypeError(
            f"expected an mpscope.Run (recorder.run, or mpscope.Run.load(directory)) or the "
            f"path of a saved run; got {type(run).__name__}, which lacks {missing}"
        )
    return run


def _advisor_function(name: str):
    """(function, None) for ``mpscope.<name>`` of the advisor, or (None, why it is unavailable)."""
    try:
        import mpscope

        return getattr(mpscope, name), None
    except Exception as exc:  # the advisor is optional for the explorer
        return None, f"advisor unavailable ({type(exc).__name__}: {exc})"


def _default_advice(run):
    """(advice, error text): the advisor's Recommendation, or None and why it is unavailable."""
    advise, error = _advisor_function("advise")
    if advise is None:
        return None, error
    try:
        return advise(run), None
    except Exception as exc:
        return None, f"advisor unavailable: advise(run) raised {type(exc).__name__}: {exc}"
