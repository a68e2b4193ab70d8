"""docs/frames.md against the code: every documented frame lists exactly the columns (in order, with
their dtypes) that a real recording gives, the Finding / Recommendation fields are the dataclasses'
own, and every table, meta key and evidence key a recording makes is documented.

Small models are recorded once per module: a TransformerEncoderLayer under CPU float16 autocast
with a GradScaler (``ops=True, shadow=True``), a Linear that overflows float16 in forward (op facts
and forensics rows), a bfloat16 Linear with two micro-batches (gradient accumulation rows), and two
ranks written in the per-rank file layout and merged by ``Run.load`` (the multi-rank tables)."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from pandas.api import types as pt

import mpscope
from mpscope.advisor import Finding, Recommendation
from mpscope.run import REQUIRED_COLUMNS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "frames.md"
_HEADING = re.compile(r"^#{2,3} `([^`]+)`", re.M)
_ROW = re.compile(r"^\| `([^`]+)` \|(.*)\|\s*$")


def _sections() -> dict[str, list[tuple[str, list[str]]]]:
    """Heading title (the backticked part) -> its table rows: (first cell's name, other cells)."""
    text = PAGE.read_text()
    heads = list(_HEADING.finditer(text))
    out = {}
    for i, h in enumerate(heads):
        body = text[h.end(): heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        rows = []
        for line in body.splitlines():
            m = _ROW.match(line)
            if m:
                rows.append((m.group(1), [c.strip() for c in m.group(2).split(" | ")]))
        out[h.group(1)] = rows
    return out


SECTIONS = _sections()


def _names(title: str) -> list[str]:
    assert title in SECTIONS, f"docs/frames.md has no section `{title}`"
    rows = SECTIONS[title]
    assert rows, f"docs/frames.md: section `{title}` has no table rows"
    return [name for name, _ in rows]


def _kind(dtype) -> str:
    """A column's dtype as the page writes it (text is `str` under pandas 3 and 2 alike)."""
    if isinstance(dtype, pd.CategoricalDtype):
        return "category"
    if pt.is_bool_dtype(dtype):
        return "bool"
    if pt.is_integer_dtype(dtype) or pt.is_float_dtype(dtype):
        return str(dtype)
    if pt.is_string_dtype(dtype) or pt.is_object_dtype(dtype):
        return "str"
    return str(dtype)


def _amp_loop(model, opt, scaler, x, steps, clip=True):
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()


class _Overflow(torch.nn.Module):
    """A Linear whose float16 output overflows in forward."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _write_rank(root: Path, rank: int, run, tensors: pd.DataFrame, steps: pd.DataFrame) -> None:
    """One rank's rows in the per-rank layout of ``record(..., out=DIR)`` (``DIR/ranks/...``)."""
    for table, frame in (("tensors", tensors), ("steps", steps), ("histograms", run.histograms)):
        d = root / "ranks" / table / f"rank={rank}"
        d.mkdir(parents=True)
        frame.to_parquet(d / "part-00000.parquet", index=False)
    (root / "ranks" / "meta").mkdir(parents=True, exist_ok=True)
    meta = dict(run.meta, rank=rank, ranks=[rank])
    (root / "ranks" / "meta" / f"rank={rank}.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> Run: ``amp`` (ops + shadow), ``overflow``, ``accumulation``, ``merged`` (two ranks)."""
    torch.manual_seed(0)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0,
                                                 batch_first=True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu")
        with mpscope.record(model, opt, scaler, ops=True, shadow=True) as rec:
            _amp_loop(model, opt, scaler, torch.randn(2, 4, 16), steps=2)
        out["amp"] = rec.run

        model = _Overflow()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu")
        with mpscope.record(model, opt, scaler, ops=True, shadow=True) as rec:
            _amp_loop(model, opt, scaler, torch.randn(4, 8), steps=1)
        out["overflow"] = rec.run

        model = torch.nn.Linear(8, 4).to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with mpscope.record(model, opt) as rec:
            for _ in range(2):
                opt.zero_grad()
                for _ in range(2):  # two micro-batches into one 16-bit .grad
                    model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
                opt.step()
        out["accumulation"] = rec.run

        amp = out["amp"]
        root = tmp_path_factory.mktemp("ranks")
        _write_rank(root, 0, amp, amp.tensors, amp.steps)
        t = amp.tensors.copy()
        t.loc[t.index[0], "nan_count"] = 1  # rank 1 saw a NaN there
        s = amp.steps.copy()
        s["loss_scale"] = s.loss_scale / 2  # and its GradScaler disagrees
        _write_rank(root, 1, amp, t, s)
        out["merged"] = mpscope.Run.load(root)
    return out


def _frames(runs) -> dict[str, pd.DataFrame]:
    """Section title -> the recorded frame it documents (each with rows)."""
    amp, overflow = runs["amp"], runs["overflow"]
    return {
        "run.tensors": amp.tensors,
        "run.steps": amp.steps,
        "run.histograms": amp.histograms,
        'run.tables["precision"]': amp.tables["precision"],
        'run.tables["ops"]': amp.tables["ops"],
        'run.tables["op_facts"]': overflow.tables["op_facts"],
        'run.tables["forensics"]': overflow.tables["forensics"],
        'run.tables["grad_accumulation"]': runs["accumulation"].tables["grad_accumulation"],
        'run.tables["nonfinite_ranks"]': runs["merged"].tables["nonfinite_ranks"],
        'run.tables["rank_disagreement"]': runs["merged"].tables["rank_disagreement"],
    }


def test_every_frame_lists_its_columns_and_dtypes(runs):
    for title, frame in _frames(runs).items():
        assert len(frame), f"the fixture recorded no rows for {title}: its dtypes go unchecked"
        documented = _names(title)
        got = list(frame.columns)
        assert documented == got, (f"docs/frames.md `{title}`: undocumented {sorted(set(got) - set(documented))}, "
                                   f"not in the frame {sorted(set(documented) - set(got))}, order {got}")
        for name, cells in SECTIONS[title]:
            assert cells[0] == _kind(frame[name].dtype), (
                f"docs/frames.md `{title}`.{name}: documented dtype {cells[0]}, recorded {frame[name].dtype}")


def test_run_precision_is_the_precision_table(runs):
    assert list(runs["amp"].precision.columns) == _names('run.tables["precision"]')
    assert list(runs["accumulation"].precision.columns) == _names('run.tables["precision"]')  # no shadow: empty


def test_every_table_is_documented(runs):
    documented = {t[len('run.tables["'):-2] for t in SECTIONS if t.startswith('run.tables["')}
    made = set().union(*(r.tables for r in runs.values()))
    assert made <= documented, f"tables without a section in docs/frames.md: {sorted(made - documented)}"
    known = set(REQUIRED_COLUMNS) - {"tensors", "steps", "histograms"}  # the tables a saved run is checked for
    assert known <= documented, f"tables without a section in docs/frames.md: {sorted(known - documented)}"


def _keys(title: str) -> tuple[set, set]:
    """(every documented key, the keys documented as present "always")."""
    rows = SECTIONS[title]
    return {k for k, _ in rows}, {k for k, cells in rows if cells[-1].startswith("always")}


def test_meta_keys(runs):
    documented, always = _keys("run.meta")
    for name, run in runs.items():
        extra = set(run.meta) - documented
        assert not extra, f"run.meta keys of the {name} run missing from docs/frames.md: {sorted(extra)}"
        if name != "merged":  # (made by record(); the merged one was loaded from files written here)
            assert always <= set(run.meta), f"{name}: documented as always there, absent: {always - set(run.meta)}"
    assert {"ops", "shadow", "forensics"} <= set(runs["amp"].meta)


def test_finding_and_recommendation_fields(runs):
    assert _names("Finding") == [f.name for f in dataclasses.fields(Finding)]
    assert _names("Recommendation") == [f.name for f in dataclasses.fields(Recommendation)]
    findings = mpscope.advise(runs["overflow"]).findings
    assert findings and all(set(f.to_dict()) == set(_names("Finding")) for f in findings)


def test_evidence_keys(runs):
    documented, always = _keys("Recommendation.evidence")
    for name in ("amp", "overflow", "accumulation"):
        evidence = mpscope.advise(runs[name]).evidence
        assert set(evidence) <= documented, f"{name}: undocumented evidence {sorted(set(evidence) - documented)}"
        assert always <= set(evidence), f"{name}: documented as always there, absent: {sorted(always - set(evidence))}"
