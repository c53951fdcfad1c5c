"""The source and test trees stay navigable: no families of look-alike module names (a family wants a
package of its own), and tests that share code through tests/helpers/ rather than through each other.
The package's layering is tests/test_layers.py."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.helpers.paths import ROOT, TESTS

PACKAGE = ROOT / "hybridsp"
MAX_SHARED_PREFIX = 2  # sibling modules named <prefix>_<rest>.py
MAX_FILES_DIRECTLY_UNDER_TESTS = 12


def _folders(root: Path) -> list[Path]:
    return sorted({path.parent for path in root.rglob("*.py") if "__pycache__" not in path.parts})


def _modules(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.py"))


def _prefix_families(folder: Path) -> dict[str, list[str]]:
    """{prefix: [module names]} for three or more siblings named ``<prefix>_<rest>.py`` (dunder files aside)."""
    stems = [path.stem.lstrip("_") for path in _modules(folder) if not path.stem.startswith("__")]  # _x.py: private x
    stems = [stem for stem in stems if "_" in stem]
    counts = Counter(stem.split("_")[0] for stem in stems)
    return {
        prefix: sorted(s for s in stems if s.split("_")[0] == prefix)
        for prefix, count in counts.items()
        if count > MAX_SHARED_PREFIX
    }


def test_no_three_sibling_modules_share_a_name_prefix():
    families = {str(folder.relative_to(ROOT)): _prefix_families(folder) for folder in _folders(PACKAGE)}
    families = {folder: found for folder, found in families.items() if found}
    assert not families, f"sibling modules that should be a package of their own: {families}"


def test_prefix_families_are_found():
    """The check above sees hf_a.py, hf_b.py, hf_c.py as a family (and two of them, or hf.py, as none)."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        for name in ("hf.py", "hf_a.py", "hf_b.py", "ring.py", "__init__.py"):
            (folder / name).write_text("")
        assert _prefix_families(folder) == {}
        (folder / "hf_c.py").write_text("")
        assert _prefix_families(folder) == {"hf": ["hf_a", "hf_b", "hf_c"]}


def _imported_modules(path: Path) -> set[str]:
    """Dotted names of every module ``path`` imports (inside functions too), ``from a import b`` as a and a.b."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this file's package
                package = module.split(".")[: -node.level]
                base = ".".join([*package, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _is_test_module(dotted: str) -> bool:
    return dotted.split(".")[0] == "tests" and dotted.split(".")[-1].startswith("test_")


def test_no_test_module_imports_another_test_module():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        own = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for name in sorted(_imported_modules(path)):
            if _is_test_module(name) and name != own:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "shared test code belongs in tests/helpers/:\n  " + "\n  ".join(offenders)


def test_the_import_check_sees_test_modules():
    assert _is_test_module("tests.attention.test_masks") and _is_test_module("tests.test_batch")
    assert not _is_test_module("tests.helpers.mesh") and not _is_test_module("hybridsp.testing")


def test_few_files_directly_under_tests():
    files = sorted(path.name for path in TESTS.iterdir() if path.is_file())
    assert len(files) <= MAX_FILES_DIRECTLY_UNDER_TESTS, f"{len(files)} files directly under tests/: {files}"


def test_every_test_folder_is_a_package():
    """tests.<folder>.<module> must import (run_distributed's workers are pickled by module path)."""
    folders = {
        folder
        for path in [*TESTS.rglob("test_*.py"), TESTS / "helpers" / "paths.py"]
        for folder in path.parents
        if folder == TESTS or TESTS in folder.parents
    }
    missing = sorted(str(folder.relative_to(ROOT)) for folder in folders if not (folder / "__init__.py").is_file())
    assert not missing, f"folders without an __init__.py: {missing}"
