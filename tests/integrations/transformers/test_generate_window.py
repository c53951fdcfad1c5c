"""generate() on sliding-window models: the window holds at prefill (hybrid attention) and at every
decode step (the sharded cache), against the unmodified model's own generate."""

import pytest
import torch

from hybridsp import init_mesh
from hybridsp.integrations import transformers as hf
from tests.helpers.models.generation import COMMON, FAMILIES, launch, portable, prompt, reference_generate
from tests.helpers.models.tiny import tiny_causal_lm

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

WINDOW, PROMPT, NEW = 12, 64, 8


def _windowed(family: str):
    """Mistral with a window on every layer; Qwen2 with one sliding and one full layer (max_window_layers=1)."""
    overrides = FAMILIES[family][2]
    window = {
        "mistral": dict(sliding_window=WINDOW),
        "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    }[family]
    return tiny_causal_lm(family, seed=0, dtype=None, **{**COMMON, **overrides, **window}).eval()


def _generate_windowed(rank, world, family):
    mesh = init_mesh(2, 2)
    model = _windowed(family)
    ids = prompt(2, PROMPT)
    expected, expected_logits = reference_generate(model, ids, max_new_tokens=NEW)
    handle = hf.apply(model, mesh)
    out = hf.generate(model, ids, mesh=mesh, max_new_tokens=NEW, eos_token_id=[], output_logits=True)
    handle.undo()
    ids_out, logits = out if isinstance(out, tuple) else (out, None)
    return portable(
        {
            "equal": torch.equal(ids_out, expected),
            "logit_err": None if logits is None else (logits.float() - expected_logits.float()).abs().max().item(),
        }
    )


def test_sliding_window_models_generate_like_the_unmodified_model():
    for family in ("mistral", "qwen2"):
        for result in launch(_generate_windowed, 4, family):
            assert result["equal"], (family, result)
            assert result["logit_err"] is None or result["logit_err"] < 1e-4, (family, result)
