"""Ring attention: exact attention over a sequence sharded across a ring of ranks.

Each of the ``R`` ranks of ``group`` holds ``S/R`` query tokens and the matching key/value
tokens. For ``R`` steps every rank attends its queries to the key/value block it holds,
merges the partial result by log-sum-exp (:mod:`hybridsp.merge`), and passes the block on
to the next rank; the next block's transfer is posted before the current block is computed
so communication overlaps compute.

Backward re-runs every block's kernel backward with the *final* out and lse (so each block
returns its exact share of the gradients). dq accumulates locally; dk/dv accumulators travel
around the ring with the blocks and arrive home after ``R`` hops. All accumulation is fp32,
cast to the input dtype once.

Note [block plan]: which part of (local queries x visiting block) is computed at each step
depends on the layout and on where the block comes from; :func:`block_plan` answers that
for one step as a list of ``(query rows, key rows, causal)`` pieces, so one loop serves
every layout and both directions.

Note [masked ring]: with ``cu_seqlens`` (packed documents) or ``sliding_window`` the pieces
come from :func:`hybridsp.masks.build_plan`, which every rank computes for every pair of
slots without communication. Then blocks are not relayed: at step ``s`` each rank sends the
rows of its own K/V block that rank ``r + s`` reads straight to it (nothing when it reads
nothing, see :mod:`hybridsp.block_exchange`), and in the backward each rank sends its
partial dK/dV of a visiting block straight home. A step with no visible key computes and
sends nothing; a window therefore costs bytes and work in proportion to the window.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridsp.block_exchange import GRAD_TAG, KV_TAG, post
from hybridsp.comm import CommCounter, RingExchange
from hybridsp.kernels import AttentionKernel, ReferenceKernel, check_qkv, default_softmax_scale, get_kernel
from hybridsp.layout import LAYOUTS
from hybridsp.masks import BlockPlan, build_plan, check_sliding_window, normalize_cu_seqlens
from hybridsp.merge import merge_into
from hybridsp.varlen import backward_block, forward_block

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
    """q [B, S, H, D], k/v [B, S, Hkv, D] (local shards) -> (out [B, S, H, D], lse [B, H, S] fp32)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    out_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), -torch.inf, device=q.device)
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
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv, grad_pending = [k, v], None
    for step in range(size):
        kv_pending = kv_exchange.start(kv) if step + 1 < size else None
        block_dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        block_dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
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


# --------------------------------------------------------------------------- masked ring


def _ring_size_rank(group) -> tuple[int, int]:
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


def _band_kernel(kernel):
    """The kernel itself if it computes band pieces, else the fp32 reference math."""
    return kernel if hasattr(kernel, "forward_band") else ReferenceKernel()


def _piece_forward(kernel, q, k, v, piece, scale):
    """(out, lse) of one plan piece; q/k/v already cut to the piece."""
    if piece.kind == "band":
        return _band_kernel(kernel).forward_band(q, k, v, band=piece.band, softmax_scale=scale)
    return kernel.forward(q, k, v, causal=piece.kind == "causal", softmax_scale=scale)


def _piece_backward(kernel, dout, q, k, v, out, lse, piece, scale):
    """(dq, dk, dv) of one plan piece given the final out/lse cut to its rows."""
    if piece.kind == "band":
        return _band_kernel(kernel).backward_band(dout, q, k, v, out, lse, band=piece.band, softmax_scale=scale)
    return kernel.backward(dout, q, k, v, out, lse, causal=piece.kind == "causal", softmax_scale=scale)


