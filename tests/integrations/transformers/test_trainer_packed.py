"""HybridSPTrainer on packed batches (documents concatenated, position_ids restarting at 0) equals the
plain Trainer on the same documents one per row: per-step loss and grad_norm (4 steps, accumulation 2)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.trainer_workers import _arguments, _step_logs, collate, ds_config, samples, tiny_llama

RTOL = 1e-3
DOCS_PER_ROW = 2


def packed_rows(docs: list[dict]) -> list[dict]:
    """Every DOCS_PER_ROW consecutive documents as one row; position_ids restart at each document."""
    rows = []
    for first in range(0, len(docs), DOCS_PER_ROW):
        group = docs[first : first + DOCS_PER_ROW]
        rows.append({
            "input_ids": torch.cat([d["input_ids"] for d in group]),
            "labels": torch.cat([d["labels"] for d in group]),
            "position_ids": torch.cat([torch.arange(len(d["input_ids"])) for d in group]),
        })
    return rows


def packed_collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding: ids 0, labels -100, mask 0, positions continuing after the last document."""
    batch = collate([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    longest = batch["input_ids"].shape[1]
    positions = []
    for row in rows:
        tail = torch.arange(1, longest - len(row["position_ids"]) + 1) + row["position_ids"][-1]
        positions.append(torch.cat([row["position_ids"], tail]))
    return {**batch, "position_ids": torch.stack(positions)}  # each [B, S]


def _train(rank, world, packed: bool):
    from transformers import Trainer

    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build
    from hybridsp.integrations.transformers import HybridSPTrainer

    docs = samples(16, seed=1)
    with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
        if packed:
            args = _arguments(out, ds_config(2, 1, 2, False), per_device_train_batch_size=1,
                              train_sampling_strategy="sequential")
            trainer = HybridSPTrainer(model=tiny_llama(), args=args, train_dataset=packed_rows(docs),
                                      data_collator=packed_collate)
        else:
            args = _arguments(out, None, per_device_train_batch_size=DOCS_PER_ROW, train_sampling_strategy="sequential")
            trainer = Trainer(model=tiny_llama(), args=args, train_dataset=docs, data_collator=collate)
        trainer.train()
    return _step_logs(trainer) if rank == 0 else None


@pytest.fixture(scope="module")
def runs():
    plain = run_distributed(_train, 1, False, timeout=300)[0]
    packed = run_distributed(_train, 2, True, timeout=300)[0]
    return plain, packed


def test_packed_batches_train_like_one_document_per_row(runs):
    plain, packed = runs
    assert packed["step"] == plain["step"] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        ours, reference = torch.tensor(packed[key]), torch.tensor(plain[key])
        assert torch.allclose(ours, reference, rtol=RTOL, atol=0), (key, ours.tolist(), reference.tolist())
