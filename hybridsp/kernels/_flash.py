"""flash-attn 2.x behind the local attention kernel protocol (see :mod:`hybridsp.kernels._base`).

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

Note [value head dim]: flash-attn 2 wants v with q's head dim. A v of another head dim Dv (MLA:
D 192, Dv 128) is zero-padded to ``W = max(D, Dv)`` rounded up to 8 (as q/k are: zero columns are
exact) and out/dv are cut back to Dv; the padding costs ``W - Dv`` columns of v, out, dout and dv
in the kernel's memory and work, nothing on the wire. Soft-capping: ``softcap > 0`` (2.6+;
``supports_softcap`` says whether the installed calls take it) caps the scaled scores,
``softcap * tanh(scale q.k / softcap)``, in forward and backward alike.

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

from hybridsp.kernels._band import flash_window
from hybridsp.kernels._base import (
    HALF_DTYPES,
    AttentionKernel,
    Band,
    check_qkv,
    lse_for_backward,
    no_key_lse_to_neg_inf,
    no_key_result,
    padded_head_dim,
)
from hybridsp.kernels._flash_calls import FlashCalls, VarlenCalls, packed_lse

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


def _flash_width(q: torch.Tensor, v: torch.Tensor) -> int:
    """The one head dim flash-attn 2 computes with (Note [value head dim]): max(D, Dv) rounded up to 8."""
    return padded_head_dim(max(q.shape[-1], v.shape[-1]))


def _flash_softcap(softcap: float | None) -> float:
    """flash-attn's spelling of soft-capping: 0.0 is off."""
    return 0.0 if softcap is None else float(softcap)


def _band_window(q: torch.Tensor, k: torch.Tensor, band: Band) -> tuple[int, int]:
    """flash-attn's window of a band piece on q [B, Sq, ...] x k [B, Sk, ...]."""
    return flash_window(q.shape[1], k.shape[1], band)


