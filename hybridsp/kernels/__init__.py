"""Local attention backends behind one protocol (:class:`AttentionKernel`).

``get_kernel(name, device=..., dtype=...)`` returns one of:
    ``"torch"``      PyTorch's fused flash kernels (CPU and CUDA), the CPU workhorse;
    ``"flash"``      flash-attn 2.x on CUDA (imported only when chosen);
    ``"reference"``  plain fp32 math, ground truth for tests;
    ``"auto"``       :func:`choose_backend`: flash-attn on CUDA for fp16/bf16 and head dims up to
                     256 when it is installed; else torch (whose CUDA path picks the aten flash or
                     memory-efficient kernel by dtype and head dim); reference for fp64 on CUDA.
An object that already has ``forward``/``backward`` is returned unchanged.
:func:`resolve_kernel` resolves and also checks that the kernel supports the inputs
(ValueError otherwise): call it before any communication.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from hybridsp.kernels.base import (
    AttentionKernel,
    accumulation_dtype,
    check_qkv,
    check_tensor_kinds,
    default_softmax_scale,
    unit_stride,
)
from hybridsp.kernels.reference import ReferenceKernel
from hybridsp.kernels.torch_fused import TorchFusedKernel

FLASH_ATTN_MAX_HEAD_DIM = 256

BACKEND_NAMES = ("auto", "torch", "flash", "reference")

__all__ = [
    "AttentionKernel",
    "BACKEND_NAMES",
    "ReferenceKernel",
    "TorchFusedKernel",
    "accumulation_dtype",
    "check_qkv",
    "check_tensor_kinds",
    "choose_backend",
    "default_softmax_scale",
    "get_kernel",
    "resolve_kernel",
    "unit_stride",
]


@functools.lru_cache(maxsize=None)
def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def get_kernel(
    backend: str | AttentionKernel = "auto",
    *,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
) -> AttentionKernel:
    """Resolve a backend name (or pass through a kernel object) for tensors on ``device``."""
    if not isinstance(backend, str):
        return backend
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if backend == "auto":
        device_type = torch.device(device).type if device is not None else "cpu"
        backend = choose_backend(device_type, dtype, head_dim, flash_installed=_flash_attn_installed())
    return _kernel_named(backend)


@functools.lru_cache(maxsize=None)
def _kernel_named(backend: str) -> AttentionKernel:
    """One stateless kernel object per backend and process (flash's reads flash-attn's signatures once)."""
    if backend == "torch":
        return TorchFusedKernel()
    if backend == "reference":
        return ReferenceKernel()
    from hybridsp.kernels.flash import FlashAttnKernel  # lazy: imports flash_attn

    return FlashAttnKernel()


def choose_backend(device_type: str, dtype: torch.dtype | None, head_dim: int | None, *, flash_installed: bool) -> str:
    """What ``backend="auto"`` runs for inputs of ``dtype`` and ``head_dim`` on ``device_type``.

    CUDA: ``flash`` (flash-attn) for fp16/bf16 with head dims up to 256 when installed; else
    ``torch`` (aten flash for fp16/bf16, memory-efficient for fp32 or large head dims);
    ``reference`` for fp64, which no fused CUDA kernel supports. Elsewhere: ``torch``
    (the CPU kernel handles every float dtype and head dim). No CUDA call: unit-testable on CPU.
    """
    if device_type != "cuda":
        return "torch"
    if dtype == torch.float64:
        return "reference"
    half = dtype in (torch.float16, torch.bfloat16)
    fits_flash = head_dim is None or -(-head_dim // 8) * 8 <= FLASH_ATTN_MAX_HEAD_DIM
    return "flash" if half and fits_flash and flash_installed else "torch"


def resolve_kernel(backend: str | AttentionKernel, q: torch.Tensor) -> AttentionKernel:
    """The kernel for ``q``'s device/dtype/head dim, checked to support them (ValueError, no communication)."""
    kernel = get_kernel(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1])
    check = getattr(kernel, "check_inputs", None)
    if check is not None:
        check(q)
    return kernel
