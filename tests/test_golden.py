"""Golden text: what a user reads for two cases, kept in ``tests/golden/`` so that a reader sees the
output here and a change to it shows up as a diff.

The files are the exact output of ``Recommendation.to_text()`` and of ``mpscope.summary.text_summary``
for two cases of ``tests/cases/scenarios.py`` (seed 0, CPU). After an intended change to that output,
regenerate them on purpose and review the diff::

    MPSCOPE_REGEN_GOLDEN=1 python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import mpscope
from cases import scenarios as S
from mpscope.summary import text_summary

GOLDEN = Path(__file__).resolve().parent / "golden"
REGEN = os.environ.get("MPSCOPE_REGEN_GOLDEN") == "1"

#: case name -> the Run it reads (the failing setup of each case)
CASES = {
    "c07_clip_before_unscale": lambda: S.c07().bad.run,
    "c09_adam_eps_fp16": lambda: S.c09().bad.run,
}


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if REGEN:
        path.write_text(text + "\n")
    assert path.exists(), f"{path} is missing: run MPSCOPE_REGEN_GOLDEN=1 python -m pytest tests/test_golden.py"
    want = path.read_text().removesuffix("\n")
    assert text == want, f"{name} differs from the golden file; if the change is intended, regenerate it " \
                         "(MPSCOPE_REGEN_GOLDEN=1) and review the diff"


@pytest.mark.parametrize("case", sorted(CASES))
def test_recommendation_text(case):
    _check(f"{case}.recommendation.txt", mpscope.advise(CASES[case]()).to_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_summary_text(case):
    run = CASES[case]()
    _check(f"{case}.summary.txt", text_summary(run, mpscope.advise(run)))
