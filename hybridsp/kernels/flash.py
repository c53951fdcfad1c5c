"""flash-attn 2.x behind the local attention kernel protocol (see :mod:`hybridsp.kernels.base`).

This is the only module of hybridsp that talks to flash-attn, and the only place where
its version differences live. It calls the low-level functions
``flash_attn.flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward`` because
they expose the log-sum-exp and accept the *final* out/lse in the backward, which is what
ring attention needs. flash-attn is imported lazily, when :class:`FlashAttnKernel` is
constructed, never when ``hybridsp`` or ``hybridsp.kernels`` is imported.

The low-level API as read from flash-attn's ``flash_attn/flash_attn_interface.py`` and
``csrc/flash_attn/flash_api.cpp`` (tags v2.4.0 to v2.8.3):

    2.7, 2.8   _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal,
                   window_size_left, window_size_right, softcap, alibi_slopes, return_softmax)
                 -> (out, softmax_lse, S_dmask, rng_state)
               _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                   softmax_scale, causal, window_size_left, window_size_right, softcap,
                   alibi_slopes, deterministic, rng_state=None)
                 -> softmax_d                       (dq/dk/dv are written in place)
               With torch >= 2.4 both are ``torch.library.custom_op`` objects whose
               ``inspect.signature`` is ``(*args, **kwargs)``. The C++ side refuses a head
               dim that is not a multiple of 8; the padding lives in the autograd wrappers
               (``FlashAttnFunc``), which this module does not use, so it pads itself.
    2.6        _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size,
                   softcap, alibi_slopes, return_softmax)
                 -> (out, q_padded, k_padded, v_padded, out_padded, softmax_lse, S_dmask, rng_state)
               _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   rng_state=None)
                 -> (dq, dk, dv, softmax_d)         (also written into the dq/dk/dv given)
               ``window_size`` is a (left, right) tuple; the C++ forward pads the head dim
               itself and the backward wants q/k/v/out already padded.
    2.4, 2.5   as 2.6 without ``softcap`` (2.4 also lacks the backward's ``deterministic``).

Every version: q [B, Sq, H, D], k/v [B, Sk, Hkv, D] with native GQA/MQA (dk/dv come back
with Hkv heads), fp16/bf16 only, last dim stride 1 (the Python wrappers fix q/k/v/out/dout,
but not the dq/dk/dv buffers), D <= 256, softmax_lse [B, H, Sq] fp32, and a row that sees
no key gets out 0 and lse **+inf** (our protocol says -inf, so this module converts both
ways). ``causal=True`` is aligned to the bottom-right corner of the score matrix in
flash-attn >= 2.1 (query i sees keys j <= i + Sk - Sq) while hybridsp's reference aligns it
top-left; the two agree on the square blocks that :func:`check_qkv` allows, so the
difference never shows here.

Rather than parse version strings, this module reads the argument names of the two
functions (falling back to the 2.7+ order when a custom op hides them) and fills each
argument by name; the forward's result is read by its length (4 or 8).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import torch

from hybridsp.kernels.band import flash_window
from hybridsp.kernels.base import (
    HALF_DTYPES,
    AttentionKernel,
    check_qkv,
    lse_for_backward,
    no_key_lse_to_neg_inf,
    no_key_result,
    padded_head_dim,
)
from hybridsp.kernels.flash_calls import FlashCalls, VarlenCalls, packed_lse

INSTALL_HINT = (
    "the 'flash' attention backend needs flash-attn 2.x on a CUDA machine: "
    "pip install hybridsp[flash] (or pass backend='torch' to use PyTorch's fused kernels)"
)

MAX_HEAD_DIM = 256  # flash-attn 2 forward and backward refuse larger (padded) head dims


def _to_flash(x: torch.Tensor, padded_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, S, H, D] -> [B, S, H, Dp] in ``dtype``, zero-padded, with a unit-stride last dim."""
    x = x.to(dtype)
    if x.shape[-1] != padded_dim:
        return torch.nn.functional.pad(x, (0, padded_dim - x.shape[-1]))  # [B, S, H, Dp]
    return x if x.stride(-1) == 1 else x.contiguous()  # [B, S, H, D]


