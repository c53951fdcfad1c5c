"""Every Python snippet in README.md, CONTRIBUTING.md and docs/ parses, and every hybridsp name it imports or
spells out (``hybridsp.x.y``) exists on the public surface: no private module, no deprecated path."""

from __future__ import annotations

import ast
import importlib
import re
import warnings

import pytest

from tests.helpers.paths import ROOT

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
