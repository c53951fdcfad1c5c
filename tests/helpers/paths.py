"""Where things are, whatever folder of tests/ asks: the repository root, tests' data and scripts."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root (tests/helpers/paths.py -> ../..)
TESTS = ROOT / "tests"
DATA = TESTS / "data"
SCRIPTS = TESTS / "scripts"
