"""The benchmarks' runner and registry, without running a benchmark (no process is started).

- every registry entry names a module that imports and has ``main(argv)``, and a quick run that writes
  under its temporary folder;
- ``python -m benchmarks list`` runs (in this process, through runpy) and names every benchmark, and the
  runner and registry import nothing but the standard library (``list`` imports no benchmark);
- no file under benchmarks/ imports ``tests`` or touches ``sys.path`` (a static check of every file);
- ``$BENCHMARKS_RESULTS`` moves the results folder (what a quick run relies on).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import runpy
import sys
from pathlib import Path

import pytest

import benchmarks
from benchmarks import _registry

PACKAGE = Path(benchmarks.__file__).resolve().parent
SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("entry", _registry.BENCHMARKS, ids=lambda entry: entry.name)
def test_every_entry_imports_and_has_main(entry):
    module = importlib.import_module(entry.module)
    assert Path(module.__file__).resolve() == PACKAGE / Path(*entry.name.split(".")).with_suffix(".py")
    assert callable(getattr(module, "main", None)), f"{entry.module} has no main"
    assert "argv" in inspect.signature(module.main).parameters, f"{entry.module}.main takes no argv"
    assert any("{tmp}" in arg for arg in entry.quick), f"{entry.name}: the quick run must write under {{tmp}}"
    filled = [arg.format(tmp="/tmp/x", root="/r") for arg in entry.quick]  # placeholders are only these two
    assert all("{" not in arg for arg in filled)
    assert entry.results.startswith("results/") and entry.question.endswith("?")


def test_names_are_unique_and_short_names_resolve():
    names = [entry.name for entry in _registry.BENCHMARKS]
    assert len(names) == len(set(names))
    assert _registry.find("peers").name == "attention.peers"
    with pytest.raises(KeyError):
        _registry.find("no_such_benchmark")


def test_list_runs_and_names_every_benchmark(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [benchmarks.__name__, "list"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(benchmarks.__name__, run_name="__main__")
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(_registry.BENCHMARKS)
    for entry, line in zip(_registry.BENCHMARKS, lines[1:]):
        assert line.split()[:2] == [entry.name, entry.results + "/"]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, ``from x import y`` as ``x``, relative ones as ``.``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def test_runner_and_registry_import_only_the_standard_library():
    for name in ("__main__.py", "_registry.py"):
        for line, module in _imports(PACKAGE / name):
            root = module.split(".")[0]
            assert root in sys.stdlib_module_names or module == f"{benchmarks.__name__}._registry", (
                f"{name}:{line} imports {module}"
            )


def test_no_benchmark_imports_tests_or_edits_sys_path():
    offenders = []
    for path in SOURCES:
        where = path.relative_to(PACKAGE.parent)
        offenders += [
            f"{where}:{line} imports {module}" for line, module in _imports(path) if module.split(".")[0] == "tests"
        ]
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                offenders.append(f"{where}:{node.lineno} uses sys.path")
            if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
                offenders.append(f"{where}:{node.lineno} imports sys.path")
    assert SOURCES and not offenders, "\n  ".join(["benchmarks reach into tests or sys.path:", *offenders])


def test_results_env_moves_the_results(monkeypatch, tmp_path):
    harness = importlib.import_module(f"{benchmarks.__name__}.common.harness")
    runner = importlib.import_module(f"{benchmarks.__name__}.__main__")
    assert runner.RESULTS_ENV == harness.RESULTS_ENV
    monkeypatch.delenv(harness.RESULTS_ENV, raising=False)
    assert Path(harness.results_path("peers", "peers")) == PACKAGE / "results" / "peers" / "peers"
    monkeypatch.setenv(harness.RESULTS_ENV, str(tmp_path))
    assert Path(harness.results_path("peers", "peers")) == tmp_path / "peers" / "peers"
    assert runner.quick_argv(_registry.find("attention.peers"), str(tmp_path))[-1] == f"{tmp_path}/peers"
