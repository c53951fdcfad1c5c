"""Token layouts: which global token positions each context rank holds.

A context group of ``C = R * U`` ranks is indexed by ``(ring_rank r, ulysses_rank u)``. A layout
gives every ring slot ``r`` its ``S / R`` tokens as *runs* of consecutive global positions
(:meth:`TokenLayout.slot_runs`); inside a slot the tokens are split contiguously over the ``U``
Ulysses ranks. Concatenating the slots' runs gives a permutation ``perm`` of ``range(S)``: shard
``(r, u)`` holds ``perm[(r * U + u) * L : (r * U + u + 1) * L]`` with ``L = S / C``.

Three layouts, each a :class:`TokenLayout` object (the only place that knows their rules):

``zigzag`` (the default; Note [zigzag]): ``2R`` equal chunks; slot ``r`` holds chunks ``r`` and
``2R-1-r``.

``contiguous``: slot ``r`` holds the ``r``-th contiguous slice.

``balanced`` (Note [balanced]): computed per batch row from its document boundaries so that every
slot holds the same number of tokens and (close to) the same causal work; zigzag for one document.

Note [zigzag]: with causal attention a contiguous split gives the last ring slot all the work.
Pairing an early chunk with its mirror image makes every ring step that is not the diagonal one
cost exactly half a block on every rank.

Note [balanced]: zigzag balances causal work over the whole sequence, not over packed documents:
with a few long documents the busiest slot does up to twice the mean work. The balanced layout
(:mod:`hybridsp.layout.balance.tries`) splits a long document over as few slots as its work needs (in
consecutive pieces) and places short documents whole by work, so the layout depends on the
batch's boundaries: the same
boundaries must reach :func:`take_shard`, the attention and :func:`join_shards` (``bounds``).
"""

from __future__ import annotations

import functools
import math

import torch

from hybridsp.formulas import zigzag_slot_runs

Runs = tuple[tuple[tuple[int, int], ...], ...]  # per slot: (global start, length) runs in slot order


class TokenLayout:
    """A token layout over a ring of ``R`` slots. Subclasses define :meth:`_runs`."""

    name: str = ""
    uses_documents = False  # whether the runs depend on a row's document boundaries

    def chunks(self, ring: int) -> int:
        """Equal chunks the sequence is cut into when it holds one document."""
        return 2 * ring

    def required_multiple(self, ring: int, ulysses: int = 1, kv_chunks: int | None = None) -> int:
        """The step of sequence lengths the layout splits evenly (and ``kv_chunks`` divides per slot)."""
        return math.lcm(self.chunks(ring), ring * ulysses, ring * (kv_chunks or 1))

    def check_sequence_length(self, seq_len: int, ring: int, ulysses: int = 1, kv_chunks: int | None = None) -> None:
        """Raise ValueError, quoting the numbers, unless the layout splits ``seq_len`` evenly."""
        multiple = self.required_multiple(ring, ulysses, kv_chunks)
        if seq_len % multiple:
            chunked = f" with kv_chunks={kv_chunks}" if kv_chunks else ""
            raise ValueError(
                f"sequence length {seq_len} cannot be split by the {self.name} layout over ring={ring} x "
                f"ulysses={ulysses}{chunked}: it must be a multiple of {multiple}; pad the sequence to "
                f"{-(-seq_len // multiple) * multiple} tokens"
            )

    def slot_runs(self, seq_len: int, ring: int, bounds: tuple[int, ...] | None = None) -> Runs:
        """Per ring slot, its tokens as ``(global start, length)`` runs in the order the slot holds them.

        ``bounds``: one row's document boundaries ``(0, ..., seq_len)``; ignored by layouts that do
        not use documents. Memoised (pure function of its arguments).
        """
        self.check_sequence_length(seq_len, ring)
        return _cached_runs(self, seq_len, ring, bounds if self.uses_documents else None)

    def _runs(self, seq_len: int, ring: int, bounds: tuple[int, ...] | None) -> Runs:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))


@functools.lru_cache(maxsize=64)
def _cached_runs(layout: TokenLayout, seq_len: int, ring: int, bounds) -> Runs:
    return layout._runs(seq_len, ring, bounds)


class Zigzag(TokenLayout):
    """Slot ``r`` holds chunks ``r`` and ``2R-1-r`` of ``2R`` (Note [zigzag])."""

    name = "zigzag"

    def _runs(self, seq_len, ring, bounds):
        return zigzag_slot_runs(seq_len, ring)


class Contiguous(TokenLayout):
    """Slot ``r`` holds the ``r``-th of ``R`` contiguous slices."""

    name = "contiguous"

    def chunks(self, ring: int) -> int:
        return ring

    def _runs(self, seq_len, ring, bounds):
        local = seq_len // ring
        return tuple(((r * local, local),) for r in range(ring))


class Balanced(TokenLayout):
    """Equal tokens and (close to) equal causal work per slot for a row's documents (Note [balanced])."""

    name = "balanced"
    uses_documents = True

    def _runs(self, seq_len, ring, bounds):
        if bounds is None or len(bounds) <= 2:
            return ZIGZAG._runs(seq_len, ring, None)
        from hybridsp.layout.balance.tries import balanced_slot_runs  # torch-free, below this module

        return tuple(tuple(slot) for slot in balanced_slot_runs(tuple(bounds), seq_len, ring))


ZIGZAG, CONTIGUOUS, BALANCED = Zigzag(), Contiguous(), Balanced()
_BY_NAME = {layout.name: layout for layout in (ZIGZAG, CONTIGUOUS, BALANCED)}
LAYOUTS = tuple(_BY_NAME)