def _from_flash(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, S, H, Dp] -> [B, S, H, D], dropping the padding columns."""
    if x.shape[-1] == head_dim:
        return x
    return x[..., :head_dim].contiguous()  # [B, S, H, D]


def _grad_buffer(like: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous [B, S, H, Dp] buffer for flash-attn to write a gradient into."""
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _check_flash_inputs(q: torch.Tensor, require_cuda: bool) -> None:
    """Raise ValueError for what flash-attn 2 cannot compute: fp32/fp64, head dim > 256, CPU tensors."""
    if require_cuda and q.device.type != "cuda":
        raise ValueError(f"flash-attn runs on CUDA only, got tensors on {q.device}; use backend='torch'")
    if q.dtype not in HALF_DTYPES:
        raise ValueError(
            f"flash-attn needs fp16 or bf16 inputs, got {q.dtype}; cast q/k/v to torch.bfloat16 "
            f"or use backend='torch', which also handles fp32"
        )
    if padded_head_dim(q.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(
            f"flash-attn 2 supports head dims up to {MAX_HEAD_DIM}, got {q.shape[-1]}; use backend='torch'"
        )


def _check_lse(lse: torch.Tensor, q: torch.Tensor) -> None:
    """Raise ValueError unless lse is [B, H, Sq] for q [B, Sq, H, D]."""
    b, s, h, _ = q.shape
    if tuple(lse.shape) != (b, h, s):
        raise ValueError(f"lse must be [B, H, Sq] = {(b, h, s)} for q {tuple(q.shape)}; got {tuple(lse.shape)}")


def _has_no_work(q: torch.Tensor, k: torch.Tensor) -> bool:
    """flash-attn refuses batch 0 and cannot backward an empty key block, so answer those here."""
    return q.numel() == 0 or k.shape[1] == 0


# --------------------------------------------------------------------------- kernel


def _import_flash_interface() -> ModuleType:
    """``flash_attn.flash_attn_interface``, or an ImportError that says how to install it."""
    try:
        return importlib.import_module("flash_attn.flash_attn_interface")
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} (importing flash_attn failed: {err})") from err


