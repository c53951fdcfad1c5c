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

import importlib
import inspect
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch

from hybridsp.kernels.band import flash_window
from hybridsp.kernels.base import check_qkv, lse_for_backward

INSTALL_HINT = (
    "the 'flash' attention backend needs flash-attn 2.x on a CUDA machine: "
    "pip install hybridsp[flash] (or pass backend='torch' to use PyTorch's fused kernels)"
)

MAX_HEAD_DIM = 256  # flash-attn 2 forward and backward refuse larger (padded) head dims
_HALF_DTYPES = (torch.float16, torch.bfloat16)

# Argument order of flash-attn 2.7/2.8, used when the functions are torch custom ops whose
# Python signature is hidden behind (*args, **kwargs).
_FORWARD_ARGS_2_7 = (
    "q", "k", "v", "dropout_p", "softmax_scale", "causal",
    "window_size_left", "window_size_right", "softcap", "alibi_slopes", "return_softmax",
)
_BACKWARD_ARGS_2_7 = (
    "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p", "softmax_scale",
    "causal", "window_size_left", "window_size_right", "softcap", "alibi_slopes",
    "deterministic", "rng_state",
)
# Arguments without which a version cannot be driven by this module.
_FORWARD_NEEDS = frozenset({"q", "k", "v", "softmax_scale", "causal"})
_BACKWARD_NEEDS = frozenset({"dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale", "causal"})
# Values of the options hybridsp never uses: no dropout, no sliding window, no softcap,
# no ALiBi, no returned probabilities, the dropout RNG state unused.
_FIXED_ARGS = {
    "dropout_p": 0.0,
    "window_size": (-1, -1),
    "window_size_left": -1,
    "window_size_right": -1,
    "softcap": 0.0,
    "alibi_slopes": None,
    "return_softmax": False,
    "rng_state": None,
}


# --------------------------------------------------------------------------- signatures


@dataclass(frozen=True)
class _Signature:
    """Argument names of one flash-attn function, in order, with their defaults."""

    function: Callable[..., Any]
    names: tuple[str, ...]
    defaults: tuple[Any, ...]  # inspect.Parameter.empty where the argument is required

    def arguments(self, values: dict[str, Any]) -> list[Any]:
        """Positional arguments for this function, each taken by name from ``values``."""
        args = []
        for name, default in zip(self.names, self.defaults):
            if name in values:
                args.append(values[name])
            elif default is not inspect.Parameter.empty:
                args.append(default)
            else:
                raise RuntimeError(
                    f"flash-attn's {self.function_name} takes an argument {name!r} that hybridsp "
                    f"does not know; this flash-attn version is not supported (2.4 to 2.8 are)"
                )
        return args

    @property
    def function_name(self) -> str:
        return getattr(self.function, "__name__", None) or repr(self.function)


def _visible_signature(function: Callable[..., Any]) -> inspect.Signature | None:
    """The real Python signature of ``function``, looking through torch custom-op wrappers."""
    for candidate in (function, getattr(function, "_init_fn", None), getattr(function, "__wrapped__", None)):
        if candidate is None:
            continue
        try:
            signature = inspect.signature(candidate)
        except (TypeError, ValueError):
            continue
        kinds = {p.kind for p in signature.parameters.values()}
        if inspect.Parameter.VAR_POSITIONAL not in kinds and inspect.Parameter.VAR_KEYWORD not in kinds:
            return signature
    return None


def _read_signature(function: Callable[..., Any], fallback: tuple[str, ...], needs: frozenset[str]) -> _Signature:
    """Argument names of ``function`` (``fallback`` when hidden); refuse one we cannot drive."""
    signature = _visible_signature(function)
    if signature is None:
        names, defaults = fallback, (inspect.Parameter.empty,) * len(fallback)
    else:
        names = tuple(signature.parameters)
        defaults = tuple(p.default for p in signature.parameters.values())
    missing = sorted(needs - set(names))
    if missing:
        raise RuntimeError(
            f"flash-attn's {getattr(function, '__name__', function)} lacks the arguments {missing}; "
            f"this flash-attn version is not supported (2.4 to 2.8 are)"
        )
    return _Signature(function, names, defaults)


