"""docs/model-support.md is the table the family tests run (tests/helpers/families.py), and names real tests."""

import pytest

from tests.helpers.families import (
    CHECKS,
    COLUMNS,
    LINEAR_GENERATE,
    LINEAR_SUPPORT,
    LINEAR_TESTS,
    SUPPORT,
    render_support_matrix,
)
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.integration


def test_the_support_page_is_generated_from_the_tests_table():
    page = (ROOT / "docs" / "model-support.md").read_text()
    assert page == render_support_matrix(), "regenerate: python -m tests.helpers.families > docs/model-support.md"


def test_every_column_names_tests_that_exist_and_every_family_has_every_check():
    for check, (_, tests) in COLUMNS.items():
        for path in tests.split(", "):
            path = path if path.startswith("tests/") else f"tests/integrations/transformers/{path}"
            assert (ROOT / path).exists(), f"{check}: {path}"
    assert all(set(row) == set(CHECKS) for row in [*SUPPORT.values(), *LINEAR_SUPPORT.values()])
    assert (ROOT / LINEAR_TESTS).exists() and (ROOT / LINEAR_GENERATE).exists()
