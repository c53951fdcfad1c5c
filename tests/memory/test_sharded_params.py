"""memory/_sharded_params: a parameter reaches its engine's adapter by the marker the engine puts on it; plain
parameters pass through untouched, and one block never mixes two engines."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch

from hybridsp.memory import _sharded_params as sharded


def _adapter(name: str, calls: list) -> types.ModuleType:
    module = types.ModuleType(name)
    module.gathered = lambda params: calls.append(("gathered", len(params))) or contextlib.nullcontext("full")
    module.land_full_gradient = lambda output, index, param: calls.append(("land", index))
    return module


@pytest.fixture
def engines(monkeypatch):
    calls: dict[str, list] = {"one": [], "two": []}
    for name in calls:
        monkeypatch.setitem(sys.modules, f"fake_engine_{name}", _adapter(f"fake_engine_{name}", calls[name]))
    table = (("one_marker", "fake_engine_one"), ("two_marker", "fake_engine_two"))
    monkeypatch.setattr(sharded, "ENGINE_ADAPTERS", table)
    return calls


def _param(marker: str | None = None) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(2))
    if marker:
        setattr(param, marker, 1)
    return param


def test_plain_parameters_need_no_engine(engines):
    with sharded.gathered([_param(), _param()]) as value:
        assert value is None
    sharded.land_full_gradient(torch.zeros(1), 0, _param())
    assert engines == {"one": [], "two": []}


def test_marked_parameters_go_to_their_engine(engines):
    with sharded.gathered([_param(), _param("one_marker"), _param("one_marker")]) as value:
        assert value == "full"
    sharded.land_full_gradient(torch.zeros(1), 3, _param("two_marker"))
    assert engines == {"one": [("gathered", 3)], "two": [("land", 3)]}


def test_one_block_of_two_engines_is_refused(engines):
    with pytest.raises(ValueError, match="parameters of 2 different engines"):
        sharded.gathered([_param("one_marker"), _param("two_marker")])


def test_the_deepspeed_adapter_is_named_and_provides_both_calls():
    import importlib

    ((marker, module),) = sharded.ENGINE_ADAPTERS
    adapter = importlib.import_module(module)
    assert marker == "ds_id" and callable(adapter.gathered) and callable(adapter.land_full_gradient)