class _FlashCalls:
    """The two low-level flash-attn calls, with every version difference resolved here."""

    def __init__(self, interface: ModuleType | Any):
        self.interface = interface
        self.forward_signature = _read_signature(
            interface._flash_attn_forward, _FORWARD_ARGS_2_7, _FORWARD_NEEDS
        )
        self.backward_signature = _read_signature(
            interface._flash_attn_backward, _BACKWARD_ARGS_2_7, _BACKWARD_NEEDS
        )

    @property
    def style(self) -> str:
        """'2.7+' (window_size_left/right, 4-tuple forward) or '2.4-2.6' (window_size tuple)."""
        return "2.7+" if "window_size_left" in self.forward_signature.names else "2.4-2.6"

    def forward(self, q, k, v, causal: bool, softmax_scale: float,
                window: tuple[int, int] = (-1, -1)) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded q [B, Sq, H, Dp], k/v [B, Sk, Hkv, Dp] -> (out [B, Sq, H, Dp], raw lse [B, H, Sq]).

        ``window`` is flash-attn's (left, right), -1 = unbounded (see :func:`_window_args`).
        """
        values = dict(_FIXED_ARGS, q=q, k=k, v=v, softmax_scale=softmax_scale, causal=causal, **_window_args(window))
        result = self.forward_signature.function(*self.forward_signature.arguments(values))
        if len(result) == 4:  # 2.7+: out, softmax_lse, S_dmask, rng_state
            return result[0], result[1]
        if len(result) == 8:  # <= 2.6: out, q_pad, k_pad, v_pad, out_pad, softmax_lse, S_dmask, rng_state
            return result[0], result[5]
        raise RuntimeError(
            f"flash-attn's _flash_attn_forward returned {len(result)} values (expected 4 or 8); "
            f"this flash-attn version is not supported (2.4 to 2.8 are)"
        )

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, causal: bool, softmax_scale: float,
                 deterministic: bool, window: tuple[int, int] = (-1, -1)) -> None:
        """Write this block's dq [B, Sq, H, Dp], dk/dv [B, Sk, Hkv, Dp] into the given buffers.

        Every supported version fills the dq/dk/dv buffers it is handed; 2.7+ returns only
        softmax_d and <= 2.6 returns (dq, dk, dv, softmax_d), so the result is ignored.
        """
        values = dict(
            _FIXED_ARGS, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
            softmax_scale=softmax_scale, causal=causal, deterministic=deterministic, **_window_args(window),
        )
        self.backward_signature.function(*self.backward_signature.arguments(values))


def _window_args(window: tuple[int, int]) -> dict[str, Any]:
    """flash-attn's window arguments in both conventions (each version reads the names it has)."""
    left, right = window
    return {"window_size": (left, right), "window_size_left": left, "window_size_right": right}


# --------------------------------------------------------------------------- tensors


