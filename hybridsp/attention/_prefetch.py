"""A to-heads all-to-all started now and finished later: the overlap of head-chunked attention.

:func:`start_seq_to_heads_buffers` does what :func:`~hybridsp.attention._ulysses.seq_to_heads_buffers`
does, but launches each sequence's all-to-all asynchronously and returns at once; :meth:`PendingHeads.wait`
waits for them and assembles the same heads-first buffers. Head-chunked attention
(:mod:`hybridsp.attention._head_chunks`) starts the next head group's exchange this way before it runs
the current group's ring, so the all-to-all proceeds while the ring computes (NCCL on its own stream;
gloo on its worker thread). Bytes on the wire and the results are those of the synchronous path; the
send buffers of every sequence of the batch stay alive until the exchange is done (one head group's
share of q/k/v, or of dout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridsp._comm import CommCounter
from hybridsp.attention._ulysses import by_destination, count_all_to_all, head_dim_groups, pack_row, place_row


@dataclass
class _PendingJoin:
    """One head-dim group's exchange: per sequence (send, receive buffer, work); the joined buffer's shape."""

    rows: list[tuple[torch.Tensor, torch.Tensor, dist.Work | None]]
    shape: tuple[int, int, int, int]
    like: torch.Tensor = field(repr=False)

    def wait(self) -> torch.Tensor:
        """The heads-first buffer [B, sum h_i, U*L, D], once every sequence's all-to-all is done."""
        joined = self.like.new_empty(self.shape)  # [B, sum H_i/U, U*L, D]
        for row, (_send, received, work) in enumerate(self.rows):
            if work is not None:
                work.wait()
            place_row(joined, row, received)
        self.rows = []
        return joined


def _start_join(tensors: list[torch.Tensor], group: dist.ProcessGroup, counter: CommCounter | None) -> _PendingJoin:
    size = dist.get_world_size(group)
    tensors = [by_destination(t, size) for t in tensors]  # each [B, L, U, h_i, D]
    b, length, _, _, d = tensors[0].shape
    packed = sum(t.shape[3] for t in tensors)
    rows = []
    for row in range(b):  # one all-to-all per sequence, all in flight together
        send = pack_row(tensors, row)  # [U (dest), sum H_i/U, L, D]
        received = torch.empty_like(send)  # [U (source), sum H_i/U, L, D]
        work = dist.all_to_all_single(received, send, group=group, async_op=True)
        count_all_to_all(send, group, counter)
        rows.append((send, received, work))
    return _PendingJoin(rows, (b, packed, size * length, d), tensors[0])


@dataclass
class PendingHeads:
    """The exchanges of :func:`start_seq_to_heads_buffers`, one per distinct head dim."""

    parts: list[_PendingJoin]

    def wait(self) -> list[torch.Tensor]:
        """The buffers :func:`~hybridsp.attention._ulysses.seq_to_heads_buffers` would have returned."""
        return [part.wait() for part in self.parts]


def start_seq_to_heads_buffers(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, counter: CommCounter | None = None
) -> PendingHeads:
    """Start :func:`~hybridsp.attention._ulysses.seq_to_heads_buffers` of ``tensors`` (each [B, L, H_i, D]
    or [B, L, U, H_i/U, D]); :meth:`PendingHeads.wait` finishes it."""
    return PendingHeads(
        [_start_join([tensors[i] for i in members], group, counter) for members in head_dim_groups(tensors)]
    )
