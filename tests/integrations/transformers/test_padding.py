"""A switched HF model called with a 2-D padding ``attention_mask``, against the
unmodified model with the same mask (unpacked rows) or run on each document alone (packed rows),
compared on real tokens; holes inside a sequence are refused on every rank."""

from __future__ import annotations

import pytest
import torch

from hybridsp import gather_sequence, init_mesh, shard_sequence
from hybridsp.integrations import transformers as hf
from hybridsp.integrations.transformers._padding import flattened_boundaries, padded_documents
from hybridsp.testing import run_distributed
from tests.helpers.models.switched import build
from tests.helpers.references.attention import rel_err

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4
SEQ = 16
LEFT = torch.tensor([[0] * 5 + [1] * 11, [1] * 16, [0] * 1 + [1] * 15])  # left padding (HF's generate default)
RIGHT_PACKED = ((7, 6), 3)  # two documents then 3 pads (row 0); row 1 is one document of 16
MODELS = {"llama": {}, "mistral window 4": {"sliding_window": 4}, "qwen2": {}}


def test_boundaries_of_left_right_and_packed_rows():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    positions = torch.tensor([[0, 0, 0, 1, 0, 1], [0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    rows = padded_documents(mask, positions)
    assert [r.tolist() for r in rows] == [[0, 1, 2, 4, 6], [0, 2, 4, 6], [0, 6]]  # pads: own segments
    assert flattened_boundaries(rows, 6).tolist() == [0, 1, 2, 4, 6, 8, 10, 12, 18]
    assert padded_documents(torch.ones(2, 6, dtype=torch.bool)) is None
    assert padded_documents(mask.bool(), None)[0].tolist() == [0, 2, 6]


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.tensor([[1, 1, 0, 0, 1, 1]]), r"row 0 has 2 padding token\(s\) at indices 2\.\.3 between real tokens"),
        (torch.tensor([[1, 2, 1, 1, 1, 1]]), r"only 0 \(padding\) and 1"),
    ],
)
def test_holes_and_non_binary_masks_are_refused(mask, message):
    with pytest.raises(ValueError, match=message):
        padded_documents(mask, torch.arange(6)[None])


def test_a_hole_between_packed_documents_is_accepted():
    mask, positions = torch.tensor([[1, 1, 0, 0, 1, 1]]), torch.tensor([[0, 1, 2, 3, 0, 1]])
    assert padded_documents(mask, positions)[0].tolist() == [0, 2, 4, 6]


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(1, 128, (3, SEQ), generator=torch.Generator().manual_seed(seed))


def _switched_logits(model, mesh, ids, mask, positions):
    """Gathered logits [B, S, V] of the switched model; positions None only on a 1 x 1 mesh."""
    with hf.apply(model, mesh, backend="torch"):
        local = {"input_ids": shard_sequence(ids, mesh), "attention_mask": shard_sequence(mask, mesh)}
        if positions is not None:
            local["position_ids"] = shard_sequence(positions.expand_as(ids).contiguous(), mesh)
        logits = model(**local, use_cache=False).logits
    return gather_sequence(logits.detach(), mesh)


def _packed_right_padded():
    """ids, mask and positions of a packed right-padded row 0 and a one-document row 1; per-row documents."""
    (docs, pads) = RIGHT_PACKED
    positions = torch.stack(
        [torch.cat([torch.arange(n) for n in docs] + [torch.arange(pads) + docs[-1]]), torch.arange(SEQ)]
    )  # [2, S]
    mask = torch.stack([torch.arange(SEQ) < sum(docs), torch.ones(SEQ, dtype=torch.bool)]).long()  # [2, S]
    return _ids(3)[:2], mask, positions, [docs, (SEQ,)]


def _per_document(model, ids, rows):
    """Logits of the unmodified model run on each document alone (zeros elsewhere)."""
    out = torch.zeros(*ids.shape, model.config.vocab_size)
    for b, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            out[b, start : start + n] = model(input_ids=ids[b : b + 1, start : start + n], use_cache=False).logits[0]
            start += n
    return out


def _padding_worker(rank, world, ulysses, ring):
    mesh = init_mesh(ulysses, ring)
    errors = {}
    with torch.no_grad():
        for name, overrides in MODELS.items():
            model = build(name.split()[0], seed=1, **overrides)
            ids, real = _ids(2), LEFT.bool()
            default = torch.arange(SEQ)[None]  # HF's default positions; not passed on a 1 x 1 mesh
            reference = model(input_ids=ids, attention_mask=LEFT, use_cache=False).logits
            ours = _switched_logits(model, mesh, ids, LEFT, None if mesh.context == 1 else default)
            errors[f"{name} left"] = rel_err(ours[real], reference[real])
        model = build("llama", seed=1)
        ids, mask, positions, rows = _packed_right_padded()
        reference = _per_document(model, ids, rows)
        ours = _switched_logits(model, mesh, ids, mask, positions)
        errors["llama packed + right"] = rel_err(ours[mask.bool()], reference[mask.bool()])
        hole = LEFT.clone()
        hole[1, 6:9] = 0  # real tokens resume at index 9 inside one sequence
        try:
            _switched_logits(model, mesh, _ids(2), hole, default)
            errors["hole message"] = None
        except ValueError as error:
            errors["hole message"] = str(error)
    return errors


def _two_meshes(rank, world):
    """One launch, two meshes: a ring of two, and 1 x 1 (DP = 2: each rank is its own context group)."""
    return {"1x2": _padding_worker(rank, world, 1, 2), "1x1": _padding_worker(rank, world, 1, 1)}


@pytest.mark.distributed
def test_padding_masks_match_the_unmodified_model_on_real_tokens():
    for per_mesh in run_distributed(_two_meshes, 2):
        for mesh, errors in per_mesh.items():
            message = errors.pop("hole message")
            assert message and "row 1 has 3 padding token(s) at indices 6..8 between real tokens" in message, mesh
            assert max(errors.values()) < TOLERANCE, (mesh, errors)


@pytest.mark.distributed
@pytest.mark.slow
def test_padding_masks_on_a_hybrid_mesh():
    for errors in run_distributed(_padding_worker, 4, 2, 2):
        errors.pop("hole message")
        assert max(errors.values()) < TOLERANCE, errors
