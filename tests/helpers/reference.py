"""Independent ground truth for the tests: attention as plain float64 autograd math."""

from __future__ import annotations

import math

import torch


def reference_attention(q, k, v, *, causal: bool, softmax_scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v in float64 with autograd; q [B, S, H, D], k/v [B, S, Hkv, D]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    group = q.shape[2] // k.shape[2]
    k = k.double().repeat_interleave(group, dim=2)  # [B, S, H, D]
    v = v.double().repeat_interleave(group, dim=2)  # [B, S, H, D]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * scale  # [B, H, S, S]
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)  # [B, S, H, D]


def reference_with_grads(q, k, v, dout, *, causal: bool, softmax_scale: float | None = None):
    """(out, dq, dk, dv) of :func:`reference_attention` in float64 for the given upstream grad."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, computed in float64."""
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def random_qkv(batch, seq, heads, kv_heads, head_dim, *, seed=0, dtype=torch.float32):
    """Deterministic q [B, S, H, D], k/v [B, S, Hkv, D] and an upstream gradient like q."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).to(dtype)
    dout = torch.randn(batch, seq, heads, head_dim, generator=gen).to(dtype)
    return q, k, v, dout