def _padded_head_dim(head_dim: int) -> int:
    """flash-attn 2's kernels want the head dim rounded up to a multiple of 8."""
    return -(-head_dim // 8) * 8


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


def _no_key_rows_to_neg_inf(lse: torch.Tensor) -> torch.Tensor:
    """flash-attn 2 marks a row that saw no key with lse +inf; the protocol says -inf."""
    return torch.where(torch.isposinf(lse), torch.full_like(lse, -math.inf), lse)


def _check_flash_inputs(q: torch.Tensor, require_cuda: bool) -> None:
    """Raise ValueError for what flash-attn 2 cannot compute: fp32/fp64, head dim > 256, CPU tensors."""
    if require_cuda and q.device.type != "cuda":
        raise ValueError(f"flash-attn runs on CUDA only, got tensors on {q.device}; use backend='torch'")
    if q.dtype not in _HALF_DTYPES:
        raise ValueError(
            f"flash-attn needs fp16 or bf16 inputs, got {q.dtype}; cast q/k/v to torch.bfloat16 "
            f"or use backend='torch', which also handles fp32"
        )
    if _padded_head_dim(q.shape[-1]) > MAX_HEAD_DIM:
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


class FlashAttnKernel:
    """flash-attn 2.x kernels (see :mod:`hybridsp.kernels.base` for the protocol).

    ``interface`` is any object with flash-attn's ``_flash_attn_forward`` and
    ``_flash_attn_backward`` (tests pass a CPU stand-in); None imports the real
    ``flash_attn.flash_attn_interface`` and then insists on CUDA tensors. ``deterministic``
    is flash-attn's option for a reproducible (slower) backward, ignored by versions that lack it.
    """

    name = "flash"

    def __init__(self, interface: ModuleType | Any | None = None, *, deterministic: bool = False):
        self._calls = _FlashCalls(_import_flash_interface() if interface is None else interface)
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
            b, s, h, _ = q.shape
            return torch.zeros_like(q), torch.full((b, h, s), -math.inf, device=q.device)
        head_dim, padded = q.shape[-1], _padded_head_dim(q.shape[-1])
        q_f, k_f, v_f = (_to_flash(x, padded, q.dtype) for x in (q, k, v))  # [B, S, H(kv), Dp]
        out, lse = self._calls.forward(q_f, k_f, v_f, causal, softmax_scale)
        lse = _no_key_rows_to_neg_inf(lse[..., : q.shape[1]].float())  # [B, H, Sq]
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
        head_dim, padded = q.shape[-1], _padded_head_dim(q.shape[-1])
        q_f, k_f, v_f, out_f, dout_f = (
            _to_flash(x, padded, q.dtype) for x in (q, k, v, out, dout)
        )  # [B, S, H(kv), Dp]
        dq, dk, dv = _grad_buffer(q_f), _grad_buffer(k_f), _grad_buffer(v_f)  # [B, S, H(kv), Dp]
        lse_f = lse_for_backward(lse.float()).contiguous()  # [B, H, Sq], no-key rows +inf
        self._calls.backward(
            dout_f, q_f, k_f, v_f, out_f, lse_f, dq, dk, dv, causal, softmax_scale, self.deterministic
        )
        return _from_flash(dq, head_dim), _from_flash(dk, head_dim), _from_flash(dv, head_dim)

    # ----------------------------------------------------------------- band pieces (hybridsp.masks)

    def forward_band(self, q, k, v, *, band, softmax_scale: float):
        """A band piece (see :mod:`hybridsp.kernels.band`) as one flash-attn call with ``window_size``.

        q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, H, D], lse [B, H, Sq] fp32).
        """
        check_qkv(q, k, v, causal=False)
        _check_flash_inputs(q, self._require_cuda)
        if _has_no_work(q, k):
            b, s, h, _ = q.shape
            return torch.zeros_like(q), torch.full((b, h, s), -math.inf, device=q.device)
        window = flash_window(q.shape[1], k.shape[1], band)
        head_dim, padded = q.shape[-1], _padded_head_dim(q.shape[-1])
        q_f, k_f, v_f = (_to_flash(x, padded, q.dtype) for x in (q, k, v))  # [B, S, H(kv), Dp]
        out, lse = self._calls.forward(q_f, k_f, v_f, False, softmax_scale, window)
        lse = _no_key_rows_to_neg_inf(lse[..., : q.shape[1]].float())  # [B, H, Sq]
        return _from_flash(out, head_dim), lse

    def backward_band(self, dout, q, k, v, out, lse, *, band, softmax_scale: float):
        """This band piece's (dq [B, Sq, H, D], dk, dv [B, Sk, Hkv, D]) given the final out/lse."""
        check_qkv(q, k, v, causal=False)
        _check_flash_inputs(q, self._require_cuda)
        _check_lse(lse, q)
        if _has_no_work(q, k):
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        window = flash_window(q.shape[1], k.shape[1], band)
        head_dim, padded = q.shape[-1], _padded_head_dim(q.shape[-1])
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

    @property
    def _varlen(self) -> "_VarlenCalls | None":
        if not hasattr(self, "_varlen_calls"):
            self._varlen_calls = _VarlenCalls.of(self._calls.interface)
        return self._varlen_calls

    def forward_varlen(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                       window: tuple[int, int], softmax_scale: float):
        """Packed sequences in one call (``flash_attn_varlen_func``'s kernel).

        q [Tq, H, D], k/v [Tk, Hkv, D], ``cu_seqlens_q/k`` int32 [N + 1] (sequence i is rows
        ``cu[i]:cu[i+1]``), ``window`` flash-attn's (left, right) measured from each sequence's
        bottom-right diagonal (``(-1, 0)`` is causal) -> (out [Tq, H, D], lse [H, Tq] fp32, -inf
        for rows without keys).
        """
        _check_flash_inputs(q, self._require_cuda)
        head_dim, padded = q.shape[-1], _padded_head_dim(q.shape[-1])
        q_f, k_f, v_f = (_to_flash(x, padded, q.dtype) for x in (q, k, v))  # [T, H(kv), Dp]
        out, lse = self._varlen.forward(q_f, k_f, v_f, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, window)
        return _from_flash(out, head_dim), _no_key_rows_to_neg_inf(_packed_lse(lse, cu_seqlens_q).float())

    def backward_varlen(self, dout, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                        max_seqlen_k: int, window: tuple[int, int], softmax_scale: float):
        """Gradients of :meth:`forward_varlen`'s pieces given the final out [Tq, H, D] and lse [H, Tq]."""
        _check_flash_inputs(q, self._require_cuda)
        head_dim, padded = q.shape[-1], _padded_head_dim(q.shape[-1])
        q_f, k_f, v_f, out_f, dout_f = (_to_flash(x, padded, q.dtype) for x in (q, k, v, out, dout))
        dq, dk, dv = _grad_buffer(q_f), _grad_buffer(k_f), _grad_buffer(v_f)  # [T, H(kv), Dp]
        lse_f = lse_for_backward(lse.float()).contiguous()  # [H, Tq]
        self._varlen.backward(dout_f, q_f, k_f, v_f, out_f, lse_f, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, softmax_scale, self.deterministic, window)
        return _from_flash(dq, head_dim), _from_flash(dk, head_dim), _from_flash(dv, head_dim)


_VARLEN_FORWARD_ARGS_2_7 = (
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale",
    "causal", "window_size_left", "window_size_right", "softcap", "alibi_slopes", "return_softmax",
    "block_table", "leftpad_k", "seqused_k",
)
_VARLEN_BACKWARD_ARGS_2_7 = (
    "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
    "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size_left",
    "window_size_right", "softcap", "alibi_slopes", "deterministic", "rng_state",
)
_VARLEN_NEEDS = frozenset({"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                           "softmax_scale", "causal"})
_VARLEN_FIXED = {"block_table": None, "leftpad_k": None, "seqused_k": None, "zero_tensors": False}


def _packed_lse(lse: torch.Tensor, cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """Varlen lse as [H, Tq]; older builds return it padded as [N, H, max_seqlen_q]."""
    if lse.dim() == 2:
        return lse
    bounds = cu_seqlens_q.tolist()
    return torch.cat([lse[i, :, : b - a] for i, (a, b) in enumerate(zip(bounds, bounds[1:]))], dim=1)  # [H, Tq]


class _VarlenCalls:
    """flash-attn's low-level varlen pair, argument names read like :class:`_FlashCalls`'."""

    def __init__(self, forward, backward):
        self.forward_signature = _read_signature(forward, _VARLEN_FORWARD_ARGS_2_7, _VARLEN_NEEDS)
        self.backward_signature = _read_signature(
            backward, _VARLEN_BACKWARD_ARGS_2_7, _VARLEN_NEEDS | {"dout", "out", "softmax_lse", "dq", "dk", "dv"}
        )

    @classmethod
    def of(cls, interface) -> "_VarlenCalls | None":
        forward = getattr(interface, "_flash_attn_varlen_forward", None)
        backward = getattr(interface, "_flash_attn_varlen_backward", None)
        return None if forward is None or backward is None else cls(forward, backward)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, window):
        values = dict(_FIXED_ARGS, **_VARLEN_FIXED, q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                      max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=softmax_scale, causal=False,
                      **_window_args(window))
        result = self.forward_signature.function(*self.forward_signature.arguments(values))
        if len(result) == 4:  # 2.7+: out, softmax_lse, S_dmask, rng_state
            return result[0], result[1]
        if len(result) == 8:  # <= 2.6: out, q_pad, k_pad, v_pad, out_pad, softmax_lse, S_dmask, rng_state
            return result[0], result[5]
        raise RuntimeError(f"flash-attn's _flash_attn_varlen_forward returned {len(result)} values (expected 4 or 8)")

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, softmax_scale,
                 deterministic, window) -> None:
        values = dict(_FIXED_ARGS, **_VARLEN_FIXED, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq,
                      dk=dk, dv=dv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                      softmax_scale=softmax_scale, causal=False, deterministic=deterministic, **_window_args(window))
        self.backward_signature.function(*self.backward_signature.arguments(values))
