"""Fixtures for the module-level case tests (C01, C05-C10). Scenario code lives in scenarios.py."""

from __future__ import annotations

import os

import pytest

import mpscope

if os.environ.get("MPSCOPE_CASES_ENGINE") == "1":  # every case recorded with precision forensics on
    _record = mpscope.record

    def _with_engine(*args, **kwargs):
        return _record(*args, **dict(kwargs, ops=kwargs.get("ops") or True, shadow=True))

    mpscope.record = _with_engine


def codes(rec) -> list[str]:
    return [f.code for f in rec.findings]


def find(rec, code, module=None):
    """The findings with ``code`` (and ``module`` when given); fails listing what exists otherwise."""
    fs = [f for f in rec.findings if f.code == code and (module is None or f.module == module)]
    assert fs, f"no {code} finding for module {module!r}; findings: {[(f.code, f.module) for f in rec.findings]}"
    return fs


@pytest.fixture
def advise():
    return mpscope.advise
