"""Ulysses resharding: trade a sequence shard for a head shard with one all-to-all.

Inside a Ulysses group of ``U`` ranks (ranks ``u = 0..U-1`` hold consecutive sequence
pieces of ``L`` tokens each):

    seq_to_heads:  [B, L, H, D]    -> [B, U*L, H/U, D]   (gather the sequence, scatter heads)
    heads_to_seq:  [B, U*L, H/U, D] -> [B, L, H, D]      (the inverse)

Each op is the other's adjoint, so each one's backward is the other applied to the
gradients. Several tensors that share B, L, D and dtype (q, k and v) are packed along the
head axis per destination and travel in one all-to-all on the way to heads; on the way back
each tensor travels alone (Note [lean buffers]).

GQA: rank ``u`` receives query heads ``[u*H/U, (u+1)*H/U)``; :func:`expand_kv_heads_for`
repeats K/V heads just enough that every rank also receives the K/V heads those queries
use, with a uniform query-group size locally (autograd sums the copies' gradients back).

Note [lean buffers]: at long context these buffers are the size of q, k and v, so copies
count. To heads (q, k, v packed together, one all-to-all per sequence of the batch): each
tensor is copied once, straight into its slot of a send buffer, and received straight into
the rows of the output, so the outputs are *views* of one receive buffer (split along the
head axis) and the send buffer is freed as soon as its all-to-all returns. To the sequence
(out; or dq, dk, dv in backward): one all-to-all per tensor, so at most one tensor's send and
receive buffers exist at a time; the send buffer is the tensor itself when it is contiguous
and B = 1; the reorder from the receive buffer into [B, L, U*h, D] is the one copy. The
all-to-all byte count is unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hybridsp.comm import CommCounter, tensor_bytes


def kv_repeats_for(num_heads: int, num_kv_heads: int, ulysses: int) -> int:
    """How many times each K/V head must be repeated before a U-way head scatter.

    With query group size ``g = H / Hkv`` and ``H/U`` query heads per rank, the local
    group size becomes ``gcd(g, H/U)``, so each K/V head is repeated ``g / gcd(g, H/U)``
    times: 1 when Hkv % U == 0 (no copies), Hkv' = U copies in total when a rank's
    queries all share one K/V head.
    """
    group = num_heads // num_kv_heads
    return group // math.gcd(group, num_heads // ulysses)


def expand_kv_heads_for(x: torch.Tensor, num_heads: int, ulysses: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, Hkv * repeats, D], repeats from :func:`kv_repeats_for`."""
    repeats = kv_repeats_for(num_heads, x.shape[2], ulysses)
    return x if repeats == 1 else x.repeat_interleave(repeats, dim=2)  # [B, S, Hkv', D]


def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup, counter: CommCounter | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """all_to_all_single along dim 0 (one slice per rank), into ``out`` (default a new tensor like
    ``send``); counts the bytes that leave this rank."""
    received = torch.empty_like(send) if out is None else out
    dist.all_to_all_single(received, send, group=group)
    if counter is not None:
        size = dist.get_world_size(group)
        counter.record("all_to_all", tensor_bytes([send]) * (size - 1) // size)
    return received


def _seq_to_heads(tensors, group, counter):
    """Each [B, L, H_i, D] -> [B, U*L, H_i/U, D] (Note [lean buffers]): views of one receive buffer."""
    size = dist.get_world_size(group)
    b, length, _, d = tensors[0].shape
    per_rank = [t.shape[2] // size for t in tensors]
    packed = sum(per_rank)
    joined = tensors[0].new_empty(b, size * length, packed, d)  # [B, U*L, sum H_i/U, D]
    for row in range(b):  # one all-to-all per sequence, received straight into its rows
        send = tensors[0].new_empty(size, length, packed, d)  # [U (dest), L, sum H_i/U, D]
        offset = 0
        for t, h in zip(tensors, per_rank):
            send[:, :, offset:offset + h].copy_(t[row].reshape(length, size, h, d).transpose(0, 1))
            offset += h
        _all_to_all(send, group, counter, out=joined[row].view(size, length, packed, d))  # [U (source), L, sum, D]
        del send
    return list(joined.split(per_rank, dim=2))  # views, each [B, U*L, H_i/U, D]


def _heads_to_seq(tensors, group, counter):
    """Each [B, U*L, h_i, D] -> [B, L, U*h_i, D] (Note [lean buffers]): one all-to-all per tensor."""
    size = dist.get_world_size(group)
    b, total, _, d = tensors[0].shape
    length = total // size
    results = []
    for t in tensors:
        h = t.shape[2]
        if b == 1 and t.is_contiguous():
            send = t.view(size, 1, length, h, d)  # [U (dest), 1, L, h, D]: the tensor itself
        else:
            send = t.reshape(b, size, length, h, d).transpose(0, 1).contiguous()  # [U (dest), B, L, h, D]
        received = _all_to_all(send, group, counter)  # [U (source = head slice), B, L, h, D]
        del send
        results.append(received.permute(1, 2, 0, 3, 4).reshape(b, length, size * h, d))  # [B, L, U*h, D]
        del received
    return results


_RESHARD = {True: _seq_to_heads, False: _heads_to_seq}


class _Reshard(torch.autograd.Function):
    """One all-to-all in either direction; its backward is the other direction (its adjoint)."""

    @staticmethod
    def forward(ctx, to_heads, group, counter, *tensors):
        ctx.to_heads, ctx.group, ctx.counter = to_heads, group, counter
        return tuple(_RESHARD[to_heads](list(tensors), group, counter))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, *_RESHARD[not ctx.to_heads](list(grads), ctx.group, ctx.counter))


def seq_to_heads(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, counter: CommCounter | None = None
) -> list[torch.Tensor]:
    """Differentiable: each [B, L, H_i, D] -> [B, U*L, H_i/U, D] over ``group`` (one all-to-all).

    Every H_i must be divisible by U = the group size (the caller checks and expands K/V).
    """
    return list(_Reshard.apply(True, group, counter, *tensors))


def heads_to_seq(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, counter: CommCounter | None = None
) -> list[torch.Tensor]:
    """Differentiable inverse of :func:`seq_to_heads`: each [B, U*L, h_i, D] -> [B, L, U*h_i, D]."""
    return list(_Reshard.apply(False, group, counter, *tensors))
