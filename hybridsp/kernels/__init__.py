"""Local attention backends behind one protocol (:class:`AttentionKernel`, in :mod:`.base`).

The face of the package: the protocol and its helpers (:mod:`.base`), the backends
(:mod:`.reference`, :mod:`.torch_fused`, :mod:`.flash` imported only when chosen) and the choice
of one (:mod:`.select`: ``get_kernel``, ``choose_backend``, ``resolve_kernel``).
"""

from __future__ import annotations

from hybridsp._types import BACKEND_NAMES
from hybridsp.kernels._base import (
    AttentionKernel,
    accumulation_dtype,
    check_qkv,
    check_tensor_kinds,
    default_softmax_scale,
    unit_stride,
)
from hybridsp.kernels._reference import ReferenceKernel
from hybridsp.kernels._select import (
    FLASH_ATTN_MAX_HEAD_DIM,
    choose_backend,
    complete_kernel,
    get_kernel,
    resolve_kernel,
)
from hybridsp.kernels._torch_fused import TorchFusedKernel

__all__ = [
    "AttentionKernel",
    "BACKEND_NAMES",
    "FLASH_ATTN_MAX_HEAD_DIM",
    "ReferenceKernel",
    "TorchFusedKernel",
    "accumulation_dtype",
    "check_qkv",
    "check_tensor_kinds",
    "choose_backend",
    "complete_kernel",
    "default_softmax_scale",
    "get_kernel",
    "resolve_kernel",
    "unit_stride",
]
