"""Many small pieces of one block as one kernel call, stacked along the batch axis (kernels without varlen).

A packed block of many short documents is many small plan pieces; on a kernel without
``supports_varlen`` (the aten CPU flash kernel, the reference) one call per piece costs its launch,
its Python and its merge per document, so the time follows the document count rather than the
cells the mask keeps (S=8,192 in 4,096 documents of 2 tokens took 14.8x the time of 128 documents
of 64 on one rank, ``benchmarks/bench_documents.py``; now 0.84x). Pieces of one shape (query rows n, key rows m, kind and band) need the same mask, so they
run as one call on a batch of G such pieces: their query rows gathered into q [G, n, H, D], their
key rows into k/v [G, m, Hkv, D(v)], the results merged into the accumulators by index.

Note [stacks]: a stack never holds two pieces that share a query row of the same batch row (the
forward gathers the accumulators' rows, merges and writes them back: two members on one row would
lose a merge), and holds only pieces of at most ``MAX_ROWS`` query and key rows (the gathers copy the
members' q/k/v rows: for small pieces that costs less than the calls it saves; large pieces run one
call each as before). A shape with one piece runs as before. Stacks and their index tensors are built
once per plan, block offset and shape (the plan's memo), like the varlen groups.

Shapes: q [B, S, H, D], k_rows [B, S_block, Hkv, D], v_rows [B, S_block, Hkv, Dv], accumulators as
in :mod:`hybridsp.attention._pieces`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from hybridsp.layout._block_plan import Band, BlockPlan, Piece

MAX_ROWS = 256  # pieces with more query or key rows than this run alone (Note [stacks])


@dataclass
class Stack:
    """Pieces of one shape (``like`` with block-relative keys is the first) that run in one call."""

    like: Piece
    size: int  # G
    q_batch: torch.Tensor  # [G * n] batch row of each gathered query row
    q_seq: torch.Tensor  # [G * n] its position in the local sequence
    k_batch: torch.Tensor  # [G * m]
    k_seq: torch.Tensor  # [G * m] its row in the block


def stacks_and_singles(
    pieces: Sequence[Piece], offset: int, batch: int, device: torch.device, plan: BlockPlan | None = None
) -> tuple[list[Stack], list[Piece]]:
    """One block's pieces split into stacks (Note [stacks]) and the pieces that run alone (original keys).

    With ``plan`` (the :class:`~hybridsp.layout._block_plan.BlockPlan` that owns ``pieces``) the split is
    built once per plan, offset, batch and device and reused by every layer and the backward."""
    if plan is not None:
        key = ("stacks", id(pieces), offset, batch, str(device), MAX_ROWS)
        split: tuple[list[Stack], list[Piece]] = plan.memo(
            key, lambda: stacks_and_singles(pieces, offset, batch, device)
        )
        return split
    by_shape: dict[tuple[int, int, str, Band], list[Piece]] = {}
    singles = []
    for piece in pieces:
        shifted = piece.shifted(offset)
        if max(_length(shifted.rows), _length(shifted.keys)) > MAX_ROWS:
            singles.append(piece)
        else:
            by_shape.setdefault((_length(shifted.rows), _length(shifted.keys), shifted.kind, shifted.band), []).append(
                piece
            )
    stacks = []
    for same_shape in by_shape.values():
        for layer in _disjoint_layers(same_shape, batch):
            if len(layer) == 1:
                singles.append(layer[0])
            else:
                stacks.append(_stack([(p.shifted(offset), b) for p in layer for b in _rows_of(p, batch)], device))
    return stacks, singles


def _length(span: slice[int, int, int | None]) -> int:
    return span.stop - span.start


def _rows_of(piece: Piece, batch: int) -> range | list[int]:
    """The batch rows a piece covers (every row, or one: :class:`~hybridsp.layout._block_plan.Piece`)."""
    if piece.batch == slice(None):
        return range(batch)
    if piece.batch.stop - piece.batch.start != 1:
        raise ValueError(f"a plan piece covers every batch row or one; got rows {piece.batch}")
    return [piece.batch.start]


def _disjoint_layers(same_shape: list[Piece], batch: int) -> list[list[Piece]]:
    """Pieces of one shape in layers whose members share no query row of a batch row (first fit in order
    of their first row; with equal lengths, a layer's last end per batch row is its furthest)."""
    layers: list[list[Piece]] = []
    ends: list[dict[int, int]] = []  # per layer: batch row -> end of its last query rows
    for piece in sorted(same_shape, key=lambda p: p.rows.start):
        rows = _rows_of(piece, batch)
        fits = (i for i, end in enumerate(ends) if all(end.get(b, 0) <= piece.rows.start for b in rows))
        index = next(fits, len(layers))
        if index == len(layers):
            layers.append([])
            ends.append({})
        layers[index].append(piece)
        ends[index].update(dict.fromkeys(rows, piece.rows.stop))
    return layers


def _stack(members: list[tuple[Piece, int]], device: torch.device) -> Stack:
    like = members[0][0]
    q_seq = torch.cat([torch.arange(p.rows.start, p.rows.stop) for p, _ in members])  # [G * n]
    k_seq = torch.cat([torch.arange(p.keys.start, p.keys.stop) for p, _ in members])  # [G * m]
    n, m = _length(like.rows), _length(like.keys)
    q_batch = torch.tensor([b for _, b in members]).repeat_interleave(n)  # [G * n]
    k_batch = torch.tensor([b for _, b in members]).repeat_interleave(m)  # [G * m]
    return Stack(like, len(members), *(t.to(device) for t in (q_batch, q_seq, k_batch, k_seq)))


def gather_rows(x: torch.Tensor, batch_index: torch.Tensor, seq_index: torch.Tensor, size: int) -> torch.Tensor:
    """[B, S, H, D] -> [G, n, H, D]: the stack's rows of ``x`` (a copy)."""
    return cast(torch.Tensor, x[batch_index, seq_index].unflatten(0, (size, -1)))  # [G, n, H, D]


def gather_lse(lse: torch.Tensor, stack: Stack) -> torch.Tensor:
    """[B, H, S] -> [G, H, n]: the stack's query rows of a log-sum-exp (a copy)."""
    gathered = cast(torch.Tensor, lse[stack.q_batch, :, stack.q_seq].unflatten(0, (stack.size, -1)))  # [G, n, H]
    return gathered.transpose(1, 2).contiguous()  # [G, H, n]


def scatter_lse(lse: torch.Tensor, stack: Stack, values: torch.Tensor) -> None:
    """Write [G, H, n] ``values`` back into the stack's rows of ``lse`` [B, H, S]."""
    lse[stack.q_batch, :, stack.q_seq] = values.transpose(1, 2).flatten(0, 1)  # [G * n, H]
