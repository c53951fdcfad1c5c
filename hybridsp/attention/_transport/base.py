"""What every K/V transport of ring attention offers the autograd shell (Note [one shell] in
:mod:`hybridsp.attention._ring_function`): :class:`Block` s to compute against and a way home
for the gradients of the visiting ones.

Shapes: k/v [B, S, Hkv, D] local (S = this ring slot's tokens); a block's k/v [B, rows, Hkv, D];
gradient accumulators dk_acc/dv_acc [B, S, Hkv, D] in the accumulation dtype (fp32; fp64 for fp64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from hybridsp.layout._block_plan import Piece


@dataclass
class Block:
    """One key/value block as a transport hands it out.

    ``k``/``v`` [B, rows, Hkv, D] (None: nothing arrived, nothing to compute); ``pieces`` with keys
    counted from ``offset``; ``own``: the rank's own block (its gradients stay home). Where a
    visiting block's gradients go is one of two fields, whichever the transport sets:
    ``step``: the ring step that brought it (point-to-point: it came from ``rank - step``);
    ``chunk_rows``: the rows of every owner's block that this gathered chunk holds (all-gather).
    """

    pieces: tuple[Piece, ...]
    k: torch.Tensor | None
    v: torch.Tensor | None
    offset: int = 0
    own: bool = False
    step: int | None = None
    chunk_rows: slice | None = None


class Transport(Protocol):
    """How the K/V blocks of one pass (forward, or backward) reach this rank and how their
    gradients go home. Built per pass as ``Transport(call, k, v)`` from a resolved
    :class:`~hybridsp.attention._resolve.RingCall` and this rank's k/v [B, S, Hkv, D]."""

    def blocks(self) -> Iterator[Block]:
        """The own block first, then every visiting block (the next one already in flight)."""
        ...

    def send_home(
        self, block: Block, grads: list[torch.Tensor] | None, dk_acc: torch.Tensor, dv_acc: torch.Tensor
    ) -> None:
        """Start returning a visiting block's partial (dk, dv) [B, rows, Hkv, D] (accumulation dtype;
        None: the block had no pieces) to its owner, rounded once to the input dtype; add what has
        arrived for this rank so far into dk_acc/dv_acc."""
        ...

    def finish(self, dk_acc: torch.Tensor, dv_acc: torch.Tensor) -> None:
        """Wait for the last gradient exchange and add its arrivals into dk_acc/dv_acc."""
        ...
