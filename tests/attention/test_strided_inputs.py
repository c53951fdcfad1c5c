"""Inputs users really pass as strided views (transposed, sliced, fused q/k/v, heads-first): the kernels
and the hybrid attention give the contiguous result."""

from __future__ import annotations

import pytest
import torch

import hybridsp
from hybridsp import hybrid_attn_func, init_mesh
from hybridsp.kernels import get_kernel
from hybridsp.testing import run_distributed
from tests.helpers.references.attention import random_qkv, reference_with_grads, rel_err


def _strided_views(q, k, v):
    """The same values as (q, k, v) [B, S, H, D] through views whose strides users produce."""
    b, s, h, d = q.shape
    hkv = k.shape[2]

    def transposed(x):  # last dim stride H: y.view(B, S, D, H).transpose(-1, -2)
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)

    def every_other(x):  # last dim stride 2: a slice x[..., ::2] of a wider tensor
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]

    def fused_qkv():  # q, k, v sliced out of one packed projection [B, S, H + 2 Hkv, D]
        packed = torch.cat([q, k, v], dim=2)
        return packed[:, :, :h], packed[:, :, h : h + hkv], packed[:, :, h + hkv :]

    def heads_first():  # [B, H, S, D] tensors transposed to [B, S, H, D]
        return tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))

    return {
        "transposed-last-dim": tuple(transposed(x) for x in (q, k, v)),
        "sliced-last-dim": tuple(every_other(x) for x in (q, k, v)),
        "fused-qkv": fused_qkv(),
        "heads-first": heads_first(),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_kernels_exact_on_strided_inputs(backend, dtype):
    q, k, v, dout = random_qkv(2, 16, 4, 2, 8, seed=5, dtype=dtype)
    kernel, scale = get_kernel(backend), 0.3
    base_out, base_lse = kernel.forward(q, k, v, causal=True, softmax_scale=scale)
    for name, (qs, ks, vs) in _strided_views(q, k, v).items():
        assert torch.equal(qs, q) and torch.equal(ks, k)
        out, lse = kernel.forward(qs, ks, vs, causal=True, softmax_scale=scale)
        grads = kernel.backward(
            dout.transpose(-1, -2).contiguous().transpose(-1, -2),
            qs,
            ks,
            vs,
            out.transpose(-1, -2).contiguous().transpose(-1, -2),
            lse,
            causal=True,
            softmax_scale=scale,
        )
        assert torch.isfinite(out).all(), name
        assert torch.allclose(out.double(), base_out.double(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6), name
        assert torch.allclose(lse.double(), base_lse.double(), atol=1e-5), name
        if dtype != torch.bfloat16:
            ref = reference_with_grads(q, k, v, dout, causal=True, softmax_scale=scale)
            for actual, truth in zip((out, *grads), ref):
                assert rel_err(actual, truth) < 1e-5, name


def _strided_hybrid_case(rank, world, ulysses, ring, dtype):
    mesh = init_mesh(ulysses, ring)
    full = random_qkv(2, 8 * world, 4, 2, 16, seed=6, dtype=dtype)
    local = [hybridsp.shard_sequence(t, mesh) for t in full]
    expected = [hybridsp.shard_sequence(t, mesh) for t in reference_with_grads(*full, causal=True)]
    errors = {}
    for name, views in _strided_views(*local[:3]).items():
        q, k, v = (t.detach().requires_grad_() for t in views)
        out = hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend="torch")
        out.backward(local[3])
        errors[name] = max(rel_err(a, e) for a, e in zip((out, q.grad, k.grad, v.grad), expected))
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("world,ulysses,ring", [(2, 1, 2), (2, 2, 1), (4, 2, 2)])
def test_hybrid_exact_on_strided_inputs(world, ulysses, ring):
    for errors in run_distributed(_strided_hybrid_case, world, ulysses, ring, torch.float32):
        assert max(errors.values()) < 1e-5, errors


def _strided_bf16_ring(rank, world):
    """bf16 pure ring (U = 1) on transposed inputs equals the same ring on contiguous inputs."""
    mesh = init_mesh(1, world)
    full = random_qkv(1, 16 * world, 4, 1, 16, seed=8, dtype=torch.bfloat16)
    local = [hybridsp.shard_sequence(t, mesh) for t in full]
    outs = []
    for q, k, v in (local[:3], _strided_views(*local[:3])["transposed-last-dim"]):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = hybrid_attn_func(q, k, v, mesh=mesh, causal=True)
        out.backward(local[3])
        outs.append([out, q.grad, k.grad, v.grad])
    return all(torch.equal(a, b) for a, b in zip(*outs)) and all(torch.isfinite(t).all() for t in outs[1])


@pytest.mark.distributed
def test_bf16_ring_on_strided_inputs_is_bitwise_the_contiguous_result():
    assert all(run_distributed(_strided_bf16_ring, 2))
