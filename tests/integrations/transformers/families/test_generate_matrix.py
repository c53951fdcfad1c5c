"""Greedy generation of every family the table marks for it (tests/helpers/families.py), switched at U2xR2 over 4
gloo ranks with its sharded K/V cache: the ids equal the unmodified model's own ``generate`` on every rank."""

import pytest
import torch

from hybridsp import init_mesh
from hybridsp.integrations import transformers as hf
from tests.helpers.families import REFUSED, SUPPORT, build_family, families_where
from tests.helpers.models.generation import launch, portable

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

PROMPT, NEW = 64, 6


def prompt_ids() -> torch.Tensor:
    return torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(0))  # [B, S]


def _rank(rank, world, names, refused):
    mesh = init_mesh(ulysses=2, ring=2)
    results = {}
    for name in names + refused:
        model = build_family(name).eval()
        with hf.apply(model, mesh):
            try:
                results[name] = hf.generate(model, prompt_ids(), mesh=mesh, max_new_tokens=NEW)
            except ValueError as error:
                results[name] = str(error)
    return portable(results)


def test_greedy_ids_equal_model_generate_for_every_family():
    names, refused = families_where("generate"), families_where("generate", REFUSED)
    assert names, "the table marks no family for generate: nothing to compare"
    results = launch(_rank, 4, names, refused)
    assert all(sorted(result) == sorted(names + refused) for result in results), [sorted(r) for r in results]
    for name in refused:
        reason = SUPPORT[name]["generate"][len(REFUSED) :]
        assert all(reason in str(result[name]) for result in results), (name, results[0][name])
    for name in names:
        expected = build_family(name).eval().generate(prompt_ids(), do_sample=False, max_new_tokens=NEW)
        for rank, result in enumerate(results):
            assert torch.equal(result[name], expected), (
                f"{name} rank {rank}: {result[name][:, PROMPT:]} vs {expected[:, PROMPT:]}"
            )
