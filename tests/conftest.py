"""Test-session settings: what the distributed test workers inherit from the forkserver."""

import os
from pathlib import Path

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


# --------------------------------------------------------------------------- markers (registered in setup.cfg)

INTEGRATION_FOLDERS = ("integrations", "examples")  # tests/<folder>/...: DeepSpeed, transformers, TRL, the examples


def _spawns(code, namespace, depth=3, seen=None) -> bool:
    """Whether ``code`` calls hybridsp.testing.run_distributed, itself or through the module functions it
    calls (``depth`` calls deep); nested code (lambdas, comprehensions, inner functions) included."""
    from hybridsp.testing import run_distributed

    seen = set() if seen is None else seen
    if code in seen:
        return False
    seen.add(code)
    if {"hybridsp.testing", "run_distributed"} <= set(code.co_names):  # imported inside the function
        return True
    for name in code.co_names:
        target = namespace.get(name)
        if target is run_distributed:
            return True
        inner = getattr(target, "__code__", None)
        if depth and inner is not None and _spawns(inner, getattr(target, "__globals__", {}), depth - 1, seen):
            return True
    nested = (const for const in code.co_consts if hasattr(const, "co_names"))
    return any(_spawns(const, namespace, depth, seen) for const in nested)


def _calls(item):
    """The test function and the fixture functions it requests."""
    yield item.function
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        for definition in definitions:
            yield definition.func


def pytest_collection_modifyitems(config, items):
    """``integration`` for every test under tests/integrations/ and tests/examples/ (elsewhere a module or
    test says so itself); ``distributed`` for every test whose function or fixtures start gloo ranks
    through run_distributed (tests that start launchers in subprocesses say so themselves)."""
    import pytest

    tests = Path(__file__).resolve().parent
    for item in items:
        parts = Path(item.fspath).resolve().relative_to(tests).parts
        if parts[0] in INTEGRATION_FOLDERS:
            item.add_marker(pytest.mark.integration)
        functions = [getattr(f, "__wrapped__", f) for f in _calls(item)]
        if any(_spawns(f.__code__, f.__globals__) for f in functions if hasattr(f, "__code__")):
            item.add_marker(pytest.mark.distributed)
