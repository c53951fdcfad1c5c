"""flash-attn's low-level call conventions, read from the installed functions' signatures.

flash-attn 2.4-2.8 changed the argument lists of ``_flash_attn_forward`` / ``_backward`` and their
varlen twins (2.7+ made them torch custom ops whose Python signature is ``(*args, **kwargs)``).
:class:`FlashCalls` and :class:`VarlenCalls` read the names once and call by name, with fixed
values for the options hybridsp never uses; :func:`window_args` spells a flash window for any version.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch

# Argument order of flash-attn 2.7/2.8, used when the functions are torch custom ops whose
# Python signature is hidden behind (*args, **kwargs).
_FORWARD_ARGS_2_7 = (
    "q",
    "k",
    "v",
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "softcap",
    "alibi_slopes",
    "return_softmax",
)
_BACKWARD_ARGS_2_7 = (
    "dout",
    "q",
    "k",
    "v",
    "out",
    "softmax_lse",
    "dq",
    "dk",
    "dv",
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "softcap",
    "alibi_slopes",
    "deterministic",
    "rng_state",
)
# Arguments without which a version cannot be driven by this module.
_FORWARD_NEEDS = frozenset({"q", "k", "v", "softmax_scale", "causal"})
_BACKWARD_NEEDS = frozenset({"dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale", "causal"})
# Values of the options a call does not set: no dropout, no sliding window, no softcap (a
# soft-capped call overrides it), no ALiBi, no returned probabilities, the dropout RNG state unused.
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


class FlashCalls:
    """The two low-level flash-attn calls, with every version difference resolved here."""

    def __init__(self, interface: ModuleType | Any) -> None:
        self.interface = interface
        self.forward_signature = _read_signature(interface._flash_attn_forward, _FORWARD_ARGS_2_7, _FORWARD_NEEDS)
        self.backward_signature = _read_signature(interface._flash_attn_backward, _BACKWARD_ARGS_2_7, _BACKWARD_NEEDS)

    @property
    def has_softcap(self) -> bool:
        """Whether both calls take ``softcap`` (flash-attn 2.6+)."""
        return "softcap" in self.forward_signature.names and "softcap" in self.backward_signature.names

    @property
    def style(self) -> str:
        """'2.7+' (window_size_left/right, 4-tuple forward) or '2.4-2.6' (window_size tuple)."""
        return "2.7+" if "window_size_left" in self.forward_signature.names else "2.4-2.6"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        softmax_scale: float,
        window: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded q [B, Sq, H, Dp], k/v [B, Sk, Hkv, Dp] -> (out [B, Sq, H, Dp], raw lse [B, H, Sq]).

        ``window`` is flash-attn's (left, right), -1 = unbounded (see :func:`window_args`);
        ``softcap`` > 0 caps the scores (only versions with :attr:`has_softcap`).
        """
        values = dict(
            _FIXED_ARGS,
            q=q,
            k=k,
            v=v,
            softmax_scale=softmax_scale,
            causal=causal,
            **window_args(window),
            **_softcap_args(softcap),
        )
        result = self.forward_signature.function(*self.forward_signature.arguments(values))
        if len(result) == 4:  # 2.7+: out, softmax_lse, S_dmask, rng_state
            return result[0], result[1]
        if len(result) == 8:  # <= 2.6: out, q_pad, k_pad, v_pad, out_pad, softmax_lse, S_dmask, rng_state
            return result[0], result[5]
        raise RuntimeError(
            f"flash-attn's _flash_attn_forward returned {len(result)} values (expected 4 or 8); "
            f"this flash-attn version is not supported (2.4 to 2.8 are)"
        )

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        causal: bool,
        softmax_scale: float,
        deterministic: bool,
        window: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
    ) -> None:
        """Write this block's dq [B, Sq, H, Dp], dk/dv [B, Sk, Hkv, Dp] into the given buffers.

        Every supported version fills the dq/dk/dv buffers it is handed; 2.7+ returns only
        softmax_d and <= 2.6 returns (dq, dk, dv, softmax_d), so the result is ignored.
        """
        values = dict(
            _FIXED_ARGS,
            dout=dout,
            q=q,
            k=k,
            v=v,
            out=out,
            softmax_lse=lse,
            dq=dq,
            dk=dk,
            dv=dv,
            softmax_scale=softmax_scale,
            causal=causal,
            deterministic=deterministic,
            **window_args(window),
            **_softcap_args(softcap),
        )
        self.backward_signature.function(*self.backward_signature.arguments(values))


