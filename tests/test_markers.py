"""Every test says what it is (the markers registered in pyproject.toml; tests/README.md): a test that starts processes is marked
``distributed``, one that runs DeepSpeed, a Trainer, an example script or a launcher end to end ``integration``.

The markers are written in the test modules; nothing infers them at collection time. This file reads the test tree
(the ast only, nothing imported or run) and fails when a test reaches ``run_distributed`` or a launcher command
line, through its own body, its fixtures or any function of tests/ it uses, at any depth, without the marker.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.paths import ROOT, TESTS

SPAWNERS = {"run_distributed"}  # hybridsp.testing's process launcher, however imported
LAUNCHERS = {"deepspeed", "torchrun"}  # argv[0] of a launcher command line
LAUNCHER_MODULES = {"torch.distributed.run", "torch.distributed.launch"}  # python -m <these>
ENGINE_BUILDER = "initialize"  # deepspeed.initialize, hybridsp.integrations.deepspeed.initialize: an engine
INTEGRATION_FOLDERS = ("integrations", "examples")  # tests/<folder>/: end to end as a whole, said per module
OWNED_ELSEWHERE = "tests.benchmarks"  # tests/benchmarks/: edited with the benchmarks, checked apart (see below)


def _dotted(path: Path, base: Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _marks(node: ast.AST) -> set[str]:
    """Names X of every ``pytest.mark.X`` inside ``node`` (a decorator list, a pytestmark value, a pytest.param)."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark":
            found.add(sub.attr)
    return found


def _is_launch(node: ast.AST) -> bool:
    """A literal command line that starts a launcher: ["deepspeed", ...], ["torchrun", ...], [..., "-m",
    "torch.distributed.run", ...]."""
    if not isinstance(node, ast.List):
        return False
    words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
    return (len(words) > 1 and words[0] in LAUNCHERS) or any(
        a == "-m" and b in LAUNCHER_MODULES for a, b in zip(words, words[1:])
    )


def _is_deepspeed(dotted: str) -> bool:
    return any(part.lstrip("_") == "deepspeed" for part in dotted.split("."))


@dataclass
class Unit:
    """A module-level definition (function, class, or assigned name) and what its code refers to."""

    module: str
    name: str
    node: ast.AST
    names: set[str] = field(default_factory=set)  # bare names read (and parameters: fixtures are asked by name)
    attributes: set[tuple[str, str]] = field(default_factory=set)  # (name, attribute) of ``name.attribute``
    spawns: bool = False  # calls run_distributed or starts a launcher itself
    launches: bool = False  # starts a launcher itself
    engine: bool = False  # builds a DeepSpeed engine or a Trainer itself


