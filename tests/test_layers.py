"""The package's structure: imports go one way (import-linter's ``layers`` contract in pyproject.toml,
the diagram of docs/architecture.md), ``import mpscope`` stays light, and the only imports inside
functions are of optional or slow dependencies, each saying so, plus the two documented facades."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mpscope"

#: Imports allowed inside functions: optional dependencies (extras "notebook", "hf", "lightning"),
#: parts of torch that are slow to import or absent from some builds, the C++ tool chain, and the
#: two facades on lower layers (Run.report, Recommendation.export).
ALLOWED_LAZY = ("IPython", "ipywidgets", "altair", "anywidget", "vl_convert", "transformers", "accelerate",
                "lightning", "pytorch_lightning", "torch._dynamo", "torch.fx", "torch.utils.cpp_extension",
                "mpscope.report", "mpscope.export", "mpscope.widgets.explorer", "mpscope.magic",
                "mpscope.integrations.hf", "mpscope.integrations.lightning",
                "mpscope._core")  # (compiled at install where a C++ compiler is: may be missing)


def _lint_imports() -> str:
    local = Path(sys.executable).parent / "lint-imports"  # the one installed with this interpreter
    exe = str(local) if local.exists() else shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not found: install the dev extra (pip install -e '.[dev]'), which has import-linter")
    return exe


def test_layers_contract_is_kept():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "1 kept, 0 broken" in out.stdout


def _lazy_imports():
    """(file, line, imported module, source line + the line above) of every import inside a function."""
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                else:
                    continue
                context = "\n".join(lines[max(0, node.lineno - 3):node.end_lineno])
                for name in names:
                    yield path.relative_to(ROOT), node.lineno, name, context


def test_imports_inside_functions_are_optional_dependencies_that_say_so():
    bad = []
    for path, line, name, context in _lazy_imports():
        allowed = any(name == a or name.startswith(a + ".") for a in ALLOWED_LAZY)
        if not allowed or "#" not in context and '"""' not in context:
            bad.append(f"{path}:{line}: import {name}")
    assert not bad, "imports inside functions that are neither optional dependencies nor commented:\n" + "\n".join(bad)


def test_import_mpscope_loads_no_notebook_stack():
    code = ("import sys, mpscope; heavy = [m for m in ('IPython', 'ipywidgets', 'altair', 'anywidget', "
            "'transformers', 'lightning') if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
