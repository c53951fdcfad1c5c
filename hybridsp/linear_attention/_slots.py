"""Which plan each batch row of a recurrent layer's call follows: rows with the same document
boundaries share one :class:`~hybridsp.linear_attention._segments.SegmentChain` (every row alike when nothing is
packed), kept in the batch's :class:`~hybridsp.layout._documents.Documents` memo so every layer of a
forward reuses it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from hybridsp.attention._spec import CuSeqlens, placement_layout
from hybridsp.layout._documents import Documents, as_documents
from hybridsp.layout._layouts import TokenLayout
from hybridsp.linear_attention._segments import SegmentChain, conv_taps, row_plan, tail_index
from hybridsp.mesh._hybrid_mesh import HybridMesh


@dataclass(frozen=True)
class RowGroup:
    """Batch rows sharing document boundaries ``bounds`` and so one ``plan``."""

    rows: tuple[int, ...]
    bounds: tuple[int, ...]
    plan: SegmentChain

    def taps(self, slot: int, kernel: int) -> torch.Tensor:
        """:func:`~hybridsp.linear_attention._segments.conv_taps` of ``slot`` (memoised on the group)."""
        return _memo(self, ("taps", slot, kernel), lambda: conv_taps(self.plan, slot, kernel, self.bounds))

    def tails(self, slot: int, halo: int) -> torch.Tensor:
        """:func:`~hybridsp.linear_attention._segments.tail_index` of ``slot`` (memoised on the group)."""
        return _memo(self, ("tails", slot, halo), lambda: tail_index(self.plan, slot, halo))


def _memo(group: RowGroup, key: tuple[str, int, int], compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    store: dict[tuple[str, int, int], torch.Tensor] = group.__dict__.setdefault("_memo", {})
    if key not in store:
        store[key] = compute()
    return store[key]


@dataclass(frozen=True)
class SlotCall:
    """What one rank's recurrent layers need of a batch: its ring slot, the ring group and the row groups."""

    slot: int
    ring: int
    group: dist.ProcessGroup | None  # the ring's ProcessGroup (None: a ring of one)
    rows: tuple[RowGroup, ...]

    def row_order(self) -> torch.Tensor:
        """The permutation that puts rows back after the groups' outputs are concatenated: int64 [B]."""
        flat = torch.tensor([row for group in self.rows for row in group.rows], dtype=torch.int64)
        inverse = torch.empty_like(flat)
        inverse[flat] = torch.arange(flat.numel())
        return inverse


def slot_call(mesh: HybridMesh, documents: CuSeqlens, batch: int, seq_len: int) -> SlotCall:
    """The :class:`SlotCall` of this rank for a batch of ``batch`` rows of ``seq_len`` global tokens
    (``documents``: the batch's :class:`Documents`, any ``cu_seqlens`` form, or None)."""
    documents = Documents(batch, seq_len) if documents is None else as_documents(documents, batch, seq_len)
    layout = placement_layout(mesh, documents)
    key = ("linear_rows", layout, mesh.ring)
    rows: tuple[RowGroup, ...] = documents.remember(key, lambda: _row_groups(documents, layout, mesh.ring))
    group = mesh.ring_group if mesh.ring > 1 else None
    return SlotCall(mesh.ring_rank, mesh.ring, group, rows)


def _row_groups(documents: Documents, layout: TokenLayout, ring: int) -> tuple[RowGroup, ...]:
    by_bounds: dict[tuple[int, ...], list[int]] = {}
    for b in range(documents.batch):
        by_bounds.setdefault(tuple(documents.row(b)), []).append(b)
    return tuple(
        RowGroup(tuple(rows), bounds, row_plan(layout, documents.seq_len, ring, bounds))
        for bounds, rows in by_bounds.items()
    )