def _requests_fixtures(node: ast.AST) -> bool:
    """A test or a fixture: its parameters name fixtures (anything else's are its own local names)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    return node.name.startswith("test_") or any("fixture" in ast.unparse(d) for d in node.decorator_list)


def _unit(module: str, name: str, node: ast.AST) -> Unit:
    unit, read, bound = Unit(module, name, node), set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            (read if isinstance(sub.ctx, ast.Load) else bound).add(sub.id)
            unit.spawns |= sub.id in SPAWNERS
            unit.engine |= sub.id.endswith("Trainer")
        elif isinstance(sub, ast.Attribute):
            unit.spawns |= sub.attr in SPAWNERS
            unit.engine |= sub.attr.endswith("Trainer")
            if isinstance(sub.value, ast.Name):
                unit.attributes.add((sub.value.id, sub.attr))
        elif isinstance(sub, ast.arg):
            bound.add(sub.arg)
        unit.launches |= _is_launch(sub)
    unit.spawns |= unit.launches
    unit.names = read - bound
    if _requests_fixtures(node):
        unit.names |= {a.arg for a in node.args.args + node.args.kwonlyargs}
    return unit


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    units: dict[str, Unit] = field(default_factory=dict)
    imported: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # local name -> (module, attribute)
    marks: set[str] = field(default_factory=set)  # pytestmark's, for every test of the module


def _module(path: Path, base: Path) -> Module:
    tree = ast.parse(path.read_text(), filename=str(path))
    module = Module(_dotted(path, base), path, tree)
    for node in ast.walk(tree):  # imports inside functions too (one namespace: a name means one thing per module)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                module.imported[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module.imported[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0],
                    None,
                )
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            module.units[node.name] = _unit(module.name, node.name, node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    module.units[target.id] = _unit(module.name, target.id, node.value or target)
                    if target.id == "pytestmark":
                        module.marks = _marks(node.value)
    return module


class Tree:
    """Every module of tests/ and which of their definitions start processes or engines, at any depth."""

    def __init__(self, root: Path = TESTS):
        paths = [path for path in sorted(root.rglob("*.py")) if "__pycache__" not in path.parts]
        self.root = root
        self.modules = {m.name: m for m in (_module(path, root.parent) for path in paths)}
        for module in self.modules.values():
            for unit in module.units.values():
                unit.engine |= any(
                    self._builds_engine(module, name, attribute)
                    for name, attribute in [*((n, None) for n in unit.names), *unit.attributes]
                )
        self.spawning = self._closure(lambda unit: unit.spawns)
        self.end_to_end = self._closure(lambda unit: unit.engine or unit.launches)

    @staticmethod
    def _builds_engine(module: Module, name: str, attribute: str | None) -> bool:
        """``name`` (``name.attribute``) in ``module`` is DeepSpeed's or hybridsp's engine builder."""
        if name not in module.imported:
            return False
        source, imported = module.imported[name]
        if attribute is None:
            return imported == ENGINE_BUILDER and _is_deepspeed(source)
        return attribute == ENGINE_BUILDER and _is_deepspeed(source if imported is None else f"{source}.{imported}")

    def _target(self, module: Module, name: str, attribute: str | None = None) -> Unit | None:
        """The unit of tests/ that ``name`` (or ``name.attribute``) means inside ``module``, if any."""
        if attribute is None and name in module.units:
            return module.units[name]
        if name not in module.imported:
            return None
        source, imported = module.imported[name]
        owner = self.modules.get(source if imported is None else f"{source}.{imported}")  # a module of tests/
        if owner is not None:
            return owner.units.get(attribute) if attribute else None
        if attribute is None and source in self.modules:
            return self.modules[source].units.get(imported)
        return None

    def _conftest_fixture(self, module: Module, name: str) -> Unit | None:
        package = module.name.split(".")
        for depth in range(len(package), 0, -1):
            conftest = self.modules.get(".".join(package[:depth] + ["conftest"]))
            if conftest is not None and name in conftest.units:
                return conftest.units[name]
        return None

    def uses(self, unit: Unit) -> list[Unit]:
        module = self.modules[unit.module]
        found = [self._target(module, name) or self._conftest_fixture(module, name) for name in unit.names]
        found += [self._target(module, name, attribute) for name, attribute in unit.attributes]
        return [u for u in found if u is not None and u is not unit]

    def _closure(self, own) -> set[tuple[str, str]]:
        units = [u for m in self.modules.values() for u in m.units.values()]
        marked = {(u.module, u.name) for u in units if own(u)}
        changed = True
        while changed:
            changed = False
            for unit in units:
                if (unit.module, unit.name) not in marked and any(
                    (u.module, u.name) in marked for u in self.uses(unit)
                ):
                    marked.add((unit.module, unit.name))
                    changed = True
        return marked

    def tests(self, cases: bool = False):
        """(module, test function, its markers: the function's own and the module's pytestmark); with ``cases``, also
        one row per ``pytest.param(..., marks=...)`` of its parametrize, with that case's markers added."""
        for module in self.modules.values():
            if not module.path.name.startswith("test_"):
                continue
            for node in module.tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                    marks = set().union(*(_marks(d) for d in node.decorator_list if not _is_parametrize(d)))
                    yield module, node.name, marks | module.marks
                    params = [
                        sub
                        for d in node.decorator_list
                        if _is_parametrize(d)
                        for sub in ast.walk(d)
                        if isinstance(sub, ast.Call) and ast.unparse(sub.func).endswith("param")
                    ]
                    for param in params if cases else []:
                        yield module, node.name, marks | module.marks | _marks(param)


def _is_parametrize(decorator: ast.AST) -> bool:
    """``pytest.mark.parametrize(...)``: its pytest.param(marks=...) mark single cases, not the test."""
    return (
        isinstance(decorator, ast.Call)
        and isinstance(decorator.func, ast.Attribute)
        and decorator.func.attr == "parametrize"
    )


# --------------------------------------------------------------------------- the guards


@functools.cache
def _tree() -> Tree:
    return Tree()


def _where(module: Module, name: str) -> str:
    return f"{module.path.relative_to(ROOT)}::{name}"


def _unmarked(owned_elsewhere: bool = False) -> dict[str, list]:
    """{marker: tests that need it and lack it}, in tests/ but OWNED_ELSEWHERE (or only there)."""
    tree, missing = _tree(), {"distributed": [], "integration": []}
    for module, name, marks in tree.tests():
        folder = module.path.relative_to(tree.root).parts[0]
        if module.name.startswith(OWNED_ELSEWHERE + ".") != owned_elsewhere:
            continue
        if (module.name, name) in tree.spawning and "distributed" not in marks:
            missing["distributed"].append(_where(module, name))
        end_to_end = (module.name, name) in tree.end_to_end or folder in INTEGRATION_FOLDERS
        if end_to_end and "integration" not in marks:
            missing["integration"].append(_where(module, name))
    return missing


