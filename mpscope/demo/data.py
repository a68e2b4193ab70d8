"""Real text that ships with Python: the source of a fixed list of standard-library modules.

The files are read from ``sysconfig.get_paths()["stdlib"]`` (the interpreter's own standard
library), not downloaded, so the demo runs offline and on every machine with the same corpus for
the same Python version. Some distributions strip the ``.py`` sources (keeping only ``.pyc``);
then :func:`load_text` raises :class:`FileNotFoundError` naming the directory it searched.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["STDLIB_FILES", "CharDataset", "load_text", "stdlib_dir"]

#: Standard-library source files (relative to the stdlib directory) that make up the corpus:
#: plain-Python modules present in every CPython 3.11+ build, about 1 MB of text together.
STDLIB_FILES: tuple[str, ...] = (
    "textwrap.py",
    "string.py",
    "difflib.py",
    "argparse.py",
    "fractions.py",
    "statistics.py",
    "heapq.py",
    "bisect.py",
    "dataclasses.py",
    "functools.py",
    "json/decoder.py",
    "json/encoder.py",
    "csv.py",
    "shlex.py",
    "calendar.py",
)


def stdlib_dir() -> Path:
    """The interpreter's standard-library directory (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_text(files: tuple[str, ...] = STDLIB_FILES, root: Path | str | None = None) -> str:
    """Concatenate the given source files (UTF-8) under ``root`` (default :func:`stdlib_dir`).

    Files that are missing are skipped; if none of them exists, raises ``FileNotFoundError`` that
    names the searched directory and the files looked for (install your distribution's full Python
    package, e.g. ``python3-dev``/``libpython3-stdlib``, or pass another ``root``).
    """
    base = Path(root) if root is not None else stdlib_dir()
    parts = []
    for rel in files:
        path = base / rel
        if path.is_file():
            parts.append(path.read_text(encoding="utf-8"))
    if not parts:
        raise FileNotFoundError(
            f"mpscope demo: none of the standard-library sources {list(files)} exists under "
            f"{base} (sysconfig.get_paths()['stdlib']). Your Python distribution seems to ship "
            "without .py sources; install its full standard library (for example the "
            "python3 / libpython3-stdlib package) and run `mpscope demo` again."
        )
    return "\n".join(parts)


@dataclass
class CharDataset:
    """Character-level language-modelling data over ``text``.

    ``vocab``: the sorted distinct characters; ``data``: the text as int64 token ids (1-D tensor).
    :meth:`batch` draws ``batch_size`` random windows of ``seq_len + 1`` characters with a
    ``torch.Generator`` so that the same seed gives the same batches on every run.
    """

    text: str
    seq_len: int

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if len(self.text) < self.seq_len + 2:
            raise ValueError(
                f"text has {len(self.text)} characters; need at least seq_len + 2 = "
                f"{self.seq_len + 2}"
            )
        self.vocab: list[str] = sorted(set(self.text))
        self.stoi = {ch: i for i, ch in enumerate(self.vocab)}
        self.data = torch.tensor([self.stoi[ch] for ch in self.text], dtype=torch.int64)

    @classmethod
    def from_stdlib(cls, seq_len: int) -> "CharDataset":
        """Dataset over :data:`STDLIB_FILES` (see :func:`load_text` for the errors raised)."""
        return cls(load_text(), seq_len)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids) -> str:
        """Token ids (iterable of int or a 1-D tensor) back to text."""
        return "".join(self.vocab[int(i)] for i in ids)

    def generator(self, seed: int) -> torch.Generator:
        """A CPU ``torch.Generator`` seeded with ``seed``, to pass to :meth:`batch`."""
        g = torch.Generator()
        g.manual_seed(seed)
        return g

    def batch(self, batch_size: int, generator: torch.Generator, device="cpu"):
        """``(x, y)``: int64 tensors ``(batch_size, seq_len)`` on ``device``; ``y`` is ``x``
        shifted by one character (the next-character targets)."""
        starts = torch.randint(
            0, len(self.data) - self.seq_len - 1, (batch_size,), generator=generator
        )
        offsets = torch.arange(self.seq_len + 1)
        windows = self.data[starts[:, None] + offsets]
        x, y = windows[:, :-1], windows[:, 1:]
        return x.to(device), y.to(device)