def _post_kv(group, plan: BlockPlan, rank: int, step: int, k, v, counter):
    """Post step ``step``'s K/V: own rows to ``rank + step``, rows of ``rank - step`` from it."""
    size = plan.ring
    dest, source = (rank + step) % size, (rank - step) % size
    send_hull, recv_hull = plan.hulls[(dest, rank)], plan.hulls[(rank, source)]
    sends = [] if send_hull is None else [k[:, send_hull[0]:send_hull[1]], v[:, send_hull[0]:send_hull[1]]]
    like = []
    if recv_hull is not None:
        rows = recv_hull[1] - recv_hull[0]
        like = [((k.shape[0], rows, *k.shape[2:]), k.dtype), ((v.shape[0], rows, *v.shape[2:]), v.dtype)]
    return post(
        group, None if send_hull is None else dest, sends, None if recv_hull is None else source, like,
        device=k.device, tag=KV_TAG, counter=counter,
    )


def _visiting_blocks(group, plan: BlockPlan, rank: int, k, v, counter):
    """Yield ``(step, source, key offset, k rows, v rows)`` per ring step, the next step's
    transfer posted before the current step is handed out (k/v None: nothing visible)."""
    size = plan.ring
    pending = _post_kv(group, plan, rank, 1, k, v, counter) if size > 1 else None
    for step in range(size):
        source = (rank - step) % size
        if step == 0:
            block = (0, k, v)
        else:
            received = pending.wait()
            hull = plan.hulls[(rank, source)]
            block = (hull[0], *received) if received is not None else (0, None, None)
            pending = _post_kv(group, plan, rank, step + 1, k, v, counter) if step + 1 < size else None
        yield (step, source, *block)


def _masked_forward(q, k, v, group, kernel, scale, plan: BlockPlan, counter):
    """q [B, S, H, D], k/v [B, S, Hkv, D] (local) -> (out [B, S, H, D], lse [B, H, S] fp32)."""
    _, rank = _ring_size_rank(group)
    out_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), -torch.inf, device=q.device)
    varlen = getattr(kernel, "supports_varlen", False)
    for _, source, offset, k_rows, v_rows in _visiting_blocks(group, plan, rank, k, v, counter):
        if varlen and plan.pieces[(rank, source)]:  # one call per flash window (hybridsp.varlen)
            forward_block(kernel, q, k_rows, v_rows, plan.pieces[(rank, source)], offset, scale, out_acc, lse_acc)
            continue
        for piece in plan.pieces[(rank, source)]:
            b, rows, keys = piece.batch, piece.rows, piece.shifted(offset).keys
            block_out, block_lse = _piece_forward(kernel, q[b, rows], k_rows[b, keys], v_rows[b, keys], piece, scale)
            merge_into(out_acc[b, rows], lse_acc[b, :, rows], block_out, block_lse)
    return out_acc.to(q.dtype), lse_acc


def _block_grads(dout, q, k_rows, v_rows, out, lse, kernel, scale, pieces, offset, dq_acc):
    """One visiting block's fp32 (dk, dv) [B, rows, Hkv, D]; adds its dq share into dq_acc."""
    dk = torch.zeros(k_rows.shape, dtype=torch.float32, device=k_rows.device)
    dv = torch.zeros(v_rows.shape, dtype=torch.float32, device=v_rows.device)
    if getattr(kernel, "supports_varlen", False):
        backward_block(kernel, dout, q, k_rows, v_rows, out, lse, pieces, offset, scale, dq_acc, dk, dv)
        return dk, dv
    for piece in pieces:
        b, rows, keys = piece.batch, piece.rows, piece.shifted(offset).keys
        dq, dk_piece, dv_piece = _piece_backward(
            kernel, dout[b, rows], q[b, rows], k_rows[b, keys], v_rows[b, keys], out[b, rows], lse[b, :, rows],
            piece, scale,
        )
        dq_acc[b, rows] += dq
        dk[b, keys] += dk_piece
        dv[b, keys] += dv_piece
    return dk, dv


