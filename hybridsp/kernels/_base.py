"""The local attention kernel protocol shared by every backend.

Shape legend (used in every docstring of this package):
    B  batch size
    S  sequence length of this call (Sq for queries, Sk for keys/values)
    H  query heads, Hkv key/value heads (H % Hkv == 0; Hkv < H is GQA/MQA)
    D  head dimension of q and k; Dv the head dimension of v and out (Dv == D unless a model's
       values are narrower or wider, e.g. DeepSeek-V3's MLA: D 192, Dv 128)

A kernel computes softmax attention of one query block against one key/value block
and returns the log-sum-exp (LSE) of each query row, which is what lets ring attention
merge partial results exactly.

Conventions every backend honours:
    q [B, Sq, H, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv]   (flash-attn layout), any strides
    out [B, Sq, H, Dv] in q's dtype, lse [B, H, Sq] in the accumulation dtype
    (fp32, or fp64 for fp64 inputs: :func:`accumulation_dtype`)
    A row with no visible key returns out = 0 and lse = -inf.
    ``causal=True`` is only defined for square blocks (Sq == Sk); backends disagree on
    how to align a non-square causal mask, so :func:`check_qkv` refuses it.
    ``backward`` receives the *final* out and lse of the whole attention (not of this
    block) and returns this block's exact share of dq [B, Sq, H, D], dk/dv [B, Sk, Hkv, D],
    each in the input dtype. An lse of -inf marks a row with no key anywhere; its
    gradients are zero.
    Soft-capping (Gemma 2's ``attn_logit_softcapping``): a kernel with ``supports_softcap`` takes
    ``softcap=c`` in every call and computes with scores ``c * tanh(scale * q.k / c)`` (the cap
    after the softmax scale, before any mask); its lse is the log-sum-exp of the capped scores.
    Callers pass ``softcap=`` only when it is set (:func:`softcap_kwargs`), so a kernel without
    it keeps its plain signatures.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

Band = tuple[int | None, int | None]  # (lo, hi): row i sees column j iff lo <= i - j <= hi, None unbounded (._band)


class AttentionKernel(Protocol):
    """What ring and hybrid attention need from a local attention implementation.

    Every member is called without discovery. A kernel declares the protocol by subclassing this
    class, which also gives it the documented defaults: :meth:`check_inputs` accepts everything
    that :func:`check_qkv` accepts, ``supports_varlen`` is False and the varlen calls raise.
    A user's object that does not subclass it (only ``forward``/``backward``, say) is completed
    in one place, :func:`hybridsp.kernels._select.complete_kernel`.
    """

    name: str
    supports_varlen: bool = False  # True: forward_varlen/backward_varlen run many pieces per call
    supports_softcap: bool = False  # True: every call takes softcap=c (the module docstring)

    def check_inputs(self, q: torch.Tensor) -> None:
        """Raise ValueError for q [B, S, H, D] this kernel cannot run (device, dtype, head dim).

        Called once per call, before any communication. Default: no extra restriction."""
        return None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Sq, H, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] -> (out [B, Sq, H, Dv], lse [B, H, Sq] fp32)."""
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
        """dout/out [B, Sq, H, Dv], lse [B, H, Sq] -> (dq [B, Sq, H, D], dk [B, Sk, Hkv, D], dv [B, Sk, Hkv, Dv])."""
        ...

    def forward_band(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, band: Band, softmax_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A band piece (:mod:`hybridsp.kernels._band`): shapes as :meth:`forward`."""
        ...

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
        """This band piece's share of the gradients: shapes as :meth:`backward`."""
        ...

    def forward_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        window: tuple[int, int],
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed pieces in one call (only when ``supports_varlen``): q [Tq, H, D], k/v [Tk, Hkv, D]
        -> (out [Tq, H, D], lse [H, Tq] fp32); see :mod:`hybridsp.attention._varlen`."""
        # the message in a variable: a body that only raises would make type checkers read this
        # documented default as abstract (and refuse to instantiate the subclasses that keep it)
        message = f"the {self.name!r} kernel has no varlen calls (supports_varlen is False)"
        raise NotImplementedError(message)

    def backward_varlen(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        window: tuple[int, int],
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of :meth:`forward_varlen`'s pieces (only when ``supports_varlen``)."""
        message = f"the {self.name!r} kernel has no varlen calls (supports_varlen is False)"  # see forward_varlen
        raise NotImplementedError(message)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # every dtype attention accepts
HALF_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_ALIGN = 8  # fused CUDA kernels and flash-attn want head dims that are multiples of this


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of LSEs, merges and gradient accumulators: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``: itself when it already is (without the dispatch a no-op ``.to`` still costs)."""
    return x if x.dtype == dtype else x.to(dtype)


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is unit-stride (what fused kernels assume), else a contiguous copy.

    Note [strides]: the aten CPU flash kernel and flash-attn read the head dim as if
    ``stride(-1) == 1``; a transposed or sliced view (``y.transpose(-1, -2)``, ``x[..., ::2]``)
    would silently give garbage. Other strides (batch, sequence, heads) are honoured.
    """
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def padded_head_dim(head_dim: int) -> int:
    """``head_dim`` rounded up to a multiple of :data:`HEAD_DIM_ALIGN` (zero columns are exact)."""
    return -(-head_dim // HEAD_DIM_ALIGN) * HEAD_DIM_ALIGN


def expand_kv_heads(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, H, D] by repeating each K/V head for its query group."""
    return x.repeat_interleave(num_q_heads // x.shape[2], dim=2)  # [B, S, H, D]


def reduce_kv_heads(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, S, H, D] -> [B, S, Hkv, D] by summing the gradients of each query group."""
    b, s, h, d = x.shape
    return x.reshape(b, s, num_kv_heads, h // num_kv_heads, d).sum(dim=3)  # [B, S, Hkv, D]


def default_softmax_scale(head_dim: int, softmax_scale: float | None) -> float:
    """The usual 1/sqrt(D) unless the caller chose a scale."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def softcap_kwargs(softcap: float | None) -> dict[str, float]:
    """``{"softcap": c}`` for a kernel call when soft-capping is on, else ``{}`` (plain signatures)."""
    return {} if softcap is None else {"softcap": softcap}


def apply_softcap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Scaled scores (any shape) -> ``c * tanh(scores / c)``; unchanged when ``softcap`` is None."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> None:
    """Raise ValueError, quoting the shapes, unless q/k/v form one valid attention call
    (q [B, Sq, H, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv]; Dv may differ from D)."""
    if _valid_qkv(q, k, v, causal):  # the common case, decided without building any message
        return
    check_tensor_kinds(q, k, v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k and v must be 4-D [B, S, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3] or v.shape[-1] < 1:
        raise ValueError(
            f"k and v must share batch, tokens and heads (their head dims may differ); got k {tuple(k.shape)} "
            f"and v {tuple(v.shape)}"
        )
    (bq, sq, hq, dq), (bk, sk, hk, dk) = q.shape, k.shape
    if bq != bk or dq != dk:
        raise ValueError(f"q and k/v must share batch and head dim; got q {tuple(q.shape)} and k/v {tuple(k.shape)}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            f"query heads ({hq}, q's dim 2) must be a multiple of key/value heads ({hk}, k/v's dim 2) for GQA; pass "
            f"q [B, S, H, D] and k/v [B, S, H_kv, D] with H_kv dividing H (num_key_value_heads dividing "
            f"num_attention_heads)"
        )
    if causal and sq != sk:
        raise ValueError(f"causal attention is only defined here for square blocks; got {sq} queries and {sk} keys")


def _valid_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """Whether :func:`check_qkv` passes, in one expression (it runs on every kernel call)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    (bq, sq, hq, dq), (bk, sk, hk, dk), (bv, sv, hv, dv) = q.shape, k.shape, v.shape
    return (
        q.dtype in FLOAT_DTYPES
        and q.dtype == k.dtype == v.dtype
        and q.device == k.device == v.device
        and bq == bk == bv
        and sk == sv
        and hk == hv
        and dq == dk
        and dv >= 1
        and hk > 0
        and hq % hk == 0
        and (sq == sk or not causal)
    )


def _same_float_kind(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether every one of ``tensors`` is a floating tensor of the first one's dtype and device."""
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or first.dtype not in FLOAT_DTYPES:
        return False
    return all(isinstance(t, torch.Tensor) and t.dtype == first.dtype and t.device == first.device for t in tensors[1:])


def check_tensor_kinds(*tensors: torch.Tensor, names: tuple[str, ...] = ("q", "k", "v")) -> None:
    """Raise ValueError unless every tensor is a floating tensor of one dtype on one device."""
    if _same_float_kind(tensors):  # the common case, checked without building any message
        return
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


# Note [no key]: the protocol marks a query row that saw no key with lse -inf (and out 0).
# flash-attn and the CUDA flash kernel say +inf instead (no_key_lse_to_neg_inf maps theirs);
# to compute exp(score - lse) for such a row, lse -inf becomes +inf (lse_for_backward), so the
# probabilities are 0, not inf or nan.


def no_key_result(
    q: torch.Tensor, lse_dtype: torch.dtype | None = None, v_head_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """out = 0 [B, Sq, H, Dv] (Dv: ``v_head_dim``, default q's) and lse = -inf [B, H, Sq] (``lse_dtype``,
    default the accumulation dtype) for a call in which no query row sees a key (Note [no key])."""
    b, s, h, d = q.shape
    dtype = accumulation_dtype(q.dtype) if lse_dtype is None else lse_dtype
    out = q.new_zeros(b, s, h, d if v_head_dim is None else v_head_dim)  # [B, Sq, H, Dv]
    return out, torch.full((b, h, s), -torch.inf, device=q.device, dtype=dtype)


def no_key_lse_to_neg_inf(lse: torch.Tensor) -> torch.Tensor:
    """lse (any shape): +inf, some kernels' marker of a row that saw no key, becomes -inf (Note [no key])."""
    return lse.nan_to_num(nan=math.nan, posinf=-math.inf, neginf=-math.inf)  # one elementwise op; NaN stays


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Map -inf (row saw no key) to +inf so that exp(score - lse) is 0, not inf (Note [no key]); NaN and
    +inf stay. One elementwise op (a compare and a fill were two, and ~10x slower on [1, 8, 8192])."""
    return lse.nan_to_num(nan=math.nan, posinf=math.inf, neginf=math.inf)
