"""A stream's full tensor -> this rank's slots, and the output's slots -> the full stream on every rank.

``take_slots`` is local (an index, differentiable: its backward puts this rank's gradient back on
its tokens, zero elsewhere, so the context ranks' gradients sum to the one-process gradient).
``gather_slots`` all-gathers over the context group; its backward keeps this rank's slots of the
incoming gradient (every rank computes the same loss on the same full output, so each rank's part
of that loss's gradient is exactly its slots').
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridsp.integrations.diffusers._plan import StreamSlots
from hybridsp.mesh import HybridMesh


def take_slots(x: torch.Tensor, slots: StreamSlots, rank: int, dim: int) -> torch.Tensor:
    """``x`` [..., T, ...] (stream tokens along ``dim``) -> [..., L, ...]: this rank's slots, pads zero."""
    if x.shape[dim] != slots.length:
        raise ValueError(
            f"a {slots.name!r} tensor has {x.shape[dim]} tokens along dim {dim}, but this forward's "
            f"{slots.name!r} stream has {slots.length}; the switched model needs the full inputs on every rank"
        )
    pad_shape = list(x.shape)
    pad_shape[dim] = 1
    padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)  # [..., T + 1, ...]: index T is the pad
    return padded.index_select(dim, slots.index[rank].to(x.device))  # [..., L, ...]


class _GatherSlots(torch.autograd.Function):
    """[B, L, F] this rank's slots -> [B, T, F] the whole stream (real tokens only) on every rank."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, slots: StreamSlots, mesh: HybridMesh) -> torch.Tensor:
        ctx.slots, ctx.rank = slots, mesh.context_rank
        pieces = _all_gather_in_shard_order(local.contiguous(), mesh)  # C x [B, L, F]
        stacked = torch.cat(pieces, dim=1)  # [B, C*L, F] in shard order
        full = local.new_zeros(local.shape[0], slots.length + 1, *local.shape[2:])  # [B, T + 1, F]
        full.index_copy_(1, slots.index.flatten().to(local.device), stacked)  # pads all land on row T
        return full[:, : slots.length]  # [B, T, F]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return take_slots(grad, ctx.slots, ctx.rank, dim=1), None, None


def gather_slots(local: torch.Tensor, slots: StreamSlots, mesh: HybridMesh) -> torch.Tensor:
    """The full stream [B, T, F] from every rank's slots [B, L, F] (a collective over the context group)."""
    if mesh.context == 1:
        return local[:, slots.index[0] < slots.length]  # [B, T, F]: drop the pads
    out = _GatherSlots.apply(local, slots, mesh)
    assert isinstance(out, torch.Tensor)
    return out


def _all_gather_in_shard_order(local: torch.Tensor, mesh: HybridMesh) -> list[torch.Tensor]:
    """Every context rank's ``local``, ordered by shard index ``r * U + u``."""
    group = mesh.context_group
    pieces = [torch.empty_like(local) for _ in range(mesh.context)]
    dist.all_gather(pieces, local, group=group)
    by_global = dict(zip(dist.get_process_group_ranks(group), pieces))
    return [by_global[member] for member in mesh.context_members()]
