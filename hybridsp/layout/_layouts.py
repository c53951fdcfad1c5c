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
(:mod:`hybridsp.layout._balance.tries`) splits a long document over as few slots as its work needs (in
consecutive pieces) and places short documents whole by work, so the layout depends on the
batch's boundaries: the same
boundaries must reach :func:`take_shard`, the attention and :func:`join_shards` (``bounds``).

Note [placement window]: with a sliding window ``W`` a token at offset ``p`` of its document
attends to ``min(p + 1, W)`` keys, so the work of a long document grows linearly, not
quadratically, and a layout balanced for full attention can leave the busiest slot far above
the mean (1.86 x on lognormal packs at W = 512). ``Balanced(window=W)`` (``layout.placing(W)``)
balances that work instead. The window is part of the layout object (its equality and hash):
the runs, the permutation and the block plan are functions of (documents, window), and every
place that shards, plans or joins must use the same object; the mesh
(``init_mesh(sliding_window=)``) and the batch's :class:`~hybridsp.layout._documents.Documents`
(``window``) carry it there. A window at least as long as a row's longest document places that
row exactly as no window does.

Runs are cached per row in a byte-bounded LRU (Note [runs cache] in
:mod:`hybridsp.layout._runs_cache`); permutations and shard positions are rebuilt from them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from hybridsp._formulas import zigzag_slot_runs
from hybridsp.layout._runs_cache import RUNS_CACHE, Runs

if TYPE_CHECKING:
    from typing_extensions import TypeIs

# a batch's document boundaries: one row's shared by every row, one per row, or None
BatchBounds = tuple[int, ...] | Sequence[tuple[int, ...]] | None


