"""Which kernel runs: the automatic backend choice and the CUDA variant by dtype and head dim (no GPU needed)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridsp.kernels import choose_backend
from hybridsp.kernels._torch_fused import cuda_backward, cuda_forward, cuda_variant


@pytest.mark.parametrize(
    "device,dtype,head_dim,installed,expected",
    [
        ("cpu", torch.float32, 64, True, "torch"),
        ("cpu", torch.float64, 64, False, "torch"),
        ("cpu", torch.bfloat16, 80, True, "torch"),
        ("cuda", torch.bfloat16, 128, True, "flash"),
        ("cuda", torch.float16, 80, True, "flash"),
        ("cuda", torch.bfloat16, 128, False, "torch"),
        ("cuda", torch.float32, 128, True, "torch"),
        ("cuda", torch.bfloat16, 512, True, "torch"),
        ("cuda", torch.float64, 64, True, "reference"),
    ],
)
def test_auto_backend_choice(device, dtype, head_dim, installed, expected):
    assert choose_backend(device, dtype, head_dim, flash_installed=installed) == expected


@pytest.mark.parametrize(
    "dtype,head_dim,expected",
    [
        (torch.bfloat16, 128, "flash"),
        (torch.float16, 256, "flash"),
        (torch.bfloat16, 250, "flash"),
        (torch.bfloat16, 512, "efficient"),
        (torch.float32, 64, "efficient"),
        (torch.float32, 80, "efficient"),
    ],
)
def test_cuda_variant_by_dtype_and_head_dim(dtype, head_dim, expected):
    assert cuda_variant(dtype, head_dim) == expected


def test_cuda_float64_is_refused_with_advice():
    with pytest.raises(ValueError, match="backend='reference'"):
        cuda_variant(torch.float64, 64)


@pytest.mark.parametrize(
    "dtype,head_dim,kv_heads",
    [(torch.bfloat16, 80, 2), (torch.float32, 80, 1), (torch.bfloat16, 512, 4), (torch.float16, 64, 4)],
)
def test_cuda_calls_have_the_right_shapes_on_the_meta_device(dtype, head_dim, kv_heads):
    """The aten CUDA calls (flash and memory-efficient, padded head dims, padded LSE) checked
    for argument order and shapes through their meta kernels; values need a GPU."""
    q = torch.empty(2, 30, 4, head_dim, device="meta", dtype=dtype)
    k = torch.empty(2, 30, kv_heads, head_dim, device="meta", dtype=dtype)
    out, lse = cuda_forward(q, k, k, True, 1 / math.sqrt(head_dim))
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 4, 30) and lse.dtype == torch.float32
    dq, dk, dv = cuda_backward(out, q, k, k, out, lse, True, 0.1)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape and dk.dtype == dtype
