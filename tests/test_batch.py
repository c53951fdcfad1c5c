"""shard_batch, padded_length, replica_sampler and ShardedDataLoader."""

import itertools
import re

import pytest
import torch
from torch.utils.data import DataLoader

from hybridsp import ShardedDataLoader, init_mesh, shard_batch
from hybridsp.data._batch import prepare_batch, replica_sampler
from hybridsp.layout._layouts import join_shards
from hybridsp.mesh._hybrid_mesh import padded_length
from hybridsp.testing import run_distributed
from tests.helpers.mesh import mesh_at

LENGTHS = (61, 40)  # row 0 fills the sequence, row 1 is right-padded
PAD = 7


def padded_batch(seq=61, lengths=LENGTHS, seed=0):
    """input_ids [B, S] (PAD after each row's length), labels = input_ids, attention_mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 100, (len(lengths), seq), generator=gen)
    mask = (torch.arange(seq) < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}


MESHES = [
    (2, 2, "zigzag"),
    (4, 2, "zigzag"),
    (2, 4, "zigzag"),
    (1, 1, "zigzag"),
    (2, 2, "contiguous"),
    (3, 1, "contiguous"),
]


@pytest.mark.parametrize("ulysses,ring,layout", MESHES)
def test_shards_join_back_to_the_shifted_padded_batch(ulysses, ring, layout):
    batch = padded_batch()
    full = prepare_batch(batch, mesh_at(ulysses, ring, layout=layout), pad_token_id=PAD)
    shards = [
        shard_batch(batch, mesh_at(ulysses, ring, r, u, layout), pad_token_id=PAD)
        for r, u in itertools.product(range(ring), range(ulysses))
    ]  # shard order r * U + u
    for key, value in full.items():
        assert torch.equal(join_shards([s[key] for s in shards], ring, ulysses, layout), value), key
    length = full["input_ids"].shape[1]
    assert length % (ulysses * ring) == 0 and length - 61 < 2 * ulysses * ring
    assert torch.equal(full["position_ids"], torch.arange(length).expand(2, -1))
    assert (full["input_ids"][:, 61:] == PAD).all()
    for row, real in enumerate(LENGTHS):  # the target of token i is token i + 1, only between real tokens
        expected = torch.full((length,), -100)
        expected[: real - 1] = batch["input_ids"][row, 1:real]
        assert torch.equal(full["shift_labels"][row], expected)


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (4, 2), (2, 4)])
def test_no_target_is_lost_at_a_shard_boundary(ulysses, ring):
    batch = padded_batch(seq=64, lengths=(64, 64))
    targets = 0
    for r, u in itertools.product(range(ring), range(ulysses)):
        local = shard_batch(batch, mesh_at(ulysses, ring, r, u))
        positions, labels = local["position_ids"], local["shift_labels"]
        valid = positions < 63  # every token but the last has a target: the next global token
        assert torch.equal(labels[valid], batch["input_ids"].gather(1, positions + 1 * valid)[valid])
        assert (labels[~valid] == -100).all()
        targets += int(valid.sum())
    assert targets == 2 * 63


def test_padding_is_ignored_even_when_labels_are_not_masked():
    batch = padded_batch()
    full = prepare_batch(batch, mesh_at(2, 2))
    assert int((full["shift_labels"] != -100).sum()) == (61 - 1) + (40 - 1)


def test_given_position_ids_keep_their_offset_and_pads_continue_the_count():
    batch = padded_batch(seq=14, lengths=(14, 9))
    batch["position_ids"] = (torch.arange(14) + 100)[None]  # [1, S], broadcast over the batch
    full = prepare_batch(batch, mesh_at(2, 2))  # padded to 16
    assert torch.equal(full["position_ids"], (torch.arange(16) + 100).expand(2, -1))
    odd = padded_batch(seq=14, lengths=(14, 9))
    pads_at_zero = torch.cat([torch.arange(9), torch.zeros(5, dtype=torch.long)])  # as some collators write them
    odd["position_ids"] = torch.stack([torch.arange(14), pads_at_zero])
    assert torch.equal(prepare_batch(odd, mesh_at(2, 2))["position_ids"], torch.arange(16).expand(2, -1))


def test_padded_length_is_the_layouts_multiple():
    assert padded_length(61, mesh_at(4, 2)) == 64  # zigzag U4 R2: multiple of 8
    assert padded_length(65, mesh_at(2, 4)) == 72  # zigzag U2 R4: multiple of 8
    assert padded_length(5, mesh_at(1, 1)) == 6  # zigzag R1: two chunks
    assert padded_length(7, mesh_at(3, 1, layout="contiguous")) == 9
    assert padded_length(64, mesh_at(2, 2)) == 64


def test_bad_batches_raise_value_errors_that_say_what_to_change():
    left = padded_batch()
    left["attention_mask"] = left["attention_mask"].flip(1)
    hole = padded_batch()
    hole["attention_mask"][0, 5] = 0
    packed = padded_batch(lengths=(61, 61))
    packed["position_ids"] = torch.cat([torch.arange(30), torch.arange(31) + 5])[None]  # not a restart at 0
    cases = {
        "real token at index 21 after padding": left,
        "row 0 has a real token at index 6": hole,
        "only 0 and 1": {**padded_batch(), "attention_mask": padded_batch()["attention_mask"] * 2},
        "jumps from 29 to 5 at token 30": packed,
        "labels (2, 60) must have the shape of input_ids (2, 61)": {**padded_batch(), "labels": torch.zeros(2, 60)},
        "does not know how to shard ['pixel_values']": {**padded_batch(), "pixel_values": torch.zeros(2, 3)},
        "needs a 'labels' tensor": {"input_ids": torch.zeros(2, 8, dtype=torch.long)},
        "input_ids must be [B, S]": {"input_ids": torch.zeros(8, dtype=torch.long), "labels": torch.zeros(8)},
        "position_ids (3, 61) must be": {**padded_batch(), "position_ids": torch.arange(61).expand(3, -1)},
    }
    for message, batch in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            shard_batch(batch, mesh_at(2, 2))


def test_replica_sampler_gives_every_context_rank_of_a_replica_the_same_samples():
    dataset = list(range(20))
    drawn = {}
    for dp_rank, r, u in itertools.product(range(2), range(2), range(2)):
        mesh = mesh_at(2, 2, r, u, dp=2, dp_rank=dp_rank)
        drawn[dp_rank, r, u] = list(replica_sampler(dataset, mesh, shuffle=True, seed=3))
    for dp_rank in range(2):
        assert len({tuple(v) for k, v in drawn.items() if k[0] == dp_rank}) == 1
    assert sorted(drawn[0, 0, 0] + drawn[1, 0, 0]) == dataset


def _loader(seed):
    rows = padded_batch(seq=30, lengths=(30, 30, 22, 30), seed=seed)
    samples = [{k: v[i] for k, v in rows.items()} for i in range(4)]
    return DataLoader(samples, batch_size=2)


def _loader_ranks(rank, world):
    mesh = init_mesh(ulysses=2, ring=2)
    loader = ShardedDataLoader(_loader(seed=5), mesh, pad_token_id=PAD, check_same_batch=True)
    assert len(loader) == 2
    shards = list(loader)
    expected = [shard_batch(batch, mesh, pad_token_id=PAD) for batch in _loader(seed=5)]
    assert len(shards) == 2 and shards[0]["input_ids"].shape == (2, 8)  # 30 tokens padded to 32
    for got, want in zip(shards, expected):
        assert got.keys() == want.keys() and all(
            torch.equal(got[k], want[k]) if torch.is_tensor(got[k]) else got[k].key() == want[k].key() for k in got
        )
    differing = ShardedDataLoader(_loader(seed=5 + (rank == 3)), mesh, check_same_batch=True)
    with pytest.raises(ValueError, match="loaded different batches"):
        next(iter(differing))


@pytest.mark.distributed
def test_sharded_data_loader_shards_and_detects_differing_batches():
    run_distributed(_loader_ranks, 4, timeout=300)  # catches a hang


# --------------------------------------------------------------------------- the same batch on every context rank


def test_fingerprint_sees_a_swap_of_two_tokens_1009_apart():
    from hybridsp.data._batch import batch_fingerprint

    ids = torch.randint(0, 50000, (1, 4096), generator=torch.Generator().manual_seed(0))
    swapped = ids.clone()
    swapped[0, 10], swapped[0, 1019] = ids[0, 1019], ids[0, 10]
    assert not torch.equal(ids, swapped)
    assert not torch.equal(batch_fingerprint(ids), batch_fingerprint(swapped))
    assert torch.equal(batch_fingerprint(ids), batch_fingerprint(ids.clone()))


def _swapped_batches(rank, world):
    from hybridsp.data._batch import check_same_across_context

    mesh = init_mesh(1, world)
    ids = torch.randint(0, 50000, (2, 2048), generator=torch.Generator().manual_seed(1))
    if rank == 1:
        ids[1, 5], ids[1, 1014] = ids[1, 1014].item(), ids[1, 5].item()
    try:
        check_same_across_context(ids, mesh)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.distributed
def test_context_ranks_with_swapped_tokens_all_raise():
    messages = run_distributed(_swapped_batches, 2)
    assert all(m and "loaded different batches" in m for m in messages)