def _check_flash_inputs(q: torch.Tensor, require_cuda: bool, v: torch.Tensor | None = None) -> None:
    """Raise ValueError for what flash-attn 2 cannot compute: fp32/fp64, head dim > 256 (q's or, when
    given, v's), CPU tensors."""
    if require_cuda and q.device.type != "cuda":
        raise ValueError(f"flash-attn runs on CUDA only, got tensors on {q.device}; use backend='torch'")
    if q.dtype not in HALF_DTYPES:
        raise ValueError(
            f"flash-attn needs fp16 or bf16 inputs, got {q.dtype}; cast q/k/v to torch.bfloat16 "
            f"or use backend='torch', which also handles fp32"
        )
    widest = q.shape[-1] if v is None else max(q.shape[-1], v.shape[-1])
    if padded_head_dim(widest) > MAX_HEAD_DIM:
        raise ValueError(f"flash-attn 2 supports head dims up to {MAX_HEAD_DIM}, got {widest}; use backend='torch'")


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
    """flash-attn 2.x kernels (see :mod:`hybridsp.kernels._base` for the protocol).

    ``interface`` is any object with flash-attn's ``_flash_attn_forward`` and
    ``_flash_attn_backward`` (tests pass a CPU stand-in); None imports the real
    ``flash_attn.flash_attn_interface`` and then insists on CUDA tensors. ``deterministic``
    is flash-attn's option for a reproducible (slower) backward, ignored by versions that lack it.
    """

    name = "flash"

    def __init__(self, interface: ModuleType | Any | None = None, *, deterministic: bool = False) -> None:
        self._calls = FlashCalls(_import_flash_interface() if interface is None else interface)
        self._require_cuda = interface is None  # a stand-in interface may run anywhere
        self.deterministic = deterministic

    @property
    def interface_style(self) -> str:
        """Which low-level calling convention was detected: '2.7+' or '2.4-2.6'."""
        return self._calls.style

    @property
    def supports_softcap(self) -> bool:  # type: ignore[override]  # read-only: from the installed flash-attn
        """True when both low-level calls take ``softcap`` (flash-attn 2.6+)."""
        return self._calls.has_softcap

    def check_inputs(self, q: torch.Tensor) -> None:
        """Raise ValueError for what flash-attn cannot run (CPU tensors, fp32/fp64, head dim > 256)."""
        _check_flash_inputs(q, self._require_cuda)

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
        """q [B, Sq, H, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] -> (out [B, Sq, H, Dv] in q's dtype,
        lse [B, H, Sq] fp32)."""
        check_qkv(q, k, v, causal=causal)
        return self._forward(q, k, v, causal, softmax_scale, (-1, -1), softcap)

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
        """dout/out [B, Sq, H, Dv], final lse [B, H, Sq] -> (dq [B, Sq, H, D], dk [B, Sk, Hkv, D], dv [B, Sk, Hkv, Dv]).

        ``dout`` and ``out`` are cast to q's dtype if they differ (flash-attn requires it).
        """
        check_qkv(q, k, v, causal=causal)
        return self._backward(dout, q, k, v, out, lse, causal, softmax_scale, (-1, -1), softcap)

    # ----------------------------------------------------------------- band pieces (hybridsp.layout._block_plan)

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
        """A band piece (see :mod:`hybridsp.kernels._band`) as one flash-attn call with ``window_size``;
        shapes as :meth:`forward`."""
        check_qkv(q, k, v, causal=False)
        return self._forward(q, k, v, False, softmax_scale, _band_window(q, k, band), softcap)

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
        """This band piece's gradients given the final out/lse; shapes as :meth:`backward`."""
        check_qkv(q, k, v, causal=False)
        return self._backward(dout, q, k, v, out, lse, False, softmax_scale, _band_window(q, k, band), softcap)

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        window: tuple[int, int],
        softcap: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_flash_inputs(q, self._require_cuda, v)
        if _has_no_work(q, k):
            return no_key_result(q, v_head_dim=v.shape[-1])
        width = _flash_width(q, v)
        q_f, k_f, v_f = (_to_flash(x, width, q.dtype) for x in (q, k, v))  # [B, S, H(kv), W]
        out, lse = self._calls.forward(q_f, k_f, v_f, causal, scale, window, _flash_softcap(softcap))
        lse = no_key_lse_to_neg_inf(lse[..., : q.shape[1]].float())  # [B, H, Sq]
        return _from_flash(out, v.shape[-1]), lse

    def _backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
        window: tuple[int, int],
        softcap: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _check_flash_inputs(q, self._require_cuda, v)
        _check_lse(lse, q)
        if _has_no_work(q, k):
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        width = _flash_width(q, v)
        q_f, k_f, v_f, out_f, dout_f = (_to_flash(x, width, q.dtype) for x in (q, k, v, out, dout))  # [B, S, H(kv), W]
        dq, dk, dv = _grad_buffer(q_f), _grad_buffer(k_f), _grad_buffer(v_f)  # [B, S, H(kv), W]
        lse_f = lse_for_backward(lse.float()).contiguous()  # [B, H, Sq], no-key rows +inf
        self._calls.backward(
            dout_f,
            q_f,
            k_f,
            v_f,
            out_f,
            lse_f,
            dq,
            dk,
            dv,
            causal,
            scale,
            self.deterministic,
            window,
            _flash_softcap(softcap),
        )
        return _from_flash(dq, q.shape[-1]), _from_flash(dk, q.shape[-1]), _from_flash(dv, v.shape[-1])

    # ----------------------------------------------------------------- varlen (many pieces, one call)

    @property
    def supports_varlen(self) -> bool:  # type: ignore[override]  # read-only: from the interface
        """True when the interface has ``_flash_attn_varlen_forward/backward`` (flash-attn 2.7+)."""
        return self._varlen is not None

    @functools.cached_property
    def _varlen(self) -> VarlenCalls | None:
        """The varlen calls, read from the interface on first use (None when it has none)."""
        return VarlenCalls.of(self._calls.interface)

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
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed sequences in one call (``flash_attn_varlen_func``'s kernel).

        q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], ``cu_seqlens_q/k`` int32 [N + 1] (sequence i is
        rows ``cu[i]:cu[i+1]``), ``window`` flash-attn's (left, right) measured from each sequence's
        bottom-right diagonal (``(-1, 0)`` is causal) -> (out [Tq, H, Dv], lse [H, Tq] fp32, -inf
        for rows without keys).
        """
        _check_flash_inputs(q, self._require_cuda, v)
        width = _flash_width(q, v)
        q_f, k_f, v_f = (_to_flash(x, width, q.dtype) for x in (q, k, v))  # [T, H(kv), W]
        out, lse = self._varlen.forward(  # type: ignore[union-attr]  # called only when supports_varlen
            q_f,
            k_f,
            v_f,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            window,
            _flash_softcap(softcap),
        )
        return _from_flash(out, v.shape[-1]), no_key_lse_to_neg_inf(packed_lse(lse, cu_seqlens_q).float())

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
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of :meth:`forward_varlen`'s pieces given the final out [Tq, H, Dv] and lse [H, Tq]."""
        _check_flash_inputs(q, self._require_cuda, v)
        width = _flash_width(q, v)
        q_f, k_f, v_f, out_f, dout_f = (_to_flash(x, width, q.dtype) for x in (q, k, v, out, dout))
        dq, dk, dv = _grad_buffer(q_f), _grad_buffer(k_f), _grad_buffer(v_f)  # [T, H(kv), W]
        lse_f = lse_for_backward(lse.float()).contiguous()  # [H, Tq]
        self._varlen.backward(  # type: ignore[union-attr]  # called only when supports_varlen
            dout_f,
            q_f,
            k_f,
            v_f,
            out_f,
            lse_f,
            dq,
            dk,
            dv,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            self.deterministic,
            window,
            _flash_softcap(softcap),
        )
        return _from_flash(dq, q.shape[-1]), _from_flash(dk, q.shape[-1]), _from_flash(dv, v.shape[-1])
