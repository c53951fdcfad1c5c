"""Hybrid (Ulysses x ring) attention against a single-process float64 reference, on gloo ranks."""

import itertools

import pytest
import torch

import hybridsp
from hybridsp import gather_sequence, hybrid_attn_func, init_mesh, shard_sequence
from hybridsp.testing import run_distributed
from tests.helpers.references.attention import random_qkv, reference_with_grads, rel_err

pytestmark = pytest.mark.distributed

HEADS, HEAD_DIM, BATCH = 8, 16, 2
TOLERANCE = 1e-5


def _errors_for(mesh, full, expected, causal):
    """Relative errors of this rank's (out, dq, dk, dv) against the reference's shards."""
    q, k, v = (shard_sequence(t, mesh).clone().requires_grad_() for t in full[:3])
    out = hybrid_attn_func(q, k, v, mesh=mesh, causal=causal, backend="torch")
    out.backward(shard_sequence(full[3], mesh))
    return [rel_err(a, shard_sequence(e, mesh)) for a, e in zip([out, q.grad, k.grad, v.grad], expected)]


def _check_meshes(rank, world, meshes, order):
    failures = []
    for causal, kv_heads in itertools.product([False, True], [HEADS, 2, 1]):
        full = random_qkv(BATCH, 64, HEADS, kv_heads, HEAD_DIM, seed=3)
        expected = reference_with_grads(*full, causal=causal)
        for ulysses, ring in meshes:
            mesh = init_mesh(ulysses=ulysses, ring=ring, order=order)
            errors = _errors_for(mesh, full, expected, causal)
            if max(errors) > TOLERANCE:
                failures.append(f"U={ulysses} R={ring} causal={causal} kv_heads={kv_heads}: {errors}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "world,meshes",
    [
        (8, [(8, 1), (1, 8), (4, 2), (2, 4), (2, 2)]),
        pytest.param(4, [(4, 1), (1, 4), (2, 2), (2, 1)], marks=pytest.mark.fast),  # fast: tests/README.md
        (2, [(2, 1), (1, 2)]),
    ],
)
def test_hybrid_attention_equals_full_attention(world, meshes):
    run_distributed(_check_meshes, world, meshes, "ulysses_inner")


def test_ring_inner_rank_order_is_exact_too():
    run_distributed(_check_meshes, 4, [(2, 2)], "ring_inner")


def _round_trip(rank, world):
    mesh = init_mesh(ulysses=2, ring=2)  # DP = 2 at world 8
    full = torch.arange(2 * 32 * 3).reshape(2, 32, 3).float()
    local = shard_sequence(full, mesh)
    assert local.shape == (2, 8, 3)
    assert torch.equal(gather_sequence(local, mesh), full)
    positions = shard_sequence(torch.arange(32), mesh, dim=0)
    # zigzag: ring slot r holds chunks r and 3-r of 8 tokens, split over 2 Ulysses ranks
    slot = torch.cat(
        [
            torch.arange(8 * mesh.ring_rank, 8 * mesh.ring_rank + 8),
            torch.arange(8 * (3 - mesh.ring_rank), 8 * (3 - mesh.ring_rank) + 8),
        ]
    )
    assert torch.equal(positions, slot[8 * mesh.ulysses_rank : 8 * mesh.ulysses_rank + 8])
    return mesh.dp_rank, mesh.ring_rank, mesh.ulysses_rank


def test_shard_and_gather_round_trip_with_data_parallel_replicas():
    coords = run_distributed(_round_trip, 8)
    assert coords == [(d, r, u) for d in range(2) for r in range(2) for u in range(2)]


def _bad_inputs(rank, world):
    mesh, ring_only = init_mesh(ulysses=4, ring=2), init_mesh(ulysses=1, ring=8)
    q, k, v, _ = random_qkv(1, 8, 6, 2, 16)
    raised = {}
    for name, call in {
        "heads": lambda: hybrid_attn_func(q, k, v, mesh=mesh),
        "seq": lambda: hybrid_attn_func(*random_qkv(1, 3, 8, 2, 16)[:3], mesh=ring_only),
        "shape": lambda: hybrid_attn_func(q[..., :8], k, v, mesh=mesh),
        "kv_len": lambda: hybrid_attn_func(*random_qkv(1, 8, 8, 2, 16)[:1], k[:, :4], v[:, :4], mesh=mesh),
        "shard": lambda: shard_sequence(torch.zeros(1, 36), mesh),
        "mesh": lambda: init_mesh(ulysses=3, ring=1),
        "auto": lambda: init_mesh(),
    }.items():
        with pytest.raises(ValueError) as info:
            call()
            pytest.fail(f"{name}: no ValueError")
        raised[name] = str(info.value)
    assert "query heads (6)" in raised["heads"] and "Ulysses degree (4)" in raised["heads"]
    assert "sequence length 24" in raised["seq"] and "multiple of 16" in raised["seq"]
    assert "head dim" in raised["shape"]
    assert "same local tokens" in raised["kv_len"]
    assert "sequence length 36" in raised["shard"] and "pad the sequence to 40" in raised["shard"]
    assert "3 context ranks do not divide the world size 8" in raised["mesh"]
    assert "needs the attention shape" in raised["auto"]


def test_bad_inputs_raise_value_errors_on_every_rank_without_hanging():
    run_distributed(_bad_inputs, 8, timeout=300)  # catches a hang; start-up alone can take a minute when busy


def _bytes_sent(rank, world, kv_heads, head_chunks):
    mesh = init_mesh(ulysses=2, ring=2)
    q, k, v, dout = (shard_sequence(t, mesh).requires_grad_() for t in random_qkv(1, 64, 8, kv_heads, 16))
    counter = hybridsp.CommCounter()
    out = hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend="torch", counter=counter, head_chunks=head_chunks)
    out.backward(dout)
    return mesh.ring_rank, dict(counter.bytes_sent)


@pytest.mark.parametrize("kv_heads,head_chunks", [(2, 1), (4, 2)])  # head groups: the same bytes
def test_bytes_sent_equal_the_analytic_minimum(kv_heads, head_chunks):
    element = 4  # fp32
    local, heads, d, u = 16, 8, 16, 2
    qkv = local * (heads + 2 * kv_heads) * d * element  # one rank's q, k, v
    out = local * heads * d * element
    # forward: q/k/v and out all-to-all; backward: dout and dq/dk/dv; (U-1)/U of each leaves the rank
    all_to_all = (qkv + out) * 2 * (u - 1) // u
    slot, row = local * u, 2 * (kv_heads // u) * d * element  # tokens per ring slot; one token's k and v
    # zigzag, R = 2: slot 1 reads the first half of slot 0's block, slot 0 reads all of slot 1's.
    # K/V rows go out in the forward and again in the backward; dK/dV of what a rank read go home once.
    sent_rows = {0: slot // 2, 1: slot}
    read_rows = {0: slot, 1: slot // 2}
    for ring_rank, rank_sent in run_distributed(_bytes_sent, 4, kv_heads, head_chunks):
        ring = (2 * sent_rows[ring_rank] + read_rows[ring_rank]) * row
        assert rank_sent == {"all_to_all": all_to_all, "ring": ring}
