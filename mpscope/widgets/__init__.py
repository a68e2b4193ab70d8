"""Notebook views of a Run: :mod:`mpscope.widgets.charts` (pure DataFrame -> altair chart) and
:mod:`mpscope.widgets.explorer` (the ipywidgets layer explorer, ``explore(run)``).

Nothing is imported here, so ``import mpscope.widgets`` stays free of altair and ipywidgets.
"""


def explore(run, advice=None):
    """See :func:`mpscope.widgets.explorer.explore` (imported on first use)."""
    from mpscope.widgets.explorer import explore as _explore

    return _explore(run, advice=advice)
