"""PyTorch's fused flash-attention kernels that expose the log-sum-exp.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (fp32,
bf16, fp16; native GQA). CUDA: ``aten._scaled_dot_product_flash_attention`` and its
``_backward`` (fp16/bf16 only; K/V heads are expanded for GQA and their gradients summed).
Both take the layout [B, H, S, D]; this module converts from and to [B, S, H, D].
"""

from __future__ import annotations

import torch

from hybridsp.kernels.band import additive_mask, band_mask, math_backward_band, math_forward_band, rows_without_keys_to_neg_inf
from hybridsp.kernels.base import check_qkv, lse_for_backward
from hybridsp.kernels.reference import _expand_kv_heads, _reduce_kv_heads

_aten = torch.ops.aten


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> [B, H, S, D] (a view)."""
    return x.transpose(1, 2)  # [B, H, S, D]


def _heads_first_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> [B, H, S, D], copied to contiguous memory."""
    return x.transpose(1, 2).contiguous()  # [B, H, S, D]


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> [B, S, H, D] (a view)."""
    return x.transpose(1, 2)  # [B, S, H, D]


def _no_key_rows_to_neg_inf(lse: torch.Tensor) -> torch.Tensor:
    """The CUDA flash kernel reports a row that saw no key as lse +inf; make it -inf.

    (The CPU kernel would say 0, but only for rows masked by an explicit mask, which this
    module never passes; empty key blocks are answered by :func:`_empty_key_result`.)
    """
    return torch.where(torch.isposinf(lse), torch.full_like(lse, -torch.inf), lse)


class TorchFusedKernel:
    """Fused PyTorch flash kernels (see :mod:`hybridsp.kernels.base` for the protocol)."""

    name = "torch"

    def forward(self, q, k, v, *, causal: bool, softmax_scale: float):
        check_qkv(q, k, v, causal=causal)
        if k.shape[1] == 0:
            return _empty_key_result(q)
        if q.is_cuda:
            return _cuda_forward(q, k, v, causal, softmax_scale)
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            _heads_first(q), _heads_first(k), _heads_first(v), 0.0, causal, scale=softmax_scale
        )
        return _seq_first(out), lse.float()

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float):
        check_qkv(q, k, v, causal=causal)
        lse = lse_for_backward(lse.float())
        if q.is_cuda:
            return _cuda_backward(dout, q, k, v, out, lse, causal, softmax_scale)
        return _cpu_backward(dout, q, k, v, out, lse, causal, softmax_scale)

    def forward_band(self, q, k, v, *, band, softmax_scale: float):
        """A band piece (:mod:`hybridsp.kernels.band`): on CPU the fused kernel with an additive mask
        (rows without keys normalised to lse -inf); on CUDA plain fp32 math (the CUDA flash op
        takes no mask)."""
        check_qkv(q, k, v, causal=False)
        if k.shape[1] == 0:
            return _empty_key_result(q)
        if q.is_cuda:
            return math_forward_band(q, k, v, band=band, softmax_scale=softmax_scale)
        visible = band_mask(q.shape[1], k.shape[1], band, q.device)  # [Sq, Sk]
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            _heads_first(q), _heads_first(k), _heads_first(v), 0.0, False,
            attn_mask=additive_mask(visible, q.dtype), scale=softmax_scale,
        )
        return _seq_first(out), rows_without_keys_to_neg_inf(lse.float(), visible)

    def backward_band(self, dout, q, k, v, out, lse, *, band, softmax_scale: float):
        check_qkv(q, k, v, causal=False)
        if q.is_cuda:
            return math_backward_band(dout, q, k, v, out, lse, band=band, softmax_scale=softmax_scale)
        return _cpu_band_backward(dout, q, k, v, out, lse_for_backward(lse.float()), band, softmax_scale)


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    """aten CPU flash backward. Note [GQA in low precision]: the CPU kernel sums the query
    group's dK/dV in the input dtype, which triples their bf16 error; for fp16/bf16 with GQA
    the K/V heads are expanded and the group sum is done in fp32 instead."""
    hkv = k.shape[2]
    low_precision = q.dtype in (torch.float16, torch.bfloat16)
    low_precision_gqa = low_precision and hkv < q.shape[2]
    if low_precision_gqa:
        k, v = _expand_kv_heads(k, q.shape[2]), _expand_kv_heads(v, q.shape[2])  # [B, S, H, D]
    # The bf16/fp16 CPU backward runs 12-40% faster on heads-first contiguous inputs
    # (measured in benchmarks/bench_peers.py); fp32 does not care, so it skips the copies.
    layout = _heads_first_contiguous if low_precision else _heads_first
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        layout(dout), layout(q), layout(k), layout(v), layout(out), lse, 0.0, causal, scale=scale,
    )
    dk, dv = _seq_first(dk), _seq_first(dv)
    if low_precision_gqa:
        dk, dv = _sum_query_groups(dk, hkv), _sum_query_groups(dv, hkv)
    return _seq_first(dq), dk, dv


def _sum_query_groups(grad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, S, H, D] per-query-head K/V gradients -> [B, S, Hkv, D], summed in fp32."""
    return _reduce_kv_heads(grad.float(), num_kv_heads).to(grad.dtype)


