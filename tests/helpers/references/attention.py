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


def random_qkv(batch, seq, heads, kv_heads, head_dim, *, seed=0, dtype=torch.float32, v_head_dim=None):
    """Deterministic q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] and an upstream gradient
    like the output [B, S, H, Dv] (Dv: ``v_head_dim``, default D)."""
    dv = head_dim if v_head_dim is None else v_head_dim
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, seq, kv_heads, dv, generator=gen).to(dtype)
    dout = torch.randn(batch, seq, heads, dv, generator=gen).to(dtype)
    return q, k, v, dout


def sinks_reference_with_grads(
    q, k, v, dout, *, causal: bool, sinks=None, softcap=None, rows_bounds=None, window=None, softmax_scale=None
):
    """(out, dq, dk, dv, dsinks) in float64 autograd, written as the unmodified models do it: scores
    scaled, soft-capped (``softcap * tanh(scores / softcap)``, Gemma 2), masked (causal, documents
    ``rows_bounds`` per batch row, window), a sink logit per head appended as one more column
    (GPT-OSS's eager attention), softmax, the sink column dropped. q [B, S, H, D], k [B, S, Hkv, D],
    v [B, S, Hkv, Dv], sinks [H] or None (dsinks None then)."""
    from tests.helpers.references.masks import visible_mask

    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    logits = None if sinks is None else sinks.detach().double().requires_grad_()
    b, s, h, d = q.shape
    group = h // k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2)) * scale  # [B, H, S, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    bounds = rows_bounds if rows_bounds is not None else [[0, s]] * b
    mask = torch.stack([visible_mask(s, row, causal, window) for row in bounds])  # [B, S, S]
    scores = scores.masked_fill(~mask[:, None], -math.inf)
    if logits is not None:
        scores = torch.cat([scores, logits.view(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)  # [B, H, S, S + 1]
    probs = torch.softmax(scores, -1).nan_to_num(0.0)[..., :s]  # [B, H, S, S]; rows without keys: 0
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(group, 2))  # [B, S, H, Dv]
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad, None if logits is None else logits.grad
