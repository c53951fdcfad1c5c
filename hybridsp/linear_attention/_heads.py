"""The Ulysses head split of a recurrent layer: an all-to-all to a slice of whole head groups.

A recurrent layer's heads come in groups that must stay together on one rank: Gated DeltaNet's
value heads share a key head (``Hv / Hk`` of them, keys repeated per group), Mamba-2's heads share
``B``/``C`` groups. So the unit of the split is the group: every per-token feature of a group
(its q/k, its value heads' v, b, a; or its heads' x, dt and its B, C) is packed along the last
axis of one ``[B, L, units, F]`` tensor and travels in one all-to-all
(:func:`~hybridsp.attention._ulysses.seq_to_heads`), giving each Ulysses rank ``units / U``
groups of the ring slot's tokens. The per-head parameters (conv channels, ``A_log``,
``dt_bias``, ``D``) are sliced to the same groups (:func:`unit_range`); autograd writes their
gradients into the sliced rows, and the gradient all-reduce over the context group sums them.
"""

from __future__ import annotations

import torch

from hybridsp.attention._ulysses import heads_to_seq, seq_to_heads
from hybridsp.mesh._hybrid_mesh import HybridMesh


def unit_range(units: int, mesh: HybridMesh) -> tuple[int, int]:
    """This Ulysses rank's groups ``[lo, hi)`` of ``units`` (U divides ``units``: checked by the switch)."""
    per_rank = units // mesh.ulysses
    return mesh.ulysses_rank * per_rank, (mesh.ulysses_rank + 1) * per_rank


def to_slot_heads(parts: list[torch.Tensor], mesh: HybridMesh) -> list[torch.Tensor]:
    """Each [B, L, units, f_i] (one dtype) -> [B, U * L, units / U, f_i]: the ring slot's tokens of
    this rank's groups, in one all-to-all over the Ulysses group (no-op when U = 1)."""
    if mesh.ulysses == 1:
        return parts
    sizes = [p.shape[-1] for p in parts]
    packed = torch.cat(parts, dim=-1)  # [B, L, units, sum f_i]
    [slot] = seq_to_heads([packed], mesh.ulysses_group, mesh.comm_counter)  # [B, U * L, units / U, sum f_i]
    return list(slot.split(sizes, dim=-1))


def to_sequence(x: torch.Tensor, mesh: HybridMesh) -> torch.Tensor:
    """[B, U * L, h, D] -> [B, L, U * h, D]: back to this rank's tokens, every head (no-op when U = 1)."""
    if mesh.ulysses == 1:
        return x
    [out] = heads_to_seq([x], mesh.ulysses_group, mesh.comm_counter)
    return out
