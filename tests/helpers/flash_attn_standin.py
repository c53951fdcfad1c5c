"""A STAND-IN for ``flash_attn.flash_attn_interface`` used by the tests. It is NOT flash-attn.

flash-attn needs CUDA and cannot be installed on the CPU machines the tests run on, so this
module reproduces the *interface* of its two low-level functions, with plain fp32 torch math
on CPU, so that :class:`hybridsp.kernels._flash.FlashAttnKernel` can be tested anywhere.

The module-level ``_flash_attn_forward`` / ``_flash_attn_backward`` copy flash-attn 2.8's
argument names and order, return tuples and conventions (read from flash-attn v2.8.3's
``flash_attn/flash_attn_interface.py`` and ``csrc/flash_attn/flash_api.cpp``):

* fp16/bf16 only (RuntimeError otherwise), head dim a multiple of 8 and at most 256, H a
  multiple of Hkv (native GQA: query head h reads K/V head h // (H // Hkv));
* q/k/v (and dout/out) with a strided last dim are made contiguous, as flash-attn's Python
  wrapper does, but the dq/dk/dv buffers must have a unit-stride last dim;
* ``causal`` is aligned bottom-right (query i sees keys j <= i + Sk - Sq), sliding windows
  are measured from that diagonal;
* lse is [B, H, Sq] fp32, +inf for a row that sees no key (whose out is 0);
* the backward writes dq/dk/dv into the buffers given and returns softmax_d
  [B, H, round_up(Sq, 128)] fp32;
* ``softcap > 0`` (2.6+) caps the scaled scores before the mask: ``softcap * tanh(scale q.k / softcap)``
  (flash_api.cpp sets ``params.softcap = softmax_scale / softcap`` and ``scale_softmax = softcap``;
  the kernel applies ``tanh`` to ``q.k * params.softcap``), the lse is that of the capped scores and
  the backward multiplies the score gradient by ``1 - tanh^2``; v must have q's head dim
  (flash-attn 2 checks v against ``head_size_og``).

It is stricter than flash-attn in one way: it rejects a non-contiguous or non-fp32
softmax_lse in the backward (the real kernel would silently read it with the wrong strides).
Dropout, ALiBi and ``return_softmax=True`` are not modelled (NotImplementedError).

:func:`make_standin` builds variants with older calling conventions (2.4, 2.5, 2.6), a 2.8
variant registered as real ``torch.library.custom_op`` objects (as flash-attn >= 2.7 does on
torch >= 2.4; their ``inspect.signature`` is ``(*args, **kwargs)``), and a 2.8 variant whose
signature cannot be recovered at all, so the adapter's version shims are tested. (The first
call through a custom op imports much of torch's compiler stack, ~2 s, so the fast tests only
register the custom ops and call the "2.8-opaque" variant.)
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional, Tuple

import torch

__version__ = "2.8.3-standin"

_HALF = (torch.float16, torch.bfloat16)


def _check(condition: bool, message: str) -> None:
    """flash-attn's TORCH_CHECK raises RuntimeError."""
    if not condition:
        raise RuntimeError(message)


