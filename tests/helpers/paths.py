"""Where things are, whatever folder of tests/ asks: the repository root, tests' data and scripts."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root (tests/helpers/paths.py -> ../..)
TESTS = ROOT / "tests"
DATA = TESTS / "data"
SCRIPTS = TESTS / "scripts"


SHIM_MARKS = ("Deprecated path (keep-old-paths)", "Deprecated package path (keep-old-paths)")


def is_old_path_shim(path: Path) -> bool:
    """A module at a path that moved in 0.2: its docstring starts with one of :data:`SHIM_MARKS`."""
    return path.read_text().startswith(tuple(f'"""{mark}' for mark in SHIM_MARKS))
