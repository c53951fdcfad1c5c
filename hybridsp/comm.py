"""Point-to-point ring exchange and the opt-in byte counter.

All functions take their process group explicitly; nothing here touches the world group
unless it is handed the world group.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommCounter:
    """Bytes this rank sent, per collective kind (e.g. ``"ring"``, ``"all_to_all"``).

    Opt-in: pass one to the attention call (``counter=``), or set ``mesh.comm_counter`` to
    count every call over that mesh (e.g. inside a switched HF model), and read
    ``bytes_sent`` afterwards. ``calls`` counts the operations of each kind.
    """

    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, nbytes: int) -> None:
        """Add one operation of ``kind`` that sent ``nbytes`` bytes to other ranks."""
        self.bytes_sent[kind] += nbytes
        self.calls[kind] += 1

    def total(self) -> int:
        return sum(self.bytes_sent.values())


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Total payload of a list of tensors in bytes."""
    return sum(t.numel() * t.element_size() for t in tensors)


class _PendingExchange:
    """Posted sends/receives of one ring step; ``wait()`` returns the received tensors."""

    def __init__(self, requests: list, received: list[torch.Tensor]):
        self._requests = requests
        self._received = received

    def wait(self) -> list[torch.Tensor]:
        for request in self._requests:
            request.wait()
        return self._received


class RingExchange:
    """Send tensors to the next ring rank while receiving the previous rank's, double-buffered.

    ``start(tensors)`` posts one batched isend/irecv (every tensor to ``next``, same-shaped
    tensors from ``prev``) and returns at once, so the caller computes while the bytes move.
    Received tensors land in one of two buffer sets that alternate, so a buffer is never
    overwritten while it is still being sent or read. Callers must ``wait()`` each exchange
    before starting the next one.
    """

    def __init__(self, group: dist.ProcessGroup, counter: CommCounter | None = None, kind: str = "ring"):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next_rank = dist.get_global_rank(group, (rank + 1) % size)
        self.prev_rank = dist.get_global_rank(group, (rank - 1) % size)
        self._group = group
        self._counter = counter
        self._kind = kind
        self._buffers: list[list[torch.Tensor] | None] = [None, None]
        self._turn = 0

    def _receive_buffers(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        buffers = self._buffers[self._turn]
        if buffers is None or any(b.shape != t.shape or b.dtype != t.dtype for b, t in zip(buffers, tensors)):
            buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
            self._buffers[self._turn] = buffers
        self._turn = 1 - self._turn
        return buffers

    def start(self, tensors: list[torch.Tensor]) -> _PendingExchange:
        tensors = [t.contiguous() for t in tensors]
        received = self._receive_buffers(tensors)
        ops = [dist.P2POp(dist.isend, t, self.next_rank, self._group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev_rank, self._group) for b in received]
        if self._counter is not None:
            self._counter.record(self._kind, tensor_bytes(tensors))
        return _PendingExchange(dist.batch_isend_irecv(ops), received)
