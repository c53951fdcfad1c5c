"""Direct point-to-point sends of (parts of) K/V blocks and their gradients between ring ranks.

The masked ring (:mod:`hybridsp.attention._ring` with a :class:`~hybridsp.layout._block_plan.BlockPlan`) does not
relay blocks around the ring: at step ``s`` every rank sends the rows of its *own* block
that rank ``r + s`` needs straight to it, and nothing where the plan says nothing is
visible. Every rank derives the same plan, so the sends and receives match without any
handshake. A block that the plan needs nowhere is never sent, which is what makes the
bytes of a sliding window scale with the window instead of the sequence.

Every point-to-point tag of the package lives here. Two exchanges that may run at the same
time between the same pair of ranks (K/V of the next step, gradients of this one) use different
tags; the all-gather transport's direct gather (:mod:`hybridsp.attention._transport.allgather`,
on gloo) has its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridsp._comm import CommCounter, tensor_bytes

KV_TAG = 11  # p2p ring: the K/V rows of a step
GRAD_TAG = 12  # p2p ring: a visited block's dK/dV going home
ALLGATHER_TAG = 13  # all-gather transport: a chunk gathered by direct sends


class PendingBlocks:
    """Posted sends/receives; ``wait()`` returns the received tensors (or None if none were posted)."""

    def __init__(self, requests: list[dist.Work], received: list[torch.Tensor] | None) -> None:
        self._requests, self._received = requests, received

    def wait(self) -> list[torch.Tensor] | None:
        for request in self._requests:
            request.wait()
        return self._received


def post(
    group: dist.ProcessGroup,
    send_to: int | None,
    tensors: list[torch.Tensor],
    receive_from: int | None,
    receive_like: list[tuple[tuple[int, ...], torch.dtype]],
    *,
    device: torch.device,
    tag: int,
    counter: CommCounter | None = None,
    kind: str = "ring",
) -> PendingBlocks:
    """Send ``tensors`` to group rank ``send_to`` and receive tensors shaped ``receive_like`` from
    ``receive_from`` (either may be None: nothing to send / receive), batched, without waiting."""
    ops, received = [], None
    if send_to is not None:
        tensors = [t.contiguous() for t in tensors]
        peer = dist.get_global_rank(group, send_to)
        ops += [dist.P2POp(dist.isend, t, peer, group, tag) for t in tensors]
        if counter is not None:
            counter.record(kind, tensor_bytes(tensors))
    if receive_from is not None:
        received = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in receive_like]
        peer = dist.get_global_rank(group, receive_from)
        ops += [dist.P2POp(dist.irecv, b, peer, group, tag) for b in received]
    requests = dist.batch_isend_irecv(ops) if ops else []
    return PendingBlocks(requests, received)
