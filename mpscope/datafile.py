"""Reading the JSON and YAML files mpscope writes (``meta.json``, recommendation files) as plain data.

A damaged or hostile file becomes one ``ValueError`` that names the file, never a ``RecursionError``
or a parser's traceback: nesting is limited to :data:`MAX_DEPTH` levels and size to :data:`MAX_VALUES`
values (mpscope's own files nest fewer than 10 levels).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

#: The deepest nesting of lists and dicts accepted in a data file.
MAX_DEPTH = 64
#: The most values (scalars, lists and dicts) accepted in a data file; a YAML alias counts as a copy
#: of what it names, so an alias bomb is refused before anything copies it.
MAX_VALUES = 1_000_000


def _problem(data: object) -> str | None:
    """Why ``data`` is refused (nested deeper than :data:`MAX_DEPTH`, or more than :data:`MAX_VALUES`
    values counting each YAML alias as a copy), or None; walked without recursion."""
    stack, values = [(data, 0)], 0
    while stack:
        x, d = stack.pop()
        values += 1
        if values > MAX_VALUES:
            return f"holds more than {MAX_VALUES:,} values"
        if isinstance(x, str) and not _is_unicode(x):
            return f"holds text that is not valid Unicode (a lone surrogate) near {x[:40]!r}"
        if isinstance(x, dict):
            stack.extend((k, d) for k in x)
            x = list(x.values())
        if isinstance(x, list):
            if d + 1 > MAX_DEPTH:
                return f"nests lists or objects deeper than {MAX_DEPTH} levels"
            stack.extend((v, d + 1) for v in x)
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_data(path: "str | os.PathLike", kind: str | None = None) -> object:
    """The data in the JSON or YAML file ``path``.

    Args:
        path: the file.
        kind: ``"json"`` or ``"yaml"``; None picks by suffix (``.yaml`` / ``.yml`` in any case is
            YAML, anything else JSON). YAML is read with ``yaml.safe_load`` (plain data only).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not UTF-8 text, not valid JSON/YAML, nests deeper than
            :data:`MAX_DEPTH`, holds more than :data:`MAX_VALUES` values or text that is not valid
            Unicode (a lone surrogate, which JSON's ``\\ud800`` escapes can write); the message names
            the file.
    """
    p = Path(path)
    kind = kind or ("yaml" if p.suffix.lower() in (".yaml", ".yml") else "json")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p} is not UTF-8 text ({e})") from None
    try:
        data = _parse(text, kind, p)
    except RecursionError:  # the parsers recurse once per level
        problem = f"nests lists or objects deeper than {MAX_DEPTH} levels"
    else:
        problem = _problem(data)
    if problem:
        raise ValueError(f"{p} {problem}; mpscope's files never do")
    return data


def _parse(text: str, kind: str, p: Path) -> object:
    if kind == "yaml":
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{p} is not valid YAML ({str(e).splitlines()[0]})") from None
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer past Python's digit limit
        raise ValueError(f"{p} is not valid JSON ({e})") from None
