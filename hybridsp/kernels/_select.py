"""Which kernel object runs a call: backend names resolved, user objects completed, inputs checked.

``get_kernel(name, device=..., dtype=...)`` returns one of:
    ``"torch"``      PyTorch's fused flash kernels (CPU and CUDA), the CPU workhorse;
    ``"flash"``      flash-attn 2.x on CUDA (imported only when chosen);
    ``"reference"``  plain fp32 math, ground truth for tests;
    ``"auto"``       :func:`choose_backend`: flash-attn on CUDA for fp16/bf16 and head dims up to
                     256 when it is installed; else torch (whose CUDA path picks the aten flash or
                     memory-efficient kernel by dtype and head dim); reference for fp64 on CUDA.
An object that already has ``forward``/``backward`` is returned unchanged.
:func:`resolve_kernel` resolves, completes the object to the whole protocol
(:func:`complete_kernel`) and checks that the kernel supports the inputs (ValueError otherwise):
call it before any communication.

Soft-capping (``softcap=``): only kernels with ``supports_softcap`` run it (``reference``, which is
the CPU choice of ``"auto"`` then, and ``flash`` on flash-attn 2.6+); ``"auto"`` picks one of them,
an explicitly named kernel without it is refused by :func:`resolve_kernel`.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable

import torch

from hybridsp._types import BACKEND_NAMES
from hybridsp.kernels._base import HALF_DTYPES, AttentionKernel, Band, padded_head_dim
from hybridsp.kernels._reference import ReferenceKernel
from hybridsp.kernels._torch_fused import TorchFusedKernel

FLASH_ATTN_MAX_HEAD_DIM = 256  # flash-attn 2's limit (hybridsp.kernels._flash.MAX_HEAD_DIM), without importing it


@functools.lru_cache(maxsize=None)
def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def get_kernel(
    backend: str | AttentionKernel = "auto",
    *,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    softcap: bool = False,
) -> AttentionKernel:
    """Resolve a backend name (or pass through a kernel object) for tensors on ``device``;
    ``softcap``: the call soft-caps its scores (``"auto"`` then picks a kernel that can)."""
    if not isinstance(backend, str):
        return backend
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if backend != "auto":
        return _kernel_named(backend)
    device_type = torch.device(device).type if device is not None else "cpu"
    kernel = _kernel_named(
        choose_backend(device_type, dtype, head_dim, flash_installed=_flash_attn_installed(), softcap=softcap)
    )
    if softcap and not kernel.supports_softcap:  # flash-attn older than 2.6
        return _kernel_named("reference")
    return kernel


@functools.lru_cache(maxsize=None)
def _kernel_named(backend: str) -> AttentionKernel:
    """One stateless kernel object per backend and process (flash's reads flash-attn's signatures once)."""
    if backend == "torch":
        return TorchFusedKernel()
    if backend == "reference":
        return ReferenceKernel()
    from hybridsp.kernels._flash import FlashAttnKernel  # lazy: imports flash_attn

    return FlashAttnKernel()


def choose_backend(
    device_type: str, dtype: torch.dtype | None, head_dim: int | None, *, flash_installed: bool, softcap: bool = False
) -> str:
    """What ``backend="auto"`` runs for inputs of ``dtype`` and ``head_dim`` (the wider of q's and
    v's) on ``device_type``.

    CUDA: ``flash`` (flash-attn) for fp16/bf16 with head dims up to 256 when installed; else
    ``torch`` (aten flash for fp16/bf16, memory-efficient for fp32 or large head dims);
    ``reference`` for fp64, which no fused CUDA kernel supports. Elsewhere: ``torch``
    (the CPU kernel handles every float dtype and head dim). With ``softcap`` (no aten kernel caps
    scores): ``flash`` where it would be chosen, else ``reference``. No CUDA call: unit-testable on CPU.
    """
    if device_type != "cuda":
        return "reference" if softcap else "torch"
    if dtype == torch.float64:
        return "reference"
    half = dtype in HALF_DTYPES
    fits_flash = head_dim is None or padded_head_dim(head_dim) <= FLASH_ATTN_MAX_HEAD_DIM
    if half and fits_flash and flash_installed:
        return "flash"
    return "reference" if softcap else "torch"


class CompletedKernel(AttentionKernel):
    """A user's kernel object that does not subclass :class:`AttentionKernel`, completed to the
    whole protocol: each member the object has is its own, each it lacks the documented default
    (no extra input check, band pieces by the reference kernel's fp32 math, no varlen calls).

    The object's members are looked up when called, so an object that only checks inputs still
    raises its own ValueError first.
    """

    def __init__(self, inner: AttentionKernel) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.supports_varlen = bool(getattr(inner, "supports_varlen", False))
        self.supports_softcap = bool(getattr(inner, "supports_softcap", False))
        band_kernel = inner if _declares_band(inner) else _kernel_named("reference")
        self._band_kernel = band_kernel

    def check_inputs(self, q: torch.Tensor) -> None:
        check: Callable[[torch.Tensor], None] | None = getattr(self.inner, "check_inputs", None)
        return None if check is None else check(q)

    # ``softcap=`` reaches these only when set, and only when the object declares supports_softcap
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: float, **softcap: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, **softcap)

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
        **softcap: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.inner.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, **softcap)

    def forward_band(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, band: Band, softmax_scale: float, **softcap: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._band_kernel.forward_band(q, k, v, band=band, softmax_scale=softmax_scale, **softcap)

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
        **softcap: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._band_kernel.backward_band(
            dout, q, k, v, out, lse, band=band, softmax_scale=softmax_scale, **softcap
        )

    def forward_varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.forward_varlen(q, k, v, **kwargs)

    def backward_varlen(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.inner.backward_varlen(dout, q, k, v, out, lse, **kwargs)


def complete_kernel(kernel: AttentionKernel) -> AttentionKernel:
    """``kernel`` when it declares the whole protocol (subclasses :class:`AttentionKernel` and defines
    its band calls, as every backend does), else a :class:`CompletedKernel` around it (a subclass with
    only ``forward``/``backward`` gets the reference band math): the one place where a kernel's
    members are discovered rather than called."""
    complete = AttentionKernel in type(kernel).__mro__ and _declares_band(kernel)
    return kernel if complete else CompletedKernel(kernel)


def _declares_band(kernel: object) -> bool:
    """Whether ``kernel``'s class defines its own band calls (not the protocol's empty declarations)."""
    cls = type(kernel)
    forward_band, backward_band = getattr(cls, "forward_band", None), getattr(cls, "backward_band", None)
    return (
        forward_band is not None
        and forward_band is not AttentionKernel.forward_band
        and backward_band is not None
        and backward_band is not AttentionKernel.backward_band
    )


def resolve_kernel(
    backend: str | AttentionKernel, q: torch.Tensor, v: torch.Tensor | None = None, softcap: float | None = None
) -> AttentionKernel:
    """The kernel for ``q`` [B, S, H, D]'s device/dtype and the wider of its and ``v`` [B, S, Hkv, Dv]'s
    head dims, able to soft-cap when ``softcap`` is set, complete (:func:`complete_kernel`) and
    checked to support them (ValueError, no communication)."""
    widest = q if v is None or v.shape[-1] <= q.shape[-1] else v
    kernel = complete_kernel(
        get_kernel(backend, device=q.device, dtype=q.dtype, head_dim=widest.shape[-1], softcap=softcap is not None)
    )
    kernel.check_inputs(q)
    if widest is not q:
        kernel.check_inputs(widest)  # the checks are of dtype, device and head dim: the widest must pass
    if softcap is not None and not kernel.supports_softcap:
        raise ValueError(
            f"softcap={softcap} needs a kernel that soft-caps its scores; the {kernel.name!r} kernel does not "
            f"(supports_softcap is False): pass backend='auto' or backend='reference' (on CUDA also 'flash' "
            f"with flash-attn >= 2.6)"
        )
    return kernel
