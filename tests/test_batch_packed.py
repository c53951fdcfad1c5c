"""shard_batch / prepare_batch on packed rows: positions kept, no target across a document boundary."""

import torch

from hybridsp.data._batch import packed_cu_seqlens, prepare_batch
from hybridsp.losses._cross_entropy import IGNORE_INDEX
from tests.helpers.mesh import mesh_at


def _packed(lengths_per_row, seq):
    ids = torch.arange(1, len(lengths_per_row) * seq + 1).view(len(lengths_per_row), seq)
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row])
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


def test_packed_rows_keep_positions_and_ignore_targets_across_documents():
    batch = _packed([(5, 1, 4), (3, 7)], 10)
    full = prepare_batch(batch, mesh_at(2, 2))  # pads 10 -> 12 tokens
    assert full["input_ids"].shape == (2, 12)
    expected_positions = torch.tensor([[0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert torch.equal(full["position_ids"], expected_positions)
    ids, labels = batch["input_ids"], full["shift_labels"]
    for b, ends in enumerate([(4, 5, 9), (2, 9)]):  # last token of each document (and of the row)
        for t in range(10):
            want = IGNORE_INDEX if t in ends else int(ids[b, t + 1])
            assert int(labels[b, t]) == want, (b, t)
        assert (labels[b, 10:] == IGNORE_INDEX).all()
    cu = packed_cu_seqlens(full["position_ids"])
    assert [c.tolist() for c in cu] == [[0, 5, 6, 12], [0, 3, 12]]


def test_padding_inside_a_packed_row_continues_the_last_document():
    batch = _packed([(4, 6)], 10)
    batch["attention_mask"] = (torch.arange(10) < 8).long()[None]
    batch["position_ids"][0, 8:] = 0  # collators often put 0 at padding: not a new document
    full = prepare_batch(batch, mesh_at(1, 2))  # 10 -> 12
    assert full["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert full["shift_labels"][0, 3] == IGNORE_INDEX and (full["shift_labels"][0, 7:] == IGNORE_INDEX).all()