class TokenLayout:
    """A token layout over a ring of ``R`` slots. Subclasses define :meth:`_runs`."""

    name: str = ""
    uses_documents = False  # whether the runs depend on a row's document boundaries
    window: int | None = None  # the sliding window the runs are balanced for (Note [placement window])

    def placing(self, window: int | None) -> TokenLayout:
        """This layout placing tokens for sliding window ``window``; layouts that ignore documents
        ignore windows too (the same object)."""
        return self

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
        not use documents. Cached per row (Note [runs cache] in :mod:`hybridsp.layout._runs_cache`).
        """
        self.check_sequence_length(seq_len, ring)
        bounds = bounds if self.uses_documents else None
        return RUNS_CACHE.get((self, seq_len, ring, bounds), bounds, lambda: self._runs(seq_len, ring, bounds))

    def _runs(self, seq_len: int, ring: int, bounds: tuple[int, ...] | None) -> Runs:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.window == other.window

    def __hash__(self) -> int:
        return hash((type(self), self.window))


class Zigzag(TokenLayout):
    """Slot ``r`` holds chunks ``r`` and ``2R-1-r`` of ``2R`` (Note [zigzag])."""

    name = "zigzag"

    def _runs(self, seq_len: int, ring: int, bounds: tuple[int, ...] | None) -> Runs:
        return zigzag_slot_runs(seq_len, ring)


class Contiguous(TokenLayout):
    """Slot ``r`` holds the ``r``-th of ``R`` contiguous slices."""

    name = "contiguous"

    def chunks(self, ring: int) -> int:
        return ring

    def _runs(self, seq_len: int, ring: int, bounds: tuple[int, ...] | None) -> Runs:
        local = seq_len // ring
        return tuple(((r * local, local),) for r in range(ring))


class Balanced(TokenLayout):
    """Equal tokens and (close to) equal causal work per slot for a row's documents (Note [balanced]),
    the work counted under sliding window ``window`` (None: full causal; Note [placement window])."""

    name = "balanced"
    uses_documents = True

    def __init__(self, window: int | None = None) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(
                f"the balanced layout's window must be a positive number of tokens or None; got {window!r}"
            )
        self.window = window

    def placing(self, window: int | None) -> TokenLayout:
        return self if window == self.window else Balanced(window)

    def _runs(self, seq_len: int, ring: int, bounds: tuple[int, ...] | None) -> Runs:
        if bounds is None or len(bounds) <= 2:
            return ZIGZAG._runs(seq_len, ring, None)
        from hybridsp.layout._balance.tries import balanced_slot_runs  # torch-free, below this module
        from hybridsp.layout._balance.work import TiledWindow

        window = self.window
        if window is not None and window >= max(b - a for a, b in zip(bounds, bounds[1:])):
            window = None  # no document is longer than the window: the work is full causal work
        cost = None if window is None else TiledWindow.of(window)  # what the plan computes (Note [tiled work])
        return tuple(tuple(slot) for slot in balanced_slot_runs(tuple(bounds), seq_len, ring, window=cost))

    def __repr__(self) -> str:
        return "Balanced()" if self.window is None else f"Balanced(window={self.window})"


ZIGZAG, CONTIGUOUS, BALANCED = Zigzag(), Contiguous(), Balanced()
_BY_NAME = {layout.name: layout for layout in (ZIGZAG, CONTIGUOUS, BALANCED)}
LAYOUTS = tuple(_BY_NAME)


def get_layout(layout: str | TokenLayout, window: int | None = None) -> TokenLayout:
    """The layout object for a name (``zigzag``, ``contiguous``, ``balanced``) or the object itself;
    ``window`` given: that layout placing for it (:meth:`TokenLayout.placing`)."""
    if not isinstance(layout, TokenLayout):
        if layout not in _BY_NAME:
            raise ValueError(f"unknown token layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
        layout = _BY_NAME[layout]
    return layout if window is None else layout.placing(window)


def check_sequence_length(
    seq_len: int, ring: int, ulysses: int = 1, layout: str | TokenLayout = "zigzag", kv_chunks: int | None = None
) -> None:
    """Raise ValueError, quoting the numbers, unless ``layout`` can split ``seq_len`` evenly."""
    get_layout(layout).check_sequence_length(seq_len, ring, ulysses, kv_chunks)


def required_multiple(
    ring: int, ulysses: int = 1, layout: str | TokenLayout = "zigzag", kv_chunks: int | None = None
) -> int:
    """The smallest step of sequence lengths the layout splits evenly."""
    return get_layout(layout).required_multiple(ring, ulysses, kv_chunks)


def runs_positions(runs: Iterable[tuple[int, int]], begin: int, end: int) -> torch.Tensor:
    """Positions ``begin .. end-1`` of the concatenation of ``runs`` ((start, length) pairs), shape
    [end - begin], int64: a few vectorised ops whatever the number of runs (no per-token Python)."""
    starts, lengths, offset = [], [], 0
    for start, length in runs:
        lo, hi = max(begin, offset), min(end, offset + length)
        if lo < hi:
            starts.append(start + lo - offset)
            lengths.append(hi - lo)
        offset += length
    starts_t, lengths_t = torch.tensor(starts, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    shift = starts_t - (torch.cumsum(lengths_t, 0) - lengths_t)  # [m] start minus where the run begins
    return torch.repeat_interleave(shift, lengths_t, output_size=end - begin) + torch.arange(end - begin)


def layout_permutation(
    seq_len: int,
    ring: int,
    ulysses: int = 1,
    layout: str | TokenLayout = "zigzag",
    bounds: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Global token index of every position of the concatenated shards, shape [S], int64 (a new
    tensor, built from the cached runs: Note [runs cache] in :mod:`hybridsp.layout._runs_cache`)."""
    layout = get_layout(layout)
    layout.check_sequence_length(seq_len, ring, ulysses)
    return runs_positions(_flat_runs(layout, seq_len, ring, bounds), 0, seq_len)


def _flat_runs(layout: TokenLayout, seq_len: int, ring: int, bounds: tuple[int, ...] | None) -> list[tuple[int, int]]:
    """Every slot's runs in shard order (slot 0's first)."""
    return [run for slot in layout.slot_runs(seq_len, ring, bounds) for run in slot]


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``, so ``x_perm.index_select(d, inv)`` undoes the layout."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


