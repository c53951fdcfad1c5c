"""The transport of a ring of one: the own block only (documents or a window still need the
plan's pieces, so the shell runs them instead of one kernel call)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch

from hybridsp.attention._transport.base import Block, Transport

if TYPE_CHECKING:
    from hybridsp.attention._resolve import RingCall


class LocalTransport(Transport):
    """A ring of one: the own block, no visiting block, nothing to send home."""

    def __init__(self, call: RingCall, k: torch.Tensor, v: torch.Tensor) -> None:
        assert call.plan is not None  # a call without a plan runs one kernel call, no transport
        self._block = Block(call.plan.pieces[(0, 0)], k, v, own=True)

    def blocks(self) -> Iterator[Block]:
        yield self._block

    def send_home(
        self, block: Block, grads: list[torch.Tensor] | None, dk_acc: torch.Tensor, dv_acc: torch.Tensor
    ) -> None:  # pragma: no cover - never visited
        raise AssertionError("a ring of one has no visiting block")

    def finish(self, dk_acc: torch.Tensor, dv_acc: torch.Tensor) -> None:
        return None
