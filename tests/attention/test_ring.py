"""Ring attention against a single-process float64 reference, on real gloo ranks."""

import itertools

import pytest
import torch
import torch.distributed as dist

from hybridsp import ring_attention
from hybridsp.layout._layouts import join_shards, take_shard
from hybridsp.testing import run_distributed
from tests.helpers.references.attention import random_qkv, reference_with_grads, rel_err

pytestmark = pytest.mark.distributed

# (batch, heads, kv_heads, head_dim): MHA and GQA, head dims 64, 128 and an odd 80.
SHAPES = [(2, 4, 4, 64), (2, 4, 2, 128), (1, 4, 1, 80)]
TOLERANCE = 1e-5


def _ring_vs_reference(rank, world, backend, layout, causal, shape, seq_per_rank, dtype=torch.float32):
    """Relative errors of this rank's (out, dq, dk, dv) shard against the float64 reference."""
    batch, heads, kv_heads, head_dim = shape
    full = random_qkv(batch, seq_per_rank * world, heads, kv_heads, head_dim, seed=7, dtype=dtype)
    shard = [take_shard(t, rank, 0, world, layout=layout) for t in full]
    q, k, v = (t.clone().requires_grad_() for t in shard[:3])
    out = ring_attention(q, k, v, dist.group.WORLD, causal=causal, backend=backend, layout=layout)
    out.backward(shard[3])
    expected = [take_shard(t, rank, 0, world, layout=layout) for t in reference_with_grads(*full, causal=causal)]
    return [rel_err(a, e) for a, e in zip([out, q.grad, k.grad, v.grad], expected)]


def _check_all_cases(rank, world):
    failures = []
    cases = itertools.product(["torch", "reference"], [False, True], SHAPES)
    for backend, causal, shape in cases:
        errors = _ring_vs_reference(rank, world, backend, "zigzag", causal, shape, seq_per_rank=8)
        if max(errors) > TOLERANCE:
            failures.append(f"{backend} causal={causal} shape={shape}: out/dq/dk/dv rel err {errors}")
    errors = _ring_vs_reference(rank, world, "torch", "contiguous", True, SHAPES[1], seq_per_rank=8)
    if max(errors) > TOLERANCE:
        failures.append(f"contiguous layout: {errors}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.fast), 8])  # fast: tests/README.md
def test_ring_attention_equals_full_attention(world):
    run_distributed(_check_all_cases, world)


def _gather_zigzag(local, world):
    """All ranks' zigzag shards [B, S/R, ...] -> the full tensor [B, S, ...] (test-only gather)."""
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local.contiguous())
    return join_shards(shards, world)


def _bf16_errors(rank, world):
    """(ring bf16 error, single-process bf16 kernel error) against the fp32-input reference."""
    shape, seq = (1, 4, 2, 64), 32 * world
    full32 = random_qkv(shape[0], seq, shape[1], shape[2], shape[3], seed=11)
    full16 = [t.bfloat16() for t in full32]
    reference = reference_with_grads(*[t.float() for t in full16], causal=True)
    q, k, v = (take_shard(t, rank, 0, world).clone().requires_grad_() for t in full16[:3])
    out = ring_attention(q, k, v, dist.group.WORLD, causal=True, backend="torch")
    out.backward(take_shard(full16[3], rank, 0, world))
    gathered = [_gather_zigzag(t, world) for t in (out, q.grad, k.grad, v.grad)]
    ring_errors = [rel_err(a, e) for a, e in zip(gathered, reference)]
    q1, k1, v1 = (t.clone().requires_grad_() for t in full16[:3])
    out1 = ring_attention(q1, k1, v1, None, causal=True, backend="torch")
    out1.backward(full16[3])
    single_errors = [rel_err(a, e) for a, e in zip([out1, q1.grad, k1.grad, v1.grad], reference)]
    for ring_error, single_error in zip(ring_errors, single_errors):
        assert ring_error <= 2 * single_error, (ring_errors, single_errors)
    return ring_errors, single_errors


def test_bf16_ring_error_at_most_twice_single_kernel_error():
    run_distributed(_bf16_errors, 8)


def _masked_steps_stay_finite(rank, world):
    """Contiguous causal: rank 0's queries see no key in R-1 steps; nothing may turn NaN/Inf."""
    full = random_qkv(1, 8 * world, 2, 2, 16, seed=5)
    q, k, v = (take_shard(t, rank, 0, world, layout="contiguous").clone().requires_grad_() for t in full[:3])
    out = ring_attention(q, k, v, dist.group.WORLD, causal=True, backend="torch", layout="contiguous")
    out.backward(take_shard(full[3], rank, 0, world, layout="contiguous"))
    for tensor in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(tensor).all()


def test_fully_masked_steps_never_produce_nan():
    run_distributed(_masked_steps_stay_finite, 4)
