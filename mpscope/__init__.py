"""mpscope: see where a mixed-precision PyTorch run's numbers sit against fp16 / bf16 limits.

Public names are resolved lazily so that ``import mpscope`` imports neither IPython, ipywidgets,
altair nor anywidget (and not even the advisor until it is used).
"""

from __future__ import annotations

import importlib

from mpscope._version import __version__ as __version__

_PUBLIC = {
    "record": "mpscope.recorder",
    "Recorder": "mpscope.recorder",
    "Run": "mpscope.run",
    "advise": "mpscope.advisor",
    "Recommendation": "mpscope.advisor",
    "Finding": "mpscope.advisor",
    "simulate_scaler": "mpscope.advisor",
    "scale_whatif": "mpscope.advisor",
    "apply": "mpscope.applying",
    "shadow_check": "mpscope.advisor.precision",
    "ShadowCheck": "mpscope.advisor.precision",
    "compare": "mpscope.comparison",
    "Comparison": "mpscope.comparison",
    "compare_precision": "mpscope.comparison",
    "explore": "mpscope.widgets.explorer",
    "FORMATS": "mpscope.formats",
}

__all__ = sorted(_PUBLIC) + ["load_ipython_extension", "unload_ipython_extension"]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'mpscope' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def load_ipython_extension(ipython) -> None:
    """Entry point of ``%load_ext mpscope``: registers the ``%mpscope`` / ``%%mpscope`` magics."""
    from mpscope.magic import (
        load_ipython_extension as _load,  # imports IPython (optional)
    )

    _load(ipython)


def unload_ipython_extension(ipython) -> None:
    from mpscope.magic import (
        unload_ipython_extension as _unload,  # imports IPython (optional)
    )

    _unload(ipython)