class FlashAttnKernel(AttentionKernel):
    """flash-attn 2.x kernels (see :mod:`hybridsp.kernels.base` for the protocol).

    ``interface`` is any object with flash-attn's ``_flash_attn_forward`` and
    ``_flash_attn_backward`` (tests pass a CPU stand-in); None imports the real
    ``flash_attn.flash_attn_interface`` and then insists on CUDA tensors. ``deterministic``
    is flash-attn's option for a reproducible (slower) backward, ignored by versions that lack it.
    """

    name = "flash"

    def __init__(self, interface: ModuleType | Any | None = None, *, deterministic: bool = False):
        self._calls = FlashCalls(_import_flash_interface() if interface is None else interface)
        self._require_cuda = interface is None  # a stand-in interface may run anywhere
        self.deterministic = deterministic

    @property
    def interface_style(self) -> str:
        """Which low-level calling convention was detected: '2.7+' or '2.4-2.6'."""
        return self._calls.style

    def check_inputs(self, q: torch.Tensor) -> None:
        """Raise ValueError for what flash-attn cannot run (CPU tensors, fp32/fp64, head dim > 256)."""
        _check_flash_inputs(q, self._require_cuda)

    def forward(self, q, k, v, *, causal: bool, softmax_scale: float):
        """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] fp32)."""
        check_qkv(q, k, v, causal=causal)
        _check_flash_inputs(q, self._require_cuda)
        if _has_no_work(q, k):
            return no_key_result(q)
        head_dim, padded = q.shape[-1], padded_head_dim(q.shape[-1])
        q_f, k_f, v_f = (_to_flash(x, padded, q.dtype) for x in (q, k, v))  # [B, S, H(kv), Dp]
        out, lse = self._calls.forward(q_f, k_f, v_f, causal, softmax_scale)
        lse = no_key_lse_to_neg_inf(lse[..., : q.shape[1]].float())  # [B, H, Sq]
        return _from_flash(out, head_dim), lse

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float):
        """dout/out [B, Sq, H, D], final lse [B, H, Sq] -> (dq [B, Sq, H, D], dk, dv [B, Sk, Hkv, D]).

        ``dout`` and ``out`` are cast to q's dtype if they differ (flash-attn requires it).
        """
        check_qkv(q, k, v, causal=causal)
        _check_flash_inputs(q, self._require_cuda)
        _check_lse(lse, q)
        if _has_no_work(q, k):
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        head_dim, padded = q.shape[-1], padded_head_dim(q.shape[-1])
        q_f, k_f, v_f, out_f, dout_f = (
            _to_flash(x, padded, q.dtype) for x in (q, k, v, out, dout)
        )  # [B, S, H(kv), Dp]
        dq, dk, dv = _grad_buffer(q_f), _grad_buffer(k_f), _grad_buffer(v_f)  # [B, S, H(kv), Dp]
        lse_f = lse_for_backward(lse.float()).contiguous()  # [B, H, Sq], no-key rows +inf
        self._calls.backward(
            dout_f, q_f, k_f, v_f, out_f, lse_f, dq, dk, dv, causal, softmax_scale, self.deterministic
        )
        return _from_flash(dq, head_dim), _from_flash(dk, head_dim), _from_flash(dv, head_dim)

    # ----------------------------------------------------------------- band pieces (hybridsp.layout.block_plan)

    def forward_band(self, q, k, v, *, band, softmax_scale: float):
        """A band piece (see :mod:`hybridsp.kernels.band`) as one flash-attn call with ``window_size``.

        q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, H, D], lse [B, H, Sq] fp32).
        """
        check_qkv(q, k, v, causal=False)
        _check_flash_inputs(q, self._require_cuda)
        if _has_no_work(q, k):
            return no_key_result(q)
        window = flash_window(q.shape[1], k.shape[1], band)
        head_dim, padded = q.shape[-1], padded_head_dim(q.shape[-1])
        q_f, k_f, v_f = (_to_flash(x, padded, q.dtype) for x in (q, k, v))  # [B, S, H(kv), Dp]
        out, lse = self._calls.forward(q_f, k_f, v_f, False, softmax_scale, window)
        lse = no_key_lse_to_neg_inf(lse[..., : q.shape[1]].float())  # [B, H, Sq]
        return _from_flash(out, head_dim), lse

    def backward_band(self, dout, q, k, v, out, lse, *, band, softmax_scale: float):
        """This band piece's (dq [B, Sq, H, D], dk, dv [B, Sk, Hkv, D]) given the final out/lse."""
        check_qkv(q, k, v, causal=False)
        _check_flash_inputs(q, self._require_cuda)
        _check_lse(lse, q)
        if _has_no_work(q, k):
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        window = flash_window(q.shape[1], k.shape[1], band)
        head_dim, padded = q.shape[-1], padded_head_dim(q.shape[-1])
        q_f, k_f, v_f, out_f, dout_f = (_to_flash(x, padded, q.dtype) for x in (q, k, v, out, dout))
        dq, dk, dv = _grad_buffer(q_f), _grad_buffer(k_f), _grad_buffer(v_f)  # [B, S, H(kv), Dp]
        lse_f = lse_for_backward(lse.float()).contiguous()  # [B, H, Sq]
        self._calls.backward(
            dout_f, q_f, k_f, v_f, out_f, lse_f, dq, dk, dv, False, softmax_scale, self.deterministic, window
        )
        return _from_flash(dq, head_dim), _from_flash(dk, head_dim), _from_flash(dv, head_dim)

    # ----------------------------------------------------------------- varlen (many pieces, one call)

    @property
    def supports_varlen(self) -> bool:
        """True when the interface has ``_flash_attn_varlen_forward/backward`` (flash-attn 2.7+)."""
        return self._varlen is not None

    @functools.cached_property
    def _varlen(self) -> "VarlenCalls | None":
        """The varlen calls, read from the interface on first use (None when it has none)."""
        return VarlenCalls.of(self._calls.interface)

    def forward_varlen(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                       window: tuple[int, int], softmax_scale: float):
        """Packed sequences in one call (``flash_attn_varlen_func``'s kernel).

        q [Tq, H, D], k/v [Tk, Hkv, D], ``cu_seqlens_q/k`` int32 [N + 1] (sequence i is rows
        ``cu[i]:cu[i+1]``), ``window`` flash-attn's (left, right) measured from each sequence's
        bottom-right diagonal (``(-1, 0)`` is causal) -> (out [Tq, H, D], lse [H, Tq] fp32, -inf
        for rows without keys).
        """
        _check_flash_inputs(q, self._require_cuda)
        head_dim, padded = q.shape[-1], padded_head_dim(q.shape[-1])
        q_f, k_f, v_f = (_to_flash(x, padded, q.dtype) for x in (q, k, v))  # [T, H(kv), Dp]
        out, lse = self._varlen.forward(q_f, k_f, v_f, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, window)
        return _from_flash(out, head_dim), no_key_lse_to_neg_inf(packed_lse(lse, cu_seqlens_q).float())

    def backward_varlen(self, dout, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                        max_seqlen_k: int, window: tuple[int, int], softmax_scale: float):
        """Gradients of :meth:`forward_varlen`'s pieces given the final out [Tq, H, D] and lse [H, Tq]."""
        _check_flash_inputs(q, self._require_cuda)
        head_dim, padded = q.shape[-1], padded_head_dim(q.shape[-1])
        q_f, k_f, v_f, out_f, dout_f = (_to_flash(x, padded, q.dtype) for x in (q, k, v, out, dout))
        dq, dk, dv = _grad_buffer(q_f), _grad_buffer(k_f), _grad_buffer(v_f)  # [T, H(kv), Dp]
        lse_f = lse_for_backward(lse.float()).contiguous()  # [H, Tq]
        self._varlen.backward(dout_f, q_f, k_f, v_f, out_f, lse_f, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, softmax_scale, self.deterministic, window)
        return _from_flash(dq, head_dim), _from_flash(dk, head_dim), _from_flash(dv, head_dim)
