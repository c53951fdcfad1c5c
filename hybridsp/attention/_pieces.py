"""Computing a key/value block's plan pieces against the local queries, whatever brought the block.

Both K/V transports (:mod:`hybridsp.attention._transport.p2p` and :mod:`hybridsp.attention._transport.allgather`) hand a block of
key rows and the :class:`~hybridsp.layout._block_plan.Piece` list that says which local query rows see
which of them; these two functions run the pieces and fold the results into the caller's
accumulators. The kernel is complete (:class:`~hybridsp.kernels._base.AttentionKernel`, as
:func:`~hybridsp.kernels._select.resolve_kernel` returns it): kernels with ``supports_varlen`` run a
block's pieces in one call per flash window (:mod:`hybridsp.attention._varlen`); others run small
pieces of one shape as one call stacked along the batch axis (:mod:`hybridsp.attention._stacked`)
and every other piece in a call of its own, band pieces by the kernel's ``forward_band``/``backward_band``.

Shapes: q [B, S, H, D], dout/out [B, S, H, Dv] local, lse [B, H, S], k_rows [B, rows, Hkv, D],
v_rows [B, rows, Hkv, Dv];
piece keys are counted from ``offset`` in the block's own coordinates (``Piece.shifted``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridsp.attention._merge import merge_into
from hybridsp.attention._stacked import gather_lse, gather_rows, scatter_lse, stacks_and_singles
from hybridsp.attention._varlen import backward_block, forward_block
from hybridsp.kernels._base import softcap_kwargs

if TYPE_CHECKING:
    from hybridsp.attention._resolve import RingCall
    from hybridsp.attention._transport.base import Block
    from hybridsp.layout._block_plan import Piece


def _piece_forward(
    call: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, piece: Piece
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one plan piece; q/k/v already cut to the piece."""
    kernel, capped = call.kernel, softcap_kwargs(call.softcap)
    if piece.kind == "band":
        return kernel.forward_band(q, k, v, band=piece.band, softmax_scale=call.scale, **capped)
    return kernel.forward(q, k, v, causal=piece.kind == "causal", softmax_scale=call.scale, **capped)


def _piece_backward(
    call: RingCall,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    piece: Piece,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one plan piece given the final out/lse cut to its rows."""
    kernel, capped = call.kernel, softcap_kwargs(call.softcap)
    if piece.kind == "band":
        return kernel.backward_band(dout, q, k, v, out, lse, band=piece.band, softmax_scale=call.scale, **capped)
    return kernel.backward(dout, q, k, v, out, lse, causal=piece.kind == "causal", softmax_scale=call.scale, **capped)


def forward_pieces(call: RingCall, q: torch.Tensor, block: Block, out_acc: torch.Tensor, lse_acc: torch.Tensor) -> None:
    """Attend q's piece rows to the block's piece keys; merge into out_acc [B, S, H, Dv] / lse_acc [B, H, S].
    The call gives the kernel, the scale, the soft-capping and the plan that owns the block's pieces
    (varlen index tables are kept on it)."""
    pieces, offset, k_rows, v_rows, plan = block.pieces, block.offset, block.k, block.v, call.plan
    if not pieces:
        return
    assert k_rows is not None and v_rows is not None  # a block with pieces has arrived
    if call.kernel.supports_varlen:
        forward_block(call, q, block, out_acc, lse_acc)
        return
    stacks, singles = stacks_and_singles(pieces, offset, q.shape[0], q.device, plan)
    for stack in stacks:  # many small pieces of one shape: one call (hybridsp.attention._stacked)
        block_out, block_lse = _piece_forward(
            call,
            gather_rows(q, stack.q_batch, stack.q_seq, stack.size),
            gather_rows(k_rows, stack.k_batch, stack.k_seq, stack.size),
            gather_rows(v_rows, stack.k_batch, stack.k_seq, stack.size),
            stack.like,
        )  # [G, n, H, Dv], [G, H, n]
        out_rows, lse_rows = gather_rows(out_acc, stack.q_batch, stack.q_seq, stack.size), gather_lse(lse_acc, stack)
        merge_into(out_rows, lse_rows, block_out, block_lse)
        out_acc[stack.q_batch, stack.q_seq] = out_rows.flatten(0, 1)  # [G * n, H, Dv]
        scatter_lse(lse_acc, stack, lse_rows)
    for piece in singles:
        b, rows, keys = piece.batch, piece.rows, piece.shifted(offset).keys
        block_out, block_lse = _piece_forward(call, q[b, rows], k_rows[b, keys], v_rows[b, keys], piece)
        merge_into(out_acc[b, rows], lse_acc[b, :, rows], block_out, block_lse)


def backward_pieces(
    call: RingCall,
    dout: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block: Block,
    dq_acc: torch.Tensor,
    dk_acc: torch.Tensor,
    dv_acc: torch.Tensor,
) -> None:
    """Add the block's pieces' gradients: dq into dq_acc [B, S, H, D], dk/dv into dk_acc [B, rows, Hkv, D] /
    dv_acc [B, rows, Hkv, Dv] (accumulators in the accumulation dtype; the block's keys counted from its offset)."""
    pieces, offset, k_rows, v_rows, plan = block.pieces, block.offset, block.k, block.v, call.plan
    if not pieces:
        return
    assert k_rows is not None and v_rows is not None  # a block with pieces has arrived
    if call.kernel.supports_varlen:
        backward_block(call, dout, q, out, lse, block, dq_acc, dk_acc, dv_acc)
        return
    stacks, singles = stacks_and_singles(pieces, offset, q.shape[0], q.device, plan)
    for stack in stacks:
        q_rows = (stack.q_batch, stack.q_seq)
        k_keys = (stack.k_batch, stack.k_seq)
        dq, dk, dv = _piece_backward(
            call,
            gather_rows(dout, *q_rows, stack.size),
            gather_rows(q, *q_rows, stack.size),
            gather_rows(k_rows, *k_keys, stack.size),
            gather_rows(v_rows, *k_keys, stack.size),
            gather_rows(out, *q_rows, stack.size),
            gather_lse(lse, stack),
            stack.like,
        )  # [G, n, H, D], [G, m, Hkv, D], [G, m, Hkv, Dv]
        dq_acc.index_put_(q_rows, dq.flatten(0, 1).to(dq_acc.dtype), accumulate=True)
        dk_acc.index_put_(k_keys, dk.flatten(0, 1).to(dk_acc.dtype), accumulate=True)
        dv_acc.index_put_(k_keys, dv.flatten(0, 1).to(dv_acc.dtype), accumulate=True)
    for piece in singles:
        b, rows, keys = piece.batch, piece.rows, piece.shifted(offset).keys
        dq, dk, dv = _piece_backward(
            call, dout[b, rows], q[b, rows], k_rows[b, keys], v_rows[b, keys], out[b, rows], lse[b, :, rows], piece
        )
        dq_acc[b, rows] += dq
        dk_acc[b, keys] += dk
        dv_acc[b, keys] += dv