def _softcap_args(softcap: float) -> dict[str, float]:
    """``softcap`` for the calls; 0.0 (off) is the fixed default, so a version without it runs plain."""
    return {"softcap": softcap} if softcap else {}


def window_args(window: tuple[int, int]) -> dict[str, Any]:
    """flash-attn's window arguments in both conventions (each version reads the names it has)."""
    left, right = window
    return {"window_size": (left, right), "window_size_left": left, "window_size_right": right}


# --------------------------------------------------------------------------- tensors


_VARLEN_FORWARD_ARGS_2_7 = (
    "q",
    "k",
    "v",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "softcap",
    "alibi_slopes",
    "return_softmax",
    "block_table",
    "leftpad_k",
    "seqused_k",
)
_VARLEN_BACKWARD_ARGS_2_7 = (
    "dout",
    "q",
    "k",
    "v",
    "out",
    "softmax_lse",
    "dq",
    "dk",
    "dv",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "softcap",
    "alibi_slopes",
    "deterministic",
    "rng_state",
)
_VARLEN_NEEDS = frozenset(
    {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal"}
)
_VARLEN_FIXED = {"block_table": None, "leftpad_k": None, "seqused_k": None, "zero_tensors": False}


def packed_lse(lse: torch.Tensor, cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """Varlen lse as [H, Tq]; older builds return it padded as [N, H, max_seqlen_q]."""
    if lse.dim() == 2:
        return lse
    bounds = cu_seqlens_q.tolist()
    return torch.cat([lse[i, :, : b - a] for i, (a, b) in enumerate(zip(bounds, bounds[1:]))], dim=1)  # [H, Tq]


class VarlenCalls:
    """flash-attn's low-level varlen pair, argument names read like :class:`FlashCalls`'."""

    def __init__(self, forward: Callable[..., Any], backward: Callable[..., Any]) -> None:
        self.forward_signature = _read_signature(forward, _VARLEN_FORWARD_ARGS_2_7, _VARLEN_NEEDS)
        self.backward_signature = _read_signature(
            backward, _VARLEN_BACKWARD_ARGS_2_7, _VARLEN_NEEDS | {"dout", "out", "softmax_lse", "dq", "dk", "dv"}
        )

    @classmethod
    def of(cls, interface: ModuleType | Any) -> VarlenCalls | None:
        forward = getattr(interface, "_flash_attn_varlen_forward", None)
        backward = getattr(interface, "_flash_attn_varlen_backward", None)
        return None if forward is None or backward is None else cls(forward, backward)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        softmax_scale: float,
        window: tuple[int, int],
        softcap: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values = dict(
            _FIXED_ARGS,
            **_VARLEN_FIXED,
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            softmax_scale=softmax_scale,
            causal=False,
            **window_args(window),
            **_softcap_args(softcap),
        )
        result = self.forward_signature.function(*self.forward_signature.arguments(values))
        if len(result) == 4:  # 2.7+: out, softmax_lse, S_dmask, rng_state
            return result[0], result[1]
        if len(result) == 8:  # <= 2.6: out, q_pad, k_pad, v_pad, out_pad, softmax_lse, S_dmask, rng_state
            return result[0], result[5]
        raise RuntimeError(f"flash-attn's _flash_attn_varlen_forward returned {len(result)} values (expected 4 or 8)")

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        softmax_scale: float,
        deterministic: bool,
        window: tuple[int, int],
        softcap: float = 0.0,
    ) -> None:
        values = dict(
            _FIXED_ARGS,
            **_VARLEN_FIXED,
            dout=dout,
            q=q,
            k=k,
            v=v,
            out=out,
            softmax_lse=lse,
            dq=dq,
            dk=dk,
            dv=dv,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            softmax_scale=softmax_scale,
            causal=False,
            deterministic=deterministic,
            **window_args(window),
            **_softcap_args(softcap),
        )
        self.backward_signature.function(*self.backward_signature.arguments(values))
