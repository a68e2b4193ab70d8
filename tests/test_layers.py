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

#: Imports allowed inside functions: optional dependencies (extras "notebook", "hf", "lightning",
#: "tensorboard"), parts of torch that are slow to import or absent from some builds, the C++ tool
#: chain, and the facades on lower layers (Run.report, Run.to_tensorboard, Recommendation.export).
ALLOWED_LAZY = ("IPython", "ipywidgets", "altair", "anywidget", "vl_convert", "transformers", "accelerate",
                "lightning", "pytorch_lightning", "torch._dynamo", "torch.fx", "torch.utils.cpp_extension",
                "tensorboard", "tqdm", "torch.utils.tensorboard", "mpscope.tensorboard",
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
            "'transformers', 'lightning', 'tensorboard', 'torch.utils.tensorboard') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def _classes():
    """(file, class node) of every class in the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                yield path, node


def _private_names(cls: ast.ClassDef) -> set[str]:
    """The private names a class defines: its ``_methods``, class-level ``_names`` and the
    ``self._names`` its methods assign (dunder names are protocols, not private state)."""
    out = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            out.add(node.attr)
    for node in cls.body:
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []):
            if isinstance(t, ast.Name):
                out.add(t.id)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


#: The documented exceptions (docs/architecture.md, "Who may touch what"): ``file: expression.name``.
PRIVATE_ACCESS_ALLOWED = {
    # IPython's display protocol: a view shows a Recommendation as a notebook does
    "mpscope/report.py: advice._repr_html_",
    "mpscope/widgets/explorer.py: self.advice._repr_html_",
}


def test_no_object_reads_or_writes_another_objects_private_state():
    """An attribute ``x._name`` of a private name some mpscope class defines is used only inside a
    class that defines that name itself (its own instances), or where docs/architecture.md says so."""
    classes = list(_classes())
    defined = set().union(*(_private_names(c) for _, c in classes))
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        owners: dict[int, set[str]] = {}  # id(node) -> private names of the classes enclosing it
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = _private_names(cls)
            for node in ast.walk(cls):
                owners.setdefault(id(node), set()).update(names)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in defined):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in owners.get(id(node), ()):
                continue
            where = f"{path.relative_to(ROOT)}: {ast.unparse(node.value)}.{node.attr}"
            if where not in PRIVATE_ACCESS_ALLOWED:
                bad.append(f"{where} (line {node.lineno})")
    assert not bad, "private state of another object:\n" + "\n".join(bad)


def test_the_recording_core_has_no_class_over_700_lines_nor_function_over_100():
    too_long = []
    for path in [PACKAGE / "recorder.py", *sorted((PACKAGE / "recording").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            n = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
            if isinstance(node, ast.ClassDef) and n > 700 or \
                    isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n > 100:
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, "\n".join(too_long)


def test_the_cpp_hook_path_reads_no_recorder_attribute_by_name():
    """``_kernel.cpp`` names the fields of ``HookState`` (checked against its ``__slots__``) and the
    attributes of the row tables, GradHooks and tensors it is handed, never a private name of
    mpscope's (only PyTorch's own ``_backward_hooks`` / ``_register_hook_dict``)."""
    import re

    from mpscope.recording.hook_state import HookState

    source = (PACKAGE / "_kernel.cpp").read_text()
    interned = set(re.findall(r'\bi\("([^"]+)"\)', source))
    assert {n for n in interned if n.startswith("_")} == {"_backward_hooks", "_register_hook_dict"}
    fields = re.search(r"kFields\[kFieldCount\] = \{([^}]*)\}", source).group(1)
    assert set(re.findall(r'"(\w+)"', fields)) <= set(HookState.__slots__)
    # the plain-tuple records it makes have the fields Python reads them by, in order
    from mpscope.recording.observer import SEEN
    from mpscope.recording.step_buffer import LOG_ENTRY

    for name, fields in (("kLogEntryFields", LOG_ENTRY), ("kSeenFields", SEEN)):
        declared = re.search(name + r"\[\] = \{([^}]*)\}", source).group(1)
        assert tuple(re.findall(r'"(\w+)"', declared)) == fields, name
