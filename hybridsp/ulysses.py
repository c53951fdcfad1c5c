"""Ulysses resharding: trade a sequence shard for a head shard with one all-to-all.

Inside a Ulysses group of ``U`` ranks (ranks ``u = 0..U-1`` hold consecutive sequence
pieces of ``L`` tokens each):

    seq_to_heads:  [B, L, H, D]    -> [B, U*L, H/U, D]   (gather the sequence, scatter heads)
    heads_to_seq:  [B, U*L, H/U, D] -> [B, L, H, D]      (the inverse)

Each op is the other's adjoint, so each one's backward is the other applied to the
gradients. Several tensors that share B, L, D and dtype (q, k and v; or dk and dv) are
packed along the head axis per destination and travel in one all-to-all.

GQA: rank ``u`` receives query heads ``[u*H/U, (u+1)*H/U)``; :func:`expand_kv_heads_for`
repeats K/V heads just enough that every rank also receives the K/V heads those queries
use, with a uniform query-group size locally (autograd sums the copies' gradients back).
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


def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup, counter: CommCounter | None) -> torch.Tensor:
    """all_to_all_single along dim 0 (one slice per rank); counts the bytes that leave this rank."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    if counter is not None:
        size = dist.get_world_size(group)
        counter.record("all_to_all", tensor_bytes([send]) * (size - 1) // size)
    return received


def _seq_to_heads(tensors, group, counter):
    """Each [B, L, H_i, D] -> [B, U*L, H_i/U, D], all in one all-to-all."""
    size = dist.get_world_size(group)
    b, length, _, d = tensors[0].shape
    per_rank = [t.shape[2] // size for t in tensors]
    split = [t.reshape(b, length, size, h, d) for t, h in zip(tensors, per_rank)]  # [B, L, U, H_i/U, D]
    packed = torch.cat(split, dim=3).permute(2, 0, 1, 3, 4).contiguous()  # [U, B, L, sum H_i/U, D]
    received = _all_to_all(packed, group, counter)  # [U (source), B, L, sum H_i/U, D]
    joined = received.permute(1, 0, 2, 3, 4).reshape(b, size * length, sum(per_rank), d)  # [B, U*L, sum, D]
    return [part.contiguous() for part in joined.split(per_rank, dim=2)]  # each [B, U*L, H_i/U, D]


def _heads_to_seq(tensors, group, counter):
    """Each [B, U*L, h_i, D] -> [B, L, U*h_i, D], all in one all-to-all."""
    size = dist.get_world_size(group)
    b, total, _, d = tensors[0].shape
    length, heads = total // size, [t.shape[2] for t in tensors]
    split = [t.reshape(b, size, length, h, d) for t, h in zip(tensors, heads)]  # [B, U, L, h_i, D]
    packed = torch.cat(split, dim=3).permute(1, 0, 2, 3, 4).contiguous()  # [U (dest), B, L, sum h_i, D]
    received = _all_to_all(packed, group, counter)  # [U (source = head slice), B, L, sum h_i, D]
    ordered = received.permute(1, 2, 0, 3, 4)  # [B, L, U, sum h_i, D]
    return [part.reshape(b, length, size * h, d) for part, h in zip(ordered.split(heads, dim=3), heads)]


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
