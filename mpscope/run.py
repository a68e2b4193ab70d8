"""Run: the recorded data of one training run, as columns, with pandas views and Parquet files.

A Run is written by one :class:`~mpscope.recorder.Recorder` and read by everything else (advisor,
widgets, report, export, compare). Rows are kept in compact column chunks (about 80 bytes per
tensor row; see :meth:`Run.nbytes`) and, when ``spill_dir`` is given, spilled to Parquet part files
once ``max_rows_in_memory`` is exceeded, so a long run's memory stays bounded without losing rows.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch
from pandas.api import types as pt
from pandas.api.types import union_categoricals

from mpscope import merge as _merge
from mpscope.datafile import read_data
from mpscope.schema import (
    AUDIT_COLUMNS,
    COUNT_NAMES,
    FACT_COLUMNS,
    GRAD_ACCUMULATION_COLUMNS,
    HIST_COLUMNS,
    LOW_PRECISION,
    PRECISION_COLUMNS,
    RENAMED_STEP_COLUMNS,
    ROLES,
    STEP_COLUMNS,
    TENSOR_COLUMNS,
)

#: dtype of each ``Run.steps`` column.
STEP_DTYPES = {"step": "int64", "loss": "float64", "loss_scale": "float64", "found_inf": "bool", "skipped": "bool",
               "scale_after": "float64", "recorded": "bool", "backward_count": "int64", "clip_norm": "float64",
               "clipped_before_unscale": "bool", "opt_scaled": "bool", "autocast_at_step": "bool", "clip_norm_fp32": "float64",
               "clip_grad_absmax": "float64", "grad_reset": "float64"}
#: ``Run.tables["nonfinite_ranks"]`` of a merged multi-rank Run: tensors holding NaN / inf, the
#: lowest rank that saw them and how many ranks did.
NONFINITE_RANK_COLUMNS = ("step", "module", "role", "name", "dtype", "first_rank", "ranks")
#: ``Run.tables["rank_disagreement"]``: steps where the ranks' GradScaler values differ.
DISAGREEMENT_COLUMNS = ("step", "column", "min", "max")
_CATEGORICAL = ("module", "role", "name", "dtype")
_FILES = {"tensors": "tensors.parquet", "steps": "steps.parquet", "histograms": "histograms.parquet"}
#: Sub-directories of a multi-rank ``out=`` directory: the merged Run, and the per-rank rows.
MERGED_DIR, RANKS_DIR = "merged", "ranks"


#: Types of the known ``meta.json`` fields (a missing field is fine; extra fields are kept as they are).
META_TYPES: dict[str, tuple[type, ...]] = {
    "device": (str, type(None)),
    "device_name": (str, type(None)),
    "cuda_capability": (list, type(None)),
    "torch_version": (str, type(None)),
    "autocast_dtype": (str, type(None)),
    "autocast_device_type": (str, type(None)),
    "model": (str, type(None)),
    "module_types": (dict, type(None)),
    "param_count": (int, type(None)),
    "param_dtypes": (dict, type(None)),
    "optimizer": (str, type(None)),
    "optimizer_hparams": (dict, type(None)),
    "scaler": (dict, type(None)),
    "every": (int,),
    "hist_every": (int,),
    "roles": (list,),
    "mpscope_version": (str, type(None)),
    "rank": (int,),
    "ranks": (list,),
    "compiled": (bool,),
    "unobserved": (dict,),
    "distributed": (dict, type(None)),
    "complete": (bool,),
    "parts_written": (dict,),
    "untrained_model": (int,),
}
#: ``optimizer_hparams`` fields the advisor reads as numbers (a missing or null one is fine).
_NUMERIC_HPARAMS = ("lr", "eps", "weight_decay", "momentum")
#: Numeric fields of ``meta["scaler"]`` (GradScaler's constructor arguments).
_SCALER_FIELDS = {"init_scale": (int, float), "growth_factor": (int, float), "backoff_factor": (int, float),
                  "growth_interval": (int,)}
#: Column kinds checked when a run is loaded: "i" integer, "f" number, "b" boolean, "s" text.
_COLUMN_KINDS = {
    "tensors": {"step": "i", "module": "s", "role": "s", "name": "s", "dtype": "s", "numel": "i",
                **{c: "f" for c in ("min", "max", "absmax", "absmin_nonzero", "zero_frac", "subnormal_frac",
                                    "fp16_underflow_frac", "fp16_subnormal_frac", "fp16_overflow_frac",
                                    "bf16_underflow_frac", "bf16_subnormal_frac", "bf16_overflow_frac", "loss_scale")},
                "nan_count": "i", "inf_count": "i"},
    "steps": {"step": "i", "loss": "f", "loss_scale": "f", "found_inf": "b", "skipped": "b", "scale_after": "f",
              "recorded": "b", "backward_count": "i", "clip_norm": "f", "clipped_before_unscale": "b", "clip_scaled": "b",
              "opt_scaled": "b", "autocast_at_step": "b", "clip_norm_fp32": "f", "clip_grad_absmax": "f",
              "grad_reset": "f"},
    "histograms": {"step": "i", "module": "s", "role": "s", "name": "s", "dtype": "s", "exponent": "i", "count": "i"},
}


#: Columns :meth:`Run.from_frames` fills when a frame lacks them: table -> column -> value.
FILLED_COLUMNS: dict[str, dict] = {
    "tensors": {"bf16_overflow_frac": 0.0, "loss_scale": 1.0},
    "steps": {"backward_count": 1, "clip_norm": math.nan, "clipped_before_unscale": False, "recorded": True,
              "opt_scaled": False, "autocast_at_step": False, "clip_norm_fp32": math.nan,
              "clip_grad_absmax": math.nan, "grad_reset": math.nan},
}
#: The columns each table of a saved run must hold: the row tables less the columns
#: :meth:`Run.from_frames` fills, and the ``tables/<name>.parquet`` mpscope writes.
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    **{table: tuple(c for c in columns if c not in FILLED_COLUMNS[table])
       for table, columns in (("tensors", TENSOR_COLUMNS), ("steps", STEP_COLUMNS))},
    "histograms": tuple(c for c in HIST_COLUMNS if c != "dtype"),  # from_frames takes dtype from the tensor rows
    "precision": tuple(PRECISION_COLUMNS),
    "ops": tuple(AUDIT_COLUMNS),
    "op_facts": tuple(FACT_COLUMNS),
    "grad_accumulation": tuple(GRAD_ACCUMULATION_COLUMNS),
    "nonfinite_ranks": NONFINITE_RANK_COLUMNS,
    "rank_disagreement": DISAGREEMENT_COLUMNS,
}


class RunFileError(RuntimeError):
    """A run directory is missing, incomplete or unreadable, or cannot be written."""


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


class StepRecord(NamedTuple):
    """One row of :attr:`Run.steps` as a recording appends it (fields: :data:`~mpscope.schema.STEP_COLUMNS`)."""

    step: int
    loss: float
    loss_scale: float
    found_inf: bool
    skipped: bool
    scale_after: float
    recorded: bool
    backward_count: int
    clip_norm: float
    clipped_before_unscale: bool
    opt_scaled: bool
    autocast_at_step: bool
    clip_norm_fp32: float
    clip_grad_absmax: float
    grad_reset: float


assert list(StepRecord._fields) == STEP_COLUMNS, "StepRecord must list STEP_COLUMNS in order"


class _Store:
    """What a Run holds before it is read as frames (shared by the :class:`Run` and its
    :class:`RunBuilder`): the key table, the tensor and histogram row chunks, the step rows, the
    frames made of them (dropped when rows arrive), the listeners told of appended rows, and, for a
    merged multi-rank Run, where each rank's own rows are."""

    def __init__(self, spill: Path | None, max_rows: int, tensor_frame, hist_frame) -> None:
        self.keys = _Keys()
        self.tensor_frame, self.hist_frame = tensor_frame, hist_frame
        self.tensors = _ChunkedTable("tensors", _compact_tensor_rows, tensor_frame, spill, max_rows)
        self.histograms = _ChunkedTable("histograms", _compact_hist_rows, hist_frame, spill, max_rows)
        self.steps: list[tuple] = []
        self.frames: dict[str, pd.DataFrame] = {}
        self.listeners: list = []
        self.rank_dir: Path | None = None  # the out= directory holding each rank's own rows
        self.rank_runs: dict[int, Run] = {}  # rank Runs at hand (rank 0's own, in rank 0's process)


