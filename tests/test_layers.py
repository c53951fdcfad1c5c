"""The package's layering: which package may import which (:data:`ALLOWED`, the declared map), no
import cycle between modules, no private name imported across modules, modules of about 400 lines
at most. The graph is read with ``ast``, imports inside functions included; old-path shims (files
marked ``keep-old-paths``) are not part of it."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import is_old_path_shim

PACKAGE = Path(__file__).resolve().parent.parent / "hybridsp"
MAX_LINES = 420  # "about 400"

_BASE = {"_types", "_checks", "_formulas"}  # torch-free leaves every package may use
_CORE = _BASE | {
    "_comm",
    "_opaque",
    "kernels",
    "layout",
    "launch",
    "mesh",
    "attention",
    "memory",
    "losses",
    "data",
    "inference",
    "linear_attention",
    "tensor_parallel",
}
ALLOWED: dict[str, set[str]] = {
    # the leaves: torch-free names and checks, the byte counter, the opaque reference, the version
    "_types": set(),
    "_checks": set(),
    "_formulas": set(),
    "_version": set(),
    "_deprecated": set(),
    "_comm": set(),
    "_opaque": set(),
    # the core, bottom up: each may import only what is below it
    "kernels": set(_BASE),
    "layout": _BASE | {"_opaque"},
    "launch": set(_BASE),
    "mesh": _BASE | {"_opaque", "layout", "launch"},
    "attention": _BASE | {"_comm", "_opaque", "kernels", "layout", "mesh"},
    "memory": set(_BASE),  # engines' sharded parameters are reached by name (memory/_sharded_params), not imported
    "losses": _BASE | {"attention", "layout", "mesh", "memory"},
    "data": _BASE | {"attention", "layout", "losses", "mesh"},
    "inference": _BASE | {"_comm", "attention", "kernels", "mesh"},
    "linear_attention": _BASE | {"_comm", "attention", "layout", "mesh"},
    "tensor_parallel": _BASE | {"mesh"},
    "planner": _BASE | {"_deprecated", "layout", "linear_attention", "mesh"},
    "testing": set(),
    "_commands": _BASE | {"launch", "mesh", "monitor", "testing", "integrations.transformers"},  # verify: lazily
    # the probe and run health: the core, and the transformers switch's recorded pass (lazily, inside verify_parity)
    "monitor": _CORE | {"integrations.transformers"},
    "hybridsp": _CORE | {"_version", "monitor"},  # the top-level face
    "__main__": set(),  # finds its commands by name
    # the integrations: anything in the core, their shared helper, and each other as drawn here
    "integrations": {"_deprecated"},
    "integrations.deepspeed": _CORE
    | {"monitor", "integrations", "integrations.transformers"},  # _entry: the switch, lazily
    "integrations.transformers": _CORE
    | {"monitor", "integrations", "integrations.deepspeed", "integrations.fsdp"},  # the Trainer builds its engine
    "integrations.trl": _CORE | {"monitor", "integrations", "integrations.deepspeed", "integrations.transformers"},
    "integrations.diffusers": _CORE | {"integrations"},  # imports no diffusers module at all
    "integrations.fsdp": _CORE | {"integrations"},  # FSDP2 over the mesh; the Trainer's FSDP2 path imports it
}


def _unit(module: str) -> str:
    """The layer a module belongs to: ``hybridsp.attention._api`` -> ``attention``; the integrations one
    level deeper (``integrations.trl``); the top-level face is ``hybridsp``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "hybridsp"
    if parts[1] == "integrations" and len(parts) > 2:
        return ".".join(parts[1:3])
    return parts[1]


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (packages as their __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if is_old_path_shim(path):
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(module: str, level: int, name: str | None, is_package: bool) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str, path: Path, known: set[str]) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every import anywhere in the file,
    each mapped to the deepest known package module (``from a import b`` with b a submodule: a.b)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known_prefix(alias.name, known)
                if target:
                    out.append((target, "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node.level, node.module, is_package)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in known:
                    out.append((submodule, "", node.lineno))
                else:
                    target = _known_prefix(source, known)
                    if target:
                        out.append((target, alias.name, node.lineno))
    return out


def _known_prefix(name: str, known: set[str]) -> str | None:
    """The longest package module that ``name`` is or lies inside (None outside the package)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def _type_only_lines(path: Path) -> set[int]:
    """The lines inside ``if TYPE_CHECKING:`` blocks (imports there exist for the type checker only)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def _graph(runtime_only: bool = False) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}; a module's own package __init__ chain is not an edge
    that it names, so only what the file writes counts. ``runtime_only``: without the imports under
    ``if TYPE_CHECKING:`` (they cannot form an import cycle at run time)."""
    modules = _modules()
    known = set(modules)
    graph = {}
    for module, path in modules.items():
        skip = _type_only_lines(path) if runtime_only else set()
        edges: dict[str, int] = {}
        for target, _, line in _imports(module, path, known):
            if target != module and line not in skip:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, {})))))
    return None


def test_the_graph_sees_every_kind_of_import(tmp_path):
    source = tmp_path / "cli.py"
    source.write_text(
        "import hybridsp.mesh\n"
        "from hybridsp import _formulas, init_mesh\n"
        "from . import _specs\n"
        "from ._costs import comm_volume as volume\n"
        "from .. import degrees\n"
        "def later():\n"
        "    import hybridsp.layout as layout\n"
        "    from hybridsp.kernels._reference import _private\n"
    )
    known = {
        "hybridsp",
        "hybridsp.mesh",
        "hybridsp._formulas",
        "hybridsp.planner",
        "hybridsp.planner._specs",
        "hybridsp.planner._costs",
        "hybridsp.degrees",
        "hybridsp.layout",
        "hybridsp.kernels",
        "hybridsp.kernels._reference",
    }
    assert sorted((target, name) for target, name, _ in _imports("hybridsp.planner._cli", source, known)) == [
        ("hybridsp", "init_mesh"),
        ("hybridsp._formulas", ""),
        ("hybridsp.degrees", ""),
        ("hybridsp.kernels._reference", "_private"),
        ("hybridsp.layout", ""),
        ("hybridsp.mesh", ""),
        ("hybridsp.planner._costs", "comm_volume"),
        ("hybridsp.planner._specs", ""),
    ]
    graph = _graph()
    assert "hybridsp.kernels._flash" in graph["hybridsp.kernels._select"]  # inside a function
    found = _find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}})
    assert found == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 1}}) is None
    assert _resolve("hybridsp.planner._cli", 1, "_specs", False) == "hybridsp.planner._specs"
    assert _resolve("hybridsp.planner", 1, "_specs", True) == "hybridsp.planner._specs"
    assert _resolve("hybridsp.planner._cli", 2, None, False) == "hybridsp"


def _assert_acyclic(graph: dict[str, dict[str, int]]) -> None:
    cycle = _find_cycle(graph)
    if cycle:
        lines = [f"{a} -> {b} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle in hybridsp:\n  " + "\n  ".join(lines))


def test_every_import_follows_the_declared_layers():
    offenders = []
    for module, edges in _graph().items():
        source = _unit(module)
        assert source in ALLOWED, f"{module}: its layer {source!r} is not in ALLOWED; declare what it may import"
        for target, line in edges.items():
            layer = _unit(target)
            if layer != source and layer not in ALLOWED[source]:
                offenders.append(f"{module}:{line} imports {target} ({source} -> {layer})")
    assert not offenders, "imports the layer map does not allow:\n  " + "\n  ".join(offenders)


def test_the_layer_map_has_no_cycle_inside_the_core():
    core = {
        layer: {t for t in targets if t in ALLOWED}
        for layer, targets in ALLOWED.items()
        if not layer.startswith("integrations")
    }
    assert _find_cycle({k: dict.fromkeys(v, 0) for k, v in core.items()}) is None


def test_the_layer_check_sees_a_wrong_arrow():
    assert _unit("hybridsp.attention._api") == "attention" and _unit("hybridsp") == "hybridsp"
    assert _unit("hybridsp.integrations.trl._grpo") == "integrations.trl"
    assert "attention" not in ALLOWED["layout"] and "integrations.deepspeed" not in ALLOWED["memory"]


def test_import_graph_has_no_cycles():
    graph = _graph(runtime_only=True)
    _assert_acyclic(graph)


def test_no_module_imports_a_private_name_of_another():
    modules = _modules()
    known = set(modules)
    offenders = [
        f"{module}:{line} imports {name} from {target}"
        for module, path in modules.items()
        for target, name, line in _imports(module, path, known)
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert not offenders, "private names imported across modules:\n  " + "\n  ".join(offenders)


def _too_long() -> dict[str, int]:
    """Package files over MAX_LINES lines, by path relative to the repository."""
    lengths = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    return {path: count for path, count in lengths.items() if count > MAX_LINES}


def test_no_module_is_over_about_400_lines():
    offenders = [f"{path}: {count} lines" for path, count in _too_long().items()]
    assert not offenders, f"modules over {MAX_LINES} lines:\n  " + "\n  ".join(offenders)


def test_tests_use_nothing_from_benchmarks():
    """No test imports a benchmark script or reads a committed results file (fixtures live in tests/data)."""
    tests = Path(__file__).resolve().parent
    scripts = {path.stem for path in (tests.parent / "benchmarks").glob("*.py")}
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue  # this test names what it looks for
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in scripts]
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and (node.value == "benchmarks" or node.value.startswith("results_"))
            ):
                offenders.append(f"{path.name}:{node.lineno} names {node.value!r}")
    assert not offenders, "tests reach into benchmarks/:\n  " + "\n  ".join(offenders)
