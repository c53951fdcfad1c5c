"""Local attention backends behind one protocol (:class:`AttentionKernel`).

``get_kernel(name, device=..., dtype=...)`` returns one of:
    ``"torch"``      PyTorch's fused flash kernels (CPU and CUDA), the CPU workhorse;
    ``"flash"``      flash-attn 2.x on CUDA (imported only when chosen);
    ``"reference"``  plain fp32 math, ground truth for tests;
    ``"auto"``       flash on CUDA with fp16/bf16 when flash-attn is installed, else torch.
An object that already has ``forward``/``backward`` is returned unchanged.
"""

from __future__ import annotations

import importlib.util

import torch

from hybridsp.kernels.base import AttentionKernel, check_qkv, default_softmax_scale
from hybridsp.kernels.reference import ReferenceKernel
from hybridsp.kernels.torch_fused import TorchFusedKernel

BACKEND_NAMES = ("auto", "torch", "flash", "reference")

__all__ = [
    "AttentionKernel",
    "BACKEND_NAMES",
    "ReferenceKernel",
    "TorchFusedKernel",
    "check_qkv",
    "default_softmax_scale",
    "get_kernel",
]


def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def get_kernel(
    backend: str | AttentionKernel = "auto",
    *,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionKernel:
    """Resolve a backend name (or pass through a kernel object) for tensors on ``device``."""
    if not isinstance(backend, str):
        return backend
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if backend == "auto":
        on_cuda = device is not None and torch.device(device).type == "cuda"
        half = dtype in (torch.float16, torch.bfloat16)
        backend = "flash" if on_cuda and half and _flash_attn_installed() else "torch"
    if backend == "torch":
        return TorchFusedKernel()
    if backend == "reference":
        return ReferenceKernel()
    from hybridsp.kernels.flash import FlashAttnKernel  # lazy: imports flash_attn

    return FlashAttnKernel()
