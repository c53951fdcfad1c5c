"""Edges of the attention core that used to be silently wrong or hang: cu_seqlens passed positionally,
NaN propagation, kv_chunks in the padded length, ranks that disagree, float cu_seqlens, a non-bool causal.

Each against an independent reference where there is a result (float64 masked attention, one
kernel call over the whole sequence), otherwise a ValueError on every rank before anything hangs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridsp import HybridAttention, hybrid_attn_func, init_mesh, shard_batch, shard_sequence
from hybridsp.batch import padded_length
from hybridsp.layout.documents import normalize_cu_seqlens
from hybridsp.mesh.hybrid_mesh import HybridMesh, MeshShape
from hybridsp.testing import run_distributed
from tests.mask_reference import masked_reference_with_grads
from tests.reference import random_qkv, rel_err
from tests.test_batch import mesh_at

DOCS = (0, 10, 40, 64)


def _module_positional_documents(rank, world):
    mesh = init_mesh(ulysses=1, ring=world)
    full = random_qkv(1, 64, 4, 2, 8, seed=1)
    attn = HybridAttention(mesh, backend="torch")
    q, k, v = (shard_sequence(t, mesh) for t in full[:3])
    out = attn(q, k, v, torch.tensor(DOCS))  # documented positional form: forward(q, k, v, cu_seqlens)
    expected = masked_reference_with_grads(*full, rows_bounds=[DOCS], causal=True, window=None)[0]
    return rel_err(out, shard_sequence(expected, mesh))


@pytest.mark.parametrize("world", [1, 2])
def test_hybrid_attention_module_takes_cu_seqlens_positionally(world):
    assert max(run_distributed(_module_positional_documents, world)) < 1e-5


def _nan_query(rank, world):
    mesh = init_mesh(ulysses=1, ring=world)
    q, k, v, _ = random_qkv(1, 32, 2, 2, 8, seed=2)
    q[0, 20, 1, 3] = float("nan")  # one query row of one head
    out = hybrid_attn_func(*(shard_sequence(t, mesh) for t in (q, k, v)), mesh=mesh, backend="torch")
    whole = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)[0].transpose(1, 2)  # one kernel call
    return torch.isnan(out), torch.isnan(shard_sequence(whole, mesh))


def test_nan_in_a_query_propagates_like_one_kernel_call():
    results = run_distributed(_nan_query, 2)
    assert any(want.any() for _, want in results)  # the NaN row lives on one rank
    assert all(torch.equal(got, want) for got, want in results)


def test_padded_length_honours_kv_chunks():
    groups = dict.fromkeys(["ulysses", "ring", "context", "data", "data_context"])  # nothing communicates
    mesh = HybridMesh(MeshShape(2, 1, 2, kv_comm="allgather", kv_chunks=4), 0, groups)
    for seq in (50, 61, 64, 100):
        padded = padded_length(seq, mesh)
        assert padded >= seq and (padded // 2) % 4 == 0 and padded % 4 == 0, (seq, padded)


def _kv_chunks_batch(rank, world):
    mesh = init_mesh(ulysses=1, ring=world, kv_comm="allgather", kv_chunks=4)
    ids = torch.arange(50)[None] % 17
    local = shard_batch({"input_ids": ids, "labels": ids}, mesh)
    q = torch.randn(1, local["input_ids"].shape[1], 2, 8)
    return hybrid_attn_func(q, q, q, mesh=mesh, backend="torch").shape


def test_allgather_chunks_never_meet_a_batch_they_cannot_split():
    assert all(shape[1] == 28 for shape in run_distributed(_kv_chunks_batch, 2))  # 50 -> 56 tokens, 4 chunks of 7


def _disagree(rank, world, what):
    mesh = init_mesh(ulysses=2, ring=world // 2)
    q, k, v, _ = random_qkv(1, 64, 4, 2, 8, seed=3)
    local = [shard_sequence(t, mesh) for t in (q, k, v)]
    kwargs = {"mesh": mesh, "backend": "torch"}
    if what == "window":
        kwargs["sliding_window"] = 8 if rank == world - 1 else 16
    elif what == "documents":
        kwargs["cu_seqlens"] = torch.tensor([0, 30, 64] if rank == 1 else [0, 20, 64])
    elif what == "length":
        local = [t[:, :8] if rank == 2 else t for t in local]
    try:
        hybrid_attn_func(*local, **kwargs)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("what", ["window", "documents", "length"])
def test_ranks_that_disagree_raise_on_every_rank(what):
    messages = run_distributed(_disagree, 4, what, timeout=60)
    assert all(m is not None and "disagree" in m for m in messages), messages


def test_cu_seqlens_refuses_floats_and_accepts_numpy():
    with pytest.raises(ValueError, match="integer"):
        normalize_cu_seqlens([0, 5.7, 16], 1, 16)
    with pytest.raises(ValueError, match="integer"):
        normalize_cu_seqlens(torch.tensor([0.0, 16.0]), 1, 16)
    rows = np.array([[0, 5, 16], [0, 9, 16]])
    assert normalize_cu_seqlens(rows, 2, 16) == ((0, 5, 16), (0, 9, 16))
    assert normalize_cu_seqlens(np.array([0, 5, 16], dtype=np.int32), 2, 16) == ((0, 5, 16), (0, 5, 16))


def test_causal_must_be_a_bool():
    mesh = mesh_at(1, 1)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="causal must be True or False"):
        hybrid_attn_func(q, q, q, mesh=mesh, causal="no")
    with pytest.raises(ValueError, match="causal must be True or False"):
        HybridAttention(mesh, causal=1)
