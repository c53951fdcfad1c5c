"""PyTorch's fused attention kernels that expose the log-sum-exp.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (fp16, bf16,
fp32, fp64; native GQA; any head dim). CUDA (Note [CUDA kernels]): the aten flash kernel for
fp16/bf16 and head dims up to 256, else the aten memory-efficient kernel (also fp32), with
K/V heads expanded for GQA and their gradients summed. fp64 on CUDA has no fused kernel:
:func:`hybridsp.kernels.choose_backend` sends it to the reference math instead.
All take the layout [B, H, S, D]; this module converts from and to [B, S, H, D], and copies
an input only when its last dim is not unit-stride (Note [strides] in ``base``).

Note [value head dim]: none of these kernels takes a v whose head dim differs from q's and k's
(the CPU kernel raises "Q/K/V should have the same head size"). Zero columns are exact on either
side (in q/k they add nothing to the scores, in v they add output columns that are cut off), so
the narrower side is zero-padded to ``W = max(D, Dv)`` inside the kernel call
(:func:`same_head_dims`) and out/dv are cut back to Dv, dq/dk to D. The padding is local: it
costs ``(W - Dv)`` columns of v, out, dout and dv (or ``W - D`` of q, k, dq, dk) per call in memory
and kernel work, and nothing on the wire (K/V travel at their own head dims).

Note [CUDA kernels]: the aten CUDA flash kernel accepts only fp16/bf16 and head dims that are
multiples of 8 up to 256; the memory-efficient kernel accepts fp32 too, returns its LSE padded
to a multiple of 32 rows and wants the head dim a multiple of 8. Head dims that are not are
zero-padded (zero columns in q/k leave the scores unchanged, in v they add output columns
that are cut off), which is exact. :func:`cuda_variant` is the selection rule, kept free of
CUDA calls so that it is unit-tested on CPU.

Note [NaN rows]: the CPU kernel takes each row's maximum score with a NaN-dropping scalar max
over the keys that do not fill a whole vector (all of them when a call has fewer keys than one
vector: 16 fp32 with AVX-512). A row whose every visible score is NaN (a NaN in its query, or in
every key it sees) then looks fully masked and comes back out 0, lse 0, where the math, and one
call over a longer sequence, give NaN; a ring's merge would weigh that block as a real one. So
:func:`restore_nan_rows` makes such rows NaN: the candidates are the rows with lse exactly 0 (one
compare over [B, H, Sq]; usually none), each confirmed from its own scores, so every other row
keeps its bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridsp.kernels._band import (
    additive_mask,
    band_mask,
    band_mask_rows,
    math_backward_band,
    math_forward_band,
    rows_without_keys_to_neg_inf,
)
from hybridsp.kernels._base import (
    HALF_DTYPES,
    AttentionKernel,
    Band,
    accumulation_dtype,
    as_dtype,
    check_qkv,
    expand_kv_heads,
    lse_for_backward,
    no_key_lse_to_neg_inf,
    no_key_result,
    padded_head_dim,
    reduce_kv_heads,
    unit_stride,
)

_aten = torch.ops.aten
CUDA_FLASH_MAX_HEAD_DIM = 256
_EFFICIENT_LSE_ALIGN = 32


def cuda_variant(dtype: torch.dtype, head_dim: int) -> str:
    """Which aten CUDA kernel serves ``dtype`` and ``head_dim``: ``"flash"`` or ``"efficient"``.

    Raises ValueError for fp64 (no fused CUDA kernel; use backend='reference').
    """
    if dtype == torch.float64:
        raise ValueError(
            "PyTorch has no fused CUDA attention kernel for float64; use backend='reference' (exact fp64 math, "
            "O(S^2) memory per block) or cast q/k/v to float32/bfloat16"
        )
    if dtype in HALF_DTYPES and padded_head_dim(head_dim) <= CUDA_FLASH_MAX_HEAD_DIM:
        return "flash"
    return "efficient"


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> [B, H, S, D] (a view; unit-stride last dim guaranteed)."""
    return unit_stride(x).transpose(1, 2)  # [B, H, S, D]