class RunBuilder:
    """The writing side of a :class:`Run` (``run.builder()``): what a recording's step buffer and the
    rank merge append. The Run reads as frames at any time; each append drops the frames it changes.

    Rows are columns of int keys: ``key(module, role, name, dtype)`` interns a key (``key_index``
    maps the tuple to its key, ``key_rows[k]`` back). A *listener* (:meth:`add_listener`: an object
    with ``rows(cols)``, ``hist(cols)`` and ``step(record)``) hears of every batch appended, after
    the Run has it (per-rank files, the rank merge). ``run``: the Run written.
    """

    def __init__(self, store: _Store, run: "Run") -> None:
        self._store = store
        self.run = run
        self.key_index: dict = store.keys.index
        self.key_rows: list = store.keys.rows

    def key(self, module: str, role: str, name: str, dtype: str) -> int:
        """The int key of ``(module, role, name, dtype)``, made on first use."""
        return self._store.keys.key(module, role, name, dtype)

    def append_rows(self, cols: dict[str, np.ndarray]) -> None:
        """Append tensor rows: ``step, key, numel, min, max, absmin_nonzero, loss_scale`` and the
        ``<name>_count`` columns of :data:`mpscope.stats.COUNT_NAMES` (arrays of equal length)."""
        store = self._store
        if store.tensors.append(cols):
            store.frames.pop("tensors", None)
        for listener in store.listeners:
            listener.rows(cols)

    def append_hist(self, cols: dict[str, np.ndarray]) -> None:
        """Append histogram rows: ``step, key, exponent, count``."""
        store = self._store
        if store.histograms.append(cols):
            store.frames.pop("histograms", None)
        for listener in store.listeners:
            listener.hist(cols)

    def append_step(self, record: tuple) -> None:
        """Append one :class:`StepRecord` (or a tuple of its fields)."""
        store = self._store
        store.steps.append(record)
        store.frames.pop("steps", None)
        for listener in store.listeners:
            listener.step(record)

    def append_merged(self, merged: "_merge.Merged", keys: list[tuple]) -> None:
        """Append the merged rows of several ranks; ``keys[i]`` is agreed key i's
        (module, role, name, dtype). Cells with NaN / inf extend ``tables["nonfinite_ranks"]``,
        GradScaler disagreements ``tables["rank_disagreement"]`` (of :attr:`run`)."""
        kmap = np.array([self.key(*k) for k in keys], dtype=np.int64)
        for row in merged.steps:
            self.append_step(row)
        if len(merged.rows["key"]):
            self.append_rows(dict(merged.rows, key=kmap[merged.rows["key"]]))
        if len(merged.hist["key"]):
            self.append_hist(dict(merged.hist, key=kmap[merged.hist["key"]]))
        nf = merged.nonfinite
        tables = self.run.tables
        if len(nf["key"]):
            rows = [dict(zip(("module", "role", "name", "dtype"), keys[k]), step=int(st), first_rank=int(fr),
                         ranks=int(n)) for st, k, fr, n in zip(nf["step"], nf["key"], nf["first_rank"], nf["ranks"])]
            _extend_table(tables, "nonfinite_ranks", pd.DataFrame(rows)[list(NONFINITE_RANK_COLUMNS)])
        if merged.disagreement:
            _extend_table(tables, "rank_disagreement",
                          pd.DataFrame(merged.disagreement, columns=list(DISAGREEMENT_COLUMNS)))

    def tensor_frame(self, cols: dict[str, np.ndarray]) -> pd.DataFrame:
        """Tensor rows (as :meth:`append_rows` takes them) as a ``Run.tensors`` frame."""
        return self._store.tensor_frame(cols)

    def hist_frame(self, cols: dict[str, np.ndarray]) -> pd.DataFrame:
        """Histogram rows (as :meth:`append_hist` takes them) as a ``Run.histograms`` frame."""
        return self._store.hist_frame(cols)

    def add_listener(self, listener) -> None:
        self._store.listeners.append(listener)

    def remove_listener(self, listener) -> None:
        self._store.listeners[:] = [x for x in self._store.listeners if x is not listener]

    def rank_sources(self, directory: "Path | None", runs: dict[int, "Run"]) -> None:
        """For a merged multi-rank Run: the ``out=`` directory holding each rank's own rows (None:
        none) and rank Runs already at hand, read by :meth:`Run.for_rank`."""
        self._store.rank_dir = directory
        self._store.rank_runs.update(runs)


