"""Ring attention by point-to-point sends, driven by a block plan (``kv_comm="ring"``).

Note [p2p ring]: every rank derives the same :class:`~hybridsp.masks.BlockPlan` (dense
causal, documents, windows alike) without communication. Blocks are not relayed around the
ring: at step ``s`` each rank sends the rows of its *own* K/V block that rank ``r + s`` reads
straight to it (its plan hull; nothing when it reads nothing, see
:mod:`hybridsp.block_exchange`), so zigzag's off-diagonal steps ship the half that is seen
and a window ships the window. The forward posts step ``s + 1``'s transfer before computing
step ``s``.

Backward at the byte minimum: the K/V rows travel again as in the forward; the partial
dK/dV a rank computes for a visiting block goes straight home, once (``R - 1`` sends per rank
per backward), only the hull rows, in the *input* dtype (the kernel returned it in that
dtype; a block made of several pieces is summed in fp32 first and rounded once). The owner
adds the ``R - 1`` arriving contributions into its fp32 (fp64 for fp64) accumulators and
rounds once at the end. The sends of step ``s`` travel while step ``s + 1`` computes; the
own block is computed at step 0, overlapping the first K/V transfer (the last gradient
transfer is the one exposed; hiding it too would mean keeping the forward's last visiting
block alive until the backward, one more K/V block per layer).

Shapes: q [B, S, H, D], k/v [B, S, Hkv, D] local (S = this ring slot's tokens), lse [B, H, S].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridsp.block_exchange import GRAD_TAG, KV_TAG, post
from hybridsp.kernels import accumulation_dtype
from hybridsp.masks import BlockPlan
from hybridsp.pieces import backward_pieces, forward_pieces


def ring_size_rank(group) -> tuple[int, int]:
    """(size, rank) of the ring group; (1, 0) for no group."""
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


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


def _ring_forward(q, k, v, group, kernel, scale, plan: BlockPlan, counter):
    """q [B, S, H, D], k/v [B, S, Hkv, D] (local) -> (out [B, S, H, D], lse [B, H, S] fp32/fp64)."""
    _, rank = ring_size_rank(group)
    acc = accumulation_dtype(q.dtype)
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), -torch.inf, dtype=acc, device=q.device)
    for _, source, offset, k_rows, v_rows in _visiting_blocks(group, plan, rank, k, v, counter):
        forward_pieces(kernel, q, k_rows, v_rows, plan.pieces[(rank, source)], offset, scale, out_acc, lse_acc)
    return out_acc.to(q.dtype), lse_acc


def _visitor_grads(dout, q, k_rows, v_rows, out, lse, kernel, scale, pieces, offset, dq_acc):
    """A visiting block's (dk, dv) [B, rows, Hkv, D] in the input dtype (summed in fp32, rounded
    once); adds its dq share into dq_acc. None when the block has no piece."""
    if not pieces:
        return None
    dk = torch.zeros(k_rows.shape, dtype=dq_acc.dtype, device=k_rows.device)
    dv = torch.zeros(v_rows.shape, dtype=dq_acc.dtype, device=v_rows.device)
    backward_pieces(kernel, dout, q, k_rows, v_rows, out, lse, pieces, offset, scale, dq_acc, dk, dv)
    return [dk.to(k_rows.dtype), dv.to(v_rows.dtype)]


def _post_grads(group, plan: BlockPlan, rank: int, step: int, grads, like_k, counter):
    """Send this step's partial (dk, dv) home to ``rank - step``; receive own-block partials from
    ``rank + step`` (in the input dtype, the hull rows that visitor read)."""
    size = plan.ring
    home, visitor = (rank - step) % size, (rank + step) % size
    recv_hull = plan.hulls[(visitor, rank)]
    like = []
    if recv_hull is not None:
        shape = (like_k.shape[0], recv_hull[1] - recv_hull[0], *like_k.shape[2:])
        like = [(shape, like_k.dtype), (shape, like_k.dtype)]
    pending = post(
        group, None if grads is None else home, grads or [], None if recv_hull is None else visitor, like,
        device=like_k.device, tag=GRAD_TAG, counter=counter,
    )
    return pending, recv_hull


def _ring_backward(dout, q, k, v, out, lse, group, kernel, scale, plan: BlockPlan, counter):
    """Gradients of the local shards: (dq [B, S, H, D], dk, dv [B, S, Hkv, D]) in the input dtype."""
    _, rank = ring_size_rank(group)
    acc = accumulation_dtype(q.dtype)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
    grad_pending = None
    for step, source, offset, k_rows, v_rows in _visiting_blocks(group, plan, rank, k, v, counter):
        pieces = plan.pieces[(rank, source)]
        if step == 0:  # the own block: straight into the accumulators
            backward_pieces(kernel, dout, q, k, v, out, lse, pieces, 0, scale, dq_acc, dk_acc, dv_acc)
            continue
        grads = _visitor_grads(dout, q, k_rows, v_rows, out, lse, kernel, scale, pieces, offset, dq_acc)
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


class P2PRingFunction(torch.autograd.Function):
    """Ring attention driven by a :class:`~hybridsp.masks.BlockPlan` (Note [p2p ring])."""

    @staticmethod
    def forward(ctx, q, k, v, group, kernel, scale, plan, counter):
        out, lse = _ring_forward(q, k, v, group, kernel, scale, plan, counter)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (group, kernel, scale, plan, counter)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.settings)
        return dq, dk, dv, None, None, None, None, None
