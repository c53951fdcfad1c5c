"""One visiting block's plan pieces as a few varlen kernel calls (flash-attn's ``flash_attn_varlen_func``).

A packed block holds many small pieces (one per document and window tile); one kernel call
per piece costs a launch each. A kernel with ``supports_varlen`` (the flash backend on
flash-attn 2.7+) computes many pieces in one call: every piece becomes one "sequence" of
the varlen batch, its query rows and key rows gathered into packed ``[T, H, D]`` tensors.
Pieces whose masks translate to the same flash-attn window ``(left, right)`` (measured from
each sequence's bottom-right diagonal: full = (-1, -1), causal square = (-1, 0), equal band
tiles alike) share a call. Results are merged per piece exactly as in the one-call-per-piece
path; gradients are scattered back with ``index_add_``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridsp.attention._merge import merge_into
from hybridsp.kernels._band import flash_window
from hybridsp.kernels._base import softcap_kwargs
from hybridsp.layout._block_plan import BlockPlan, Piece

if TYPE_CHECKING:
    from hybridsp.attention._resolve import RingCall
    from hybridsp.attention._transport.base import Block


@dataclass
class _Group:
    """Pieces (each for one batch row) that run in one varlen call with ``window``."""

    window: tuple[int, int]
    members: list[tuple[Piece, int]]  # (piece with block-relative keys, batch row)
    q_index: torch.Tensor  # [Tq] flat row indices into [B * S]
    k_index: torch.Tensor  # [Tk] flat row indices into [B * S_block]
    cu_q: torch.Tensor  # [N + 1] int32
    cu_k: torch.Tensor  # [N + 1] int32
    max_q: int
    max_k: int
    q_bounds: list[int]  # cu_q on the host (no device read per call)


def _window_of(piece: Piece) -> tuple[int, int]:
    n, m = piece.rows.stop - piece.rows.start, piece.keys.stop - piece.keys.start
    band = {"full": (None, None), "causal": (0, None)}.get(piece.kind, piece.band)
    return flash_window(n, m, band)


def varlen_groups(
    pieces: Sequence[Piece],
    offset: int,
    batch: int,
    seq_q: int,
    seq_k: int,
    device: torch.device,
    plan: BlockPlan | None = None,
) -> list[_Group]:
    """Group one block's pieces by flash window; ``offset``: first key row of the block held.

    With ``plan`` (the :class:`~hybridsp.layout._block_plan.BlockPlan` that owns ``pieces``) the groups and their
    index tensors are built once per plan and reused by every layer and the backward."""
    if plan is not None:
        key = ("varlen", id(pieces), offset, batch, seq_q, seq_k, str(device))
        groups: list[_Group] = plan.memo(key, lambda: varlen_groups(pieces, offset, batch, seq_q, seq_k, device))
        return groups
    by_window: dict[tuple[int, int], list[tuple[Piece, int]]] = {}
    for piece in pieces:
        shifted = piece.shifted(offset)
        rows = range(batch) if piece.batch == slice(None) else [piece.batch.start]
        for b in rows:
            by_window.setdefault(_window_of(shifted), []).append((shifted, b))
    groups = []
    for window, members in by_window.items():
        q_parts = [torch.arange(p.rows.start, p.rows.stop) + b * seq_q for p, b in members]
        k_parts = [torch.arange(p.keys.start, p.keys.stop) + b * seq_k for p, b in members]
        q_lens = torch.tensor([len(x) for x in q_parts])
        k_lens = torch.tensor([len(x) for x in k_parts])
        groups.append(
            _Group(
                window,
                members,
                torch.cat(q_parts).to(device),
                torch.cat(k_parts).to(device),
                torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0)]).to(torch.int32).to(device),
                torch.cat([k_lens.new_zeros(1), k_lens.cumsum(0)]).to(torch.int32).to(device),
                int(q_lens.max()),
                int(k_lens.max()),
                [0, *q_lens.cumsum(0).tolist()],
            )
        )
    return groups


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> [B * S, H, D] (a view when contiguous)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])  # [B*S, H, D]


def _flat_lse(lse: torch.Tensor) -> torch.Tensor:
    """[B, H, S] -> [B * S, H]."""
    return lse.transpose(1, 2).reshape(lse.shape[0] * lse.shape[2], lse.shape[1])  # [B*S, H]


def forward_block(call: RingCall, q: torch.Tensor, block: Block, out_acc: torch.Tensor, lse_acc: torch.Tensor) -> None:
    """Merge one visiting block's pieces into ``out_acc`` [B, S, H, Dv] / ``lse_acc`` [B, H, S] (fp32)."""
    k_rows, v_rows = block.k, block.v
    assert k_rows is not None and v_rows is not None  # a block with pieces has arrived
    batch, seq_q, seq_k = q.shape[0], q.shape[1], k_rows.shape[1]
    for group in varlen_groups(block.pieces, block.offset, batch, seq_q, seq_k, q.device, call.plan):
        out, lse = call.kernel.forward_varlen(
            _flat(q).index_select(0, group.q_index),
            _flat(k_rows).index_select(0, group.k_index),
            _flat(v_rows).index_select(0, group.k_index),
            cu_seqlens_q=group.cu_q,
            cu_seqlens_k=group.cu_k,
            max_seqlen_q=group.max_q,
            max_seqlen_k=group.max_k,
            window=group.window,
            softmax_scale=call.scale,
            **softcap_kwargs(call.softcap),
        )  # out [Tq, H, Dv], lse [H, Tq]
        bounds = group.q_bounds
        for (piece, b), start, stop in zip(group.members, bounds, bounds[1:]):
            merge_into(
                out_acc[b : b + 1, piece.rows],
                lse_acc[b : b + 1, :, piece.rows],
                out[start:stop].unsqueeze(0),
                lse[:, start:stop].unsqueeze(0),
            )


def backward_block(
    call: RingCall,
    dout: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block: Block,
    dq_acc: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Add one visiting block's gradients into ``dq_acc`` [B, S, H, D] and ``dk`` [B, S_block, Hkv, D] /
    ``dv`` [B, S_block, Hkv, Dv] (fp32)."""
    k_rows, v_rows = block.k, block.v
    assert k_rows is not None and v_rows is not None  # a block with pieces has arrived
    batch, seq_q, seq_k = q.shape[0], q.shape[1], k_rows.shape[1]
    flat_lse = _flat_lse(lse)  # [B*S, H]
    for group in varlen_groups(block.pieces, block.offset, batch, seq_q, seq_k, q.device, call.plan):
        rows, keys = group.q_index, group.k_index
        dq, dk_packed, dv_packed = call.kernel.backward_varlen(
            _flat(dout).index_select(0, rows),
            _flat(q).index_select(0, rows),
            _flat(k_rows).index_select(0, keys),
            _flat(v_rows).index_select(0, keys),
            _flat(out).index_select(0, rows),
            flat_lse.index_select(0, rows).t().contiguous(),
            cu_seqlens_q=group.cu_q,
            cu_seqlens_k=group.cu_k,
            max_seqlen_q=group.max_q,
            max_seqlen_k=group.max_k,
            window=group.window,
            softmax_scale=call.scale,
            **softcap_kwargs(call.softcap),
        )
        _flat(dq_acc).index_add_(0, rows, dq.float())
        _flat(dk).index_add_(0, keys, dk_packed.float())
        _flat(dv).index_add_(0, keys, dv_packed.float())
