"""``apply(model, mesh, adapters=...)``: the first adapter whose ``matches`` is true switches the model;
a model none matches goes through every adapter's ``check``, then the generic switch."""

from __future__ import annotations

import pytest

from hybridsp.integrations import transformers as hf
from tests.helpers.mesh import mesh_at
from tests.helpers.models.tiny import tiny_causal_lm

pytestmark = pytest.mark.integration

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
}


class _Recording:
    """An adapter that records what apply asked it and switches nothing itself."""

    name = "recording"

    def __init__(self, matches: bool, refuse: bool = False):
        self._matches, self._refuse, self.calls = matches, refuse, []

    def matches(self, model):
        self.calls.append("matches")
        return self._matches

    def check(self, model):
        self.calls.append("check")
        if self._refuse:
            raise ValueError("recording refuses this model")

    def apply(self, model, mesh, backend):
        self.calls.append(("apply", backend))
        return "handled"


def test_a_matching_adapter_switches_the_model_instead_of_the_generic_path():
    model, mesh = tiny_causal_lm("llama", **TINY), mesh_at(1, 1)
    adapter = _Recording(matches=True)
    assert hf.apply(model, mesh, backend="reference", adapters=(adapter,)) == "handled"
    assert adapter.calls == ["matches", ("apply", "reference")]
    assert model.config._attn_implementation != hf.NAME  # the generic switch did not run


def test_without_a_match_every_adapter_checks_then_the_generic_switch_runs():
    model, mesh = tiny_causal_lm("llama", **TINY), mesh_at(1, 1)
    first, second = _Recording(matches=False), _Recording(matches=False)
    handle = hf.apply(model, mesh, adapters=(first, second))
    assert first.calls == ["matches", "check"] and second.calls == ["matches", "check"]
    assert model.config._attn_implementation == hf.NAME
    handle.undo()
    assert model.config._attn_implementation != hf.NAME


def test_an_adapter_that_refuses_stops_apply_before_any_change():
    model, mesh = tiny_causal_lm("llama", **TINY), mesh_at(1, 1)
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="recording refuses"):
        hf.apply(model, mesh, adapters=(_Recording(matches=False, refuse=True),))
    assert model.config._attn_implementation == before


def test_the_default_adapters_hold_the_vision_language_models():
    (adapter,) = hf.default_adapters()
    assert adapter.name.startswith("vision-language")
