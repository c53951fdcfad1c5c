"""The peers' local kernel on CPU: the aten CPU flash kernel (what hybridsp's ``backend="torch"`` calls).

- DeepSpeed-Ulysses: :class:`LocalCpuAttention`, the local attention module inside
  ``DistributedAttention``; [B, S, H, D] in and out, passed to the kernel as [B, H, S, D] views.
- yunchang 0.6.4: :func:`patch_yunchang_cpu_kernel` gives its TORCH_FLASH path the aten kernels
  (its shipped torch path has no CPU kernel with an LSE and no backward);
  :func:`patch_yunchang_fp32_alias` fixes its fp32 zigzag ring backward (see there).
"""

from __future__ import annotations

import time

import torch

_aten = torch.ops.aten


class CpuFlashAttention(torch.autograd.Function):
    """The local kernel for DeepSpeed-Ulysses: aten CPU flash forward/backward, [B, S, H, D]."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        t = lambda x: x.transpose(1, 2)  # noqa: E731 - [B, S, H, D] -> [B, H, S, D]
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(t(q), t(k), t(v), 0.0, causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out.transpose(1, 2)  # [B, S, H, D]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            t(dout), t(q), t(k), t(v), out, lse, 0.0, ctx.causal, scale=ctx.scale
        )
        return t(dq), t(dk), t(dv), None, None


class LocalCpuAttention(torch.nn.Module):
    def __init__(self, causal: bool, scale: float):
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(self, q, k, v):
        return CpuFlashAttention.apply(q, k, v, self.causal, self.scale)


def patch_yunchang_cpu_kernel() -> None:
    """Give yunchang's TORCH_FLASH path the aten CPU flash kernels (forward with LSE, backward)."""
    import yunchang.kernels as yk
    import yunchang.kernels.attention as ya

    def forward(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=None,
                alibi_slopes=None, return_softmax=False, op_type="flash"):
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p, causal, scale=softmax_scale
        )
        return out.transpose(1, 2), lse  # out [B, S, H, D] in q's dtype, lse [B, H, S] fp32 (as flash-attn)

    def backward(dout, q, k, v, out, softmax_lse, block_dq_buffer=None, block_dk_buffer=None,
                 block_dv_buffer=None, dropout_p=0.0, softmax_scale=None, bwd_causal=None, window_size=None,
                 softcap=None, alibi_slopes=None, deterministic=True, rng_state=None, *args, **kwargs):
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            t(dout), t(q), t(k), t(v), t(out), softmax_lse.float().contiguous(), dropout_p, bool(bwd_causal),
            scale=softmax_scale,
        )
        block_dq_buffer.copy_(t(dq))
        block_dk_buffer.copy_(t(dk))
        block_dv_buffer.copy_(t(dv))

    for module in (yk, ya):
        module.pytorch_attn_forward = forward
        module.pytorch_attn_backward = backward


def patch_yunchang_fp32_alias() -> None:
    """Fix yunchang's zigzag ring backward in fp32: ``dq = dq_buffer.to(torch.float32)`` is no copy
    when the buffer already is fp32, so dq (and dk, dv) alias the scratch buffer that the next
    block's kernel overwrites. The fix is ``.to(torch.float32, copy=True)`` on those three lines."""
    import inspect

    import yunchang.ring.zigzag_ring_flash_attn as zigzag

    source = inspect.getsource(zigzag.zigzag_ring_flash_attn_backward)
    fixed = source.replace("_buffer.to(torch.float32)", "_buffer.to(torch.float32, copy=True)")
    if fixed.count("copy=True") != 3:
        raise RuntimeError("yunchang's zigzag backward changed; the fp32 alias fix no longer applies")
    namespace = dict(vars(zigzag))
    exec(compile(fixed, zigzag.__file__, "exec"), namespace)  # noqa: S102 - yunchang's own code, 3 words changed
    zigzag.zigzag_ring_flash_attn_backward = namespace["zigzag_ring_flash_attn_backward"]


def prebuild_deepspeed_ops() -> float:
    """Build DeepSpeed's CPU shared-memory comm op once, before any rank needs it (``init_distributed``
    JIT-compiles it on first use; ranks racing to build it would blow the launch's timeout)."""
    start = time.monotonic()
    try:
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            builder.load(verbose=False)
    except Exception as error:  # noqa: BLE001 - the ranks will report the real problem
        print(f"note: could not pre-build DeepSpeed's shm comm op: {error}", flush=True)
    return time.monotonic() - start
