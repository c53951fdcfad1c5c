"""Masks as data: document boundaries and sliding windows -> the visible pieces of every block.

A ring rank holds the queries of one ring slot and, at each step, visits the key/value block
of another slot. Which (query, key) pairs are visible depends only on their *global* token
positions, their documents and the window, all of which every rank can derive from the
layout, ``cu_seqlens`` and ``sliding_window`` without communication. :func:`build_plan`
turns that into, for every (query slot, key slot) pair, a list of :class:`Piece`
rectangles (local query rows x key rows of the visiting block) that hold every visible
pair, each tagged with how a kernel computes it exactly:

    "full"    every pair of the rectangle is visible          kernel(causal=False)
    "causal"  square, top-left diagonal (key j <= query i)    kernel(causal=True)
    "band"    row i sees column j iff lo <= i - j <= hi        kernel.forward_band(band=(lo, hi))

plus the hull of key rows any piece of a pair reads (so a sender ships only those rows,
and a pair with no piece is neither computed nor sent). The plan does not know how a block
arrives (point-to-point steps, all-gather), so every K/V transport shares it. Building it is
linear in the number of documents (each slot's runs are cut at the boundaries once and indexed
by document; a slot pair only looks at the documents both hold).

Visibility, for global positions i (query) and j (key) in the same document:
    causal:                  i - W < j <= i        (W = sliding_window, infinite if None)
    not causal:              |i - j| < W
``W`` follows transformers (flash-attn's ``window_size=(W - 1, 0)``).

Note [pieces]: the local tokens of a slot are runs of consecutive global positions (zigzag:
two chunks; contiguous: one; balanced: a few per document, see :mod:`hybridsp.layout._layouts`). Cutting every run at document boundaries gives sub-runs that
lie in one document; a (query sub-run, key sub-run) pair of the same document sees a band of
the difference ``i - j`` and is trimmed to the rows and columns that see anything, so no
piece has a row without a visible key. Without a window a pair is then either full, the
causal diagonal square, or nothing. With a window, the query rows of a long sub-run are cut
into tiles of ``max(W, MIN_TILE)`` rows, so the computed area grows with ``W``, not with
the sequence: about ``tile x (tile + W)`` per tile.
"""

from __future__ import annotations

import bisect
import functools
import gc
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar, cast

import torch

from hybridsp.layout._balance.work import MIN_TILE  # fewest query rows per window tile (smaller cost more calls)
from hybridsp.layout._documents import Rows
from hybridsp.layout._layouts import TokenLayout, get_layout

# re-exported (``as``): importers of this module use them; their home is _pieces
from hybridsp.layout._pieces import ALL_ROWS
from hybridsp.layout._pieces import Band as Band
from hybridsp.layout._pieces import Piece as Piece
from hybridsp.layout._pieces import merge_pieces as merge_pieces

SubRun = tuple[int, int, int]  # (global start, length, local offset) inside one document
DocRuns = dict[int, list[SubRun]]  # one slot's sub-runs by document
_T = TypeVar("_T")