def _empty_key_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out = 0 [B, Sq, H, D] and lse = -inf [B, H, Sq] for a call with no keys at all."""
    b, s, h, _ = q.shape
    return torch.zeros_like(q), torch.full((b, h, s), -torch.inf, device=q.device)


def _cuda_forward(q, k, v, causal, scale):
    """aten CUDA flash forward; K/V heads expanded to the query heads first."""
    h = q.shape[2]
    k, v = _expand_kv_heads(k, h), _expand_kv_heads(v, h)
    result = _aten._scaled_dot_product_flash_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), 0.0, causal, False, scale=scale
    )
    out, lse = result[0], result[1]
    return _seq_first(out), _no_key_rows_to_neg_inf(lse.float())


def _cuda_backward(dout, q, k, v, out, lse, causal, scale):
    """aten CUDA flash backward; K/V gradients summed back over each query group."""
    h, hkv = q.shape[2], k.shape[2]
    k_full, v_full = _expand_kv_heads(k, h), _expand_kv_heads(v, h)
    sq, sk = q.shape[1], k.shape[1]
    unused = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        _heads_first(dout).contiguous(), _heads_first(q), _heads_first(k_full), _heads_first(v_full),
        _heads_first(out), lse, unused, unused, sq, sk, 0.0, causal, unused, unused, scale=scale,
    )
    return _seq_first(dq), _sum_query_groups(_seq_first(dk), hkv), _sum_query_groups(_seq_first(dv), hkv)


def _cpu_band_backward(dout, q, k, v, out, lse, band, scale):
    """aten CPU flash backward of a band piece (additive mask); GQA in low precision as in
    :func:`_cpu_backward` (K/V expanded, the query-group sum in fp32)."""
    hkv = k.shape[2]
    low_precision = q.dtype in (torch.float16, torch.bfloat16)
    low_precision_gqa = low_precision and hkv < q.shape[2]
    if low_precision_gqa:
        k, v = _expand_kv_heads(k, q.shape[2]), _expand_kv_heads(v, q.shape[2])  # [B, S, H, D]
    visible = band_mask(q.shape[1], k.shape[1], band, q.device)  # [Sq, Sk]
    lse = lse.masked_fill(~visible.any(dim=-1), 0.0)  # rows without keys: the kernel's own 0, not +inf
    mask = additive_mask(visible, q.dtype)  # [Sq, Sk]
    layout = _heads_first_contiguous if low_precision else _heads_first
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        layout(dout), layout(q), layout(k), layout(v), layout(out), lse, 0.0, False, attn_mask=mask, scale=scale,
    )
    dk, dv = _seq_first(dk), _seq_first(dv)
    if low_precision_gqa:
        dk, dv = _sum_query_groups(dk, hkv), _sum_query_groups(dv, hkv)
    return _seq_first(dq), dk, dv
