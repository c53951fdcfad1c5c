"""Ring attention: exact attention over a sequence sharded across a ring of ranks.

Each of the ``R`` ranks of ``group`` holds ``S/R`` query tokens and the matching key/value
tokens. For ``R`` steps every rank attends its queries to the key/value block it holds,
merges the partial result by log-sum-exp (:mod:`hybridsp.merge`), and passes the block on
to the next rank; the next block's transfer is posted before the current block is computed
so communication overlaps compute.

Backward re-runs every block's kernel backward with the *final* out and lse (so each block
returns its exact share of the gradients). dq accumulates locally; dk/dv accumulators travel
around the ring with the blocks and arrive home after ``R`` hops. All accumulation is fp32
(fp64 for fp64 inputs), cast to the input dtype once.

Note [block plan]: which part of (local queries x visiting block) is computed at each step
depends on the layout and on where the block comes from; :func:`block_plan` answers that
for one step as a list of ``(query rows, key rows, causal)`` pieces, so one loop serves
every layout and both directions.

With ``cu_seqlens`` (packed documents) or ``sliding_window`` the call goes to
:mod:`hybridsp.masked_ring` instead (Note [masked ring] there): the pieces come from
:mod:`hybridsp.masks` and blocks travel by direct sends that skip what nobody sees.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridsp.comm import CommCounter, RingExchange
from hybridsp.kernels import AttentionKernel, accumulation_dtype, check_qkv, default_softmax_scale, resolve_kernel
from hybridsp.layout import LAYOUTS
from hybridsp.masked_ring import MaskedRingFunction, masked_plan
from hybridsp.merge import merge_into

Piece = tuple[slice, slice, bool]
_ALL = slice(None)


def block_plan(source: int, rank: int, causal: bool, layout: str, local_len: int) -> list[Piece]:
    """The pieces of ``local queries x block from ring rank source`` that hold visible keys.

    Returns a list of ``(query slice, key slice, causal)`` along the local sequence.
    Zigzag (causal): the diagonal block is causal; a block from an earlier slot is seen by
    all queries through its first half; a block from a later slot is seen whole by the second
    half of the queries. Contiguous (causal): earlier blocks whole, later blocks not at all.
    """
    if not causal:
        return [(_ALL, _ALL, False)]
    if source == rank:
        return [(_ALL, _ALL, True)]
    if layout == "contiguous":
        return [(_ALL, _ALL, False)] if source < rank else []
    half = local_len // 2
    if source < rank:
        return [(_ALL, slice(0, half), False)]
    return [(slice(half, None), _ALL, False)]


def _ring_forward(q, k, v, group, kernel, causal, scale, layout, counter):
    """q [B, S, H, D], k/v [B, S, Hkv, D] (local shards) -> (out [B, S, H, D], lse [B, H, S] fp32/fp64)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = accumulation_dtype(q.dtype)
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), -torch.inf, dtype=acc, device=q.device)
    exchange = RingExchange(group, counter)
    kv = [k, v]
    for step in range(size):
        pending = exchange.start(kv) if step + 1 < size else None
        for rows, keys, piece_causal in block_plan((rank - step) % size, rank, causal, layout, q.shape[1]):
            block_out, block_lse = kernel.forward(
                q[:, rows], kv[0][:, keys], kv[1][:, keys], causal=piece_causal, softmax_scale=scale
            )
            merge_into(out_acc[:, rows], lse_acc[:, :, rows], block_out, block_lse)
        if pending is not None:
            kv = pending.wait()
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(dout, q, k, v, out, lse, group, kernel, causal, scale, layout, counter):
    """Gradients of the local shards: (dq [B, S, H, D], dk, dv [B, S, Hkv, D]) in the input dtype."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    kv_exchange, grad_exchange = RingExchange(group, counter), RingExchange(group, counter)
    acc = accumulation_dtype(q.dtype)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv, grad_pending = [k, v], None
    for step in range(size):
        kv_pending = kv_exchange.start(kv) if step + 1 < size else None
        block_dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        block_dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for rows, keys, piece_causal in block_plan((rank - step) % size, rank, causal, layout, q.shape[1]):
            dq, dk, dv = kernel.backward(
                dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows], lse[:, :, rows],
                causal=piece_causal, softmax_scale=scale,
            )
            dq_acc[:, rows] += dq
            block_dk[:, keys] += dk
            block_dv[:, keys] += dv
        if grad_pending is not None:  # the accumulators of this block, from the previous rank
            travelling_dk, travelling_dv = grad_pending.wait()
            block_dk += travelling_dk
            block_dv += travelling_dv
        grad_pending = grad_exchange.start([block_dk, block_dv])
        if kv_pending is not None:
            kv = kv_pending.wait()
    dk_home, dv_home = grad_pending.wait()
    return dq_acc.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype)


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, kernel, causal, scale, layout, counter):
        out, lse = _ring_forward(q, k, v, group, kernel, causal, scale, layout, counter)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (group, kernel, causal, scale, layout, counter)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.settings)
        return dq, dk, dv, None, None, None, None, None, None


class _SingleKernelFunction(torch.autograd.Function):
    """Ring size 1: one kernel call on the whole local sequence, no communication."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, causal, scale):
        out, lse = kernel.forward(q, k, v, causal=causal, softmax_scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (kernel, causal, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, causal, scale = ctx.settings
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)
        return dq, dk, dv, None, None, None


def check_softmax_scale(softmax_scale: float | None) -> None:
    """Raise ValueError unless the scale is None or a finite positive number."""
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not (
        0 < float(softmax_scale) < float("inf")
    ):
        raise ValueError(f"softmax_scale must be a finite positive number (or None for 1/sqrt(D)); got {softmax_scale!r}")


def check_ring_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, layout: str, softmax_scale: float | None = None
) -> None:
    """Raise ValueError for inputs the ring cannot run (before any communication)."""
    check_qkv(q, k, v, causal=False)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"ring attention needs as many local queries as keys; got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"unknown token layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    check_softmax_scale(softmax_scale)
    if causal and layout == "zigzag" and q.shape[1] % 2 != 0:
        raise ValueError(
            f"the zigzag layout holds two equal chunks per rank, so the local sequence length must be "
            f"even; got {q.shape[1]}"
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool = True,
    cu_seqlens=None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
    backend: str | AttentionKernel = "auto",
    layout: str = "zigzag",
    counter: CommCounter | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: [B, S_local, H, D] this rank's queries, in ``layout`` order (see :mod:`hybridsp.layout`).
        k, v: [B, S_local, Hkv, D] the matching keys and values (H % Hkv == 0).
        group: the ring's process group (explicit; ``None`` means a ring of one, no communication).
        causal: causal masking by global token position.
        cu_seqlens: packed documents: int boundaries ``[num_docs + 1]`` over the *global*
            sequence (``S_local x R`` tokens, in natural order, not layout order), the same on
            every ring rank; shared by all batch rows, or ``[B, num_docs + 1]`` / a list of B
            such boundaries (one per row). Queries attend keys of their own document only.
        sliding_window: W: query i attends keys j with ``i - W < j <= i`` (``|i - j| < W``
            when not causal); None for no window.
        softmax_scale: defaults to 1/sqrt(D).
        backend: a kernel name (``auto``, ``torch``, ``flash``, ``reference``) or kernel object.
        layout: ``zigzag`` (balanced causal work) or ``contiguous``.
        counter: optional :class:`CommCounter` that records the bytes this rank sends.

    Returns:
        out [B, S_local, H, D] in q's dtype, differentiable in q, k and v.
    """
    check_ring_inputs(q, k, v, causal, layout, softmax_scale)
    plan = masked_plan(q, group, causal, layout, cu_seqlens, sliding_window)
    kernel = resolve_kernel(backend, q)
    scale = default_softmax_scale(q.shape[-1], softmax_scale)
    if plan is not None:
        return MaskedRingFunction.apply(q, k, v, group, kernel, scale, plan, counter)
    if group is None or dist.get_world_size(group) == 1:
        return _SingleKernelFunction.apply(q, k, v, kernel, causal, scale)
    return _RingAttentionFunction.apply(q, k, v, group, kernel, causal, scale, layout, counter)
