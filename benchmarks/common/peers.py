"""The methods the peers benchmarks compare (attention.peers, memory.a2a), each on the same CPU kernel.

:class:`Case` is one method at one U x R and shape; :func:`setup_method` sets it up inside a rank
(hybridsp at every ``kv_comm``, hybridsp with an earlier revision's resharding and CPU kernel swapped
in, DeepSpeed-Ulysses, yunchang USP); :func:`make_inputs` makes the full q, k, v, dout.

The peers' local kernel on CPU is the aten CPU flash kernel (what hybridsp's ``backend="torch"`` calls):

- DeepSpeed-Ulysses: :class:`LocalCpuAttention`, the local attention module inside
  ``DistributedAttention``; [B, S, H, D] in and out, passed to the kernel as [B, H, S, D] views.
- yunchang 0.6.4: :func:`patch_yunchang_cpu_kernel` gives its TORCH_FLASH path the aten kernels
  (its shipped torch path has no CPU kernel with an LSE and no backward);
  :func:`patch_yunchang_fp32_alias` fixes its fp32 zigzag ring backward (see there).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_aten = torch.ops.aten
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Case:
    """One method at one U x R and shape (memory.a2a builds these too)."""

    method: str  # hybridsp | hybridsp-allgather | hybridsp@REV | deepspeed | yunchang
    world: int
    ulysses: int
    ring: int
    dtype: str
    seq: int
    heads: int
    kv_heads: int
    head_dim: int = 64
    batch: int = 1
    iters: int = 15
    before: str = ""  # a git revision: also time hybridsp's ulysses.py + torch kernel of that revision

    @property
    def peer(self) -> str:
        return "deepspeed" if self.ulysses == self.world else "yunchang"


# --------------------------------------------------------------------------------------------
# the methods


def _revision_modules(revision: str):
    """(ulysses, torch_fused) modules built from hybridsp's files at a git revision (for before/after)."""
    import subprocess
    import types

    modules = []
    for name in ("ulysses", "kernels/torch_fused"):
        source = subprocess.run(
            ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "show", f"{revision}:hybridsp/{name}.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        module = types.ModuleType(f"hybridsp_{name.replace('/', '_')}_at_{revision}")
        exec(compile(source, f"{revision}:{name}.py", "exec"), module.__dict__)  # noqa: S102 - our own file
        modules.append(module)
    return modules


def _hybridsp_at(revision: str, mesh, scale):
    """hybrid_attn_func with the resharding and CPU kernel of ``revision`` swapped in for each call."""
    import hybridsp.attention._ulysses as current
    from hybridsp import hybrid_attn_func

    old_ulysses, old_kernels = _revision_modules(revision)
    kernel, mine = old_kernels.TorchFusedKernel(), dict(current._RESHARD)

    def attention(q, k, v, counter=None):
        current._RESHARD.update({True: old_ulysses._seq_to_heads, False: old_ulysses._heads_to_seq})
        try:
            out = hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend=kernel, counter=counter)
            return _SwapDuringBackward.apply(out, old_ulysses, mine)
        finally:
            current._RESHARD.update(mine)

    return attention


class _SwapDuringBackward(torch.autograd.Function):
    """Identity whose backward swaps the old resharding in for the rest of the backward pass (it is
    the first node backward meets); the current hybridsp method swaps its own back in per call."""

    @staticmethod
    def forward(ctx, out, old, mine):
        ctx.old = old
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        import hybridsp.attention._ulysses as current

        current._RESHARD.update({True: ctx.old._seq_to_heads, False: ctx.old._heads_to_seq})
        return grad, None, None


def make_inputs(case: Case, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Full q, k, v, dout [B, S, H(kv), D] in the case's dtype, identical in every process."""
    gen = torch.Generator().manual_seed(seed)
    heads = {"q": case.heads, "k": case.kv_heads, "v": case.kv_heads, "dout": case.heads}
    return {
        n: torch.randn(case.batch, case.seq, h, case.head_dim, generator=gen).to(DTYPES[case.dtype])
        for n, h in heads.items()
    }


def setup_method(case: Case, rank: int):
    """(attention(q, k, v, counter=None) -> out, shard(full [B, S, ...]) -> this rank's tokens)."""
    scale = 1.0 / math.sqrt(case.head_dim)
    if case.method.startswith("hybridsp"):
        from hybridsp import hybrid_attn_func, init_mesh, shard_sequence

        mesh = init_mesh(case.ulysses, case.ring)
        if "@" in case.method:
            return _hybridsp_at(case.method.split("@", 1)[1], mesh, scale), lambda x: shard_sequence(x, mesh)
        mode = {"kv_comm": case.method.split("-", 1)[1]} if "-" in case.method else {}

        import hybridsp.attention._ulysses

        current = dict(hybridsp.attention._ulysses._RESHARD)  # a hybridsp@REV method swaps its own in for its calls

        def attention(q, k, v, counter=None):
            hybridsp.attention._ulysses._RESHARD.update(current)
            return hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend="torch", counter=counter, **mode)

        return attention, lambda x: shard_sequence(x, mesh)
    if case.method == "deepspeed":
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the initialised torch.distributed
        layer = DistributedAttention(
            LocalCpuAttention(True, scale), dist.new_group(list(range(case.world))), scatter_idx=2, gather_idx=1
        )
        repeats = -(-case.world // case.kv_heads)

        def attention(q, k, v, counter=None):
            if repeats > 1:  # ALST-style caller-side K/V replication (DistributedAttention needs Hkv >= world)
                k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
            return layer(q, k, v, 0)  # batch_dim_idx=0: [B, S, H, D]

        return attention, lambda x: x.chunk(case.world, dim=1)[rank].contiguous()
    if case.method == "yunchang":
        import yunchang
        from yunchang import LongContextAttention, set_seq_parallel_pg
        from yunchang.kernels import AttnType

        patch_yunchang_cpu_kernel()
        if case.dtype == "fp32":
            patch_yunchang_fp32_alias()
        set_seq_parallel_pg(case.ulysses, case.ring, rank, case.world, use_ulysses_low=True)
        layer = LongContextAttention(ring_impl_type="zigzag", attn_type=AttnType.TORCH_FLASH)
        extract = yunchang.EXTRACT_FUNC_DICT["zigzag"]
        return (
            lambda q, k, v, counter=None: layer(q, k, v, softmax_scale=scale, causal=True),
            lambda x: extract(x, rank, case.world, case.ring, case.ulysses),
        )
    raise ValueError(case.method)


# --------------------------------------------------------------------------------------------
# the peers' local kernel on CPU


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

    def forward(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=True,
        window_size=(-1, -1),
        softcap=None,
        alibi_slopes=None,
        return_softmax=False,
        op_type="flash",
    ):
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p, causal, scale=softmax_scale
        )
        return out.transpose(1, 2), lse  # out [B, S, H, D] in q's dtype, lse [B, H, S] fp32 (as flash-attn)

    def backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        block_dq_buffer=None,
        block_dk_buffer=None,
        block_dv_buffer=None,
        dropout_p=0.0,
        softmax_scale=None,
        bwd_causal=None,
        window_size=None,
        softcap=None,
        alibi_slopes=None,
        deterministic=True,
        rng_state=None,
        *args,
        **kwargs,
    ):
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            t(dout),
            t(q),
            t(k),
            t(v),
            t(out),
            softmax_lse.float().contiguous(),
            dropout_p,
            bool(bwd_causal),
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