def shard_positions(
    seq_len: int,
    ring_rank: int,
    ulysses_rank: int,
    ring: int,
    ulysses: int = 1,
    layout: str | TokenLayout = "zigzag",
    bounds: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Global token positions held by shard ``(ring_rank, ulysses_rank)``, shape [S / (R*U)]."""
    layout = get_layout(layout)
    layout.check_sequence_length(seq_len, ring, ulysses)
    local = seq_len // (ring * ulysses)
    index = ring_rank * ulysses + ulysses_rank
    return runs_positions(_flat_runs(layout, seq_len, ring, bounds), index * local, (index + 1) * local)


def _row_bounds(rows: BatchBounds, batch: int) -> list[tuple[int, ...] | None]:
    """One ``bounds`` (or None) per batch row from None, one shared tuple, or per-row tuples."""
    if _shared_bounds(rows):
        return [rows] * batch
    if len(rows) != batch:
        raise ValueError(f"documents are given for {len(rows)} rows but the tensor has {batch} rows")
    return list(rows)


def _shared_bounds(rows: BatchBounds) -> TypeIs[tuple[int, ...] | None]:
    """Whether ``rows`` is None or one boundary tuple shared by every row (its first entry an int)."""
    return rows is None or bool(rows and isinstance(rows[0], int))


def shard_index(
    seq_len: int,
    rows: int,
    ring_rank: int,
    ulysses_rank: int,
    ring: int,
    ulysses: int = 1,
    layout: str | TokenLayout = "zigzag",
    bounds: BatchBounds = None,
) -> torch.Tensor:
    """The positions :func:`take_shard` takes: [1, L] when every row is laid out alike, else [rows, L]
    (``L = S / (R*U)``; ``bounds`` as there). Each row's runs come from the cache once."""
    layout = get_layout(layout)
    per_row = _row_bounds(bounds if layout.uses_documents else None, rows) or [None]  # no rows: B = 0
    if all(row == per_row[0] for row in per_row):
        return shard_positions(seq_len, ring_rank, ulysses_rank, ring, ulysses, layout, per_row[0]).unsqueeze(0)
    return torch.stack([shard_positions(seq_len, ring_rank, ulysses_rank, ring, ulysses, layout, b) for b in per_row])


def take_index(x: torch.Tensor, index: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``x`` indexed along ``dim`` by a :func:`shard_index` result ([1, L]: every row alike; [B, L]:
    row b of dim 0 by ``index[b]``)."""
    if index.shape[0] == 1:
        return x.index_select(dim, index[0].to(x.device))
    return _gather_rows(x, index, dim)


def take_shard(
    x: torch.Tensor,
    ring_rank: int,
    ulysses_rank: int,
    ring: int,
    ulysses: int = 1,
    layout: str | TokenLayout = "zigzag",
    dim: int = 1,
    bounds: BatchBounds = None,
) -> torch.Tensor:
    """This shard's tokens of a full tensor ``x`` along ``dim`` (no communication).

    ``bounds``: document boundaries for layouts that use them: one tuple shared by every row, or
    one per row of dim 0 (then ``dim`` must be 1 or later: rows may be laid out differently).
    ``layout`` carries the placement window (Note [placement window]).
    """
    rows = x.shape[0] if dim != 0 else 1
    return take_index(x, shard_index(x.shape[dim], rows, ring_rank, ulysses_rank, ring, ulysses, layout, bounds), dim)


def _gather_rows(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``x[b]`` indexed along ``dim`` by ``index[b]`` ([B, L]) for every row b of dim 0."""
    shape = [1] * x.dim()
    shape[0], shape[dim] = index.shape
    expanded = (
        index.to(x.device)
        .view(shape)
        .expand(*[index.shape[0] if d == 0 else index.shape[1] if d == dim else x.shape[d] for d in range(x.dim())])
    )
    return x.gather(dim, expanded)


def join_shards(
    shards: list[torch.Tensor],
    ring: int,
    ulysses: int = 1,
    layout: str | TokenLayout = "zigzag",
    dim: int = 1,
    bounds: BatchBounds = None,
) -> torch.Tensor:
    """Inverse of :func:`take_shard`: ``shards`` ordered by ``r * U + u`` -> the full tensor (the
    same ``layout`` object, window included, and ``bounds`` as the sharding)."""
    layout = get_layout(layout)
    joined = torch.cat(shards, dim=dim)
    per_row = _row_bounds(bounds if layout.uses_documents else None, joined.shape[0] if dim != 0 else 1)
    seq_len = joined.shape[dim]
    if all(row == per_row[0] for row in per_row):
        inverse = inverse_permutation(layout_permutation(seq_len, ring, ulysses, layout, per_row[0]))
        return joined.index_select(dim, inverse.to(joined.device))
    inverses = [inverse_permutation(layout_permutation(seq_len, ring, ulysses, layout, b)) for b in per_row]
    return _gather_rows(joined, torch.stack(inverses), dim)
