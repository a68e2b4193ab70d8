"""Names of the tensors in a module's output: ``output``, ``output.0`` for tuples, ``output.key``
for dicts (nested up to 5 levels), as ``Run.tensors``' ``name`` column spells them."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def flatten_outputs(obj, prefix: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for the tensors in a nested tuple / list / dict ``obj`` (a tensor
    itself is named ``prefix``); anything else, and nesting deeper than 5, yields nothing."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif depth > 4:
        return
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from flatten_outputs(v, f"{prefix}.{i}", depth + 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten_outputs(v, f"{prefix}.{k}", depth + 1)


def flatten_outputs_list(obj, prefix: str) -> list:
    """:func:`flatten_outputs` as a list (what hooks traced by dynamo iterate)."""
    return list(flatten_outputs(obj, prefix))
