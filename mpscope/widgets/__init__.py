"""Notebook views of a Run: :mod:`mpscope.widgets.charts` (pure DataFrame -> altair chart) and
:mod:`mpscope.widgets.explorer` (the ipywidgets layer explorer, ``explore(run)``).

Nothing heavy is imported here, so ``import mpscope.widgets`` stays free of altair and ipywidgets.
The small helpers below are shared by the explorer and :mod:`mpscope.report`.
"""

from __future__ import annotations

from mpscope.advisor import try_advise


def explore(run, advice=None, rank=None):
    """See :func:`mpscope.widgets.explorer.explore` (imported on first use)."""
    from mpscope.widgets.explorer import explore as _explore  # imports ipywidgets (optional dependency)

    return _explore(run, advice=advice, rank=rank)


def _default_advice(run):
    """(advice, error text): the advisor's Recommendation, or None and why ``advise(run)`` failed
    (a view of a partial or unusual run still shows its frames)."""
    advice, exc = try_advise(run)
    return advice, None if exc is None else f"advisor unavailable: advise(run) raised {type(exc).__name__}: {exc}"