def heads_first_dense(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> [B, H, S, D] with every head's [S, D] plane dense: a view when it already is
    (hybridsp.attention._ulysses hands out such views, Note [heads-first] there), else a contiguous copy."""
    y = x.transpose(1, 2)  # [B, H, S, D]
    dense = y.stride(-1) == 1 and (y.shape[-2] <= 1 or y.stride(-2) == y.shape[-1])
    return y if dense else y.contiguous()


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> [B, S, H, D] (a view)."""
    return x.transpose(1, 2)  # [B, S, H, D]


def _value_columns(out: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The kernel's heads-first out [B, H, Sq, W] as [B, Sq, H, Dv] (a view; W > Dv only when v was
    padded, Note [value head dim])."""
    out = _seq_first(out)  # [B, Sq, H, W]
    return out if out.shape[-1] == v.shape[-1] else out[..., : v.shape[-1]]  # [B, Sq, H, Dv]


class TorchFusedKernel(AttentionKernel):
    """Fused PyTorch kernels (see :mod:`hybridsp.kernels._base` for the protocol)."""

    name = "torch"

    def check_inputs(self, q: torch.Tensor) -> None:
        """Raise ValueError for inputs no fused kernel here can run (fp64 on CUDA)."""
        if q.is_cuda:
            cuda_variant(q.dtype, q.shape[-1])

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_qkv(q, k, v, causal=causal)
        if k.shape[1] == 0 or q.shape[1] == 0:
            return no_key_result(q, v_head_dim=v.shape[-1])
        if q.is_cuda:
            return cuda_forward(q, k, v, causal, softmax_scale)
        layout = heads_first_dense if q.dtype in HALF_DTYPES else _heads_first  # bf16/fp16: Note [heads-first]
        qw, kw, vw = same_head_dims(q, k, v)  # Note [value head dim]
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            layout(qw), layout(kw), layout(vw), 0.0, causal, scale=softmax_scale
        )
        band = (0, None) if causal else (None, None)  # top-left causal, or every key
        return restore_nan_rows(q, k, _value_columns(out, v), as_dtype(lse, accumulation_dtype(q.dtype)), band)

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_qkv(q, k, v, causal=causal)
        if k.shape[1] == 0 or q.shape[1] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        lse = lse_for_backward(as_dtype(lse, accumulation_dtype(q.dtype)))
        dout, out = as_dtype(dout, q.dtype), as_dtype(out, q.dtype)
        if q.is_cuda:
            return cuda_backward(dout, q, k, v, out, lse, causal, softmax_scale)
        return _cpu_backward(dout, q, k, v, out, lse, causal, softmax_scale)

    def forward_band(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, band: Band, softmax_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A band piece (:mod:`hybridsp.kernels._band`): on CPU the fused kernel with an additive mask
        (rows without keys normalised to lse -inf); on CUDA plain fp32 math (the CUDA flash op
        takes no mask)."""
        check_qkv(q, k, v, causal=False)
        if k.shape[1] == 0:
            return no_key_result(q, v_head_dim=v.shape[-1])
        if q.is_cuda:
            return math_forward_band(q, k, v, band=band, softmax_scale=softmax_scale)
        visible = band_mask(q.shape[1], k.shape[1], band, q.device)  # [Sq, Sk]
        qw, kw, vw = same_head_dims(q, k, v)  # Note [value head dim]
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            _heads_first(qw),
            _heads_first(kw),
            _heads_first(vw),
            0.0,
            False,
            attn_mask=additive_mask(visible, q.dtype),
            scale=softmax_scale,
        )
        lse = rows_without_keys_to_neg_inf(as_dtype(lse, accumulation_dtype(q.dtype)), visible)
        return restore_nan_rows(q, k, _value_columns(out, v), lse, band)

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_qkv(q, k, v, causal=False)
        if q.is_cuda:
            return math_backward_band(dout, q, k, v, out, lse, band=band, softmax_scale=softmax_scale)
        lse = lse_for_backward(as_dtype(lse, accumulation_dtype(q.dtype)))
        return _cpu_band_backward(dout, q, k, v, out, lse, band, softmax_scale)


def restore_nan_rows(
    q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, band: Band
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Sq, H, D], lse [B, H, Sq]) of a CPU kernel call with NaN, in place, on the rows whose
    every score inside ``band`` (:mod:`hybridsp.kernels._band`) is NaN (Note [NaN rows])."""
    if bool(lse.all()):  # no lse is exactly 0 (the kernel's "no key" marker, and rarely a real lse): one op
        return out, lse
    zero = lse == 0  # [B, H, Sq]
    b, h, i = zero.nonzero().unbind(1)  # each [n]
    acc = accumulation_dtype(q.dtype)
    group = q.shape[2] // k.shape[2]
    scores = torch.einsum("nd,nkd->nk", q[b, i, h].to(acc), k[b, :, h // group].to(acc))  # [n, Sk]
    seen = band_mask_rows(i, k.shape[1], band)  # [n, Sk]
    nan = (scores.isnan() | ~seen).all(dim=-1) & seen.any(dim=-1)  # [n]
    b, h, i = b[nan], h[nan], i[nan]
    out[b, i, h] = torch.nan
    lse[b, h, i] = torch.nan
    return out, lse


def same_head_dims(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each [B, S, H, D_i] zero-padded to [B, S, H, max D_i] (itself when already that wide;
    Note [value head dim])."""
    widths = {t.shape[-1] for t in tensors}
    if len(widths) == 1:
        return list(tensors)
    width = max(widths)
    return [_pad_head_dim(t, width) for t in tensors]  # each [B, S, H, W]


def _cpu_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aten CPU flash backward, v's head dim padded to q's (or q/k's to v's) where they differ
    (Note [value head dim]); dq/dk come back [B, S, H(kv), D], dv [B, S, Hkv, Dv]."""
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if head_dim == v_head_dim:
        return _cpu_backward_same_dims(dout, q, k, v, out, lse, causal, scale, mask)
    dout, q, k, v, out = same_head_dims(dout, q, k, v, out)  # each [B, S, H(kv), W]
    dq, dk, dv = _cpu_backward_same_dims(dout, q, k, v, out, lse, causal, scale, mask)
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :v_head_dim]


def _cpu_backward_same_dims(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aten CPU flash backward. Note [GQA in low precision]: the CPU kernel sums the query
    group's dK/dV in the input dtype, which triples their bf16 error; for fp16/bf16 with GQA
    the K/V heads are expanded and the group sum is done in fp32 instead."""
    hkv = k.shape[2]
    low_precision = q.dtype in HALF_DTYPES
    low_precision_gqa = low_precision and hkv < q.shape[2]
    if low_precision_gqa:
        k, v = expand_kv_heads(k, q.shape[2]), expand_kv_heads(v, q.shape[2])  # [B, S, H, D]
    # The bf16/fp16 CPU kernel runs faster on dense heads-first planes (Note [heads-first] in
    # hybridsp.attention._ulysses, whose outputs already are); fp32 does not care, so it skips the copies.
    layout = heads_first_dense if low_precision else _heads_first
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        layout(dout), layout(q), layout(k), layout(v), layout(out), lse, 0.0, causal, attn_mask=mask, scale=scale
    )
    dk, dv = _seq_first(dk), _seq_first(dv)
    if low_precision_gqa:
        dk, dv = _sum_query_groups(dk, hkv), _sum_query_groups(dv, hkv)
    return _seq_first(dq), dk, dv


