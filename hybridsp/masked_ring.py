"""Ring attention over packed documents and sliding windows, driven by a block plan.

Note [masked ring]: with ``cu_seqlens`` (packed documents) or ``sliding_window`` the pieces
of every ring step come from :func:`hybridsp.masks.build_plan`, which every rank computes
for every pair of slots without communication. Blocks are not relayed around the ring: at
step ``s`` each rank sends the rows of its own K/V block that rank ``r + s`` reads straight
to it (nothing when it reads nothing, see :mod:`hybridsp.block_exchange`), and in the
backward each rank sends its partial fp32 dK/dV of a visiting block straight home. A step
with no visible key computes and sends nothing, so a window costs bytes and work in
proportion to the window. The forward posts the next step's transfer before computing the
current one, as the dense ring does. Kernels with ``supports_varlen`` run each block's
pieces in one call per flash window (:mod:`hybridsp.varlen`); others run one call per piece.

Shapes: q [B, S, H, D], k/v [B, S, Hkv, D] local (S = this ring slot's tokens), lse [B, H, S].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridsp.block_exchange import GRAD_TAG, KV_TAG, post
from hybridsp.kernels import ReferenceKernel, accumulation_dtype
from hybridsp.masks import BlockPlan, build_plan, check_sliding_window, normalize_cu_seqlens
from hybridsp.merge import merge_into
from hybridsp.varlen import backward_block, forward_block



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
    acc = accumulation_dtype(q.dtype)
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), -torch.inf, dtype=acc, device=q.device)
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
    dk = torch.zeros(k_rows.shape, dtype=dq_acc.dtype, device=k_rows.device)
    dv = torch.zeros(v_rows.shape, dtype=dq_acc.dtype, device=v_rows.device)
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
        acc = accumulation_dtype(like_k.dtype)
        like = [(shape, acc), (shape, acc)]
    pending = post(
        group, None if grads is None else home, grads or [], None if recv_hull is None else visitor, like,
        device=like_k.device, tag=GRAD_TAG, counter=counter,
    )
    return pending, recv_hull


def _masked_backward(dout, q, k, v, out, lse, group, kernel, scale, plan: BlockPlan, counter):
    """Gradients of the local shards: (dq [B, S, H, D], dk, dv [B, S, Hkv, D]) in the input dtype."""
    _, rank = _ring_size_rank(group)
    acc = accumulation_dtype(q.dtype)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
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


class MaskedRingFunction(torch.autograd.Function):
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
