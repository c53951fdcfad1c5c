"""The opt-in byte counter of every collective hybridsp posts.

Kinds: ``all_to_all`` (Ulysses), ``ring`` (point-to-point K/V and dK/dV, ``kv_comm="ring"``),
``allgather`` and ``reduce_scatter`` (``kv_comm="allgather"``); the analytic values per rank
are in :mod:`hybridsp.attention._volume`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch


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
