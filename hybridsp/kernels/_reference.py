"""Plain attention math in fp32 (fp64 for fp64 inputs): the ground truth for tests, never used for speed."""

from __future__ import annotations

import torch

from hybridsp.kernels._band import math_backward_band, math_forward_band
from hybridsp.kernels._base import AttentionKernel, Band, check_qkv, expand_kv_heads


def causal_band(causal: bool) -> Band:
    """The band of a plain call: key j visible to query i iff ``j <= i`` (top-left causal), or all keys."""
    return (0, None) if causal else (None, None)


class ReferenceKernel(AttentionKernel):
    """Attention written out in fp32 (fp64) einsums (see :mod:`hybridsp.kernels._base`): the band
    math of :mod:`hybridsp.kernels._band` with the causal (or empty) band. Any head dims (Dv may
    differ from D); soft-capping (``softcap=``) in every call. Memory: one [B, H, Sq, Sk] score
    block per call, which is a ring piece's, not the sequence's."""

    name = "reference"
    supports_softcap = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        softmax_scale: float,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_qkv(q, k, v, causal=causal)
        return math_forward_band(q, k, v, band=causal_band(causal), softmax_scale=softmax_scale, softcap=softcap)

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        softmax_scale: float,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_qkv(q, k, v, causal=causal)
        return math_backward_band(
            dout, q, k, v, out, lse, band=causal_band(causal), softmax_scale=softmax_scale, softcap=softcap
        )

    def forward_band(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        band: Band,
        softmax_scale: float,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A band piece (:mod:`hybridsp.kernels._band`): masks in fp32 math."""
        check_qkv(q, k, v, causal=False)
        return math_forward_band(q, k, v, band=band, softmax_scale=softmax_scale, softcap=softcap)

    def backward_band(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        band: Band,
        softmax_scale: float,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_qkv(q, k, v, causal=False)
        return math_backward_band(dout, q, k, v, out, lse, band=band, softmax_scale=softmax_scale, softcap=softcap)


def attention_in_input_dtype(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, causal: bool, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Plain attention done entirely in the inputs' dtype, with autograd: (out, dq, dk, dv).

    This is flash-attn's yardstick for low precision: a kernel's error against the fp32
    reference should be at most about twice the error of this computation.
    """
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    keys, values = expand_kv_heads(k, q.shape[2]), expand_kv_heads(v, q.shape[2])  # [B, S, H, D]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) * softmax_scale  # [B, H, Sq, Sk]
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), values)  # [B, Sq, H, D]
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad
