"""generate() with left-padded prompts and an attention_mask: greedy ids equal the
unmodified model's ``model.generate(ids, attention_mask=mask)``, every step's logits within 1e-4, on
a ring of two ranks and on one process; a sliding window (Mistral) counts indices as transformers does.
Right padding is refused before any collective."""

from __future__ import annotations

import pytest
import torch

from hybridsp import init_mesh
from hybridsp.integrations import transformers as hf
from tests.helpers.models.generation import build, launch, portable, reference_generate

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

TOLERANCE = 1e-4
PROMPT, NEW = 19, 6  # 19: the layout pads the prompt on the right too
PADS = (7, 0, 2)  # left padding per row
CASES = {"llama": {}, "mistral window 5": {"sliding_window": 5}}


def left_padded(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 128, (len(PADS), PROMPT), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(PROMPT)[None] >= torch.tensor(PADS)[:, None]).long()  # [B, S]
    return ids.masked_fill(mask == 0, 0), mask


def _model(name: str):
    model = build(name.split()[0])
    for key, value in CASES[name].items():
        setattr(model.config, key, value)
    return model


def _rank(rank, world):
    """Both meshes in one launch (1 x 1 is DP = 2 here) and the refusals."""
    ids, mask = left_padded()
    results = {}
    for ulysses, ring in ((1, 2), (1, 1)):
        mesh = init_mesh(ulysses=ulysses, ring=ring)
        for name in CASES:
            model = _model(name)
            with hf.apply(model, mesh):
                results[ulysses, ring, name] = hf.generate(
                    model, ids, mesh=mesh, max_new_tokens=NEW, attention_mask=mask, output_logits=True, eos_token_id=[]
                )
    results["refusals"] = _refusals(mesh)
    return portable(results)


def _refusals(mesh) -> list:
    model = build("llama")
    ids, mask = left_padded()
    messages = []
    with hf.apply(model, mesh):
        for bad in (mask.flip(1), torch.zeros_like(mask), mask[:, 1:]):
            try:
                hf.generate(model, ids, mesh=mesh, max_new_tokens=2, attention_mask=bad)
                messages.append(None)
            except ValueError as error:
                messages.append(str(error))
    return messages


@pytest.fixture(scope="module")
def results():
    return launch(_rank, 2)


@pytest.mark.parametrize("ulysses, ring", [(1, 2), (1, 1)])
def test_left_padded_greedy_ids_equal_model_generate(results, ulysses, ring):
    ids, mask = left_padded()
    for name in CASES:
        ref_ids, ref_logits = reference_generate(
            _model(name), ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0
        )
        for rank, result in enumerate(results):
            got_ids, got_logits = result[ulysses, ring, name]
            error = (got_logits - ref_logits).abs().max().item()
            top2 = ref_logits.topk(2, dim=-1).values
            margin = (top2[..., 0] - top2[..., 1]).min().item()
            assert error < TOLERANCE, f"{name} rank {rank}: logits differ by {error:.1e}"
            assert margin > 2 * error, f"{name}: near-tie {margin:.1e} vs error {error:.1e}"
            assert torch.equal(got_ids, ref_ids), f"{name} rank {rank}: {got_ids[:, PROMPT:]} vs {ref_ids[:, PROMPT:]}"


def test_right_padding_empty_rows_and_wrong_shapes_are_refused(results):
    for result in results:
        messages = result["refusals"]
        assert "row 0 has padding at index 12 after a real token" in messages[0], messages[0]
        assert "row 0 has no real token" in messages[1], messages[1]
        assert "must be a [B, S] tensor like input_ids (3, 19)" in messages[2], messages[2]
