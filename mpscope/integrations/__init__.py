"""Callbacks for training frameworks: :mod:`mpscope.integrations.hf` (``transformers.Trainer``) and
:mod:`mpscope.integrations.lightning` (``lightning.pytorch.Trainer``).

Each submodule imports its framework when it is imported itself; ``import mpscope`` and
``import mpscope.integrations`` import neither (install ``mpscope[hf]`` / ``mpscope[lightning]``).
"""
