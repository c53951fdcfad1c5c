"""Independent ground truth for packed documents and sliding windows: float64 masked attention."""

from __future__ import annotations

import math

import torch


def visible_mask(seq_len: int, bounds, causal: bool, window: int | None) -> torch.Tensor:
    """[S, S] bool: query i may see key j (same document, causal, i - W < j)."""
    doc = torch.zeros(seq_len, dtype=torch.long)
    for start in list(bounds)[1:-1]:
        doc[start:] += 1
    pos = torch.arange(seq_len)
    visible = doc[:, None] == doc[None, :]
    diff = pos[:, None] - pos[None, :]  # [S, S]
    if causal:
        visible &= diff >= 0
    if window is not None:
        visible &= diff.abs() < window
    return visible


def masked_reference_with_grads(q, k, v, dout, *, rows_bounds, causal: bool, window: int | None):
    """(out, dq, dk, dv) in float64; ``rows_bounds``: one boundary list per batch row."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    b, s, h, d = q.shape
    group = h // k.shape[2]
    keys, values = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)  # [B, S, H, D]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) / math.sqrt(d)  # [B, H, S, S]
    mask = torch.stack([visible_mask(s, bounds, causal, window) for bounds in rows_bounds])  # [B, S, S]
    scores = scores.masked_fill(~mask[:, None], -math.inf)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # rows without keys: 0
    out = torch.einsum("bhqk,bkhd->bqhd", probs, values)  # [B, S, H, D]
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad
