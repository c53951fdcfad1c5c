"""The local attention kernel protocol shared by every backend.

Shape legend (used in every docstring of this package):
    B  batch size
    S  sequence length of this call (Sq for queries, Sk for keys/values)
    H  query heads, Hkv key/value heads (H % Hkv == 0; Hkv < H is GQA/MQA)
    D  head dimension

A kernel computes softmax attention of one query block against one key/value block
and returns the log-sum-exp (LSE) of each query row, which is what lets ring attention
merge partial results exactly.

Conventions every backend honours:
    q [B, Sq, H, D], k/v [B, Sk, Hkv, D]           (flash-attn layout), any strides
    out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] in the accumulation dtype
    (fp32, or fp64 for fp64 inputs: :func:`accumulation_dtype`)
    A row with no visible key returns out = 0 and lse = -inf.
    ``causal=True`` is only defined for square blocks (Sq == Sk); backends disagree on
    how to align a non-square causal mask, so :func:`check_qkv` refuses it.
    ``backward`` receives the *final* out and lse of the whole attention (not of this
    block) and returns this block's exact share of dq [B, Sq, H, D], dk/dv [B, Sk, Hkv, D],
    each in the input dtype. An lse of -inf marks a row with no key anywhere; its
    gradients are zero.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class AttentionKernel(Protocol):
    """What ring and hybrid attention need from a local attention implementation."""

    name: str

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, H, D], lse [B, H, Sq] fp32)."""
        ...

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
        """dout/out [B, Sq, H, D], lse [B, H, Sq] -> (dq [B, Sq, H, D], dk, dv [B, Sk, Hkv, D])."""
        ...


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of LSEs, merges and gradient accumulators: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is unit-stride (what fused kernels assume), else a contiguous copy.

    Note [strides]: the aten CPU flash kernel and flash-attn read the head dim as if
    ``stride(-1) == 1``; a transposed or sliced view (``y.transpose(-1, -2)``, ``x[..., ::2]``)
    would silently give garbage. Other strides (batch, sequence, heads) are honoured.
    """
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def default_softmax_scale(head_dim: int, softmax_scale: float | None) -> float:
    """The usual 1/sqrt(D) unless the caller chose a scale."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> None:
    """Raise ValueError, quoting the shapes, unless q/k/v form one valid attention call."""
    check_tensor_kinds(q, k, v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k and v must be 4-D [B, S, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)} and v {tuple(v.shape)}")
    (bq, sq, hq, dq), (bk, sk, hk, dk) = q.shape, k.shape
    if bq != bk or dq != dk:
        raise ValueError(
            f"q and k/v must share batch and head dim; got q {tuple(q.shape)} and k/v {tuple(k.shape)}"
        )
    if hq % hk != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hk}); change num_key_value_heads"
        )
    if causal and sq != sk:
        raise ValueError(
            f"causal attention is only defined here for square blocks; got {sq} queries and {sk} keys"
        )


def check_tensor_kinds(*tensors: torch.Tensor, names: tuple[str, ...] = ("q", "k", "v")) -> None:
    """Raise ValueError unless every tensor is a floating tensor of one dtype on one device."""
    named = list(zip(names, tensors))
    for name, tensor in named:
        if not torch.is_tensor(tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(tensor).__name__}")
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{name} has dtype {tensor.dtype}; attention needs floating tensors "
                f"(float16, bfloat16, float32 or float64): cast it, e.g. {name}.to(torch.bfloat16)"
            )
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) > 1:
        found = ", ".join(f"{n} {t.dtype}" for n, t in named)
        raise ValueError(f"{'/'.join(names)} must share one dtype; got {found}: cast them to one dtype")
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        found = ", ".join(f"{n} on {t.device}" for n, t in named)
        raise ValueError(f"{'/'.join(names)} must be on one device; got {found}: move them with .to(device)")


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Map -inf (row saw no key) to +inf so that exp(score - lse) is 0, not inf, in a backward."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
