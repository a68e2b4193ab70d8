"""Run: the recorded data of one training run, as columns, with pandas views and Parquet files.

A Run is written by one :class:`~mpscope.recorder.Recorder` and read by everything else (advisor,
widgets, report, export, compare). Rows are kept in compact column chunks (about 80 bytes per
tensor row; see :meth:`Run.nbytes`) and, when ``spill_dir`` is given, spilled to Parquet part files
once ``max_rows_in_memory`` is exceeded, so a long run's memory stays bounded without losing rows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from mpscope.stats import COUNT_NAMES

#: Column order of ``Run.tensors`` (DESIGN.md, plus ``bf16_overflow_frac``).
TENSOR_COLUMNS = [
    "step",
    "module",
    "role",
    "name",
    "dtype",
    "numel",
    "min",
    "max",
    "absmax",
    "absmin_nonzero",
    "zero_frac",
    "subnormal_frac",
    "fp16_underflow_frac",
    "fp16_subnormal_frac",
    "fp16_overflow_frac",
    "bf16_underflow_frac",
    "bf16_subnormal_frac",
    "bf16_overflow_frac",
    "nan_count",
    "inf_count",
    "loss_scale",
]
STEP_COLUMNS = [
    "step",
    "loss",
    "loss_scale",
    "found_inf",
    "skipped",
    "scale_after",
    "recorded",
    "backward_count",
    "clip_norm",
    "clip_scaled",
]
HIST_COLUMNS = ["step", "module", "role", "name", "exponent", "count"]
ROLES = ("activation", "activation_grad", "param_grad", "weight", "optimizer_state", "loss", "op_output")
_CATEGORICAL = ("module", "role", "name", "dtype")
_FILES = {"tensors": "tensors.parquet", "steps": "steps.parquet", "histograms": "histograms.parquet"}


class RunFileError(RuntimeError):
    """A run directory is missing, incomplete or unreadable."""


@dataclass
class _Keys:
    """Interning table: (module, role, name, dtype) -> int key."""

    index: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)

    def key(self, module: str, role: str, name: str, dtype: str) -> int:
        k = (module, role, name, dtype)
        i = self.index.get(k)
        if i is None:
            i = self.index[k] = len(self.rows)
            self.rows.append(k)
        return i


class Run:
    """The data of one recorded run.

    Attributes:
        meta: dict of facts about the run (device, torch version, autocast dtype, scaler settings,
            optimizer, model, parameter count; see docs/architecture.md).
        tables: extra named DataFrames (e.g. ``"ops"``: the autocast audit), saved and loaded
            with the run.

    Frames (built on access, cached until new rows arrive):
        tensors: one row per (step, module, role, name); columns :data:`TENSOR_COLUMNS`.
        steps: one row per step; columns :data:`STEP_COLUMNS`.
        histograms: ``step, module, role, name, exponent, count`` with exponent =
            floor(log2|x|) of non-zero finite elements in unscaled units.
    """

    def __init__(self, meta: dict | None = None, spill_dir=None, max_rows_in_memory: int = 2_000_000):
        self.meta: dict = dict(meta or {})
        self.tables: dict[str, pd.DataFrame] = {}
        self._keys = _Keys()
        self._chunks: list[dict[str, np.ndarray]] = []  # consolidated column chunks
        self._pending: list[dict[str, np.ndarray]] = []  # small per-step chunks
        self._pending_rows = 0
        self._hist_chunks: list[dict[str, np.ndarray]] = []
        self._steps: list[tuple] = []
        self._spill_dir = Path(spill_dir) if spill_dir is not None else None
        self._spilled: list[Path] = []
        self._max_rows = max_rows_in_memory
        self._frames: dict[str, pd.DataFrame] = {}
        self._loaded: dict[str, pd.DataFrame] | None = None

    # ---------------------------------------------------------------- writing (the recorder)
    def _key(self, module: str, role: str, name: str, dtype: str) -> int:
        return self._keys.key(module, role, name, dtype)

    def _append_rows(self, cols: dict[str, np.ndarray]) -> None:
        """Append tensor rows: ``step, key, numel, min, max, absmin_nonzero, loss_scale`` and the
        ``<name>_count`` columns of :data:`mpscope.stats.COUNT_NAMES`."""
        n = len(cols["key"])
        if n == 0:
            return
        self._pending.append(cols)
        self._pending_rows += n
        self._frames.pop("tensors", None)
        if self._pending_rows >= min(65536, self._max_rows):
            self._consolidate()

    def _append_hist(self, cols: dict[str, np.ndarray]) -> None:
        if len(cols["key"]):
            self._hist_chunks.append(cols)
            self._frames.pop("histograms", None)

    def _append_step(self, row: tuple) -> None:
        self._steps.append(row)
        self._frames.pop("steps", None)

    def _consolidate(self) -> None:
        if not self._pending:
            return
        merged = {k: np.concatenate([c[k] for c in self._pending]) for k in self._pending[0]}
        # counts fit in uint32 unless a tensor has >= 2^32 elements
        small = merged["numel"].max() < 2**32
        for name in COUNT_NAMES:
            merged[f"{name}_count"] = merged[f"{name}_count"].astype(np.uint32 if small else np.int64)
        merged["step"] = merged["step"].astype(np.int32)
        merged["key"] = merged["key"].astype(np.int32)
        merged["loss_scale"] = merged["loss_scale"].astype(np.float32)
        self._chunks.append(merged)
        self._pending, self._pending_rows = [], 0
        if self._spill_dir is not None and sum(len(c["key"]) for c in self._chunks) > self._max_rows:
            self._spill()

    def _spill(self) -> None:
        self._spill_dir.mkdir(parents=True, exist_ok=True)
        frame = self._chunks_frame(self._chunks)
        path = self._spill_dir / f"tensors-part{len(self._spilled):05d}.parquet"
        frame.to_parquet(path, index=False)
        self._spilled.append(path)
        self._chunks = []

    # ---------------------------------------------------------------- reading
    def _chunks_frame(self, chunks) -> pd.DataFrame:
        if not chunks:
            return _empty_tensors()
        cols = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
        out = {"step": cols["step"].astype(np.int64)}
        out.update(self._categoricals(cols["key"], _CATEGORICAL))
        numel = cols["numel"].astype(np.int64)
        out["numel"] = numel
        out["min"] = cols["min"].astype(np.float64)
        out["max"] = cols["max"].astype(np.float64)
        out["absmax"] = np.fmax(np.abs(out["min"]), np.abs(out["max"]))
        out["absmin_nonzero"] = cols["absmin_nonzero"].astype(np.float64)
        for name in COUNT_NAMES:
            c = cols[f"{name}_count"].astype(np.int64)
            if name in ("nan", "inf"):
                out[f"{name}_count"] = c
            else:
                out[f"{name}_frac"] = c / numel
        out["loss_scale"] = cols["loss_scale"].astype(np.float64)
        frame = pd.DataFrame(out)
        return frame[TENSOR_COLUMNS]

    def _categoricals(self, keys: np.ndarray, names) -> dict[str, pd.Categorical]:
        """Categorical columns (sorted categories) for interned keys."""
        table = self._keys.rows
        out = {}
        for cname in names:
            i = _CATEGORICAL.index(cname)
            cats = [r[i] for r in table]
            uniq = sorted(set(cats))
            pos = {c: j for j, c in enumerate(uniq)}
            codes = np.array([pos[c] for c in cats], dtype=np.int32)
            out[cname] = pd.Categorical.from_codes(codes[keys], categories=uniq)
        return out

    @property
    def tensors(self) -> pd.DataFrame:
        """One row per (step, module, role, name): see :data:`TENSOR_COLUMNS` and DESIGN.md."""
        if self._loaded is not None:
            return self._loaded["tensors"]
        if "tensors" not in self._frames:
            self._consolidate()
            parts = [pd.read_parquet(p) for p in self._spilled]
            if self._chunks or not parts:
                parts.append(self._chunks_frame(self._chunks))
            frame = parts[0] if len(parts) == 1 else _concat_categorical(parts)
            self._frames["tensors"] = frame.reset_index(drop=True)
        return self._frames["tensors"]

    @property
    def steps(self) -> pd.DataFrame:
        """One row per step: see :data:`STEP_COLUMNS` and DESIGN.md."""
        if self._loaded is not None:
            return self._loaded["steps"]
        if "steps" not in self._frames:
            frame = pd.DataFrame(self._steps, columns=STEP_COLUMNS)
            frame = frame.astype(
                {
                    "step": "int64",
                    "loss": "float64",
                    "loss_scale": "float64",
                    "found_inf": "bool",
                    "skipped": "bool",
                    "scale_after": "float64",
                    "recorded": "bool",
                    "backward_count": "int64",
                    "clip_norm": "float64",
                    "clip_scaled": "bool",
                }
            )
            self._frames["steps"] = frame
        return self._frames["steps"]

    @property
    def histograms(self) -> pd.DataFrame:
        """Exponent histograms: ``step, module, role, name, exponent, count`` (unscaled units)."""
        if self._loaded is not None:
            return self._loaded["histograms"]
        if "histograms" not in self._frames:
            if not self._hist_chunks:
                frame = pd.DataFrame({c: [] for c in HIST_COLUMNS}).astype(
                    {"step": "int64", "exponent": "int64", "count": "int64"}
                )
                for c in ("module", "role", "name"):
                    frame[c] = pd.Categorical([])
            else:
                cols = {k: np.concatenate([c[k] for c in self._hist_chunks]) for k in self._hist_chunks[0]}
                out = {"step": cols["step"].astype(np.int64)}
                out.update(self._categoricals(cols["key"], ("module", "role", "name")))
                out["exponent"] = cols["exponent"].astype(np.int64)
                out["count"] = cols["count"].astype(np.int64)
                frame = pd.DataFrame(out)
            self._frames["histograms"] = frame[HIST_COLUMNS]
        return self._frames["histograms"]

    def nbytes(self) -> dict[str, int]:
        """Bytes held in memory: ``{"tensor_rows": n, "tensor_bytes": b, "bytes_per_row": b/n, ...}``.

        Counts the tensor-row column chunks (spilled rows are on disk and not counted).
        """
        self._consolidate()
        rows = sum(len(c["key"]) for c in self._chunks)
        b = sum(a.nbytes for c in self._chunks for a in c.values())
        hb = sum(a.nbytes for c in self._hist_chunks for a in c.values())
        return {
            "tensor_rows": rows,
            "tensor_bytes": b,
            "bytes_per_row": b / rows if rows else math.nan,
            "histogram_bytes": hb,
            "spilled_parts": len(self._spilled),
        }

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        steps = self.steps
        return (
            f"<mpscope.Run {len(steps)} steps, {int(steps['recorded'].sum()) if len(steps) else 0} recorded, "
            f"{len(self.tensors)} tensor rows, model={self.meta.get('model')}, "
            f"autocast={self.meta.get('autocast_dtype')}>"
        )

    # ---------------------------------------------------------------- files
    def save(self, path) -> Path:
        """Write the run to directory ``path`` (created): tensors/steps/histograms Parquet files,
        ``tables/<name>.parquet`` and ``meta.json``. Returns the directory."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        self.tensors.to_parquet(d / _FILES["tensors"], index=False)
        self.steps.to_parquet(d / _FILES["steps"], index=False)
        self.histograms.to_parquet(d / _FILES["histograms"], index=False)
        if self.tables:
            (d / "tables").mkdir(exist_ok=True)
            for name, frame in self.tables.items():
                frame.to_parquet(d / "tables" / f"{name}.parquet", index=False)
        (d / "meta.json").write_text(json.dumps(self.meta, indent=2, default=_json_default))
        return d

    @classmethod
    def load(cls, path) -> "Run":
        """Read a run written by :meth:`save`.

        Raises:
            RunFileError: if the directory or one of its files is missing or unreadable; the
                message names the file and says how to produce a valid run directory.
        """
        d = Path(path)
        if not d.is_dir():
            raise RunFileError(
                f"{d} is not a run directory. Save one with run.save({str(d)!r}) or `mpscope demo --out DIR`."
            )
        frames = {}
        for key, fname in _FILES.items():
            f = d / fname
            if not f.exists():
                raise RunFileError(f"{f} is missing: {d} is not a complete mpscope run (expected {sorted(_FILES.values())} and meta.json).")
            try:
                frames[key] = pd.read_parquet(f)
            except Exception as e:  # pyarrow raises several types for corrupt files
                raise RunFileError(f"{f} cannot be read as Parquet ({type(e).__name__}: {e}); re-save the run.") from e
        try:
            meta = json.loads((d / "meta.json").read_text())
        except FileNotFoundError:
            raise RunFileError(f"{d / 'meta.json'} is missing: {d} is not a complete mpscope run.") from None
        except json.JSONDecodeError as e:
            raise RunFileError(f"{d / 'meta.json'} is not valid JSON ({e}); re-save the run.") from e
        tables = {}
        if (d / "tables").is_dir():
            for f in sorted((d / "tables").glob("*.parquet")):
                tables[f.stem] = pd.read_parquet(f)
        return cls.from_frames(frames["tensors"], frames["steps"], frames["histograms"], meta, tables)

    @classmethod
    def from_frames(cls, tensors, steps, histograms=None, meta=None, tables=None) -> "Run":
        """Build a Run from DataFrames with the documented schemas (for loading, tests, synthetic runs).

        Missing optional columns are filled: ``bf16_overflow_frac`` (0.0), ``loss_scale`` (1.0),
        ``backward_count`` (1), ``clip_norm`` (NaN), ``clip_scaled`` (False).

        Raises:
            ValueError: if a required column is missing (the message lists them).
        """
        t = tensors.copy()
        s = steps.copy()
        t = _fill(t, {"bf16_overflow_frac": 0.0, "loss_scale": 1.0}, TENSOR_COLUMNS, "tensors")
        s = _fill(
            s,
            {"backward_count": 1, "clip_norm": math.nan, "clip_scaled": False, "recorded": True},
            STEP_COLUMNS,
            "steps",
        )
        for c in _CATEGORICAL:
            t[c] = t[c].astype("category")
        if histograms is None:
            histograms = pd.DataFrame({c: [] for c in HIST_COLUMNS})
        h = histograms.copy()
        missing = [c for c in HIST_COLUMNS if c not in h.columns]
        if missing:
            raise ValueError(f"histograms frame lacks columns {missing}; expected {HIST_COLUMNS}")
        for c in ("module", "role", "name"):
            h[c] = h[c].astype("category")
        run = cls(meta)
        run.tables = dict(tables or {})
        run._loaded = {
            "tensors": t[TENSOR_COLUMNS].reset_index(drop=True),
            "steps": s[STEP_COLUMNS].reset_index(drop=True),
            "histograms": h[HIST_COLUMNS].astype({"step": "int64", "exponent": "int64", "count": "int64"}).reset_index(drop=True),
        }
        return run

    def report(self, path, advice=None):
        """Write the standalone HTML report (see :mod:`mpscope.report`); returns its path."""
        from mpscope.report import write_report

        return write_report(self, path, advice=advice)


def _fill(frame: pd.DataFrame, defaults: dict, columns: list[str], what: str) -> pd.DataFrame:
    for c, v in defaults.items():
        if c not in frame.columns:
            frame[c] = v
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{what} frame lacks columns {missing}; expected {columns}")
    return frame


def _concat_categorical(parts: list[pd.DataFrame]) -> pd.DataFrame:
    from pandas.api.types import union_categoricals

    out = {}
    for c in parts[0].columns:
        if isinstance(parts[0][c].dtype, pd.CategoricalDtype):
            out[c] = union_categoricals([p[c] for p in parts], sort_categories=True)
        else:
            out[c] = np.concatenate([p[c].to_numpy() for p in parts])
    return pd.DataFrame(out)


def _empty_tensors() -> pd.DataFrame:
    frame = pd.DataFrame({c: [] for c in TENSOR_COLUMNS})
    for c in _CATEGORICAL:
        frame[c] = pd.Categorical([])
    ints = {c: "int64" for c in ("step", "numel", "nan_count", "inf_count")}
    return frame.astype(ints)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)