def test_every_test_that_starts_processes_is_marked_distributed():
    missing = _unmarked()["distributed"]
    assert not missing, (
        "these tests reach run_distributed or a launcher (directly, through a fixture or a helper): "
        "add @pytest.mark.distributed, or pytestmark = pytest.mark.distributed when the whole module "
        "does:\n  " + "\n  ".join(missing)
    )


def test_every_end_to_end_test_is_marked_integration():
    missing = _unmarked()["integration"]
    assert not missing, (
        "these tests build a DeepSpeed engine or a Trainer, start a launcher, or live in tests/"
        f"{{{','.join(INTEGRATION_FOLDERS)}}}/: add @pytest.mark.integration (pytestmark for a module)"
        ":\n  " + "\n  ".join(missing)
    )


def test_integration_folders_say_so_once_per_module():
    """tests/integrations/ and tests/examples/ modules declare ``pytestmark`` with integration (not test by test)."""
    tree = _tree()
    lacking = [
        str(m.path.relative_to(ROOT))
        for m in tree.modules.values()
        if m.path.name.startswith("test_")
        and m.path.relative_to(tree.root).parts[0] in INTEGRATION_FOLDERS
        and "integration" not in m.marks
    ]
    assert not lacking, "add pytestmark = pytest.mark.integration to:\n  " + "\n  ".join(lacking)


def test_no_fast_test_is_slow():
    """``fast`` chooses tests for ``pytest -m fast``, which replaces addopts' ``-m "not slow"``: never on a slow one."""
    both = [_where(module, name) for module, name, marks in _tree().tests(cases=True) if {"fast", "slow"} <= marks]
    assert not both, "marked both fast and slow:\n  " + "\n  ".join(both)


def test_benchmark_parity_tests_are_marked_too():
    missing = _unmarked(owned_elsewhere=True)
    assert not missing["distributed"] and not missing["integration"], missing


# --------------------------------------------------------------------------- the scan sees what it must


FAKE = {
    "helpers/__init__.py": "",
    "helpers/workers.py": """
from hybridsp.testing import run_distributed

def start(world):
    return run_distributed(print, world)

def launch():
    return ["deepspeed", "--num_gpus", "2", "train.py"]

def tool():
    return 1
""",
    "test_fake.py": """
import pytest
from tests.helpers import workers
from tests.helpers.workers import start, tool

CASES = [start]

def _indirect():
    return workers.start(2)

def _shadowed(start):
    return start + tool()

@pytest.fixture
def ranks():
    return start(4)

def test_direct():
    from hybridsp import testing
    testing.run_distributed(print, 2)

def test_through_a_module_attribute():
    _indirect()

def test_through_a_fixture(ranks):
    pass

def test_through_a_table():
    for case in CASES:
        case(2)

def test_a_launcher():
    workers.launch()

def test_a_local_name_is_not_the_helper():
    _shadowed(3)

def test_trainer():
    from transformers import Trainer
    Trainer

def test_engine():
    import deepspeed
    deepspeed.initialize

def test_hybridsp_engine():
    from hybridsp.integrations.deepspeed import initialize
    initialize

def test_nothing():
    tool()
""",
}


def test_the_scan_follows_helpers_fixtures_and_tables(tmp_path):
    root = tmp_path / "tests"
    for name, text in FAKE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    tree = Tree(root)
    spawning = {name for module, name, _ in tree.tests() if (module.name, name) in tree.spawning}
    end_to_end = {name for module, name, _ in tree.tests() if (module.name, name) in tree.end_to_end}
    assert spawning == {
        "test_direct",
        "test_through_a_module_attribute",
        "test_through_a_fixture",
        "test_through_a_table",
        "test_a_launcher",
    }
    assert end_to_end == {"test_a_launcher", "test_trainer", "test_engine", "test_hybridsp_engine"}


def test_markers_are_read_from_decorators_and_pytestmark_but_not_from_single_cases(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text("""
import pytest
pytestmark = [pytest.mark.integration]

@pytest.mark.distributed
@pytest.mark.parametrize("x", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a(x):
    pass

def test_b():
    pass
""")
    tree = Tree(tmp_path / "tests")
    assert {name: m for _, name, m in tree.tests()} == {
        "test_a": {"distributed", "integration"},
        "test_b": {"integration"},
    }
    assert [m for name, m in ((n, m) for _, n, m in tree.tests(cases=True)) if name == "test_a"] == [
        {"distributed", "integration"},
        {"distributed", "integration", "slow"},
    ]
