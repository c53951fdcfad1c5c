"""Plain attention math in fp32 (fp64 for fp64 inputs): the ground truth for tests, never used for speed."""

from __future__ import annotations

import torch

from hybridsp.kernels.band import math_backward_band, math_forward_band
from hybridsp.kernels.base import accumulation_dtype, check_qkv, lse_for_backward


def _expand_kv_heads(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, H, D] by repeating each K/V head for its query group."""
    return x.repeat_interleave(num_q_heads // x.shape[2], dim=2)  # [B, S, H, D]


def _reduce_kv_heads(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, S, H, D] -> [B, S, Hkv, D] by summing the gradients of each query group."""
    b, s, h, d = x.shape
    return x.reshape(b, s, num_kv_heads, h // num_kv_heads, d).sum(dim=3)  # [B, S, Hkv, D]


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Scores [B, H, Sq, Sk] in the accumulation dtype, masked positions -inf (top-left causal alignment)."""
    acc = accumulation_dtype(q.dtype)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), k.to(acc)) * scale  # [B, H, Sq, Sk]
    if causal:
        sq, sk = scores.shape[-2:]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


class ReferenceKernel:
    """Attention written out in fp32 (fp64) einsums (see :mod:`hybridsp.kernels.base`)."""

    name = "reference"

    def forward(self, q, k, v, *, causal: bool, softmax_scale: float):
        check_qkv(q, k, v, causal=causal)
        h = q.shape[2]
        k, v = _expand_kv_heads(k, h), _expand_kv_heads(v, h)
        scores = _scores(q, k, causal, softmax_scale)  # [B, H, Sq, Sk]
        lse = torch.logsumexp(scores, dim=-1)  # [B, H, Sq]
        probs = torch.exp(scores - lse_for_backward(lse).unsqueeze(-1))  # [B, H, Sq, Sk]
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v.to(probs.dtype))  # [B, Sq, H, D]
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float):
        check_qkv(q, k, v, causal=causal)
        h, hkv = q.shape[2], k.shape[2]
        acc = accumulation_dtype(q.dtype)
        k_full, v_full = _expand_kv_heads(k, h).to(acc), _expand_kv_heads(v, h).to(acc)
        scores = _scores(q, k_full, causal, softmax_scale)  # [B, H, Sq, Sk]
        probs = torch.exp(scores - lse_for_backward(lse.to(acc)).unsqueeze(-1))  # [B, H, Sq, Sk]
        dout32 = dout.to(acc)
        dv = torch.einsum("bhqk,bqhd->bkhd", probs, dout32)  # [B, Sk, H, D]
        dprobs = torch.einsum("bqhd,bkhd->bhqk", dout32, v_full)  # [B, H, Sq, Sk]
        row_dot = (dout32 * out.to(acc)).sum(-1).transpose(1, 2).unsqueeze(-1)  # [B, H, Sq, 1]
        dscores = probs * (dprobs - row_dot) * softmax_scale  # [B, H, Sq, Sk]
        dq = torch.einsum("bhqk,bkhd->bqhd", dscores, k_full)  # [B, Sq, H, D]
        dk = torch.einsum("bhqk,bqhd->bkhd", dscores, q.to(acc))  # [B, Sk, H, D]
        dk, dv = _reduce_kv_heads(dk, hkv), _reduce_kv_heads(dv, hkv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def forward_band(self, q, k, v, *, band, softmax_scale: float):
        """A band piece (:mod:`hybridsp.kernels.band`): masks in fp32 math."""
        check_qkv(q, k, v, causal=False)
        return math_forward_band(q, k, v, band=band, softmax_scale=softmax_scale)

    def backward_band(self, dout, q, k, v, out, lse, *, band, softmax_scale: float):
        check_qkv(q, k, v, causal=False)
        return math_backward_band(dout, q, k, v, out, lse, band=band, softmax_scale=softmax_scale)


def attention_in_input_dtype(q, k, v, dout, *, causal: bool, softmax_scale: float):
    """Plain attention done entirely in the inputs' dtype, with autograd: (out, dq, dk, dv).

    This is flash-attn's yardstick for low precision: a kernel's error against the fp32
    reference should be at most about twice the error of this computation.
    """
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    keys, values = _expand_kv_heads(k, q.shape[2]), _expand_kv_heads(v, q.shape[2])  # [B, S, H, D]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) * softmax_scale  # [B, H, Sq, Sk]
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), values)  # [B, Sq, H, D]
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad
