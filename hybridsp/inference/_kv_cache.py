"""This rank's shard of a context group's K/V cache, preallocated, for decoding.

Shape legend: B batch, Hkv key/value heads, L tokens this rank caches, D head dim.

Note [cache layout]: each rank keeps the K/V of the tokens it holds in the mesh's token
layout, as the model's attention projects them, *before* the Ulysses all-to-all: per layer
``[B, Hkv, L, D]`` with every K/V head. The alternative, keeping what a rank sees after the
all-to-all (``S/R`` tokens of ``Hkv'/U`` heads), was rejected:

- memory per rank: before, ``S/C * Hkv``; after, ``S/R * Hkv'/U = S/C * Hkv'`` where
  ``Hkv' = Hkv * kv_repeats_for(H, Hkv, U) >= Hkv``. Equal when U divides Hkv, but
  ``U/Hkv`` times larger when Hkv < U (GQA with few K/V heads, e.g. 8 K/V heads and U=16:
  twice the cache on every rank).
- decode collective: before, one all-gather over the C context ranks of the new queries'
  partial (out, lse), ``B x T x H x (D+1)`` fp32 per rank; after, a merge over the R ring
  ranks plus an all-gather of head slices over the U ranks: two collectives of the same
  total size, for nothing gained.
- at decode every rank already has the new token's queries for all heads (every rank runs
  the new token), so no all-to-all is needed; the prefill stores exactly what the model's
  own ``cache.update`` receives, so the hybrid attention's training path stays untouched.

Note [balancing]: the K/V of a new token goes to exactly one context rank: the one that
holds the fewest tokens, ties to the lowest shard index (:func:`assign_new_tokens`). Every
rank derives the same owner from the shard lengths alone, so no communication decides it,
and the shard lengths never drift apart by more than they were after the prefill (they
converge to within one token). Since the whole schedule is known at the start, each rank
preallocates exactly the capacity it will need: appending is an in-place write, never a
``torch.cat`` that would copy the whole shard (and briefly double it) every step.

Note [padding]: tokens the prefill padded on the right to the layout's multiple are never
stored (the caller passes the local indices of the real tokens), so decode cannot see them;
the positions of the stored tokens are kept (``key_positions``) for masks such as a sliding
window.
"""

from __future__ import annotations

import torch

from hybridsp.mesh._hybrid_mesh import HybridMesh


def assign_new_tokens(shard_lengths: list[int], count: int) -> list[int]:
    """The context rank (shard index) that caches each of ``count`` new tokens (Note [balancing])."""
    lengths, owners = list(shard_lengths), []
    for _ in range(count):
        owner = min(range(len(lengths)), key=lambda shard: (lengths[shard], shard))
        lengths[owner] += 1
        owners.append(owner)
    return owners


