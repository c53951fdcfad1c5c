"""Ulysses resharding: trade a sequence shard for a head shard with one all-to-all.

Inside a Ulysses group of ``U`` ranks (ranks ``u = 0..U-1`` hold consecutive sequence
pieces of ``L`` tokens each):

    seq_to_heads:  [B, L, H, D]    -> [B, U*L, H/U, D]   (gather the sequence, scatter heads)
    heads_to_seq:  [B, U*L, H/U, D] -> [B, L, H, D]      (the inverse)

Each op is the other's adjoint, so each one's backward is the other applied to the
gradients. Several tensors that share B, L, D and dtype (q, k and v) are packed along the
head axis per destination and travel in one all-to-all on the way to heads (a v with its own
head dim travels in a second one: the same bytes, no padding); on the way back each tensor
travels alone (Note [lean buffers]).

GQA: rank ``u`` receives query heads ``[u*H/U, (u+1)*H/U)``; :func:`expand_kv_heads_for`
repeats K/V heads just enough that every rank also receives the K/V heads those queries
use, with a uniform query-group size locally (autograd sums the copies' gradients back).

Note [lean buffers]: at long context these buffers are the size of q, k and v, so copies
count. To heads (q, k, v packed together, one all-to-all per sequence of the batch): each
tensor is copied once, straight into its slot of a send buffer, the send buffer is freed as
soon as its all-to-all returns, and the receive buffer is reordered once into the output
buffer, so the outputs are *views* of one buffer (split along the head axis). To the
sequence (out; or dq, dk, dv in backward): one all-to-all per tensor and sequence, so at
most one tensor's send buffer exists at a time; the packing into it is the one copy and
the all-to-all receives straight into the output. The all-to-all byte count is unchanged.

Note [heads-first]: the aten CPU flash kernel reads each head's [S, D] plane and runs
faster in bf16 when that plane is dense (measured on this CPU at S=4096, 2 heads, D=64:
forward 4-5%, backward 3-4% faster than on [B, S, H, D] storage). So both directions hand out [B, S, H, D]
*views* of heads-first [B, H, S, D] buffers: the kernel gets dense planes without a copy
(hybridsp.kernels._torch_fused), its heads-first out and gradients are packed straight from
their planes, and a caller that holds q/k/v as views of [B, H, S, D] tensors (Hugging Face
attention does) gets its gradients back in that layout. Any input strides are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast, overload

import torch
import torch.distributed as dist

from hybridsp._comm import CommCounter, tensor_bytes
from hybridsp._formulas import expanded_kv_heads
from hybridsp.kernels._base import expand_kv_heads

if TYPE_CHECKING:
    from hybridsp.mesh._hybrid_mesh import HybridMesh


def expand_kv_heads_for(x: torch.Tensor, num_heads: int, ulysses: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, Hkv', D], Hkv' from :func:`hybridsp._formulas.expanded_kv_heads` (each
    K/V head repeated :func:`~hybridsp._formulas.kv_repeats_for` times; x itself when that is once)."""
    heads = expanded_kv_heads(num_heads, x.shape[2], ulysses)
    return x if heads == x.shape[2] else expand_kv_heads(x, heads)  # [B, S, Hkv', D]


@overload
def heads_of_rank(per_head: torch.Tensor, mesh: HybridMesh) -> torch.Tensor: ...


@overload
def heads_of_rank(per_head: None, mesh: HybridMesh) -> None: ...


def heads_of_rank(per_head: torch.Tensor | None, mesh: HybridMesh) -> torch.Tensor | None:
    """The slice of a per-head tensor [H] for the query heads this rank holds after
    :func:`seq_to_heads`: ``[u H/U, (u + 1) H/U)``, u its rank in the Ulysses group (a
    differentiable view; None stays None)."""
    if per_head is None:
        return None
    local = per_head.shape[0] // mesh.ulysses
    return per_head.narrow(0, dist.get_rank(mesh.ulysses_group) * local, local)  # [H/U]


