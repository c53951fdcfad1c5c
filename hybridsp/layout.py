"""Token layouts: which global token positions each context rank holds.

A context group of ``C = R * U`` ranks is indexed by ``(ring_rank r, ulysses_rank u)``.
A layout is a permutation ``perm`` of ``range(S)``: the tokens of shard ``(r, u)`` are
``perm[(r * U + u) * L : (r * U + u + 1) * L]`` with ``L = S / C`` (in that order), and
``inverse_permutation(perm)`` puts the concatenated shards back in order.

``zigzag`` (the default; Note [zigzag]): the sequence is cut into ``2R`` equal chunks;
ring slot ``r`` holds chunks ``r`` and ``2R-1-r`` (in that order); inside a slot the
``S/R`` tokens are split contiguously over the ``U`` Ulysses ranks.

``contiguous``: shard ``(r, u)`` holds the ``(r * U + u)``-th contiguous slice.

Note [zigzag]: with causal attention a contiguous split gives the last ring slot all the
work. Pairing an early chunk with its mirror image makes every ring step that is not the
diagonal one cost exactly half a block on every rank: against an earlier slot only the
first half of the keys is visible to all local queries, against a later slot only the
second half of the queries sees anything (and then all keys).
"""

from __future__ import annotations

import torch

LAYOUTS = ("zigzag", "contiguous")


def check_sequence_length(seq_len: int, ring: int, ulysses: int, layout: str) -> None:
    """Raise ValueError, quoting the numbers, unless ``layout`` can split ``seq_len`` evenly."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown token layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    chunks = 2 * ring if layout == "zigzag" else ring
    if seq_len % chunks != 0 or (seq_len // ring) % ulysses != 0:
        multiple = required_multiple(ring, ulysses, layout)
        raise ValueError(
            f"sequence length {seq_len} cannot be split by the {layout} layout over ring={ring} x "
            f"ulysses={ulysses}: it must be a multiple of {multiple}; pad the sequence to "
            f"{-(-seq_len // multiple) * multiple} tokens"
        )


def required_multiple(ring: int, ulysses: int, layout: str) -> int:
    """The smallest step of valid sequence lengths for this layout."""
    base = 2 * ring if layout == "zigzag" else ring
    length = base
    while (length // ring) % ulysses != 0:
        length += base
    return length


def layout_permutation(seq_len: int, ring: int, ulysses: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """Global token index of every position of the concatenated shards, shape [S], int64."""
    check_sequence_length(seq_len, ring, ulysses, layout)
    positions = torch.arange(seq_len)
    if layout == "contiguous":
        return positions
    chunks = positions.view(2 * ring, seq_len // (2 * ring))  # [2R, S/2R]
    slots = [torch.cat([chunks[r], chunks[2 * ring - 1 - r]]) for r in range(ring)]
    return torch.cat(slots)  # [S]


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``, so ``x_perm.index_select(d, inv)`` undoes the layout."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


def shard_positions(
    seq_len: int, ring_rank: int, ulysses_rank: int, ring: int, ulysses: int = 1, layout: str = "zigzag"
) -> torch.Tensor:
    """Global token positions held by shard ``(ring_rank, ulysses_rank)``, shape [S / (R*U)]."""
    perm = layout_permutation(seq_len, ring, ulysses, layout)
    local = seq_len // (ring * ulysses)
    index = ring_rank * ulysses + ulysses_rank
    return perm[index * local : (index + 1) * local]


def take_shard(
    x: torch.Tensor, ring_rank: int, ulysses_rank: int, ring: int, ulysses: int = 1,
    layout: str = "zigzag", dim: int = 1,
) -> torch.Tensor:
    """This shard's tokens of a full tensor ``x`` along ``dim`` (no communication)."""
    positions = shard_positions(x.shape[dim], ring_rank, ulysses_rank, ring, ulysses, layout)
    return x.index_select(dim, positions.to(x.device))


def join_shards(
    shards: list[torch.Tensor], ring: int, ulysses: int = 1, layout: str = "zigzag", dim: int = 1
) -> torch.Tensor:
    """Inverse of :func:`take_shard`: ``shards`` ordered by ``r * U + u`` -> the full tensor."""
    joined = torch.cat(shards, dim=dim)
    perm = layout_permutation(joined.shape[dim], ring, ulysses, layout)
    return joined.index_select(dim, inverse_permutation(perm).to(joined.device))