class ShardedKVCache:
    """One rank's K/V shard for every layer, plus the schedule of who caches each new token.

    Args:
        mesh: the :class:`~hybridsp.mesh._hybrid_mesh.HybridMesh`; ``mesh.context_rank`` names this shard.
        num_layers: how many attention layers write to the cache.
        positions: [L0] int64 global positions of the prompt tokens this rank will store.
        shard_lengths: the L0 of every context rank, in shard order (the same list on every rank).
        new_tokens: how many generated tokens will be appended over the whole context group.

    Buffers (``[B, Hkv, capacity, D]`` keys and values per layer) are allocated at the first
    write of each layer, with that write's batch, heads, dtype and device.
    """

    def __init__(
        self, mesh: HybridMesh, num_layers: int, *, positions: torch.Tensor, shard_lengths: list[int], new_tokens: int
    ):
        if len(shard_lengths) != mesh.context:
            raise ValueError(f"shard_lengths has {len(shard_lengths)} entries for {mesh.context} context ranks")
        if positions.numel() != shard_lengths[mesh.context_rank]:
            raise ValueError(
                f"rank {mesh.rank} stores {positions.numel()} prompt tokens but shard_lengths says "
                f"{shard_lengths[mesh.context_rank]} for shard {mesh.context_rank}"
            )
        self.mesh, self.num_layers = mesh, num_layers
        self.owners = assign_new_tokens(shard_lengths, new_tokens)
        self.capacity = positions.numel() + self.owners.count(mesh.context_rank)
        self.shard_lengths = list(shard_lengths)
        self._positions = torch.empty(self.capacity, dtype=torch.long, device=positions.device)
        self._positions[: positions.numel()] = positions
        self._tokens = positions.numel()  # positions recorded (all layers catch up within a step)
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._filled = [0] * num_layers
        self.steps = 0  # new tokens scheduled so far
        self.owner: int | None = None  # shard index caching the current new token

    @property
    def decoding(self) -> bool:
        """True once :meth:`begin_token` has been called (the prefill is over)."""
        return self.owner is not None

    @property
    def total_tokens(self) -> int:
        """Tokens cached over the whole context group (prompt without padding + new tokens)."""
        return sum(self.shard_lengths)

    def begin_token(self, position: int) -> bool:
        """Schedule the next new token at global ``position``; True if this rank caches it."""
        if self.steps >= len(self.owners):
            raise ValueError(
                f"the cache was sized for {len(self.owners)} new tokens; a {self.steps + 1}-th was requested"
            )
        self.owner = self.owners[self.steps]
        self.steps += 1
        self.shard_lengths[self.owner] += 1
        mine = self.owner == self.mesh.context_rank
        if mine:
            self._positions[self._tokens] = position
            self._tokens += 1
        return mine

    @property
    def owns_current(self) -> bool:
        """Whether this rank caches the token of the current decode step."""
        return self.owner == self.mesh.context_rank

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Append tokens to ``layer``'s shard: keys/values [B, Hkv, T, D], optionally only the columns ``index``."""
        if index is not None:
            keys, values = keys.index_select(2, index), values.index_select(2, index)  # [B, Hkv, T', D]
        if self._keys[layer] is None:
            b, h, _, d = keys.shape
            self._keys[layer] = keys.new_empty(b, h, self.capacity, d)  # [B, Hkv, capacity, D]
            self._values[layer] = values.new_empty(b, h, self.capacity, values.shape[-1])  # [B, Hkv, capacity, Dv]
        start, count = self._filled[layer], keys.shape[2]
        if start + count > self.capacity:
            raise ValueError(f"layer {layer}: {start} + {count} tokens exceed this shard's capacity {self.capacity}")
        keys_buffer, values_buffer = self._keys[layer], self._values[layer]
        assert keys_buffer is not None and values_buffer is not None  # allocated above
        keys_buffer[:, :, start : start + count].copy_(keys)
        values_buffer[:, :, start : start + count].copy_(values)
        self._filled[layer] = start + count

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (keys, values) of ``layer``, each a view [B, Hkv, L, D]."""
        keys, values = self._keys[layer], self._values[layer]
        if keys is None:
            raise ValueError(f"layer {layer} of the cache was never written (run the prefill first)")
        assert values is not None  # allocated with the keys
        filled = self._filled[layer]
        return keys[:, :, :filled], values[:, :, :filled]

    def key_positions(self, layer: int) -> torch.Tensor:
        """[L] global positions of ``layer``'s cached tokens, in cache order."""
        return self._positions[: self._filled[layer]]

    def nbytes(self) -> int:
        """Bytes of this rank's allocated K/V buffers (all layers)."""
        return sum(t.numel() * t.element_size() for t in self._keys + self._values if t is not None)

    def __repr__(self) -> str:
        return (
            f"ShardedKVCache(shard {self.mesh.context_rank} of {self.mesh.context}, {self._tokens} tokens, "
            f"capacity {self.capacity}, layers {self.num_layers}, group total {self.total_tokens})"
        )