def _maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _round_multiple(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _refuse_unmodelled(dropout_p, softcap, alibi_slopes, return_softmax=False) -> None:
    if dropout_p != 0.0 or alibi_slopes is not None or return_softmax:
        raise NotImplementedError("the flash-attn stand-in models no dropout, ALiBi or return_softmax")
    _check(softcap >= 0.0, "stand-in: softcap must be >= 0 (0 switches it off)")


def _check_inputs(q, k, v, *, padded_head_dim: bool = True) -> None:
    """The checks flash-attn's C++ forward/backward apply to q/k/v."""
    _check(q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    for x in (q, k, v):
        _check(x.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    b, _, h, d = q.shape
    _check(b > 0, "batch size must be positive")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    if padded_head_dim:
        _check(d % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    _check(h % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query")
    _check(k.shape == (b, k.shape[1], k.shape[2], d) and v.shape == k.shape, "k/v have the wrong shape")


def _window(sq: int, sk: int, causal: bool, left: int, right: int) -> tuple[int, int]:
    """flash-attn's normalisation of (window_size_left, window_size_right)."""
    left = -1 if left >= sk else left
    right = -1 if right >= sk else right
    if sq == 1:
        causal = False
    return (left, 0) if causal else (left, right)


def _visible(sq: int, sk: int, left: int, right: int, device) -> torch.Tensor:
    """[Sq, Sk] mask, True where query i may see key j, windows measured bottom-right."""
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    diagonal = i + sk - sq
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= diagonal + right
    if left >= 0:
        visible &= j >= diagonal - left
    return visible


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, H, D] fp32."""
    return x.float().repeat_interleave(heads // x.shape[2], dim=2)  # [B, S, H, D]


def _probs(q, k, scale, left, right, lse=None, softcap=0.0):
    """(fp32 probabilities [B, H, Sq, Sk], lse [B, H, Sq] with +inf for rows without keys, and the
    derivative of the capped score by the scaled one [B, H, Sq, Sk], 1 without softcap)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), _expand(k, q.shape[2])) * scale  # [B, H, Sq, Sk]
    slope = torch.ones((), device=q.device)
    if softcap > 0:
        tanh = torch.tanh(scores / softcap)  # [B, H, Sq, Sk]
        scores, slope = tanh * softcap, 1 - tanh * tanh
    visible = _visible(q.shape[1], k.shape[1], left, right, q.device)
    scores = scores.masked_fill(~visible, -math.inf)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)  # [B, H, Sq]
        lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
    return torch.exp(scores - lse.unsqueeze(-1)), lse, slope


def _attention_forward(q, k, v, scale, causal, left, right, softcap=0.0):
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] fp32)."""
    b, sq, h, _ = q.shape
    if k.shape[1] == 0:  # flash-attn: "If seqlen_k == 0 ... set the output to 0", lse +inf
        return torch.zeros_like(q), torch.full((b, h, sq), math.inf, device=q.device)
    left, right = _window(sq, k.shape[1], causal, left, right)
    probs, lse, _ = _probs(q, k, scale, left, right, softcap=softcap)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, _expand(v, h))  # [B, Sq, H, D]
    return out.to(q.dtype), lse


def _attention_backward(dout, q, k, v, out, lse, scale, causal, left, right, softcap=0.0):
    """fp32 (dq [B, Sq, H, D], dk/dv [B, Sk, Hkv, D], softmax_d [B, H, Sq]) from the given out/lse."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    left, right = _window(sq, sk, causal, left, right)
    probs, _, slope = _probs(q, k, scale, left, right, lse=lse.float(), softcap=softcap)  # [B, H, Sq, Sk]
    dout32 = dout.float()
    softmax_d = (dout32 * out.float()).sum(-1).transpose(1, 2)  # [B, H, Sq]
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, dout32)  # [B, Sk, H, D]
    dprobs = torch.einsum("bqhd,bkhd->bhqk", dout32, _expand(v, h))  # [B, H, Sq, Sk]
    dscores = probs * (dprobs - softmax_d.unsqueeze(-1)) * slope * scale  # [B, H, Sq, Sk]
    dq = torch.einsum("bhqk,bkhd->bqhd", dscores, _expand(k, h))  # [B, Sq, H, D]
    dk = torch.einsum("bhqk,bqhd->bkhd", dscores, q.float())  # [B, Sk, H, D]
    dk = dk.reshape(b, sk, hkv, h // hkv, d).sum(3)  # [B, Sk, Hkv, D]
    dv = dv.reshape(b, sk, hkv, h // hkv, d).sum(3)  # [B, Sk, Hkv, D]
    return dq, dk, dv, softmax_d


def _check_backward(dout, q, k, v, out, softmax_lse) -> None:
    for name, x in (("out", out), ("dout", dout)):
        _check(x.dtype == q.dtype, f"query and {name} must have the same dtype")
        _check(x.stride(-1) == 1, f"{name} tensor must have contiguous last dimension")
    _check(out.shape == q.shape, "out has the wrong shape")
    b, sq, h, _ = q.shape
    _check(softmax_lse.dtype == torch.float32, "stand-in: softmax_lse must be fp32")
    _check(tuple(softmax_lse.shape) == (b, h, sq), "stand-in: softmax_lse must be [B, H, Sq]")
    _check(softmax_lse.is_contiguous(), "stand-in: softmax_lse must be contiguous (the kernel assumes it)")


def _fill_buffer(buffer, value, like, name):
    """Write ``value`` into the caller's buffer (checked like flash-attn) or a fresh one."""
    if buffer is None:
        return value.to(like.dtype)
    _check(buffer.dtype == like.dtype, f"{name} must have the same dtype as q")
    _check(buffer.stride(-1) == 1, f"{name} must have contiguous last dimension")
    _check(buffer.shape == like.shape, f"{name} has the wrong shape")
    buffer.copy_(value)
    return buffer


def _softmax_d_padded(softmax_d: torch.Tensor) -> torch.Tensor:
    """[B, H, Sq] -> [B, H, round_up(Sq, 128)] as flash-attn allocates it."""
    b, h, sq = softmax_d.shape
    padded = torch.zeros(b, h, _round_multiple(sq, 128), dtype=torch.float32, device=softmax_d.device)
    padded[..., :sq] = softmax_d
    return padded


def _rng_state(q):
    return torch.zeros(2, dtype=torch.int64, device=q.device)


# --------------------------------------------------------------------------- flash-attn 2.8


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn 2.8's signature -> (out, softmax_lse, S_dmask, rng_state)."""
    q, k, v = [_maybe_contiguous(x) for x in (q, k, v)]
    _refuse_unmodelled(dropout_p, softcap, alibi_slopes, return_softmax)
    _check_inputs(q, k, v)
    out, lse = _attention_forward(q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap)
    s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    return out, lse, s_dmask, _rng_state(q)


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """flash-attn 2.8's signature; fills dq/dk/dv in place and returns softmax_d."""
    dout, q, k, v, out = [_maybe_contiguous(x) for x in (dout, q, k, v, out)]
    _refuse_unmodelled(dropout_p, softcap, alibi_slopes)
    _check_inputs(q, k, v)
    _check_backward(dout, q, k, v, out, softmax_lse)
    grads = _attention_backward(
        dout, q, k, v, out, softmax_lse, softmax_scale, causal, window_size_left, window_size_right, softcap
    )
    for buffer, value, like, name in zip((dq, dk, dv), grads[:3], (q, k, v), ("dq", "dk", "dv")):
        _fill_buffer(buffer, value, like, name)  # a buffer of None is allocated and lost, as in 2.8
    return _softmax_d_padded(grads[3])


# --------------------------------------------------------------------------- older versions


def _pad8(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, (-x.shape[-1]) % 8))


def _old_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    """flash-attn <= 2.6: pads the head dim itself, returns an 8-tuple."""
    q, k, v = [_maybe_contiguous(x) for x in (q, k, v)]
    _refuse_unmodelled(dropout_p, softcap, alibi_slopes, return_softmax)
    _check_inputs(q, k, v, padded_head_dim=False)
    head_dim = q.shape[-1]
    q_p, k_p, v_p = _pad8(q), _pad8(k), _pad8(v)
    out_p, lse = _attention_forward(q_p, k_p, v_p, softmax_scale, causal, *window_size, softcap)
    s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    return out_p[..., :head_dim], q_p, k_p, v_p, out_p, lse, s_dmask, _rng_state(q)


def _old_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state,
):
    """flash-attn <= 2.6: q/k/v/out padded, dout maybe not; returns (dq, dk, dv, softmax_d)."""
    dout, q, k, v, out = [_maybe_contiguous(x) for x in (dout, q, k, v, out)]
    _refuse_unmodelled(dropout_p, softcap, alibi_slopes)
    _check_inputs(q, k, v)
    _check(
        q.shape[-1] == _round_multiple(dout.shape[-1], 8), "head_size must be head_size_og rounded to a multiple of 8"
    )
    dout = _pad8(dout)
    _check_backward(dout, q, k, v, out, softmax_lse)
    grads = _attention_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, *window_size, softcap)
    filled = [
        _fill_buffer(buffer, value, like, name)
        for buffer, value, like, name in zip((dq, dk, dv), grads[:3], (q, k, v), ("dq", "dk", "dv"))
    ]
    return (*filled, _softmax_d_padded(grads[3]))


