"""Test-session settings: what the distributed test workers inherit from the forkserver, and the fast tier."""

import os

from hybridsp.testing import PRELOAD_ENV

# Importing transformers' model code and DeepSpeed costs several CPU seconds per process;
# the forkserver imports them once and every gloo worker of every test inherits them.
os.environ.setdefault(
    PRELOAD_ENV,
    ",".join(
        [
            "transformers.models.llama.modeling_llama",
            "transformers.models.qwen2.modeling_qwen2",
            "transformers.models.qwen3.modeling_qwen3",
            "transformers.models.mistral.modeling_mistral",
            "deepspeed",
        ]
    ),
)


# --------------------------------------------------------------------------- tiers (tests/README.md)

# Test modules write their own markers (pyproject.toml registers them; tests/test_markers.py fails on a missing one).
# Here only ``fast`` is given: to every test marked neither slow, distributed nor integration.
SLOWER = ("slow", "distributed", "integration")


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if not any(item.get_closest_marker(name) for name in SLOWER):
            item.add_marker(pytest.mark.fast)
