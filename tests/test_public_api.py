"""The public surface: each package face's ``__all__`` is exactly what docs/api.md lists, every name in it
resolves, the integration faces import nothing heavy until asked, every module outside the faces is private
(``_``-prefixed, or an old-path shim that warns), the old documented paths still import with a warning, and
every Python snippet in README.md, CONTRIBUTING.md and docs/ parses and names only current public names."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings

import pytest

from tests.helpers.paths import ROOT, is_old_path_shim

PACKAGE = ROOT / "hybridsp"


def _documented_surface() -> dict[str, list[str]]:
    """{package: names} from the table after ``<!-- public-surface -->`` in docs/api.md."""
    text = (ROOT / "docs" / "api.md").read_text().split("<!-- public-surface -->", 1)[1]
    table = {}
    rows = text.split("|---|---|", 1)[1].strip("\n").splitlines()
    for line in rows:
        if not line.startswith("| `"):
            break
        package, names = line.strip("|").split("|")
        table[package.strip().strip("`")] = re.findall(r"`([^`]+)`", names)
    return table


def test_docs_list_exactly_each_faces_all():
    table = _documented_surface()
    assert "hybridsp" in table and "hybridsp.integrations.transformers" in table
    for package, names in table.items():
        module = importlib.import_module(package)
        assert sorted(names) == sorted(module.__all__), package
        for name in names:
            assert getattr(module, name) is not None, f"{package}.{name}"


def _public_modules() -> list[str]:
    """Package modules whose own name, and every package above them, has no leading underscore."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") and p != "__main__" for p in parts) or is_old_path_shim(path):
            continue
        found.append(".".join(parts))
    return found


def test_only_the_faces_are_public_modules():
    faces = set(_documented_surface()) | {"hybridsp.__main__", "hybridsp.integrations"}
    extra = sorted(set(_public_modules()) - faces)
    assert not extra, f"public modules that are not a documented face (make them _private): {extra}"


def test_every_face_declares_all_as_a_literal_list():
    for package in _documented_surface():
        path = PACKAGE.parent / (
            package.replace(".", "/") + ("/__init__.py" if package != "hybridsp.testing" else ".py")
        )
        tree = ast.parse(path.read_text())
        assigned = [
            n
            for n in tree.body
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
        ]
        assert assigned and isinstance(assigned[0].value, ast.List), package


def test_lazy_faces_name_their_types_for_checkers():
    """The integration faces import on first use, and import the same names under TYPE_CHECKING."""
    for package in (
        "hybridsp.integrations.deepspeed",
        "hybridsp.integrations.transformers",
        "hybridsp.integrations.trl",
        "hybridsp.integrations.diffusers",
    ):
        module = importlib.import_module(package)
        tree = ast.parse((PACKAGE.parent / package.replace(".", "/") / "__init__.py").read_text())
        guarded = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"]
        typed = {
            alias.asname or alias.name
            for block in guarded
            for node in ast.walk(block)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        assert typed == set(module.__all__), package


def test_import_hybridsp_loads_no_training_framework():
    code = (
        "import sys, hybridsp, hybridsp.integrations.transformers, hybridsp.integrations.deepspeed, "
        "hybridsp.integrations.trl, hybridsp.integrations.diffusers; "
        "print(sorted(m for m in ('deepspeed', 'transformers', 'trl', 'peft', 'diffusers') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_version_is_a_release_string():
    import hybridsp

    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", hybridsp.__version__)


@pytest.mark.parametrize(
    "old, name, face",
    [
        ("hybridsp.layout.documents", "Documents", "hybridsp.layout"),
        ("hybridsp.batch", "replica_sampler", "hybridsp.data"),
        ("hybridsp.mesh.process_group", "init_process_group", "hybridsp.launch"),
        ("hybridsp.attention.volume", "hybrid_bytes", "hybridsp.attention"),
        ("hybridsp.integrations.transformers.vision.batch", "shard_vlm_batch", "hybridsp.integrations.transformers"),
    ],
)
def test_old_documented_paths_warn_and_give_the_same_object(old, name, face):
    module = importlib.import_module(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(face), name)
    assert len(caught) == 1 and issubclass(caught[0].category, DeprecationWarning)
    assert f"import {name} from {face}" in str(caught[0].message)


def test_names_that_left_a_face_warn():
    import hybridsp.integrations.deepspeed as hds

    with pytest.warns(DeprecationWarning, match="OWNED_KEYS is deprecated"):
        assert hds.OWNED_KEYS
    with pytest.raises(AttributeError):
        hds.no_such_name  # noqa: B018


def test_a_renamed_class_warns_and_is_the_new_one():
    import hybridsp.planner as planner

    with pytest.warns(DeprecationWarning, match="use hybridsp.planner.CandidatePlan"):
        assert planner.Plan is planner.CandidatePlan


# --------------------------------------------------------------------------- the snippets in the docs

PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```python\n(.*?)```", re.S)


def _snippets() -> list[tuple[str, str]]:
    return [
        (f"{page.relative_to(ROOT)}#{i}", code)
        for page in PAGES
        for i, code in enumerate(FENCE.findall(page.read_text()))
    ]


def _resolve(dotted: str) -> object:
    """The object ``dotted`` names (a module, or attributes of the longest importable module prefix)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError:
            continue
        for name in parts[end:]:
            value = getattr(value, name)
        return value
    raise ModuleNotFoundError(dotted)


def _named(code: str) -> set[str]:
    """Every ``hybridsp...`` name a snippet imports or spells out in attribute form."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hybridsp":
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.split(".")[0] == "hybridsp")
        elif isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            if dotted.startswith("hybridsp."):
                names.add(dotted)
    return names


def test_there_are_snippets_to_check():
    assert len(_snippets()) >= 10


@pytest.mark.parametrize("where, code", _snippets(), ids=[where for where, _ in _snippets()])
def test_snippet_parses_and_names_only_public_hybridsp_names(where, code):
    names = _named(code)  # SyntaxError here: the snippet does not parse
    private = sorted(n for n in names if any(part.startswith("_") and part != "__version__" for part in n.split(".")))
    assert not private, f"{where} names private modules or names: {private}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in sorted(names):
            _resolve(name)  # AttributeError / ModuleNotFoundError / DeprecationWarning: a stale name


def test_the_layout_literal_names_the_layout_objects():
    from hybridsp._types import LAYOUT_NAMES
    from hybridsp.layout import LAYOUTS

    assert LAYOUTS == LAYOUT_NAMES
