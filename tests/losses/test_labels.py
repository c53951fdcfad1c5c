"""Labels: int32 labels give the int64 loss; a label outside the vocabulary on one rank (the sharded and
fused losses, the Trainer) or on one replica is an error on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybridsp
from hybridsp import init_mesh
from hybridsp.testing import run_distributed

pytestmark = pytest.mark.distributed

# --------------------------------------------------------------------------- labels


def _int32_labels(rank, world):
    mesh = init_mesh(1, world)
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 12, 4, generator=gen), torch.randn(9, 4, generator=gen)
    labels = torch.randint(0, 9, (2, 12), generator=gen)
    labels[0, :3] = -100
    full_loss = F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten(), ignore_index=-100)
    local = slice(rank * 6, (rank + 1) * 6)  # contiguous halves: what the loss sees does not depend on layout
    h, lab = hidden[:, local], labels[:, local].to(torch.int32)
    return (
        float(hybridsp.sharded_cross_entropy(h @ weight.T, lab, mesh)),
        float(hybridsp.fused_cross_entropy(h, weight, lab, mesh)),
        float(full_loss),
    )


def _labels_worker(rank, world):
    return {"int32": _int32_labels(rank, world), "trainer": _trainer_with_a_bad_label(rank, world)}


@pytest.fixture(scope="module")
def labels():
    return run_distributed(_labels_worker, 2, timeout=240)


@pytest.mark.integration  # its fixture also runs a HybridSPTrainer
def test_int32_labels_give_the_int64_loss(labels):
    for result in labels:
        sharded, fused, expected = result["int32"]
        assert abs(sharded - expected) < 1e-5 * abs(expected) and abs(fused - expected) < 1e-5 * abs(expected)


def _trainer_with_a_bad_label(rank, world):
    """A U2 HybridSPTrainer (no DeepSpeed); the batch's one bad label lands on context rank 1 only."""
    import tempfile

    from hybridsp.integrations.transformers import HybridSPTrainer
    from tests.helpers.workers.trainer import VOCAB, _arguments, tiny_llama

    ids = torch.randint(1, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 8] = VOCAB + 5  # zigzag over 2 ranks: token 8 lives on rank 1
    inputs = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    messages = {}
    with tempfile.TemporaryDirectory() as out:
        trainer = HybridSPTrainer(model=tiny_llama(), args=_arguments(out, None), hybridsp={"ulysses": 2})
        for name, count in (("compute_loss", torch.tensor(15.0)), ("count", None)):
            try:
                trainer.compute_loss(trainer.model, inputs, num_items_in_batch=count)
                messages[name] = None
            except ValueError as error:
                messages[name] = str(error)
    return messages


@pytest.mark.integration  # its fixture also runs a HybridSPTrainer
def test_trainer_bad_label_on_one_rank_is_an_error_on_every_rank(labels):
    for result in labels:
        for name, message in result["trainer"].items():
            assert message and "outside the vocabulary [0, 64)" in message, (name, message)


def _bad_label_on_one_rank(rank, world, fused):
    mesh = init_mesh(1, world)
    hidden, weight = torch.randn(1, 8, 4, requires_grad=True), torch.randn(11, 4, requires_grad=True)
    labels = torch.randint(0, 11, (1, 8))
    if rank == world - 1:
        labels[0, 3] = 11  # outside [0, V)
    try:
        if fused:
            hybridsp.fused_cross_entropy(hidden, weight, labels, mesh)
        else:
            hybridsp.sharded_cross_entropy(hidden @ weight.T, labels, mesh)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("fused", [False, True])
def test_out_of_range_label_on_one_rank_raises_on_every_rank(fused):
    messages = run_distributed(_bad_label_on_one_rank, 2, fused)
    assert all(m and "outside the vocabulary [0, 11)" in m for m in messages), messages


def _replica_with_a_bad_label(rank, world):
    """DP 2 x U 2: only replica 1's batch has a bad label; the step's count (one all-reduce over the
    replicas) makes every rank of both replicas raise before the forward."""
    import tempfile

    from hybridsp.integrations.transformers import HybridSPTrainer
    from tests.helpers.workers.trainer import VOCAB, _arguments, tiny_llama

    with tempfile.TemporaryDirectory() as out:
        trainer = HybridSPTrainer(model=tiny_llama(), args=_arguments(out, None), hybridsp={"ulysses": 2})
        ids = torch.randint(1, VOCAB, (1, 16), generator=torch.Generator().manual_seed(trainer.hybrid_mesh.dp_rank))
        labels = ids.clone()
        if trainer.hybrid_mesh.dp_rank == 1:
            labels[0, 3] = -7
        try:
            trainer.compute_loss(trainer.model, {"input_ids": ids, "labels": labels})
        except ValueError as error:
            return str(error)
    return None


@pytest.mark.integration  # a HybridSPTrainer
@pytest.mark.slow
def test_trainer_bad_label_on_one_replica_is_an_error_on_every_replica():
    for message in run_distributed(_replica_with_a_bad_label, 4, timeout=300):
        assert message and "1 target id(s) in shift_labels lie outside the vocabulary [0, 64)" in message, message
