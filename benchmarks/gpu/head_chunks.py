"""The accelerator check's head-chunk sections (part of ``python -m benchmarks run gpu.check``).

- :func:`kernel_cost`: the local kernel's share of ``head_chunks = G``: forward + backward of causal
  attention over all heads in one call, against G calls each over one group of ``H / G`` query heads and
  ``H_kv / G`` K/V heads (GQA groups kept whole), bf16. A ratio near 1 means chunking over heads costs
  the kernel nothing; below a few thousand tokens per call the smaller launches show.
- :func:`hybrid_call`: :func:`hybridsp.hybrid_attn_func` itself on this device at world size 1 (the
  whole hybrid path: spec, plan, ring shell, merge, the head-group loop), G = 1, 2, 4, 8, against the
  fp32 reference kernel's math; per G the max relative error of out, dq, dk, dv and the peak device
  memory of the call beyond its inputs (CUDA only; None on CPU).
"""

from __future__ import annotations

import math
import os
import socket

import torch

from benchmarks.gpu import _timing
from hybridsp.kernels import get_kernel

CHUNKS = (1, 2, 4, 8)


def _group(t: torch.Tensor, index: int, groups: int) -> torch.Tensor:
    """Heads ``[index * H/G, (index + 1) * H/G)`` of ``t`` [B, S, H, D] as a contiguous [B, S, H/G, D]."""
    size = t.shape[2] // groups
    return t.narrow(2, index * size, size).contiguous()  # [B, S, H/G, D]


def _chunked_fwd_bwd(kernel, q, k, v, dout, groups: int, scale: float) -> None:
    """Forward + backward of causal attention as ``groups`` kernel calls, one per head group."""
    for index in range(groups):
        qg, kg, vg, dg = (_group(t, index, groups) for t in (q, k, v, dout))
        out, lse = kernel.forward(qg, kg, vg, causal=True, softmax_scale=scale)
        kernel.backward(dg, qg, kg, vg, out, lse, causal=True, softmax_scale=scale)


def kernel_cost(device: torch.device, backend: str, quick: bool) -> list[dict]:
    """Seconds of G head-group calls against one call (fwd+bwd, causal, bf16): rows per S and G."""
    kernel = get_kernel(backend)
    heads, kv_heads = (32, 8) if device.type == "cuda" else (8, 8)
    lengths = (1024,) if quick else (8192, 32768, 131072)
    rows = []
    for seq in lengths:
        q, k, v, dout = _timing.inputs(1, seq, heads, kv_heads, 128, torch.bfloat16, device)
        scale = 1 / math.sqrt(128)
        repeats = 3 if quick else 5
        single = _timing.timed(lambda: _chunked_fwd_bwd(kernel, q, k, v, dout, 1, scale), device, repeats)
        for groups in CHUNKS[1:]:
            chunked = _timing.timed(lambda: _chunked_fwd_bwd(kernel, q, k, v, dout, groups, scale), device, repeats)
            rows.append(
                {"backend": backend, "seq_len": seq, "G": groups, "single_s": single, "chunked_s": chunked}
                | {"ratio": chunked / single}
            )
    return rows


def _world_of_one(device: torch.device):
    """A one-rank gloo world (for the mesh's process groups) and its 1 x 1 mesh."""
    import torch.distributed as dist

    from hybridsp import init_mesh

    if not dist.is_initialized():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    return init_mesh(ulysses=1, ring=1)


def _peak_of(fn, device: torch.device) -> tuple[object, int | None]:
    """(fn(), its peak device bytes beyond what was allocated before; None off CUDA)."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    return result, torch.cuda.max_memory_allocated(device) - before


def hybrid_call(device: torch.device, backend: str, quick: bool) -> list[dict]:
    """hybrid_attn_func at world size 1 for each G against fp32 reference math: errors and peaks."""
    from hybridsp import hybrid_attn_func

    mesh = _world_of_one(device)
    seq, heads, kv_heads, dim = (256, 16, 8, 64) if quick or device.type == "cpu" else (4096, 32, 8, 128)
    dtype = torch.bfloat16
    q, k, v, dout = _timing.inputs(2, seq, heads, kv_heads, dim, dtype, device)
    scale = 1 / math.sqrt(dim)
    truth = get_kernel("reference")
    options = {"causal": True, "softmax_scale": scale}
    exact_out, exact_lse = truth.forward(*(t.float() for t in (q, k, v)), **options)
    exact = (exact_out, *truth.backward(*(t.float() for t in (dout, q, k, v)), exact_out, exact_lse, **options))
    kernel = get_kernel(backend)
    alone_out, alone_lse = kernel.forward(q, k, v, **options)
    alone = (alone_out, *kernel.backward(dout, q, k, v, alone_out, alone_lse, **options))
    floor = [_timing.relative_error(a, b) for a, b in zip(alone, exact)]
    rows = []
    for groups in CHUNKS:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

        def call(leaves=leaves, groups=groups):
            out = hybrid_attn_func(*leaves, mesh=mesh, causal=True, backend=backend, head_chunks=groups)
            out.backward(dout)
            return out.detach()

        out, peak = _peak_of(call, device)
        got = (out, *(t.grad for t in leaves))
        errors = [_timing.relative_error(a, b) for a, b in zip(got, exact)]
        ok = all(e <= 2 * f for e, f in zip(errors, floor))
        rows.append(
            {"backend": backend, "seq_len": seq, "G": groups, "errors_out_dq_dk_dv": errors}
            | {"kernel_alone": floor, "peak_bytes": peak, "ok": ok}
        )
    return rows


def markdown(report: dict) -> list[str]:
    """The two sections' tables, as markdown lines."""
    lines = [
        "",
        "## Head chunks: the kernel's share (causal, bf16, fwd+bwd, G calls over head groups vs one call)",
        "",
        "| backend | S | G | one call s | G calls s | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["head_chunk_kernel"]:
        lines.append(
            f"| {r['backend']} | {r['seq_len']} | {r['G']} | {r['single_s']:.4f} | {r['chunked_s']:.4f} | {r['ratio']:.3f} |"
        )
    lines += [
        "",
        "## Head chunks: hybrid_attn_func at world size 1 (causal, bf16, B = 2, GQA; rel. error vs fp32 reference)",
        "",
        "| backend | S | G | out, dq, dk, dv | kernel alone | peak MiB beyond inputs | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["head_chunk_call"]:
        errors = _timing.scientific(r["errors_out_dq_dk_dv"])
        floor = _timing.scientific(r["kernel_alone"])
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:,.0f}"
        lines.append(f"| {r['backend']} | {r['seq_len']} | {r['G']} | {errors} | {floor} | {peak} | {r['ok']} |")
    return lines