def _post_grads(group, plan: BlockPlan, rank: int, step: int, grads, like_k, counter):
    """Send this step's partial (dk, dv) home to ``rank - step``; receive own-block partials from ``rank + step``."""
    size = plan.ring
    home, visitor = (rank - step) % size, (rank + step) % size
    recv_hull = plan.hulls[(visitor, rank)]
    like = []
    if recv_hull is not None:
        shape = (like_k.shape[0], recv_hull[1] - recv_hull[0], *like_k.shape[2:])
        like = [(shape, torch.float32), (shape, torch.float32)]
    pending = post(
        group, None if grads is None else home, grads or [], None if recv_hull is None else visitor, like,
        device=like_k.device, tag=GRAD_TAG, counter=counter,
    )
    return pending, recv_hull


def _masked_backward(dout, q, k, v, out, lse, group, kernel, scale, plan: BlockPlan, counter):
    """Gradients of the local shards: (dq [B, S, H, D], dk, dv [B, S, Hkv, D]) in the input dtype."""
    _, rank = _ring_size_rank(group)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    grad_pending = None
    for step, source, offset, k_rows, v_rows in _visiting_blocks(group, plan, rank, k, v, counter):
        pieces = plan.pieces[(rank, source)]
        grads = None
        if pieces:
            grads = list(_block_grads(dout, q, k_rows, v_rows, out, lse, kernel, scale, pieces, offset, dq_acc))
        if step == 0:
            if grads is not None:
                dk_acc += grads[0]
                dv_acc += grads[1]
            continue
        _add_received(grad_pending, dk_acc, dv_acc)
        grad_pending = _post_grads(group, plan, rank, step, grads, k, counter)
    _add_received(grad_pending, dk_acc, dv_acc)
    return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def _add_received(grad_pending, dk_acc, dv_acc) -> None:
    """Wait for a posted gradient exchange and add what came home into the own-block accumulators."""
    if grad_pending is None:
        return
    pending, hull = grad_pending
    received = pending.wait()
    if received is not None:
        dk_acc[:, hull[0]:hull[1]] += received[0]
        dv_acc[:, hull[0]:hull[1]] += received[1]


class _MaskedRingFunction(torch.autograd.Function):
    """Ring attention driven by a :class:`~hybridsp.masks.BlockPlan` (Note [masked ring])."""

    @staticmethod
    def forward(ctx, q, k, v, group, kernel, scale, plan, counter):
        out, lse = _masked_forward(q, k, v, group, kernel, scale, plan, counter)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (group, kernel, scale, plan, counter)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _masked_backward(dout, q, k, v, out, lse, *ctx.settings)
        return dq, dk, dv, None, None, None, None, None


def masked_plan(
    q: torch.Tensor, group, causal: bool, layout: str, cu_seqlens, sliding_window
) -> BlockPlan | None:
    """The block plan of a masked call, or None when documents and window change nothing.

    Validates ``cu_seqlens`` and ``sliding_window`` (ValueError, before any communication).
    """
    check_sliding_window(sliding_window)
    size, _ = _ring_size_rank(group)
    seq_len = q.shape[1] * size
    docs = normalize_cu_seqlens(cu_seqlens, q.shape[0], seq_len)
    window = None if sliding_window is None or sliding_window >= seq_len else sliding_window
    if docs is None and window is None:
        return None
    return build_plan(seq_len, size, layout, causal=causal, docs=docs, window=window, batch=q.shape[0])


def check_ring_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, layout: str) -> None:
    """Raise ValueError for inputs the ring cannot run (before any communication)."""
    check_qkv(q, k, v, causal=False)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"ring attention needs as many local queries as keys; got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"unknown token layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
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
    check_ring_inputs(q, k, v, causal, layout)
    plan = masked_plan(q, group, causal, layout, cu_seqlens, sliding_window)
    kernel = get_kernel(backend, device=q.device, dtype=q.dtype)
    scale = default_softmax_scale(q.shape[-1], softmax_scale)
    if plan is not None:
        return _MaskedRingFunction.apply(q, k, v, group, kernel, scale, plan, counter)
    if group is None or dist.get_world_size(group) == 1:
        return _SingleKernelFunction.apply(q, k, v, kernel, causal, scale)
    return _RingAttentionFunction.apply(q, k, v, group, kernel, causal, scale, layout, counter)