def _sum_query_groups(grad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, S, H, D] per-query-head K/V gradients -> [B, S, Hkv, D], summed in fp32 (or fp64)."""
    return reduce_kv_heads(grad.to(accumulation_dtype(grad.dtype)), num_kv_heads).to(grad.dtype)


def _pad_head_dim(x: torch.Tensor, padded: int) -> torch.Tensor:
    """[B, S, H, D] -> [B, S, H, padded] with zero columns (exact for q, k and v)."""
    return x if x.shape[-1] == padded else F.pad(x, (0, padded - x.shape[-1]))  # [B, S, H, Dp]


def _cuda_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *extra: torch.Tensor) -> list[torch.Tensor]:
    """Expand K/V to the query heads and pad the head dims to one aligned width (Note [CUDA kernels],
    Note [value head dim]): each [B, H, S, Dp] heads-first."""
    h, padded = q.shape[2], padded_head_dim(max(q.shape[-1], v.shape[-1]))
    k, v = expand_kv_heads(k, h), expand_kv_heads(v, h)  # [B, S, H, D]
    return [_heads_first(_pad_head_dim(x, padded)) for x in (q, k, v, *extra)]  # each [B, H, S, Dp]


def cuda_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """aten CUDA flash or memory-efficient forward (Note [CUDA kernels])."""
    head_dim, sq = v.shape[-1], q.shape[1]
    qh, kh, vh = _cuda_inputs(q, k, v)
    if cuda_variant(q.dtype, max(q.shape[-1], head_dim)) == "flash":
        result = _aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False, scale=scale)
    else:
        result = _aten._scaled_dot_product_efficient_attention(qh, kh, vh, None, True, 0.0, causal, scale=scale)
    out, lse = result[0], result[1][..., :sq]  # [B, H, Sq, Dp], [B, H, Sq]
    # the CUDA flash kernel reports a row that saw no key as lse +inf (Note [no key] in base); the CPU
    # kernel would say 0, but only for rows masked by an explicit mask, which only band pieces pass
    return _seq_first(out[..., :head_dim]), no_key_lse_to_neg_inf(lse.float())


def cuda_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aten CUDA backward of the kernel :func:`cuda_variant` picks; K/V gradients summed per query group."""
    head_dim, v_head_dim, hkv, (sq, sk) = q.shape[-1], v.shape[-1], k.shape[2], (q.shape[1], k.shape[1])
    qh, kh, vh, outh, douth = _cuda_inputs(q, k, v, out, dout)
    douth = douth.contiguous()
    if cuda_variant(q.dtype, max(head_dim, v_head_dim)) == "flash":
        # no packed sequences and no dropout: cumulative lengths and the RNG state stay undefined (None), as
        # the forward returns them; a defined cum_seq tensor would select the varlen kernel
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            douth, qh, kh, vh, outh, lse, None, None, sq, sk, 0.0, causal, None, None, scale=scale
        )
    else:
        padded_rows = -(-sq // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN
        lse_padded = F.pad(lse.float(), (0, padded_rows - sq)).contiguous()  # [B, H, Sq padded to 32]
        seed = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            douth, qh, kh, vh, None, outh, lse_padded, seed, seed, 0.0, [True, True, True, False], causal, scale=scale
        )
    dq, dk, dv = (
        _seq_first(g[..., :d]) for g, d in ((dq, head_dim), (dk, head_dim), (dv, v_head_dim))
    )  # [B, S, H, D(v)]
    return dq, _sum_query_groups(dk, hkv), _sum_query_groups(dv, hkv)


def _cpu_band_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    band: Band,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aten CPU flash backward of a band piece through an additive mask (GQA as in :func:`_cpu_backward`)."""
    visible = band_mask(q.shape[1], k.shape[1], band, q.device)  # [Sq, Sk]
    lse = lse.masked_fill(~visible.any(dim=-1), 0.0)  # rows without keys: the kernel's own 0, not +inf
    return _cpu_backward(dout, q, k, v, out, lse, False, scale, mask=additive_mask(visible, q.dtype))
