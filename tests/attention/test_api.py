"""hybrid_attn_func and HybridAttention as users call them, against independent references: cu_seqlens
given positionally to the module (float64 masked attention), a NaN in one query row (one kernel call
over the whole sequence)."""

from __future__ import annotations

import pytest
import torch

from hybridsp import HybridAttention, hybrid_attn_func, init_mesh, shard_sequence
from hybridsp.testing import run_distributed
from tests.helpers.mask_reference import masked_reference_with_grads
from tests.helpers.reference import random_qkv, rel_err

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