def _forward_2_6(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    """flash-attn 2.6's signature -> (out, q_pad, k_pad, v_pad, out_pad, softmax_lse, S_dmask, rng_state)."""
    return _old_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax)


def _backward_2_6(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    """flash-attn 2.6's signature -> (dq, dk, dv, softmax_d)."""
    return _old_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state,
    )


def _forward_2_5(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    """flash-attn 2.4/2.5's signature (no softcap) -> the 8-tuple of 2.6."""
    return _old_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, 0.0, alibi_slopes, return_softmax)


def _backward_2_5(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    """flash-attn 2.5's signature (no softcap) -> (dq, dk, dv, softmax_d)."""
    return _old_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        0.0,
        alibi_slopes,
        deterministic,
        rng_state,
    )


def _backward_2_4(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    alibi_slopes,
    rng_state=None,
):
    """flash-attn 2.4's signature (no softcap, no deterministic) -> (dq, dk, dv, softmax_d)."""
    return _old_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        0.0,
        alibi_slopes,
        False,
        rng_state,
    )


_CUSTOM_OPS: dict[str, object] = {}


def _custom_op_pair():
    """The 2.8 functions registered as torch custom ops (CPU), as flash-attn >= 2.7 does on CUDA."""
    if not _CUSTOM_OPS:
        fwd = torch.library.custom_op(
            "hybridsp_flash_standin::_flash_attn_forward", mutates_args=(), device_types="cpu"
        )(_flash_attn_forward)
        bwd = torch.library.custom_op(
            "hybridsp_flash_standin::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu"
        )(_flash_attn_backward)
        _CUSTOM_OPS.update(forward=fwd, backward=bwd)
    return _CUSTOM_OPS["forward"], _CUSTOM_OPS["backward"]