def _extend_table(tables: dict, name: str, frame: pd.DataFrame) -> None:
    old = tables.get(name)
    tables[name] = frame if old is None else pd.concat([old, frame], ignore_index=True)


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
        histograms: ``step, module, role, name, dtype, exponent, count`` with exponent =
            floor(log2|x|) of non-zero finite elements in unscaled units.
    """

    def __init__(self, meta: dict | None = None, spill_dir=None, max_rows_in_memory: int = 2_000_000):
        self.meta: dict = dict(meta or {})
        self.tables: dict[str, pd.DataFrame] = {}
        # each Run spills into its own new folder inside spill_dir, so runs sharing one never mix
        spill = Path(spill_dir) / f"run-{os.getpid()}-{uuid.uuid4().hex[:12]}" if spill_dir is not None else None
        self.spill_path: Path | None = spill
        self._store = _Store(spill, max_rows_in_memory, self._tensor_frame, self._hist_frame)
        self._loaded: dict[str, pd.DataFrame] | None = None

    def builder(self) -> "RunBuilder":
        """The writing side of this Run (:class:`RunBuilder`): what a recording appends to it.

        Raises:
            ValueError: the Run was loaded or built from frames (it holds no rows to append to).
        """
        if self._loaded is not None:
            raise ValueError("this Run was loaded or built from frames: it takes no more rows; record a new one.")
        return RunBuilder(self._store, self)

    @property
    def ranks(self) -> list[int]:
        """The ranks whose rows this Run holds: ``[0, 1, ...]`` for a merged multi-rank Run,
        ``[n]`` for rank n's own, ``[0]`` for a single-process run."""
        return [int(r) for r in self.meta.get("ranks", [self.meta.get("rank", 0)])]

    def for_rank(self, rank: int | None) -> Run:
        """Rank ``rank``'s own rows of this multi-rank Run (``None``: this Run itself).

        A merged Run finds them in the ``out=`` directory it came from (``mpscope.Run.load(DIR)``,
        or ``recorder.run`` on rank 0 of ``record(..., out=DIR)``), read with
        ``Run.load(DIR, rank=rank)`` and kept for the next call. Without a directory only rank 0's
        own rows are at hand (in rank 0's process, where the merged Run was built): the other ranks'
        rows stayed in their own processes (their ``recorder.run``). A Run holding one rank's rows
        (or a single-process run, rank 0) returns itself for that rank.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is not one of :attr:`ranks`, or the merged Run has no directory
                holding that rank's rows (record with ``out=DIR``).
            RunFileError: the directory no longer holds that rank's files.
        """
        if rank is None:
            return self
        if not isinstance(rank, numbers.Integral) or isinstance(rank, bool):
            raise TypeError(f"rank must be an int, one of this run's ranks {self.ranks} (None: the merged rows); "
                            f"got {rank!r}")
        rank = int(rank)
        if rank not in self.ranks:
            raise ValueError(f"this run holds the rows of ranks {self.ranks}; rank {rank} is not one of them "
                             "(pass one of those, or None for the whole run)")
        if self.ranks == [rank]:
            return self
        store = self._store
        if rank not in store.rank_runs:
            if store.rank_dir is None:
                held = sorted(store.rank_runs)
                raise ValueError(
                    f"rank {rank}'s own rows are not in this merged Run: it was recorded without out=, so they "
                    f"stayed in rank {rank}'s process (its recorder.run)"
                    + (f"; ranks at hand here: {held}" if held else "")
                    + ". Record with mpscope.record(..., out=DIR) and use mpscope.Run.load(DIR, rank=N).")
            store.rank_runs[rank] = Run.load(store.rank_dir, rank=rank)
        return store.rank_runs[rank]

    # ---------------------------------------------------------------- reading
    def _tensor_frame(self, cols: dict[str, np.ndarray] | None) -> pd.DataFrame:
        if cols is None:
            return _empty_tensors()
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
        return pd.DataFrame(out)[TENSOR_COLUMNS]

    def _hist_frame(self, cols: dict[str, np.ndarray] | None) -> pd.DataFrame:
        if cols is None:
            return _empty_histograms()
        out = {"step": cols["step"].astype(np.int64)}
        out.update(self._categoricals(cols["key"], _CATEGORICAL))
        out["exponent"] = cols["exponent"].astype(np.int64)
        out["count"] = cols["count"].astype(np.int64)
        return pd.DataFrame(out)[HIST_COLUMNS]

    def _categoricals(self, keys: np.ndarray, names) -> dict[str, pd.Categorical]:
        """Categorical columns (sorted categories) for interned keys."""
        table = self._store.keys.rows
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
        """One row per (step, module, role, name): columns :data:`mpscope.schema.TENSOR_COLUMNS`."""
        if self._loaded is not None:
            return self._loaded["tensors"]
        frames = self._store.frames
        if "tensors" not in frames:
            frames["tensors"] = self._store.tensors.frame()
        return frames["tensors"]

    @property
    def steps(self) -> pd.DataFrame:
        """One row per step: columns :data:`mpscope.schema.STEP_COLUMNS`."""
        if self._loaded is not None:
            return self._loaded["steps"]
        frames = self._store.frames
        if "steps" not in frames:
            frames["steps"] = _steps_frame(self._store.steps)
        return frames["steps"]

    @property
    def histograms(self) -> pd.DataFrame:
        """Exponent histograms: ``step, module, role, name, dtype, exponent, count`` (unscaled units;
        ``dtype`` tells apart one tensor name seen in two dtypes in a step, as in ``tensors``)."""
        if self._loaded is not None:
            return self._loaded["histograms"]
        frames = self._store.frames
        if "histograms" not in frames:
            frames["histograms"] = self._store.histograms.frame()
        return frames["histograms"]

    @property
    def precision(self) -> pd.DataFrame:
        """Errors against the float32 reference, one row per (step, module, role, name, dtype) of a run
        recorded with ``shadow=True``: columns :data:`PRECISION_COLUMNS` (empty without a shadow)."""
        frame = self.tables.get("precision")
        if frame is None:
            frame = pd.DataFrame({c: pd.Series(dtype=object if c in ("module", "role", "name", "dtype")
                                               else "int64" if c == "step" else "float64")
                                  for c in PRECISION_COLUMNS})
        return frame

    def nbytes(self) -> dict:
        """Bytes held in memory by the row tables (spilled rows are on disk and not counted):
        ``tensor_rows, tensor_bytes, bytes_per_row, histogram_rows, histogram_bytes, spilled_parts``."""
        t, h = self._store.tensors, self._store.histograms
        t.consolidate()
        h.consolidate()
        return {
            "tensor_rows": t.rows_in_memory,
            "tensor_bytes": t.bytes_in_memory,
            "bytes_per_row": t.bytes_in_memory / t.rows_in_memory if t.rows_in_memory else math.nan,
            "histogram_rows": h.rows_in_memory,
            "histogram_bytes": h.bytes_in_memory,
            "spilled_parts": len(t.spilled) + len(h.spilled),
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
        """Write the run to directory ``path``: tensors/steps/histograms Parquet files,
        ``tables/<name>.parquet`` and ``meta.json``. Returns the directory.

        Atomic: everything is written into a new folder beside ``path``, which then replaces
        ``path`` by rename; a save that fails half-way leaves ``path`` as it was. ``path`` must be new,
        empty, or hold an earlier mpscope run (which is replaced as a whole).

        Raises:
            RunFileError: ``path`` is a file, or a directory holding anything but one mpscope run.
        """
        d = as_path(path, "save the run to")
        _check_save_target(d)
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = d.parent / f".{d.name}.saving-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            self.tensors.to_parquet(tmp / _FILES["tensors"], index=False)
            self.steps.to_parquet(tmp / _FILES["steps"], index=False)
            self.histograms.to_parquet(tmp / _FILES["histograms"], index=False)
            if self.tables:
                (tmp / "tables").mkdir()
                for name, frame in self.tables.items():
                    frame.to_parquet(tmp / "tables" / f"{name}.parquet", index=False)
            (tmp / "meta.json").write_text(json.dumps(self.meta, indent=2, default=_json_default))
            _replace_dir(tmp, d)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return d

    @classmethod
    def load(cls, path, rank: int | None = None) -> "Run":
        """Read a run written by :meth:`save`, or the directory ``out=`` of a multi-rank recording.

        A multi-rank directory holds ``merged/`` (the merged Run rank 0 wrote at the end) and
        ``ranks/`` (each rank's own rows, see :class:`RankFiles`). Without ``rank`` the merged Run
        is returned; if ``merged/`` is absent (a rank crashed before the end) the per-rank files are
        merged here, by the same rules. ``rank=N`` returns rank N's own rows.

        Raises:
            RunFileError: if the directory or one of its files is missing or unreadable; the
                message names the file and says how to produce a valid run directory; if ``rank``
                is given for a directory without that rank's files.
        """
        d = as_path(path, "load a run from")
        if rank is not None and (not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or rank < 0):
            raise TypeError(f"rank must be None (the merged run) or a rank number, an int >= 0; got {rank!r}")
        if rank is not None or ((d / RANKS_DIR).is_dir() and not (d / _FILES["tensors"]).exists()):
            return cls._load_ranks(d, rank)
        if not d.is_dir():
            raise RunFileError(
                f"{d} is not a run directory. Save one with run.save({str(d)!r}) or `mpscope demo --out DIR`."
            )
        if not (d / _FILES["tensors"]).exists() and (d / "run" / _FILES["tensors"]).exists():
            raise RunFileError(f"{d} holds a run in {d / 'run'}: pass that directory (`mpscope demo` saves its run there).")
        frames = {}
        for key, fname in _FILES.items():
            f = d / fname
            if not f.exists():
                raise RunFileError(f"{f} is missing: {d} is not a complete mpscope run (expected {sorted(_FILES.values())} and meta.json).")
            try:
                frames[key] = pd.read_parquet(f)
            except Exception as e:  # pyarrow raises several types for corrupt files
                raise RunFileError(f"{f} cannot be read as Parquet ({type(e).__name__}: {e}); re-save the run.") from e
            _check_columns(frames[key], key, f)
        meta = read_meta(d / "meta.json")
        tables = {}
        if (d / "tables").is_dir():
            for f in sorted((d / "tables").glob("*.parquet")):
                try:
                    tables[f.stem] = pd.read_parquet(f)
                except Exception as e:  # pyarrow raises several types for corrupt files
                    raise RunFileError(f"{f} cannot be read as Parquet ({type(e).__name__}: {e}); re-save the run.") from e
                _check_columns(tables[f.stem], f.stem, f)
        try:
            return cls.from_frames(frames["tensors"], frames["steps"], frames["histograms"], meta, tables)
        except ValueError as e:
            raise RunFileError(f"{d} is not a valid mpscope run: {e}. Re-save it with run.save().") from e

    @classmethod
    def from_frames(cls, tensors, steps, histograms=None, meta=None, tables=None) -> "Run":
        """Build a Run from DataFrames with the documented schemas (for loading, tests, synthetic runs).

        Missing optional columns are filled: ``bf16_overflow_frac`` (0.0), ``loss_scale`` (1.0),
        ``backward_count`` (1), ``clip_norm`` (NaN), ``clipped_before_unscale`` (False), ``opt_scaled``
        and ``autocast_at_step`` (False), ``clip_norm_fp32``, ``clip_grad_absmax`` and ``grad_reset``
        (NaN). Columns saved under an old name are renamed (``clip_scaled`` ->
        ``clipped_before_unscale``).

        An empty frame (no rows) stands for an empty table of the documented schema, whatever its
        columns and dtypes.

        Raises:
            ValueError: if a required column of a frame with rows is missing (the message lists them).
        """
        t = tensors.copy()
        s = steps.rename(columns={o: n for o, n in RENAMED_STEP_COLUMNS.items() if n not in steps.columns})
        t = _fill(t, FILLED_COLUMNS["tensors"], TENSOR_COLUMNS, "tensors") if len(t) else _empty_tensors()
        s = _fill(s, FILLED_COLUMNS["steps"], STEP_COLUMNS, "steps") if len(s) else _steps_frame([])
        for c in _CATEGORICAL:
            t[c] = t[c].astype("category")
        h = histograms.copy() if histograms is not None and len(histograms) else _empty_histograms()
        if "dtype" not in h.columns:  # frames written before histograms carried the dtype
            h = _dtype_from_tensors(h, t)
        missing = [c for c in HIST_COLUMNS if c not in h.columns]
        if missing:
            raise ValueError(f"histograms frame lacks columns {missing}; expected {HIST_COLUMNS}")
        for c in _CATEGORICAL:
            h[c] = h[c].astype("category")
        run = cls(meta)
        run.tables = dict(tables or {})
        run._loaded = {
            "tensors": t[TENSOR_COLUMNS].reset_index(drop=True),
            "steps": s[STEP_COLUMNS].reset_index(drop=True),
            "histograms": h[HIST_COLUMNS].astype({"step": "int64", "exponent": "int64", "count": "int64"}).reset_index(drop=True),
        }
        return run

    @classmethod
    def _load_ranks(cls, d: Path, rank: int | None) -> "Run":
        """The merged Run of a multi-rank directory (``rank=None``) or one rank's own rows."""
        root = d / RANKS_DIR
        if not root.is_dir():
            raise RunFileError(f"{d} holds no per-rank rows ({root} is missing): it was not written by record(..., out=...).")
        metas = {}
        for f in sorted((root / "meta").glob("rank=*.json")):
            number = f.stem.split("=", 1)[1]
            if not (number.isascii() and number.isdigit()):
                raise RunFileError(f"{f} is not a rank meta file (they are named rank=N.json); remove it.")
            metas[int(number)] = read_meta(f)
        if rank is not None:
            if rank not in metas:
                raise RunFileError(f"{d} has no files of rank {rank}; its ranks are {sorted(metas)}.")
            t, s, h = _rank_frames(root, rank, metas[rank])
            complete = not _unfinished({rank: metas[rank]}, d)
            return cls.from_frames(t, s, h, _loaded_meta(metas[rank], complete))
        if (d / MERGED_DIR / _FILES["tensors"]).exists():
            run = cls.load(d / MERGED_DIR)
        elif not metas:
            raise RunFileError(f"{root / 'meta'} holds no rank=N.json: {d} is not a complete multi-rank run.")
        else:
            run = _merge_rank_files(cls, root, metas, complete=not _unfinished(metas, d))
            _left_out(metas, d)
        run._store.rank_dir = d
        return run

    def report(self, path, advice=None, rank: int | None = None):
        """Write the standalone HTML report (see :func:`mpscope.report.write_report`; ``rank``:
        one rank's own rows of a multi-rank run); returns its path."""
        from mpscope.report import write_report

        return write_report(self, path, advice=advice, rank=rank)

    def to_tensorboard(self, logdir, rank: int | None = None) -> Path:
        """Write the run as TensorBoard events into ``logdir``: per step the loss, the loss scale,
        skipped steps, each module's underflow / overflow fractions per role in the run's format,
        and the exponent histograms (tags and encoding: :mod:`mpscope.tensorboard`). Needs
        ``pip install 'mpscope[tensorboard]'`` (ImportError saying so otherwise); returns ``logdir``."""
        from mpscope.tensorboard import write_tensorboard  # facade on a view (imports tensorboard when called)

        return write_tensorboard(self, logdir, rank=rank)


_RUN_ATTRS = ("tensors", "steps", "histograms", "meta")


def str_values(column: pd.Series) -> pd.Series:
    """``column.astype(str)`` (equal to it, same index and name), converting each category of a
    categorical column once and taking the strings by code: on the million rows of a histogram frame
    a few times faster than converting every row."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes = column.cat.codes.to_numpy()
        if not (codes < 0).any():  # missing values: astype(str) decides how they read
            strings = column.cat.categories.astype(str).take(codes)
            return pd.Series(strings, index=column.index, name=column.name)
    return column.astype(str)


def is_run(obj: object) -> bool:
    """True for a :class:`Run` or any object with its four frames (``tensors``, ``steps``,
    ``histograms``, ``meta``): the duck type every reader of a run accepts."""
    return isinstance(obj, Run) or all(hasattr(obj, a) for a in _RUN_ATTRS)


def check_run(obj: object, what: str = "run") -> None:
    """Raise if ``obj`` is not a run (see :func:`is_run`).

    Raises:
        TypeError: naming the argument ``what``, the type received, the attribute it lacks, and
            where a Run comes from.
    """
    if not is_run(obj):
        missing = [a for a in _RUN_ATTRS if not hasattr(obj, a)]
        raise TypeError(f"{what} must be an mpscope.Run (recorder.run, or mpscope.Run.load(directory)); "
                        f"got {type(obj).__name__}, which has no .{missing[0]}")


def as_run(obj: "Run | str | os.PathLike", what: str = "run") -> "Run":
    """``obj`` itself if it is a run, :meth:`Run.load` of it if it is a path.

    Raises:
        TypeError: neither a run nor a path (see :func:`check_run`).
        RunFileError: a path that holds no readable run.
    """
    if isinstance(obj, (str, os.PathLike)):
        return Run.load(obj)
    check_run(obj, what)
    return obj


def select_rank(run, rank: int | None):
    """``run`` itself when ``rank`` is None, else ``run.for_rank(rank)``: rank ``rank``'s own rows
    (the ``rank=`` argument of the explorer, the report, the advisor and ``compare``).

    Raises:
        TypeError: ``rank`` is not an int, or ``run`` is a Run look-alike (no ranks to choose from).
        ValueError, RunFileError: see :meth:`Run.for_rank`.
    """
    if rank is None:
        return run
    if not isinstance(run, Run):
        raise TypeError(f"rank={rank!r} needs an mpscope.Run of a multi-rank job (recorder.run, or "
                        f"mpscope.Run.load(DIR) of record(..., out=DIR)); got {type(run).__name__}")
    return run.for_rank(rank)


def read_meta(f: Path) -> dict:
    """The checked ``meta`` dict in the JSON file ``f`` (see :func:`check_meta`).

    Raises:
        RunFileError: naming ``f``: it is missing or unreadable, not valid JSON (or too deep or
            large, :func:`mpscope.datafile.read_data`), or a field breaks :func:`check_meta`.
    """
    try:
        meta = read_data(f, "json")
    except FileNotFoundError:
        raise RunFileError(f"{f} is missing: {f.parent} is not a complete mpscope run.") from None
    except (OSError, ValueError) as e:
        raise RunFileError(f"{e}; re-save the run.") from None
    check_meta(meta, f)
    return meta


def check_meta(meta, where="meta") -> None:
    """Check a run's ``meta`` dict: field types (:data:`META_TYPES`), ``scaler``'s numeric fields,
    the contents of lists and dicts (``_META_RULES``) and the numeric optimizer hyper-parameters.

    Raises:
        RunFileError: naming ``where`` (the file) and the first field of the wrong type or range.
    """
    if not isinstance(meta, dict):
        raise RunFileError(f"{where} must hold a JSON object (dict) of run facts; it holds a {type(meta).__name__}. "
                           "Re-save the run with run.save().")
    for key, types in META_TYPES.items():
        if key in meta and (not isinstance(meta[key], types) or isinstance(meta[key], bool) and bool not in types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise RunFileError(f"{where}: field {key!r} must be {want}; got {type(meta[key]).__name__} "
                               f"{str(meta[key])[:60]!r}. Re-save the run with run.save().")
    sc = meta.get("scaler")
    for key, types in _SCALER_FIELDS.items():
        if sc is not None and key in sc and (not isinstance(sc[key], types) or isinstance(sc[key], bool)
                                             or not _is_number(sc[key]) or not sc[key] > 0):
            raise RunFileError(f"{where}: field 'scaler.{key}' must be a positive number; got {str(sc[key])[:40]}.")
    for key, ok, want in _META_RULES:
        if key in meta and meta[key] is not None and not ok(meta[key]):
            raise RunFileError(f"{where}: field {key!r} must be {want}; got {str(meta[key])[:80]!r}. "
                               "Re-save the run with run.save().")
    hp = meta.get("optimizer_hparams") or {}
    for key in _NUMERIC_HPARAMS:
        if hp.get(key) is not None and not _is_number(hp[key]):
            raise RunFileError(f"{where}: field 'optimizer_hparams.{key}' must be a number; got {hp[key]!r}.")


def _is_number(x) -> bool:
    """A finite real number within float64's range (not a bool)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


#: Rules on the contents of ``meta`` fields: (field, test, what it must be).
_META_RULES = (
    ("every", lambda v: v >= 1, ">= 1"),
    ("hist_every", lambda v: v >= 1, ">= 1"),
    ("cuda_capability", lambda v: len(v) == 2 and all(map(_is_count, v)), "[major, minor] (two ints)"),
    ("roles", lambda v: all(isinstance(r, str) for r in v), "a list of role names"),
    ("rank", _is_count, "a rank number (int >= 0)"),
    ("ranks", lambda v: all(map(_is_count, v)), "a list of rank numbers (ints >= 0)"),
    ("param_dtypes", lambda v: all(isinstance(k, str) and _is_count(n) for k, n in v.items()),
     "a dict of dtype name -> parameter count"),
    ("module_types", lambda v: all(isinstance(t, str) for t in v.values()), "a dict of module name -> class name"),
    ("parts_written", lambda v: all(_is_count(n) for n in v.values()), "a dict of table -> parts written"),
    ("distributed", lambda v: isinstance(v.get("replicated_roles", []), list)
     and all(isinstance(r, str) for r in v.get("replicated_roles", []))
     and isinstance(v.get("group_ranks", []), list) and all(map(_is_count, v.get("group_ranks", []))),
     "a dict whose replicated_roles is a list of roles and group_ranks a list of rank numbers"),
    ("optimizer_hparams", lambda v: all(x is None or isinstance(x, (str, int, float, list)) for x in v.values()),
     "a dict of hyper-parameter name -> number, text or list"),
)


def _check_columns(frame: pd.DataFrame, table: str, where) -> None:
    """A loaded table has the columns it needs (:data:`REQUIRED_COLUMNS`), each known column of
    the row tables has its kind (see :data:`_COLUMN_KINDS`; not checked on an empty table, whose
    columns hold no values) and roles are known.

    Raises:
        RunFileError: naming ``where`` (the file) and the first missing or wrong column.
    """
    missing = [c for c in REQUIRED_COLUMNS.get(table, ()) if c not in frame.columns]
    if missing:
        raise RunFileError(f"{where}: the {table} table lacks the columns {missing} (it holds {list(frame.columns)[:12]}). "
                           "It was not written by mpscope's run.save(), or was edited; re-record the run.")
    if not len(frame):
        return
    if table in TABLE_TEXT_COLUMNS:
        _check_table(frame, table, where)
        return
    tests = {"i": pt.is_integer_dtype, "f": lambda d: pt.is_numeric_dtype(d) and not pt.is_bool_dtype(d),
             "b": pt.is_bool_dtype,
             "s": lambda d: pt.is_string_dtype(d) or pt.is_object_dtype(d) or isinstance(d, pd.CategoricalDtype)}
    names = {"i": "integers", "f": "numbers", "b": "booleans", "s": "text"}
    for col, kind in _COLUMN_KINDS.get(table, {}).items():
        if col in frame.columns and not tests[kind](frame[col].dtype):
            raise RunFileError(f"{where}: column {col!r} must hold {names[kind]}; it holds {frame[col].dtype}. "
                               "Re-save the run with run.save().")
    if "role" in frame.columns and table in _COLUMN_KINDS:
        bad = sorted(set(map(str, frame["role"].dropna().unique())) - set(ROLES))
        if bad:
            raise RunFileError(f"{where}: column 'role' holds unknown roles {bad[:5]}; known: {list(ROLES)}.")
    _check_values(frame, table, where)


#: Ranges of the row tables' values: (table, column) -> (test on the column as float64, what it must be).
_VALUE_RULES = {
    "step": (lambda x: (x >= 0) & (x < 2**31), "step numbers in [0, 2^31)"),
    "numel": (lambda x: x >= 0, "element counts >= 0"),
    "nan_count": (lambda x: x >= 0, "counts >= 0"),
    "inf_count": (lambda x: x >= 0, "counts >= 0"),
    "count": (lambda x: x >= 0, "counts >= 0"),
    "exponent": (lambda x: np.abs(x) <= 1100, "binary exponents in [-1100, 1100] (float64's reach -1074..1024)"),
    "loss_scale": (lambda x: ~(x <= 0), "loss scales > 0"),
    **{c: (lambda x: ~((x < 0) | (x > 1)), "fractions in [0, 1]") for c in (
        "zero_frac", "subnormal_frac", "fp16_underflow_frac", "fp16_subnormal_frac", "fp16_overflow_frac",
        "bf16_underflow_frac", "bf16_subnormal_frac", "bf16_overflow_frac")},
}


#: The text columns of the ``tables/<name>.parquet`` tables; their other columns hold numbers or booleans.
TABLE_TEXT_COLUMNS: dict[str, tuple[str, ...]] = {
    "precision": ("module", "role", "name", "dtype"),
    "ops": ("phase", "module", "op", "in_dtypes", "out_dtype", "reduction"),
    "op_facts": ("phase", "module", "name", "op", "out_dtype", "reduction"),
    "grad_accumulation": ("module", "name", "dtype"),
    "nonfinite_ranks": ("module", "role", "name", "dtype"),
    "rank_disagreement": ("column",),
}


def _check_table(frame: pd.DataFrame, table: str, where) -> None:
    """A ``tables/`` table: its text columns hold text with no missing value, the others numbers
    or booleans, ``step`` whole numbers >= 0."""
    for col in REQUIRED_COLUMNS[table]:
        x = frame[col]
        if col in TABLE_TEXT_COLUMNS[table]:
            ok = (pt.is_string_dtype(x.dtype) or pt.is_object_dtype(x.dtype) or isinstance(x.dtype, pd.CategoricalDtype)) \
                and not x.isna().any() and all(isinstance(v, str) for v in x.unique())
            want = "text"
        else:
            ok = pt.is_numeric_dtype(x.dtype) and (col != "step" or (pt.is_integer_dtype(x.dtype) and (x >= 0).all()))
            want = "whole numbers >= 0" if col == "step" else "numbers"
        if not ok:
            raise RunFileError(f"{where}: column {col!r} must hold {want}; it holds {x.dtype}. "
                               "Re-save the run with run.save().")


def _check_values(frame: pd.DataFrame, table: str, where) -> None:
    """No missing value in a row table's integer, boolean or text column; the values of
    :data:`_VALUE_RULES` in range; ``dtype`` a torch dtype name."""
    kinds = _COLUMN_KINDS.get(table, {})
    for col, kind in kinds.items():
        if col in frame.columns and kind in "ibs" and frame[col].isna().any():
            raise RunFileError(f"{where}: column {col!r} has missing values; re-save the run with run.save().")
        if col in frame.columns and col in _VALUE_RULES:
            test, want = _VALUE_RULES[col]
            if not test(frame[col].to_numpy(np.float64)).all():
                raise RunFileError(f"{where}: column {col!r} must hold {want}; re-save the run with run.save().")
    if "dtype" in frame.columns and kinds:
        bad = [d for d in map(str, frame["dtype"].unique()) if d and not isinstance(getattr(torch, d, None), torch.dtype)]
        if bad:
            raise RunFileError(f"{where}: column 'dtype' holds names that are no torch dtype: {bad[:5]}.")


def as_path(path: "str | os.PathLike", what: str, kind: str = "directory") -> Path:
    """``path`` as a :class:`pathlib.Path`.

    Raises:
        TypeError: ``path`` is no str or os.PathLike; the message says what it was for (``what``,
            e.g. "save the run to") and to pass a ``kind`` path ("directory" or "file").
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"cannot {what} {path!r}: pass a {kind} path (str or pathlib.Path), "
                        f"not {type(path).__name__}")
    return Path(path)


def _is_run_dir(d: Path) -> bool:
    """True when ``d`` holds only what :meth:`Run.save` writes (one mpscope run)."""
    names = {p.name for p in d.iterdir()}
    return set(_FILES.values()) | {"meta.json"} <= names <= set(_FILES.values()) | {"meta.json", "tables"}


def _check_save_target(d: Path) -> None:
    if d.exists() and not d.is_dir():
        raise RunFileError(f"cannot save the run to {d}: it is a file. Pass a new or empty directory.")
    if d.is_dir() and any(d.iterdir()) and not _is_run_dir(d):
        shown = ", ".join(sorted(p.name for p in d.iterdir())[:6])
        raise RunFileError(f"cannot save the run to {d}: it holds other files ({shown}), and a run directory holds "
                           "one run only. Pass a new or empty directory (or one holding an earlier run to replace).")


def _replace_dir(new: Path, d: Path) -> None:
    """Move the finished folder ``new`` to ``d``, replacing an earlier run there (renames only)."""
    if not d.exists():
        os.replace(new, d)
        return
    if d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        os.replace(new, d)
        return
    old = d.parent / f".{d.name}.replaced-{uuid.uuid4().hex[:12]}"
    os.replace(d, old)
    try:
        os.replace(new, d)
    except BaseException:
        os.replace(old, d)
        raise
    shutil.rmtree(old, ignore_errors=True)


#: When :class:`RankFiles` writes what waits: every :data:`FLUSH_STEPS` recorded steps, but not
#: sooner than :data:`MIN_FLUSH_SECONDS` after the last write, and at least every
#: :data:`FLUSH_SECONDS` while steps arrive. A write of 8 steps of rows costs about 10 ms (3 small
#: Parquet parts), so a step-count write costs at most 1 % of the time however fast the loop is;
#: ``benchmarks/overhead.py`` measures the cost (mode ``full_out``).
FLUSH_STEPS, FLUSH_SECONDS, MIN_FLUSH_SECONDS = 8, 10.0, 1.0


class RankFiles:
    """One rank's own rows, written as they arrive to hive-partitioned Parquet parts.

    Layout under ``out``::

        ranks/tensors/rank=N/part-00000.parquet     Run.tensors rows (fractions, like Run.tensors)
        ranks/steps/rank=N/part-00000.parquet       Run.steps rows
        ranks/histograms/rank=N/part-00000.parquet  Run.histograms rows
        ranks/meta/rank=N.json                      the rank's meta, with "complete": false at start
                                                    and each write, true once closed (atomic writes)

    so ``pd.read_parquet(out / "ranks" / "tensors")`` gives every rank's rows with a ``rank``
    column. What waits is written as new parts on the schedule of :data:`FLUSH_STEPS`,
    :data:`FLUSH_SECONDS` and :data:`MIN_FLUSH_SECONDS`, when more than ``buffer_rows`` rows wait,
    at once on the first row holding NaN / inf and the first step that found inf (so a crash or a
    hang keeps the evidence), and at :meth:`close`. A process killed at any point leaves every
    part written before it whole (each is written beside, then renamed). Writing involves no other
    rank (no collective).
    """

    def __init__(self, out, rank: int, builder: RunBuilder, buffer_rows: int = 50_000, clock=time.monotonic):
        self.root = Path(out) / RANKS_DIR
        self.rank, self.builder, self.buffer_rows = int(rank), builder, buffer_rows
        self.run = builder.run
        self._rows: list[dict] = []
        self._hist: list[dict] = []
        self._steps: list[tuple] = []
        self._parts = {"tensors": 0, "steps": 0, "histograms": 0}
        self._waiting = 0
        self._recorded_waiting = 0
        self._clock = clock
        self._last_write = clock()
        self._seen_nonfinite = self._seen_found_inf = False
        problem = self.problem(out, rank)
        if problem:
            raise RunFileError(problem)
        self.write_meta(complete=False)

    @staticmethod
    def problem(out, rank: int) -> str | None:
        """Why rank ``rank`` cannot write under ``out`` (a file there, or rows of an earlier
        recording), or None."""
        root = Path(out)
        if root.exists() and not root.is_dir():
            return f"out={str(root)!r} is a file; pass a new or empty directory."
        for table in ("tensors", "steps", "histograms"):
            folder = root / RANKS_DIR / table / f"rank={rank}"
            if folder.is_dir() and any(folder.iterdir()):
                return f"{folder} already holds rows of another recording; pass a new out= directory (or delete the old one)."
        return None

    def _folder(self, table: str) -> Path:
        return self.root / table / f"rank={self.rank}"

    def write_meta(self, complete: bool) -> None:
        """Write the rank's meta with ``"complete": complete`` (beside, then renamed)."""
        d = self.root / "meta"
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".rank={self.rank}.json.tmp"
        meta = dict(self.run.meta, complete=complete, parts_written=dict(self._parts))
        tmp.write_text(json.dumps(meta, indent=2, default=_json_default))
        tmp.replace(d / f"rank={self.rank}.json")

    # the Run's listener interface
    def rows(self, cols: dict) -> None:
        self._rows.append(cols)
        self._waiting += len(cols["key"])
        first_bad = not self._seen_nonfinite and (np.any(np.asarray(cols["nan_count"]) > 0)
                                                  or np.any(np.asarray(cols["inf_count"]) > 0))
        self._seen_nonfinite |= bool(first_bad)
        if first_bad or self._waiting > self.buffer_rows:
            self.flush()

    def hist(self, cols: dict) -> None:
        self._hist.append(cols)
        self._waiting += len(cols["key"])

    def step(self, row: tuple) -> None:
        self._steps.append(row)
        self._waiting += 1
        self._recorded_waiting += bool(row[STEP_COLUMNS.index("recorded")])
        first_inf = bool(row[STEP_COLUMNS.index("found_inf")]) and not self._seen_found_inf
        self._seen_found_inf |= first_inf
        since = self._clock() - self._last_write
        if first_inf or since >= FLUSH_SECONDS or (self._recorded_waiting >= FLUSH_STEPS and since >= MIN_FLUSH_SECONDS):
            self.flush()

    def flush(self, complete: bool = False) -> None:
        """Write what waits as new parts (each part is written beside, then renamed), then the
        meta (what the recording learnt since, e.g. the autocast dtype; ``complete`` at close)."""
        if self._rows:
            self._write("tensors", self.builder.tensor_frame(_concat_columns(self._rows)))
        if self._hist:
            self._write("histograms", self.builder.hist_frame(_concat_columns(self._hist)))
        if self._steps:
            self._write("steps", _steps_frame(self._steps))
        self._rows, self._hist, self._steps, self._waiting, self._recorded_waiting = [], [], [], 0, 0
        self.write_meta(complete)
        self._last_write = self._clock()

    def _write(self, table: str, frame: pd.DataFrame) -> None:
        folder = self._folder(table)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"part-{self._parts[table]:05d}.parquet"
        frame.to_parquet(folder / f".{name}.tmp", index=False)
        (folder / f".{name}.tmp").replace(folder / name)
        self._parts[table] += 1

    def close(self) -> None:
        self.flush(complete=True)


def _steps_frame(rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=STEP_COLUMNS).astype(STEP_DTYPES)


def _rank_frames(root: Path, rank: int, meta: dict) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Rank ``rank``'s tensors, steps and histograms. Every part its meta says was written must be
    there; parts written after the meta's last write (a killed writer) are read too. A rank whose
    writer did not finish keeps only the rows of steps it wrote a step row for.

    Raises:
        RunFileError: naming a missing or unreadable part, or a table with wrong columns.
    """
    written = meta.get("parts_written") or {}
    out = []
    for table, empty in (("tensors", _empty_tensors), ("steps", lambda: _steps_frame([])),
                         ("histograms", _empty_histograms)):
        folder = root / table / f"rank={rank}"
        for i in range(written.get(table, 0)):
            if not (folder / f"part-{i:05d}.parquet").is_file():
                raise RunFileError(
                    f"{folder / f'part-{i:05d}.parquet'} is missing: rank {rank}'s meta says {written[table]} {table} "
                    f"parts were written. Restore it, or load another rank alone with mpscope.Run.load(DIR, rank=N).")
        parts = sorted(p for p in folder.glob("part-*.parquet") if p.is_file()) if folder.is_dir() else []
        frames = []
        for part in parts:
            try:
                frame = pd.read_parquet(part)
            except Exception as e:  # pyarrow raises several types for corrupt files
                raise RunFileError(f"{part} cannot be read ({type(e).__name__}: {e}).") from e
            _check_columns(frame, table, part)
            if len(frame):
                frames.append(frame.astype({c: "category" for c in _CATEGORICAL if c in frame.columns}))
        out.append(_concat_categorical(frames) if len(frames) > 1 else frames[0] if frames else empty())
    t, s, h = out
    if len(s) and (not s.step.is_monotonic_increasing or s.step.iloc[-1] - s.step.iloc[0] + 1 != len(s)):
        raise RunFileError(f"{root / 'steps' / f'rank={rank}'}: the step numbers are not consecutive; the files "
                           "were edited or mixed with another recording's.")
    last = int(s.step.iloc[-1]) if len(s) else -1
    for name, f in (("tensors", t), ("histograms", h)):
        if len(f) and len(s) and int(f.step.max()) > last + 1:
            raise RunFileError(f"{root / name / f'rank={rank}'}: rows of step {int(f.step.max())}, past the last "
                               f"step row ({last}); the files were edited or mixed with another recording's.")
    if not meta.get("complete", True):  # rows of the steps after the last step row written are partial
        last = int(s.step.max()) if len(s) else -1
        t, h = t[t.step <= last].reset_index(drop=True), h[h.step <= last].reset_index(drop=True)
    return t, s, h


def _loaded_meta(meta: dict, complete: bool) -> dict:
    """A rank's meta as a loaded Run holds it: without the file bookkeeping, ``complete`` only
    when False."""
    out = {k: v for k, v in meta.items() if k not in ("parts_written", "complete")}
    if not complete:
        out["complete"] = False
    return out


def run_format(run) -> str | None:
    """The 16-bit format ``run`` computed in: ``"float16"``, ``"bfloat16"``, or None (float32).

    Its ``meta["autocast_dtype"]`` when 16-bit, else the 16-bit dtype holding most of its parameters
    (``meta["param_dtypes"]``, a ``model.half()`` run), else the 16-bit dtype holding most of its
    recorded elements (``run.tensors``), else None.
    """
    meta = getattr(run, "meta", None) or {}
    amp = str(meta.get("autocast_dtype") or "").removeprefix("torch.")
    if amp in LOW_PRECISION:
        return amp
    params = meta.get("param_dtypes") or {}
    held = {d: params.get(d) or 0 for d in LOW_PRECISION}
    if any(held.values()):
        return max(LOW_PRECISION, key=lambda d: held[d])
    t = run.tensors
    if len(t):
        numel = t.groupby(t["dtype"].astype(str))["numel"].sum()
        held = {d: int(numel.get(d, 0)) for d in LOW_PRECISION}
        if any(held.values()):
            return max(LOW_PRECISION, key=lambda d: held[d])
    return None


def _unfinished(metas: dict, where: Path) -> bool:
    """Warn when a rank's writer did not finish (``"complete": false``); True if one did not."""
    bad = sorted(r for r, m in metas.items() if not m.get("complete", True))
    if bad:
        warnings.warn(f"mpscope: the recording in {where} did not finish: the writer of rank(s) {bad} stopped before "
                      "closing (killed, or the process crashed). The steps written to disk are loaded; later steps "
                      "are lost. run.meta['complete'] is False.", RuntimeWarning, stacklevel=4)
    return bool(bad)


def _left_out(metas: dict, where: Path) -> None:
    """Warn when ranks of the job's group (``meta["distributed"]["group_ranks"]``) wrote no files."""
    group = set().union(*(set((m.get("distributed") or {}).get("group_ranks", [])) for m in metas.values()))
    missing = sorted(group - set(metas))
    if missing:
        warnings.warn(f"mpscope: rank(s) {missing} of the job wrote no files to {where} (they did not record); the "
                      f"merged run holds rank(s) {sorted(metas)} only.", RuntimeWarning, stacklevel=4)


def _merge_rank_files(cls, root: Path, metas: dict, complete: bool) -> "Run":
    """Merge per-rank files on the host by the rules of :mod:`mpscope.merge` (no merged/ written)."""
    keys: dict[tuple, int] = {}
    per_rank = {}
    for r in sorted(metas):
        t, s, h = _rank_frames(root, r, metas[r])
        kt = list(zip(t.module.astype(str), t.role.astype(str), t["name"].astype(str), t["dtype"].astype(str)))
        kh = list(zip(h.module.astype(str), h.role.astype(str), h["name"].astype(str), h["dtype"].astype(str)))
        for k in kt + kh:
            keys.setdefault(k, len(keys))
        numel = t.numel.to_numpy(np.int64)
        cols = {"step": t.step.to_numpy(np.int64), "key": np.array([keys[k] for k in kt], dtype=np.int64),
                "numel": numel, "min": t["min"].to_numpy(float), "max": t["max"].to_numpy(float),
                "absmin_nonzero": t.absmin_nonzero.to_numpy(float), "loss_scale": t.loss_scale.to_numpy(float)}
        for name in COUNT_NAMES:
            c = t[f"{name}_count"] if name in ("nan", "inf") else np.rint(t[f"{name}_frac"].to_numpy(float) * numel)
            cols[f"{name}_count"] = np.asarray(c, dtype=np.int64)
        hist = {"step": h.step.to_numpy(np.int64), "key": np.array([keys[k] for k in kh], dtype=np.int64),
                "exponent": h.exponent.to_numpy(np.int64), "count": h["count"].to_numpy(np.int64)}
        per_rank[r] = (cols, hist, list(s[STEP_COLUMNS].itertuples(index=False, name=None)))
    agreed = list(keys)
    meta = _loaded_meta(metas[min(metas)], complete)
    meta.pop("rank", None)
    meta["ranks"] = sorted(metas)
    replicated_roles = set((meta.get("distributed") or {}).get("replicated_roles", []))
    replicated = np.array([k[1] in replicated_roles for k in agreed], dtype=bool)
    run = cls(meta)
    builder = run.builder()
    identity = np.arange(len(agreed), dtype=np.int64)
    row_steps = sorted(set().union(*(set(v[0]["step"].tolist()) for v in per_rank.values())))
    step_ids = sorted(set().union(*(set(int(x[0]) for x in v[2]) for v in per_rank.values())))
    first = step_ids[0] if step_ids else 0
    last = step_ids[-1] if step_ids else -1
    chunk = 32
    for i in range(0, max(len(row_steps), 1), chunk):
        rs = tuple(row_steps[i : i + chunk])
        hi_step = row_steps[i + chunk] - 1 if i + chunk < len(row_steps) else last
        lo, hi = _merge.hist_range([v[1] for v in per_rank.values()], rs)
        w = _merge.Window(rs, first, hi_step, len(agreed), lo, hi, tuple(STEP_COLUMNS))
        blocks = [_merge.pack(w, [v[0]], [v[1]], v[2], identity, replicated, r) for r, v in per_rank.items()]
        builder.append_merged(_merge.unpack(w, *_merge.reduce_blocks(blocks), replicated), agreed)
        first = hi_step + 1
    return run


class _ChunkedTable:
    """Rows arriving in small per-step column dicts, merged into compact chunks and, when a spill
    directory is set and more than ``max_rows`` rows are in memory, written to Parquet parts."""

    def __init__(self, name, compact, to_frame, spill_dir, max_rows):
        self.name, self.compact, self.to_frame = name, compact, to_frame
        self.spill_dir, self.max_rows = spill_dir, max_rows
        self.chunks: list[dict] = []
        self.pending: list[dict] = []
        self.pending_rows = 0
        self.spilled: list[Path] = []

    def append(self, cols: dict) -> bool:
        n = len(cols["key"])
        if n == 0:
            return False
        self.pending.append(cols)
        self.pending_rows += n
        if self.pending_rows >= min(65536, self.max_rows):
            self.consolidate()
        return True

    def consolidate(self) -> None:
        if not self.pending:
            return
        merged = {k: np.concatenate([c[k] for c in self.pending]) for k in self.pending[0]}
        self.chunks.append(self.compact(merged))
        self.pending, self.pending_rows = [], 0
        if self.spill_dir is not None and self.rows_in_memory > self.max_rows:
            self.spill()

    def spill(self) -> None:
        self.consolidate()
        if not self.chunks:
            return
        path = self.spill_dir / f"{self.name}-part{len(self.spilled):05d}.parquet"
        try:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            self.to_frame(_concat_columns(self.chunks)).to_parquet(path, index=False)
        except OSError as e:  # disk full, folder removed or made read-only: keep the rows in memory
            warnings.warn(f"mpscope: cannot spill rows to {self.spill_dir} ({type(e).__name__}: {e}); "
                          "keeping them in memory from now on.", RuntimeWarning, stacklevel=2)
            self.spill_dir = None
            return
        self.spilled.append(path)
        self.chunks = []

    @property
    def rows_in_memory(self) -> int:
        return sum(len(c["key"]) for c in self.chunks)

    @property
    def bytes_in_memory(self) -> int:
        return sum(a.nbytes for c in self.chunks for a in c.values())

    def frame(self) -> pd.DataFrame:
        self.consolidate()
        parts = [pd.read_parquet(p) for p in self.spilled]
        if self.chunks or not parts:
            parts.append(self.to_frame(_concat_columns(self.chunks) if self.chunks else None))
        frame = parts[0] if len(parts) == 1 else _concat_categorical(parts)
        return frame.reset_index(drop=True)


def _concat_columns(chunks: list[dict]) -> dict:
    return {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}


def _count_dtype(numel_max) -> type:
    return np.uint32 if numel_max < 2**32 else np.int64


def _compact_tensor_rows(m: dict) -> dict:
    """About 80 bytes a row: int32 step/key, uint32 counts (int64 past 2^32 elements), float32 scale."""
    count = _count_dtype(m["numel"].max())
    for name in COUNT_NAMES:
        m[f"{name}_count"] = m[f"{name}_count"].astype(count)
    m["step"] = m["step"].astype(np.int32)
    m["key"] = m["key"].astype(np.int32)
    m["loss_scale"] = m["loss_scale"].astype(np.float32)
    return m


def _compact_hist_rows(m: dict) -> dict:
    """14 bytes a row: int32 step/key, int16 exponent, uint32 count (int64 past 2^32)."""
    return {
        "step": m["step"].astype(np.int32),
        "key": m["key"].astype(np.int32),
        "exponent": m["exponent"].astype(np.int16),
        "count": m["count"].astype(_count_dtype(m["count"].max())),
    }


def _dtype_from_tensors(h: pd.DataFrame, t: pd.DataFrame) -> pd.DataFrame:
    """A ``dtype`` column for histogram rows that lack one: the dtype of the tensor row of the same
    step, module, role and name (the first, if several); "" where there is none."""
    on = ["step", "module", "role", "name"]
    if not len(h) or not set(on) <= set(h.columns):
        return h.assign(dtype="")
    keys = t[on + ["dtype"]].astype({c: object for c in on[1:] + ["dtype"]}).drop_duplicates(on)
    out = h.astype({c: object for c in on[1:]}).merge(keys, on=on, how="left")
    out["dtype"] = out["dtype"].fillna("")
    return out


def _fill(frame: pd.DataFrame, defaults: dict, columns: list[str], what: str) -> pd.DataFrame:
    for c, v in defaults.items():
        if c not in frame.columns:
            frame[c] = v
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{what} frame lacks columns {missing}; expected {columns}")
    return frame


def _concat_categorical(parts: list[pd.DataFrame]) -> pd.DataFrame:
    out = {}
    for c in parts[0].columns:
        if isinstance(parts[0][c].dtype, pd.CategoricalDtype):
            out[c] = union_categoricals([p[c] for p in parts], sort_categories=True)
        else:
            out[c] = np.concatenate([p[c].to_numpy() for p in parts])
    return pd.DataFrame(out)


def _empty_histograms() -> pd.DataFrame:
    frame = pd.DataFrame({c: pd.Series(dtype="int64") for c in HIST_COLUMNS})
    for c in _CATEGORICAL:
        frame[c] = pd.Categorical([])
    return frame[HIST_COLUMNS]


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
