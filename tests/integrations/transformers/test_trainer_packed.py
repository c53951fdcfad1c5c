"""HybridSPTrainer on packed batches (documents concatenated, position_ids restarting at 0) equals the
plain Trainer on the same documents one per row: per-step loss and grad_norm (4 steps, accumulation 2),
and ``predict()``'s logits and loss on a ring of two in the zigzag and the balanced layout (which
places tokens by document, so the gather needs the batch's documents)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.workers.trainer import _arguments, collate, ds_config, samples, step_logs, tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

RTOL = 1e-3
DOCS_PER_ROW = 2


def packed_rows(docs: list[dict]) -> list[dict]:
    """Every DOCS_PER_ROW consecutive documents as one row; position_ids restart at each document."""
    rows = []
    for first in range(0, len(docs), DOCS_PER_ROW):
        group = docs[first : first + DOCS_PER_ROW]
        rows.append(
            {
                "input_ids": torch.cat([d["input_ids"] for d in group]),
                "labels": torch.cat([d["labels"] for d in group]),
                "position_ids": torch.cat([torch.arange(len(d["input_ids"])) for d in group]),
            }
        )
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
            args = _arguments(
                out, ds_config(2, 1, 2, False), per_device_train_batch_size=1, train_sampling_strategy="sequential"
            )
            trainer = HybridSPTrainer(
                model=tiny_llama(), args=args, train_dataset=packed_rows(docs), data_collator=packed_collate
            )
        else:
            args = _arguments(out, None, per_device_train_batch_size=DOCS_PER_ROW, train_sampling_strategy="sequential")
            trainer = Trainer(model=tiny_llama(), args=args, train_dataset=docs, data_collator=collate)
        trainer.train()
    return step_logs(trainer) if rank == 0 else None


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


# ---------------------------------------------------------------- predict() on packed rows, ring of two

PREDICT_DOCS = 8


def _predict(rank, world, layout: str | None):
    """predict() of the untrained model: HybridSPTrainer on packed rows at R=2 in ``layout``, or (None)
    the plain Trainer on the documents one per row. Rank 0 returns (logits, metrics)."""
    from transformers import Trainer

    from hybridsp.integrations.transformers import HybridSPTrainer

    docs = samples(PREDICT_DOCS, seed=3)
    with tempfile.TemporaryDirectory() as out:
        if layout is None:
            args = _arguments(out, None, per_device_eval_batch_size=2 * DOCS_PER_ROW)  # the same documents per batch
            trainer = Trainer(model=tiny_llama(), args=args, data_collator=collate)
            result = trainer.predict(docs)
        else:
            args = _arguments(out, None, per_device_eval_batch_size=2)
            trainer = HybridSPTrainer(
                model=tiny_llama(),
                args=args,
                data_collator=packed_collate,
                hybridsp={"ulysses": 1, "ring": 2, "layout": layout},
            )
            result = trainer.predict(packed_rows(docs))
    return (torch.as_tensor(result.predictions).tolist(), result.metrics["test_loss"]) if rank == 0 else None


def _per_document(packed: torch.Tensor, docs: list[dict]) -> list[torch.Tensor]:
    """The logits [len_d, V] of each document, cut from the packed rows' predictions [N_rows, S, V]."""
    pieces = []
    for first in range(0, len(docs), DOCS_PER_ROW):
        start = 0
        for doc in docs[first : first + DOCS_PER_ROW]:
            length = len(doc["input_ids"])
            pieces.append(packed[first // DOCS_PER_ROW, start : start + length])
            start += length
    return pieces


@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
def test_predictions_on_packed_rows_equal_the_plain_trainer(layout):
    """Before (balanced): relative error 1.19, the logits un-permuted without the documents."""
    docs = samples(PREDICT_DOCS, seed=3)
    plain, plain_loss = run_distributed(_predict, 1, None, timeout=300)[0]
    ours, loss = run_distributed(_predict, 2, layout, timeout=300)[0]
    plain, ours = torch.tensor(plain), torch.tensor(ours)
    for index, (got, doc) in enumerate(zip(_per_document(ours, docs), docs)):
        want = plain[index, : len(doc["input_ids"])]
        error = ((got - want).norm() / want.norm()).item()
        assert error < 1e-4, f"{layout} document {index}: relative error {error:.2e}"
    assert abs(loss - plain_loss) <= RTOL * abs(plain_loss), (loss, plain_loss)
