"""The embedded default of ``mpscope demo``: a small GPT trained on Python's own source code.

``run_demo(...)`` runs the whole demo (:mod:`mpscope.demo.training`); :class:`GPT` / :class:`GPTConfig`
(:mod:`mpscope.demo.model`) and :class:`CharDataset` (:mod:`mpscope.demo.data`) are reusable, e.g.
by ``benchmarks/overhead.py``.
"""

from mpscope.demo.data import CharDataset, load_text
from mpscope.demo.model import GPT, GPTConfig
from mpscope.demo.training import run_demo

__all__ = ["CharDataset", "GPT", "GPTConfig", "load_text", "run_demo"]
