"""The per-call overhead of hybrid_attn_func on a 1 x 1 mesh (inside a rank; shared by core_shape and call_overhead).

Per [B, S, H, D] shape, fp32 causal forward + backward, timed with harness.interleave against the kernel
wrapper alone (``get_kernel("torch").forward`` + ``.backward``), torch's own SDPA with autograd, and the raw
aten CPU kernels without any wrapper (the floor).
"""

from __future__ import annotations

import torch

from benchmarks.common.harness import interleave


def overhead_rank(rank: int, world: int, shapes: list) -> dict:
    """Per ([B, S, H, D], iters): harness.interleave times of hybrid_attn_func / bare kernel / SDPA
    fwd+bwd (fp32, causal) on a 1 x 1 mesh."""
    import hybridsp

    mesh = hybridsp.init_mesh(ulysses=1, ring=1)
    return {"x".join(map(str, shape)): overhead_times(mesh, tuple(shape), iters) for shape, iters in shapes}


def overhead_times(mesh, shape: tuple, iters: int) -> dict:
    import hybridsp
    from hybridsp.kernels import get_kernel

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(shape, generator=gen) for _ in range(4))  # [B, S, H, D]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kernel, scale = get_kernel("torch"), shape[-1] ** -0.5

    def hybrid():
        hybridsp.hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend="torch").backward(dout)

    def bare():
        out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), causal=True, softmax_scale=scale)
        kernel.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal=True, softmax_scale=scale)

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # [B, H, S, D]
        out.transpose(1, 2).backward(dout)

    def raw_aten():  # the aten CPU kernels alone, no wrapper (the floor)
        heads_first = [t.detach().transpose(1, 2) for t in (q, k, v, dout)]  # each [B, H, S, D]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*heads_first[:3], 0.0, True, scale=scale)
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            heads_first[3], *heads_first[:3], out, lse, 0.0, True, scale=scale
        )

    calls = {"hybrid_attn_func": hybrid, "bare kernel": bare, "torch SDPA": sdpa, "raw aten": raw_aten}
    for call in calls.values():
        for _ in range(10):
            call()
    return interleave(calls, iters)