def _opaque(function):
    """Hide ``function``'s signature behind (*args, **kwargs), with no way to recover it."""

    def call(*args, **kwargs):
        return function(*args, **kwargs)

    return call


VERSIONS = ("2.8", "2.8-opaque", "2.8-custom-op", "2.6", "2.5", "2.4")


def make_standin(version: str = "2.8") -> SimpleNamespace:
    """A stand-in interface object with the calling convention of flash-attn ``version``."""
    if version == "2.8":
        forward, backward = _flash_attn_forward, _flash_attn_backward
    elif version == "2.8-opaque":
        forward, backward = _opaque(_flash_attn_forward), _opaque(_flash_attn_backward)
    elif version == "2.8-custom-op":
        forward, backward = _custom_op_pair()
    elif version == "2.6":
        forward, backward = _forward_2_6, _backward_2_6
    elif version == "2.5":
        forward, backward = _forward_2_5, _backward_2_5
    elif version == "2.4":
        forward, backward = _forward_2_5, _backward_2_4
    else:
        raise ValueError(f"no stand-in for flash-attn {version!r}; choose one of {VERSIONS}")
    return SimpleNamespace(__version__=f"{version}-standin", _flash_attn_forward=forward, _flash_attn_backward=backward)


# --------------------------------------------------------------------------- varlen (flash-attn 2.7/2.8)


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """The checks flash-attn's C++ varlen_fwd/varlen_bwd apply: packed [total, H, D], int32 boundaries."""
    _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "varlen q/k/v must be [total, H, D]")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check(cu.dtype == torch.int32, f"{name} must have dtype int32")
        _check(cu.is_contiguous(), f"{name} must be contiguous")
    _check(cu_seqlens_q.numel() == cu_seqlens_k.numel(), "cu_seqlens_q and cu_seqlens_k must have the same size")
    _check(int(cu_seqlens_q[-1]) == q.shape[0] and int(cu_seqlens_k[-1]) == k.shape[0], "cu_seqlens end wrong")
    lengths_q, lengths_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    _check(int(lengths_q.max()) <= max_seqlen_q and int(lengths_k.max()) <= max_seqlen_k, "max_seqlen too small")
    _check_inputs(q[None], k[None], v[None])


