"""float64 gradcheck through the ring and the hybrid attention (also with packed documents and a window)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybridsp
from hybridsp import hybrid_attn_func, init_mesh, ring_attention
from hybridsp.testing import run_distributed


class _SumGradsOverRanks(torch.autograd.Function):
    """Identity whose backward sums the gradient over the world (test-only: replicated input)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class _GatherShards(torch.autograd.Function):
    """All context ranks' shards -> the full tensor; backward keeps this rank's rows (test-only,
    valid because every rank receives the same upstream gradient, as in gradcheck)."""

    @staticmethod
    def forward(ctx, local, mesh):
        ctx.mesh = mesh
        return hybridsp.gather_sequence(local, mesh)

    @staticmethod
    def backward(ctx, grad):
        return hybridsp.shard_sequence(grad, ctx.mesh), None


def _gradcheck_case(rank, world, ulysses, ring, layout, causal, kv_heads, masks=None):
    mesh = init_mesh(ulysses, ring, layout=layout)
    gen = torch.Generator().manual_seed(3)
    seq = 4 * world
    q = torch.randn(1, seq, 2, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(1, seq, kv_heads, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(1, seq, kv_heads, 4, dtype=torch.float64, generator=gen, requires_grad=True)

    def full_attention(q, k, v):
        q, k, v = (hybridsp.shard_sequence(_SumGradsOverRanks.apply(t), mesh) for t in (q, k, v))
        out = hybrid_attn_func(q, k, v, mesh=mesh, causal=causal, softmax_scale=0.7, **(masks or {}))
        return _GatherShards.apply(out, mesh)

    return torch.autograd.gradcheck(full_attention, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world,ulysses,ring,layout,causal,kv_heads",
    [
        (2, 1, 2, "zigzag", True, 1),
        (2, 1, 2, "contiguous", False, 2),
        # U2xR2 zigzag causal one K/V head: the packed-documents case below runs the same mesh and call with masks
        pytest.param(4, 2, 2, "zigzag", True, 1, marks=pytest.mark.slow),
    ],
)
def test_gradcheck_float64_through_ring_and_hybrid(world, ulysses, ring, layout, causal, kv_heads):
    assert all(run_distributed(_gradcheck_case, world, ulysses, ring, layout, causal, kv_heads, timeout=240))


@pytest.mark.distributed
def test_gradcheck_float64_with_packed_documents_and_a_window():
    masks = {"cu_seqlens": torch.tensor([0, 3, 4, 16]), "sliding_window": 5}
    assert all(run_distributed(_gradcheck_case, 4, 2, 2, "zigzag", True, 1, masks, timeout=240))


def test_gradcheck_float64_single_process_ring_of_one():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 6, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: ring_attention(q, k, v, None, causal=True), (q, k, v))
