"""What the accelerator check's sections share: inputs, a synchronising timer, a relative error."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp32."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def inputs(batch, seq, heads, kv_heads, dim, dtype, device, seed=0) -> list[torch.Tensor]:
    """Seeded q [B, S, H, D], k and v [B, S, H_kv, D], dout [B, S, H, D] on ``device`` in ``dtype``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [
        (batch, seq, heads, dim),
        (batch, seq, kv_heads, dim),
        (batch, seq, kv_heads, dim),
        (batch, seq, heads, dim),
    ]
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]


def scientific(values) -> str:
    """``[1.2e-03, ...]`` as "1.2e-03, ..." (a table cell of errors)."""
    return ", ".join(f"{value:.1e}" for value in values)