def _all_to_all(
    send: torch.Tensor, group: dist.ProcessGroup, counter: CommCounter | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """all_to_all_single along dim 0 (one slice per rank), into ``out`` (default a new tensor like
    ``send``); counts the bytes that leave this rank."""
    received = torch.empty_like(send) if out is None else out
    dist.all_to_all_single(received, send, group=group)
    count_all_to_all(send, group, counter)
    return received


def count_all_to_all(send: torch.Tensor, group: dist.ProcessGroup, counter: CommCounter | None) -> None:
    """Record the bytes of ``send`` that leave this rank in one all_to_all_single (all but its own slice)."""
    if counter is not None:
        size = dist.get_world_size(group)
        counter.record("all_to_all", tensor_bytes([send]) * (size - 1) // size)


def _seq_to_heads(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, counter: CommCounter | None
) -> list[torch.Tensor]:
    """Each [B, L, H_i, D] (any strides) -> [B, U*L, H_i/U, D], views of one heads-first buffer
    [B, sum H_i/U, U*L, D] (Note [lean buffers], Note [heads-first])."""
    size = dist.get_world_size(group)
    return split_heads(_joined_heads(tensors, group, counter), [t.shape[2] // size for t in tensors])


def split_heads(joined: torch.Tensor, per_rank: list[int]) -> list[torch.Tensor]:
    """The [B, U*L, h_i, D] views of a heads-first buffer [B, sum h_i, U*L, D] (h_i heads each)."""
    return [part.transpose(1, 2) for part in joined.split(per_rank, dim=1)]  # views, each [B, U*L, h_i, D]


def by_destination(t: torch.Tensor, size: int) -> torch.Tensor:
    """[B, L, H, D] -> the view [B, L, U, H/U, D] (heads per destination rank); a 5-D tensor (already
    split per destination: a head group's view, :mod:`hybridsp.attention._head_chunks`) as it is."""
    return t if t.dim() == 5 else t.unflatten(2, (size, t.shape[2] // size))  # [B, L, U, H/U, D]


def _joined_heads(tensors: list[torch.Tensor], group: dist.ProcessGroup, counter: CommCounter | None) -> torch.Tensor:
    """The heads-first buffer [B, sum H_i/U, U*L, D] that :func:`_seq_to_heads` splits (each tensor
    [B, L, H_i, D], or [B, L, U, H_i/U, D] split per destination)."""
    size = dist.get_world_size(group)
    tensors = [by_destination(t, size) for t in tensors]  # each [B, L, U, h_i, D]
    b, length, _, _, d = tensors[0].shape
    per_rank = [t.shape[3] for t in tensors]
    packed = sum(per_rank)
    if b == 0:  # an empty batch on every rank (the agreement check compared B): nothing to exchange
        return tensors[0].new_empty(0, packed, size * length, d)  # [0, sum H_i/U, U*L, D]
    # allocated once the first send buffer is freed: at most 2 of the 3 buffers live at once
    joined: torch.Tensor | None = None
    for row in range(b):  # one all-to-all per sequence
        send = pack_row(tensors, row)
        received = _all_to_all(send, group, counter)  # [U (source = sequence piece), sum H_i/U, L, D]
        del send
        if joined is None:
            joined = received.new_empty(b, packed, size * length, d)  # [B, sum H_i/U, U*L, D]
        place_row(joined, row, received)
        del received
    assert joined is not None  # b >= 1 rows were received
    return joined


def pack_row(tensors: list[torch.Tensor], row: int) -> torch.Tensor:
    """Row ``row`` of each [B, L, U, h_i, D] tensor, packed per destination: the send buffer
    [U (dest), sum h_i, L, D] of one to-heads all-to-all."""
    size, length, d = tensors[0].shape[2], tensors[0].shape[1], tensors[0].shape[4]
    per_rank = [t.shape[3] for t in tensors]
    send = tensors[0].new_empty(size, sum(per_rank), length, d)  # [U (dest), sum H_i/U, L, D]
    offset = 0
    for t, h in zip(tensors, per_rank):
        send[:, offset : offset + h].copy_(t[row].permute(1, 2, 0, 3))  # [U, h, L, D]
        offset += h
    return send


def place_row(joined: torch.Tensor, row: int, received: torch.Tensor) -> None:
    """A received [U (source), sum h_i, L, D] into row ``row`` of the heads-first [B, sum h_i, U*L, D]."""
    size, _, length, _ = received.shape
    joined[row].unflatten(1, (size, length)).copy_(received.transpose(0, 1))  # [sum H_i/U, U, L, D]


def _heads_to_seq(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, counter: CommCounter | None
) -> list[torch.Tensor]:
    """Each [B, U*L, h_i, D] (any strides) -> [B, L, U*h_i, D], a view of a heads-first [B, U*h_i, L, D]
    buffer that the all-to-all receives into (Note [lean buffers], Note [heads-first])."""
    size = dist.get_world_size(group)
    b, total = tensors[0].shape[:2]
    length = total // size
    results = []
    for t in tensors:
        h, d = t.shape[2:]  # each its own head dim (dq/dk and an MLA dv differ)
        out = t.new_empty(b, size * h, length, d)  # [B, U*h, L, D]
        for row in range(b):  # one all-to-all per sequence, received straight into its rows
            send = t[row].unflatten(0, (size, length)).permute(0, 2, 1, 3).contiguous()  # [U (dest), h, L, D]
            _all_to_all(send, group, counter, out=out[row].view(size, h, length, d))  # [U (source), h, L, D]
            del send
        results.append(out.transpose(1, 2))  # [B, L, U*h, D]
    return results


_RESHARD = {True: _seq_to_heads, False: _heads_to_seq}


class _Reshard(torch.autograd.Function):
    """One all-to-all in either direction; its backward is the other direction (its adjoint)."""

    @staticmethod
    def forward(
        ctx: Any, to_heads: bool, group: dist.ProcessGroup, counter: CommCounter | None, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.to_heads, ctx.group, ctx.counter = to_heads, group, counter
        return tuple(_RESHARD[to_heads](list(tensors), group, counter))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, None, *_RESHARD[not ctx.to_heads](list(grads), ctx.group, ctx.counter))


def seq_to_heads(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, counter: CommCounter | None = None
) -> list[torch.Tensor]:
    """Differentiable: each [B, L, H_i, D_i] -> [B, U*L, H_i/U, D_i] over ``group``: one all-to-all
    per distinct head dim (q, k and v together; v alone when its head dim differs, as in MLA).

    Every H_i must be divisible by U = the group size (the caller checks and expands K/V).
    """
    results: list[torch.Tensor | None] = [None] * len(tensors)
    for members in head_dim_groups(tensors):
        moved = _Reshard.apply(True, group, counter, *(tensors[i] for i in members))
        for i, x in zip(members, moved):
            results[i] = x
    return cast("list[torch.Tensor]", results)  # filled: every index is in one head-dim group


def heads_to_seq(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, counter: CommCounter | None = None
) -> list[torch.Tensor]:
    """Differentiable inverse of :func:`seq_to_heads`: each [B, U*L, h_i, D] -> [B, L, U*h_i, D]."""
    return list(_Reshard.apply(False, group, counter, *tensors))


def head_dim_groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The indices of ``tensors`` that travel together in :func:`seq_to_heads`: one list per distinct
    head dim, in order of appearance (q, k, v together; v alone when its head dim differs)."""
    widths = dict.fromkeys(t.shape[-1] for t in tensors)
    return [[i for i, t in enumerate(tensors) if t.shape[-1] == width] for width in widths]


def seq_to_heads_buffers(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, counter: CommCounter | None = None
) -> list[torch.Tensor]:
    """Not differentiable: :func:`seq_to_heads` of ``tensors`` as its heads-first buffers, one
    [B, sum H_i/U, U*L, D] per :func:`head_dim_groups` entry (:func:`split_heads` gives the views).
    For a caller that keeps the buffers itself (:mod:`hybridsp.attention._compiled`)."""
    return [_joined_heads([tensors[i] for i in members], group, counter) for members in head_dim_groups(tensors)]


def heads_to_seq_plain(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, counter: CommCounter | None = None
) -> list[torch.Tensor]:
    """Not differentiable: :func:`heads_to_seq` without the autograd shell."""
    return _heads_to_seq(list(tensors), group, counter)
