"""sharded_cross_entropy against the unsharded cross-entropy, on gloo ranks and on one process."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridsp import gather_sequence, init_mesh, shard_sequence, sharded_cross_entropy
from hybridsp.testing import run_distributed
from tests.helpers.mesh import mesh_at
from tests.helpers.references.attention import rel_err

BATCH, SEQ, HIDDEN, VOCAB = 2, 32, 16, 24
TOLERANCE = 1e-5


def _problem(seed, ignored):
    """hidden [B, S, E], a shared weight [E, V] and labels [B, S] with ``ignored`` set to -100."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    weight = torch.randn(HIDDEN, VOCAB, generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return hidden, weight, labels.masked_fill(ignored, -100)


def _reference(hidden, weight, labels):
    """(loss, d weight, d hidden) of the unsharded mean cross-entropy."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = F.cross_entropy((hidden @ weight).flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), weight.grad, hidden.grad


def _sharded(mesh, hidden, weight, labels):
    """(loss, d weight summed over the context group, gathered d hidden, local valid count)."""
    local = shard_sequence(hidden, mesh).clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    shift_labels = shard_sequence(labels, mesh)
    loss = sharded_cross_entropy(local @ weight, shift_labels, mesh)
    loss.backward()
    dist.all_reduce(weight.grad, group=mesh.context_group)
    return loss.detach(), weight.grad, gather_sequence(local.grad, mesh), int((shift_labels != -100).sum())


def _cases():
    """name -> ignored mask [B, S]; the zigzag shard (r=0, u=1) of a 2 x 2 mesh holds tokens 24..31."""
    tail = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    tail[:, 20:] = True  # right padding that empties the last chunk
    some = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(1)) < 0.3
    return {
        "none": torch.zeros(BATCH, SEQ, dtype=torch.bool),
        "random": some,
        "tail": tail,
        "all": torch.ones(BATCH, SEQ, dtype=torch.bool),
    }


def _check(rank, world, meshes):
    failures, empty_shards = [], 0
    for ulysses, ring in meshes:
        mesh = init_mesh(ulysses=ulysses, ring=ring)
        for name, ignored in _cases().items():
            problem = _problem(seed=10 + mesh.dp_rank, ignored=ignored)  # each replica its own batch
            expected = _reference(*problem)
            loss, dweight, dhidden, count = _sharded(mesh, *problem)
            empty_shards += count == 0 and name != "all"
            if not all(torch.isfinite(t).all() for t in (loss, dweight, dhidden)):
                failures.append(f"U={ulysses} R={ring} {name}: not finite")
                continue
            if name == "all":  # the reference is 0/0 = NaN; ours must be exactly 0
                errors = [loss.abs().item(), dweight.abs().max().item(), dhidden.abs().max().item()]
            else:
                errors = [rel_err(a, e) for a, e in zip((loss, dweight, dhidden), expected)]
            if max(errors) > TOLERANCE:
                failures.append(f"U={ulysses} R={ring} {name}: {errors}")
    assert not failures, "\n".join(failures)
    return empty_shards


@pytest.mark.distributed
def test_sharded_loss_and_gradients_equal_the_unsharded_ones():
    # world 4: U2 x R2 and R4 (DP 1), U2 (DP 2, each replica its own batch)
    empty = run_distributed(_check, 4, [(2, 2), (1, 4), (2, 1)])
    assert sum(empty) > 0, "no rank saw a shard without valid tokens"


def test_single_rank_equals_mean_cross_entropy_and_all_ignored_is_zero():
    mesh = mesh_at(1, 1)
    for name, ignored in _cases().items():
        hidden, weight, labels = _problem(seed=3, ignored=ignored)
        logits = (hidden @ weight).requires_grad_()
        loss = sharded_cross_entropy(logits, labels, mesh)
        loss.backward()
        if name == "all":
            assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
        else:
            expected = F.cross_entropy(logits.detach().flatten(0, 1), labels.flatten(), ignore_index=-100)
            assert rel_err(loss.detach(), expected) <= TOLERANCE


def test_low_precision_logits_reduce_in_fp32():
    hidden, weight, labels = _problem(seed=4, ignored=torch.zeros(BATCH, SEQ, dtype=torch.bool))
    logits = hidden @ weight
    loss = sharded_cross_entropy(logits.bfloat16(), labels, mesh_at(1, 1))
    assert loss.dtype == torch.float32
    expected = F.cross_entropy(logits.bfloat16().float().flatten(0, 1), labels.flatten())
    assert rel_err(loss, expected) <= TOLERANCE


def test_mismatched_shapes_raise_value_errors():
    logits = torch.zeros(2, 8, 5)
    with pytest.raises(ValueError, match=r"logits \(2, 8, 5\) and shift_labels \(2, 7\)"):
        sharded_cross_entropy(logits, torch.zeros(2, 7, dtype=torch.long), mesh_at(1, 1))
    with pytest.raises(ValueError, match="integer token ids"):
        sharded_cross_entropy(logits, torch.zeros(2, 8), mesh_at(1, 1))
