"""K/V by point-to-point sends, driven by a block plan (``kv_comm="ring"``).

Note [p2p ring]: every rank derives the same :class:`~hybridsp.layout._block_plan.BlockPlan` (dense
causal, documents, windows alike) without communication. Blocks are not relayed around the
ring: at step ``s`` each rank sends the rows of its *own* K/V block that rank ``r + s`` reads
straight to it (its plan hull; nothing when it reads nothing, see
:mod:`hybridsp.attention._transport.exchange`), so zigzag's off-diagonal steps ship the half that is seen
and a window ships the window. Step ``s + 1``'s transfer is posted before step ``s`` is handed
out, and the own block comes first (computed while the first transfer travels).

Backward at the byte minimum: the K/V rows travel again as in the forward; the partial dK/dV
of a visiting block goes straight home, once (``R - 1`` sends per rank per backward), only the
hull rows, in the *input* dtype (summed in fp32 first and rounded once). The owner adds the
``R - 1`` arriving contributions into its fp32 (fp64 for fp64) accumulators and rounds once at
the end. The sends of step ``s`` travel while step ``s + 1`` computes (the last gradient
transfer is the one exposed; hiding it too would mean keeping the forward's last visiting block
alive until the backward, one more K/V block per layer).

This module is the transport only (:class:`P2PTransport`); the autograd shell that runs the
pieces is :mod:`hybridsp.attention._ring_function` (Note [one shell]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Iterator

import torch

from hybridsp.attention._transport.base import Block, Transport
from hybridsp.attention._transport.exchange import GRAD_TAG, KV_TAG, PendingBlocks, post

if TYPE_CHECKING:
    from hybridsp.attention._resolve import RingCall


def _receive_like(tensors: Sequence[torch.Tensor], rows: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of ``rows`` rows of each of ``tensors`` [B, S, Hkv, D]."""
    return [((t.shape[0], rows, *t.shape[2:]), t.dtype) for t in tensors]


class P2PTransport(Transport):
    """K/V rows straight to the ranks that read them; dK/dV straight home (Note [p2p ring])."""

    def __init__(self, call: RingCall, k: torch.Tensor, v: torch.Tensor) -> None:
        assert call.plan is not None and call.group is not None  # a ring of more than one
        self._group, self._plan, self._rank, self._counter = call.group, call.plan, call.rank, call.counter
        self._k, self._v = k, v
        self._grads_pending: tuple[PendingBlocks, tuple[int, int] | None] | None = None

    def _post_kv(self, step: int) -> PendingBlocks:
        """Post step ``step``'s K/V: own rows to ``rank + step``, rows of ``rank - step`` from it."""
        size, rank, plan = self._plan.ring, self._rank, self._plan
        dest, source = (rank + step) % size, (rank - step) % size
        send_hull, recv_hull = plan.hulls[(dest, rank)], plan.hulls[(rank, source)]
        sends = [] if send_hull is None else [t[:, send_hull[0] : send_hull[1]] for t in (self._k, self._v)]
        like = [] if recv_hull is None else _receive_like((self._k, self._v), recv_hull[1] - recv_hull[0])
        return post(
            self._group,
            None if send_hull is None else dest,
            sends,
            None if recv_hull is None else source,
            like,
            device=self._k.device,
            tag=KV_TAG,
            counter=self._counter,
        )

    def blocks(self) -> Iterator[Block]:
        """The own block, then one visiting block per ring step (k/v None where nothing is visible)."""
        size, rank, plan = self._plan.ring, self._rank, self._plan
        pending = self._post_kv(1) if size > 1 else None
        yield Block(plan.pieces[(rank, rank)], self._k, self._v, own=True)
        for step in range(1, size):
            source = (rank - step) % size
            assert pending is not None  # posted for every step
            received = pending.wait()
            pending = self._post_kv(step + 1) if step + 1 < size else None
            hull = plan.hulls[(rank, source)]
            k_rows, v_rows = received if received is not None else (None, None)
            yield Block(plan.pieces[(rank, source)], k_rows, v_rows, 0 if hull is None else hull[0], step=step)

    def send_home(
        self, block: Block, grads: list[torch.Tensor] | None, dk_acc: torch.Tensor, dv_acc: torch.Tensor
    ) -> None:
        """Send this step's partial (dk, dv) home to ``rank - step`` in the input dtype; receive the
        own-block partials of ``rank + step``; add the previous step's arrivals into the accumulators."""
        size, rank, step = self._plan.ring, self._rank, block.step
        assert step is not None  # a visiting block of this transport
        home, visitor = (rank - step) % size, (rank + step) % size
        recv_hull = self._plan.hulls[(visitor, rank)]
        sends = [] if grads is None else [grads[0].to(self._k.dtype), grads[1].to(self._v.dtype)]
        like = [] if recv_hull is None else _receive_like((self._k, self._v), recv_hull[1] - recv_hull[0])
        self.finish(dk_acc, dv_acc)
        pending = post(
            self._group,
            None if grads is None else home,
            sends,
            None if recv_hull is None else visitor,
            like,
            device=self._k.device,
            tag=GRAD_TAG,
            counter=self._counter,
        )
        self._grads_pending = (pending, recv_hull)

    def finish(self, dk_acc: torch.Tensor, dv_acc: torch.Tensor) -> None:
        """Wait for the posted gradient exchange and add what came home into the own-block accumulators."""
        if self._grads_pending is None:
            return
        (pending, hull), self._grads_pending = self._grads_pending, None
        received = pending.wait()
        if received is not None:
            assert hull is not None  # rows arrive only where the plan has a hull
            dk_acc[:, hull[0] : hull[1]] += received[0]
            dv_acc[:, hull[0] : hull[1]] += received[1]
