"""The transport of a ring of one: the own block only (documents or a window still need the
plan's pieces, so the shell runs them instead of one kernel call)."""

from __future__ import annotations

from typing import Iterator

from hybridsp.attention._transport.base import Block, Transport


class LocalTransport(Transport):
    """A ring of one: the own block, no visiting block, nothing to send home."""

    def __init__(self, call, k, v):
        self._block = Block(call.plan.pieces[(0, 0)], k, v, own=True)

    def blocks(self) -> Iterator[Block]:
        yield self._block

    def send_home(self, block, grads, dk_acc, dv_acc) -> None:  # pragma: no cover - never visited
        raise AssertionError("a ring of one has no visiting block")

    def finish(self, dk_acc, dv_acc) -> None:
        return None