def get_layout(layout: str | TokenLayout) -> TokenLayout:
    """The layout object for a name (``zigzag``, ``contiguous``, ``balanced``) or the object itself."""
    if isinstance(layout, TokenLayout):
        return layout
    if layout not in _BY_NAME:
        raise ValueError(f"unknown token layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return _BY_NAME[layout]


def check_sequence_length(
    seq_len: int, ring: int, ulysses: int = 1, layout: str | TokenLayout = "zigzag", kv_chunks: int | None = None
) -> None:
    """Raise ValueError, quoting the numbers, unless ``layout`` can split ``seq_len`` evenly."""
    get_layout(layout).check_sequence_length(seq_len, ring, ulysses, kv_chunks)


def required_multiple(ring: int, ulysses: int = 1, layout: str | TokenLayout = "zigzag",
                      kv_chunks: int | None = None) -> int:
    """The smallest step of sequence lengths the layout splits evenly."""
    return get_layout(layout).required_multiple(ring, ulysses, kv_chunks)


def layout_permutation(
    seq_len: int, ring: int, ulysses: int = 1, layout: str | TokenLayout = "zigzag",
    bounds: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Global token index of every position of the concatenated shards, shape [S], int64."""
    layout = get_layout(layout)
    layout.check_sequence_length(seq_len, ring, ulysses)
    return _permutation(layout, seq_len, ring, bounds if layout.uses_documents else None).clone()


@functools.lru_cache(maxsize=64)
def _permutation(layout: TokenLayout, seq_len: int, ring: int, bounds) -> torch.Tensor:
    runs = [run for slot in layout.slot_runs(seq_len, ring, bounds) for run in slot]
    starts = torch.tensor([start for start, _ in runs], dtype=torch.int64)
    lengths = torch.tensor([length for _, length in runs], dtype=torch.int64)
    offsets = torch.cumsum(lengths, 0) - lengths  # where each run begins in the concatenation
    within = torch.arange(seq_len) - torch.repeat_interleave(offsets, lengths)  # [S] index inside its run
    return torch.repeat_interleave(starts, lengths) + within  # [S]


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``, so ``x_perm.index_select(d, inv)`` undoes the layout."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


def shard_positions(
    seq_len: int, ring_rank: int, ulysses_rank: int, ring: int, ulysses: int = 1,
    layout: str | TokenLayout = "zigzag", bounds: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Global token positions held by shard ``(ring_rank, ulysses_rank)``, shape [S / (R*U)]."""
    perm = layout_permutation(seq_len, ring, ulysses, layout, bounds)
    local = seq_len // (ring * ulysses)
    index = ring_rank * ulysses + ulysses_rank
    return perm[index * local : (index + 1) * local]


def _row_bounds(rows, batch: int) -> list:
    """One ``bounds`` (or None) per batch row from None, one shared tuple, or per-row tuples."""
    if rows is None or (rows and isinstance(rows[0], int)):
        return [rows] * batch
    if len(rows) != batch:
        raise ValueError(f"documents are given for {len(rows)} rows but the tensor has {batch} rows")
    return list(rows)


def take_shard(
    x: torch.Tensor, ring_rank: int, ulysses_rank: int, ring: int, ulysses: int = 1,
    layout: str | TokenLayout = "zigzag", dim: int = 1, bounds=None,
) -> torch.Tensor:
    """This shard's tokens of a full tensor ``x`` along ``dim`` (no communication).

    ``bounds``: document boundaries for layouts that use them: one tuple shared by every row, or
    one per row of dim 0 (then ``dim`` must be 1 or later: rows may be laid out differently).
    """
    layout = get_layout(layout)
    per_row = _row_bounds(bounds if layout.uses_documents else None, x.shape[0] if dim != 0 else 1)
    if all(row == per_row[0] for row in per_row):
        positions = shard_positions(x.shape[dim], ring_rank, ulysses_rank, ring, ulysses, layout, per_row[0])
        return x.index_select(dim, positions.to(x.device))
    rows = [shard_positions(x.shape[dim], ring_rank, ulysses_rank, ring, ulysses, layout, b) for b in per_row]
    return _gather_rows(x, torch.stack(rows), dim)


def _gather_rows(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``x[b]`` indexed along ``dim`` by ``index[b]`` ([B, L]) for every row b of dim 0."""
    shape = [1] * x.dim()
    shape[0], shape[dim] = index.shape
    expanded = index.to(x.device).view(shape).expand(*[index.shape[0] if d == 0 else index.shape[1] if d == dim
                                                       else x.shape[d] for d in range(x.dim())])
    return x.gather(dim, expanded)


def join_shards(
    shards: list[torch.Tensor], ring: int, ulysses: int = 1, layout: str | TokenLayout = "zigzag", dim: int = 1,
    bounds=None,
) -> torch.Tensor:
    """Inverse of :func:`take_shard`: ``shards`` ordered by ``r * U + u`` -> the full tensor."""
    layout = get_layout(layout)
    joined = torch.cat(shards, dim=dim)
    per_row = _row_bounds(bounds if layout.uses_documents else None, joined.shape[0] if dim != 0 else 1)
    seq_len = joined.shape[dim]
    if all(row == per_row[0] for row in per_row):
        inverse = inverse_permutation(layout_permutation(seq_len, ring, ulysses, layout, per_row[0]))
        return joined.index_select(dim, inverse.to(joined.device))
    inverses = [inverse_permutation(layout_permutation(seq_len, ring, ulysses, layout, b)) for b in per_row]
    return _gather_rows(joined, torch.stack(inverses), dim)