def _sequences(cu_seqlens_q, cu_seqlens_k):
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(slice(a, b), slice(c, d)) for a, b, c, d in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:])]


def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn 2.8's varlen signature -> (out [total_q, H, D], softmax_lse [H, total_q], S_dmask, rng_state).
    Each sequence is attended on its own; causal and windows are aligned bottom-right per sequence."""
    q, k, v = [_maybe_contiguous(x) for x in (q, k, v)]
    _refuse_unmodelled(dropout_p, softcap, alibi_slopes, return_softmax)
    _check(block_table is None and leftpad_k is None and seqused_k is None, "stand-in: no paged/leftpad K/V")
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, device=q.device)
    for rows, keys in _sequences(cu_seqlens_q, cu_seqlens_k):
        o, lse_rows = _attention_forward(
            q[None, rows],
            k[None, keys],
            v[None, keys],
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            softcap,
        )
        out[rows], lse[:, rows] = o[0], lse_rows[0]
    return out, lse, torch.empty((0,), dtype=q.dtype, device=q.device), _rng_state(q)


def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """flash-attn 2.8's varlen signature; fills dq/dk/dv in place, returns softmax_d [H, total_q + 128 B]."""
    dout, q, k, v, out = [_maybe_contiguous(x) for x in (dout, q, k, v, out)]
    _refuse_unmodelled(dropout_p, softcap, alibi_slopes)
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check(softmax_lse.dtype == torch.float32 and softmax_lse.is_contiguous(), "stand-in: lse fp32 contiguous")
    _check(tuple(softmax_lse.shape) == (q.shape[1], q.shape[0]), "stand-in: varlen softmax_lse must be [H, total_q]")
    grads = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v)]
    softmax_d = torch.zeros(q.shape[1], q.shape[0] + 128 * (cu_seqlens_q.numel() - 1), device=q.device)
    for rows, keys in _sequences(cu_seqlens_q, cu_seqlens_k):
        gq, gk, gv, d = _attention_backward(
            dout[None, rows],
            q[None, rows],
            k[None, keys],
            v[None, keys],
            out[None, rows],
            softmax_lse[None, :, rows],
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            softcap,
        )
        grads[0][rows], grads[1][keys], grads[2][keys] = gq[0], gk[0], gv[0]  # sequences do not share keys
        softmax_d[:, rows] = d[0]
    for buffer, value, like, name in zip((dq, dk, dv), grads, (q, k, v), ("dq", "dk", "dv")):
        _fill_buffer(buffer, value, like, name)
    return softmax_d


def with_varlen(standin: SimpleNamespace, opaque: bool = False) -> SimpleNamespace:
    """``standin`` plus flash-attn 2.8's ``_flash_attn_varlen_forward/backward`` (signatures hidden if ``opaque``)."""
    forward, backward = _flash_attn_varlen_forward, _flash_attn_varlen_backward
    if opaque:
        forward, backward = _opaque(forward), _opaque(backward)
    return SimpleNamespace(**vars(standin), _flash_attn_varlen_forward=forward, _flash_attn_varlen_backward=backward)