@dataclass(frozen=True)
class BlockPlan:
    """The pieces of every (query slot, key slot) pair of one masked ring attention call.

    ``pieces[(rank, source)]``: what ``rank``'s queries compute against ``source``'s block;
    ``hulls[(rank, source)]``: the ``(start, stop)`` key rows of ``source``'s block they read,
    or None when nothing is visible (no compute, no send). ``batch_rows`` multiplies the
    work of pieces that apply to every batch row.
    """

    ring: int
    local_len: int
    batch_rows: int
    pieces: dict[tuple[int, int], tuple[Piece, ...]] = field(repr=False)
    hulls: dict[tuple[int, int], tuple[int, int] | None] = field(repr=False)
    # memo of what transports derive
    derived: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)

    def memo(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        """``compute()`` once per plan and ``key`` (plans are immutable, so derived tables are too)."""
        if key not in self.derived:
            self.derived[key] = compute()
        return cast(_T, self.derived[key])  # the memo holds many kinds of value: the key determines which

    def work(self, rank: int) -> int:
        """Score cells ``rank`` computes in one forward, summed over batch rows."""
        total = 0
        for source in range(self.ring):
            for piece in self.pieces[(rank, source)]:
                total += piece.work * (self.batch_rows if piece.batch == ALL_ROWS else 1)
        return total

    def rows_received(self, rank: int) -> int:
        """Key rows ``rank`` receives from other slots per forward (each of K and V)."""
        return sum(self._hull_len(rank, s) for s in range(self.ring) if s != rank)

    def rows_sent(self, rank: int) -> int:
        """Key rows of its own block ``rank`` sends to other slots per forward (each of K and V)."""
        return sum(self._hull_len(d, rank) for d in range(self.ring) if d != rank)

    def _hull_len(self, rank: int, source: int) -> int:
        hull = self.hulls[(rank, source)]
        return 0 if hull is None else hull[1] - hull[0]


def check_sliding_window(sliding_window: object) -> None:
    """Raise ValueError unless the window is None or a positive int (tokens, query included)."""
    if sliding_window is None:
        return
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(
            f"sliding_window must be a positive number of tokens (query i sees keys j with i - W < j <= i) "
            f"or None; got {sliding_window!r}"
        )


# --------------------------------------------------------------------------- runs


def slot_runs(
    seq_len: int, ring: int, layout: str | TokenLayout, bounds: tuple[int, ...] | None = None
) -> list[list[tuple[int, int, int]]]:
    """Per ring slot, its local tokens as runs ``(global start, length, local offset)``."""
    out = []
    for slot in get_layout(layout).slot_runs(seq_len, ring, bounds):
        offset, runs = 0, []
        for start, length in slot:
            runs.append((start, length, offset))
            offset += length
        out.append(runs)
    return out


def _runs_by_doc(runs: Iterable[tuple[int, int, int]], bounds: tuple[int, ...]) -> DocRuns:
    """One slot's runs cut at document boundaries, indexed by document (linear in runs + documents)."""
    by_doc: dict[int, list[SubRun]] = {}
    for start, length, offset in runs:
        doc, position, end = bisect.bisect_right(bounds, start) - 1, start, start + length
        while position < end:
            stop = min(end, bounds[doc + 1])
            by_doc.setdefault(doc, []).append((position, stop - position, offset + position - start))
            position, doc = stop, doc + 1
    return by_doc


# --------------------------------------------------------------------------- pieces


def _diff_range(causal: bool, window: int | None) -> Band:
    """Visible values of ``i - j`` (global query minus key position) inside one document."""
    if causal:
        return 0, None if window is None else window - 1
    return (None, None) if window is None else (-(window - 1), window - 1)


def _trimmed(
    rows: tuple[int, int], keys: tuple[int, int], lo: int | None, hi: int | None, batch: slice
) -> Piece | None:
    """The rectangle ``rows x keys`` (local, half-open) with band ``lo <= i - j <= hi`` measured in
    its own coordinates, trimmed to what is visible and classified; None if nothing is."""
    n, m = rows[1] - rows[0], keys[1] - keys[0]
    lo = -(m - 1) if lo is None else max(lo, -(m - 1))
    hi = n - 1 if hi is None else min(hi, n - 1)
    if lo > hi:
        return None
    r0, r1 = max(0, lo), min(n, hi + m)  # rows that see a column
    c0, c1 = max(0, -hi), min(m, n - lo)  # columns seen by a row
    if r0 >= r1 or c0 >= c1:
        return None
    n, m, lo, hi = r1 - r0, c1 - c0, lo - (r0 - c0), hi - (r0 - c0)
    row_slice, key_slice = slice(rows[0] + r0, rows[0] + r1), slice(keys[0] + c0, keys[0] + c1)
    if lo <= -(m - 1) and hi >= n - 1:
        return Piece(row_slice, key_slice, "full", batch=batch)
    if n == m and lo == 0 and hi >= n - 1:
        return Piece(row_slice, key_slice, "causal", batch=batch)
    return Piece(row_slice, key_slice, "band", (None if lo <= -(m - 1) else lo, None if hi >= n - 1 else hi), batch)


def _pair_pieces(q_docs: DocRuns, k_docs: DocRuns, causal: bool, window: int | None, batch: slice) -> list[Piece]:
    """Pieces of one (query slot, key slot) pair for one set of documents (Note [pieces]):
    only the documents both slots hold are looked at."""
    common = q_docs.keys() & k_docs.keys() if len(q_docs) > len(k_docs) else k_docs.keys() & q_docs.keys()
    if window is None:
        return merge_pieces(_unwindowed_pieces(q_docs, k_docs, sorted(common), causal, batch))
    low, high = _diff_range(causal, window)
    tile = max(window, MIN_TILE)
    pieces = []
    for doc in sorted(common):
        for q_start, q_len, q_off in q_docs[doc]:
            for t in range(0, q_len, tile):
                n = min(tile, q_len - t)
                for k_start, k_len, k_off in k_docs[doc]:
                    shift = (q_start + t) - k_start  # global i - j at the tile's corner
                    lo = None if low is None else low - shift
                    hi = None if high is None else high - shift
                    piece = _trimmed((q_off + t, q_off + t + n), (k_off, k_off + k_len), lo, hi, batch)
                    if piece is not None:
                        pieces.append(piece)
    return merge_pieces(pieces)


def _unwindowed_pieces(
    q_docs: DocRuns, k_docs: DocRuns, docs: Iterable[int], causal: bool, batch: slice
) -> list[Piece]:
    """Without a window a (query sub-run, key sub-run) pair of one document is the causal square
    (the same run), full (keys before the queries, or not causal) or nothing (keys after)."""
    pieces = []
    for doc in docs:
        for q_start, q_len, q_off in q_docs[doc]:
            rows = slice(q_off, q_off + q_len)
            for k_start, k_len, k_off in k_docs[doc]:
                if causal and k_start == q_start:
                    pieces.append(Piece(rows, slice(k_off, k_off + k_len), "causal", batch=batch))
                elif not causal or k_start + k_len <= q_start:
                    pieces.append(Piece(rows, slice(k_off, k_off + k_len), "full", batch=batch))
    return pieces


def cut_keys(piece: Piece, start: int, stop: int) -> Piece | None:
    """The part of ``piece`` whose key rows lie in ``[start, stop)``, trimmed and reclassified
    (a causal or band piece cut off its diagonal becomes a band or full piece); None if empty."""
    lo_key, hi_key = max(piece.keys.start, start), min(piece.keys.stop, stop)
    if lo_key >= hi_key:
        return None
    if piece.kind == "full":
        return Piece(piece.rows, slice(lo_key, hi_key), "full", batch=piece.batch)
    lo, hi = (0, None) if piece.kind == "causal" else piece.band
    shift = lo_key - piece.keys.start  # i - j in the cut's own columns is larger by this much
    lo = None if lo is None else lo + shift
    hi = None if hi is None else hi + shift
    return _trimmed((piece.rows.start, piece.rows.stop), (lo_key, hi_key), lo, hi, piece.batch)


def build_plan(
    seq_len: int,
    ring: int,
    layout: str | TokenLayout,
    *,
    causal: bool,
    docs: tuple[tuple[int, ...], ...] | None,
    window: int | None,
    batch: int,
) -> BlockPlan:
    """The :class:`BlockPlan` of every (query slot, key slot) pair; no communication.

    Args:
        seq_len: global (unsharded) sequence length S.
        ring: ring degree R (slots of S / R tokens each, in ``layout`` order).
        layout: a :class:`~hybridsp.layout._layouts.TokenLayout` or its name (see :mod:`hybridsp.layout._layouts`);
            a layout that uses documents places each row by its own boundaries.
        causal: causal masking by global position.
        docs: per batch row document boundaries (:class:`~hybridsp.layout._documents.Documents` ``.rows``;
            None: one document per row).
        window: sliding window W or None.
        batch: B; rows with identical documents share their pieces.

    Linear in the number of documents. Memoised (a small LRU keyed by these arguments); the
    attention keeps the plan of a batch on its :class:`~hybridsp.layout._documents.Documents` as well, so
    the layers of one forward never hash the boundaries again.
    """
    paused = gc.isenabled()
    gc.disable()  # building allocates many small objects: collector passes would cost more than the build
    try:
        return _build_plan(seq_len, ring, get_layout(layout), causal, docs, window, batch)
    finally:
        if paused:
            gc.enable()


@functools.lru_cache(maxsize=16)
def _build_plan(
    seq_len: int, ring: int, layout: TokenLayout, causal: bool, docs: Rows | None, window: int | None, batch: int
) -> BlockPlan:
    layout.check_sequence_length(seq_len, ring)
    pieces: dict[tuple[int, int], list[Piece]] = {(rank, source): [] for rank in range(ring) for source in range(ring)}
    for bounds, rows in _row_groups(docs, batch, seq_len):
        slots = [_runs_by_doc(runs, bounds) for runs in slot_runs(seq_len, ring, layout, bounds)]
        for rank in range(ring):
            for source in range(ring):
                pieces[(rank, source)] += _pair_pieces(slots[rank], slots[source], causal, window, rows)
    hulls = {pair: _hull(found) for pair, found in pieces.items()}
    return BlockPlan(ring, seq_len // ring, batch, {pair: tuple(found) for pair, found in pieces.items()}, hulls)


def _hull(found: list[Piece]) -> tuple[int, int] | None:
    """The key rows ``(start, stop)`` any of the pieces reads, or None."""
    if not found:
        return None
    return min(p.keys.start for p in found), max(p.keys.stop for p in found)


def _row_groups(docs: Rows | None, batch: int, seq_len: int) -> list[tuple[tuple[int, ...], slice]]:
    """(boundaries, batch slice) groups: one for all rows when they agree, else one per row."""
    if docs is None:
        return [((0, seq_len), ALL_ROWS)]
    if all(row == docs[0] for row in docs):
        return [(docs[0], ALL_ROWS)]
    return [(row, slice(b, b + 1)) for b, row in enumerate(docs)]


def document_ids(docs: tuple[int, ...], seq_len: int) -> torch.Tensor:
    """[S] int64: the document index of every global position (for references and tests)."""
    lengths = torch.tensor([b - a for a, b in zip(docs[:-1], docs[1:])])
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:seq_len]
