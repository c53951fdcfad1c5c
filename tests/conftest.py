"""Test-session settings: what the distributed test workers inherit from the forkserver, and the fast tier."""

import os

from hybridsp.testing import PRELOAD_ENV

# Importing transformers' model code and DeepSpeed costs several CPU seconds per process;
# the forkserver imports them once and every gloo worker of every test inherits them.
os.environ.setdefault(
    PRELOAD_ENV,
    ",".join([
        "transformers.models.llama.modeling_llama",
        "transformers.models.qwen2.modeling_qwen2",
        "transformers.models.qwen3.modeling_qwen3",
        "transformers.models.mistral.modeling_mistral",
        "deepspeed",
    ]),
)


# --------------------------------------------------------------------------- tiers (tests/README.md)

# Test modules write their own markers (setup.cfg registers them; tests/test_markers.py fails on a missing one).
# Here only ``fast`` is given: to every test marked neither slow, distributed nor integration.
SLOWER = ("slow", "distributed", "integration")

# Stopgap: tests/benchmarks/test_alst_parity.py is edited with the benchmarks and does not declare its markers yet
# (tests/test_markers.py::test_benchmark_parity_tests_are_marked_too is the strict xfail that says when it does).
BENCHMARKS = ("tests.benchmarks.", ("distributed", "integration"))  # (module prefix, markers)


def pytest_collection_modifyitems(config, items):
    import pytest

    prefix, marks = BENCHMARKS
    for item in items:
        if getattr(item, "module", None) is not None and item.module.__name__.startswith(prefix):
            for mark in marks:
                item.add_marker(getattr(pytest.mark, mark))
        if not any(item.get_closest_marker(name) for name in SLOWER):
            item.add_marker(pytest.mark.fast)
