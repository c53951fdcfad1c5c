"""The version ranges in pyproject.toml: the installed packages satisfy them, docs/versions.md states the same
floors and upper bounds, and the transformers floor is the one the switch enforces at run time.

No minimum-versions job installs every floor (only torch 2.13.0 CPU can be installed where the suite runs);
docs/versions.md says which API sets each floor, and this test keeps that page, pyproject.toml and the
environment in agreement.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# The packages whose installed versions must lie inside the declared ranges in every test environment.
CHECKED = ("torch", "deepspeed", "transformers", "accelerate", "trl", "peft", "diffusers")
TABLE_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([^|]+?)\s*\|[^|]*\|\s*([^|]+?)\s*\|")


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]


def declared() -> dict[str, SpecifierSet]:
    """{package: its range} over the dependencies and every extra; one range per package."""
    project = _project()
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    ranges: dict[str, set[str]] = {}
    for line in lines:
        requirement = Requirement(line)
        ranges.setdefault(canonicalize_name(requirement.name), set()).add(str(requirement.specifier))
    differing = {name: sorted(specs) for name, specs in ranges.items() if len(specs) > 1}
    assert not differing, f"a package has different ranges in different extras of pyproject.toml: {differing}"
    return {name: SpecifierSet(specs.pop()) for name, specs in ranges.items()}


def documented() -> dict[str, SpecifierSet]:
    """{package: range} from the tables of docs/versions.md (package | floor | why | upper bound | why)."""
    ranges = {}
    for line in (ROOT / "docs" / "versions.md").read_text().splitlines():
        match = TABLE_ROW.match(line)
        if not match:
            continue
        name, floor, upper = match.groups()
        if floor.startswith("=="):
            spec = floor
        else:
            spec = f">={floor}" + ("" if upper == "none" else f",{upper}")
        ranges[canonicalize_name(name)] = SpecifierSet(spec)
    return ranges


def test_each_package_has_one_range_and_the_core_needs_torch_only():
    declared()
    assert [Requirement(line).name for line in _project()["dependencies"]] == ["torch"]


def test_the_documented_floors_and_bounds_are_the_declared_ones():
    table = documented()
    python = table.pop("python", None)
    assert python == SpecifierSet(_project()["requires-python"]), "docs/versions.md's python row"
    assert table == declared(), "docs/versions.md and pyproject.toml disagree (change both in one commit)"


@pytest.mark.parametrize("package", CHECKED)
def test_the_installed_version_is_inside_the_declared_range(package):
    installed = version(package)
    assert declared()[package].contains(installed, prereleases=True), (
        f"{package} {installed} is outside pyproject.toml's {package}{declared()[package]}"
    )


def test_every_other_installed_package_is_inside_its_range():
    outside = {}
    for name, spec in declared().items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue  # an extra that this environment did not install (flash-attn, yunchang, pre-commit)
        if not spec.contains(installed, prereleases=True):
            outside[name] = f"{installed} not in {spec}"
    assert not outside, outside


def test_python_is_inside_requires_python():
    running = ".".join(map(str, sys.version_info[:3]))
    assert SpecifierSet(_project()["requires-python"]).contains(running)


def test_the_transformers_floor_is_the_one_the_switch_enforces():
    from hybridsp.integrations.transformers._switch import MIN_TRANSFORMERS_VERSION

    floors = [spec.version for spec in declared()["transformers"] if spec.operator == ">="]
    assert floors == [MIN_TRANSFORMERS_VERSION.removesuffix(".0")], floors
