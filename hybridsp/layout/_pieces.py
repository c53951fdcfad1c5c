"""The pieces of a block plan (:mod:`hybridsp.layout._block_plan`): :class:`Piece`, one kernel call's
rectangle of local query rows x key rows with how the kernel computes it, and :func:`merge_pieces`,
which joins pieces into fewer, larger calls for the same cells.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridsp._types import PieceKind

ALL_ROWS = slice(None)  # a piece of every batch row (compared by value)

Band = tuple[int | None, int | None]
Corner = tuple[tuple[int, int], int, int]  # (batch key, first row, first key) of a piece


@dataclass(frozen=True, slots=True)
class Piece:
    """One kernel call: ``q[batch, rows] x kv_block[batch, keys]`` (slices along the local sequence).

    ``kind`` is ``full``, ``causal`` or ``band``; ``band = (lo, hi)`` (None = unbounded) says
    row i of the piece sees column j iff ``lo <= i - j <= hi``. ``batch`` is ``slice(None)``
    when every batch row has the same documents, else one row.
    """

    rows: slice
    keys: slice
    kind: PieceKind
    band: Band = (None, None)
    batch: slice = field(default_factory=lambda: ALL_ROWS)

    @property
    def work(self) -> int:
        """Score cells the kernel computes (a causal square counts its lower triangle)."""
        n: int = self.rows.stop - self.rows.start
        m: int = self.keys.stop - self.keys.start
        return n * (n + 1) // 2 if self.kind == "causal" else n * m

    def shifted(self, offset: int) -> Piece:
        """The same piece with key rows counted from ``offset`` (a block that starts there)."""
        keys = slice(self.keys.start - offset, self.keys.stop - offset)
        return Piece(self.rows, keys, self.kind, self.band, self.batch)


def merge_pieces(pieces: list[Piece]) -> list[Piece]:
    """Fewer, larger calls for the same cells: full pieces that share their key rows and have
    adjacent query rows (or share their query rows and have adjacent keys) become one, and a
    zigzag-style diagonal (causal square, the full block below it, the causal square after it)
    becomes one causal square. Sort-based: O(n log n) in the number of pieces."""
    if sum(p.kind == "full" for p in pieces) < 1:
        return pieces
    merged = _joined_causal(_joined_full(pieces))
    while len(merged) < len(pieces):
        pieces, merged = merged, _joined_causal(_joined_full(merged))
    return merged


def _joined_full(pieces: list[Piece]) -> list[Piece]:
    """Full pieces joined along the query rows, then along the keys."""
    by_rows = _join_adjacent(pieces, along="rows")
    return _join_adjacent(by_rows, along="keys")


def _join_adjacent(pieces: list[Piece], along: str) -> list[Piece]:
    """Join full pieces of the same batch rows that agree on the other axis and touch along ``along``."""
    other = "keys" if along == "rows" else "rows"

    def key(p: Piece) -> tuple[bool, tuple[int, int], int, int, int]:
        fixed, moving = getattr(p, other), getattr(p, along)
        return (p.kind != "full", _batch_key(p.batch), fixed.start, fixed.stop, moving.start)

    out: list[Piece] = []
    for piece in sorted(pieces, key=key):
        last = out[-1] if out else None
        if (
            last is not None
            and piece.kind == last.kind == "full"
            and piece.batch == last.batch
            and getattr(piece, other) == getattr(last, other)
            and getattr(piece, along).start == getattr(last, along).stop
        ):
            span = slice(getattr(last, along).start, getattr(piece, along).stop)
            rows, keys = (span, piece.keys) if along == "rows" else (piece.rows, span)
            out[-1] = Piece(rows, keys, "full", batch=piece.batch)
        else:
            out.append(piece)
    return out


def _batch_key(batch: slice) -> tuple[int, int]:
    return (-1, -1) if batch == ALL_ROWS else (batch.start, batch.stop)


def _corner(p: Piece) -> Corner:
    return (_batch_key(p.batch), p.rows.start, p.keys.start)


def _box(p: Piece) -> tuple[tuple[int, int], int, int, int, int]:
    return (_batch_key(p.batch), p.rows.start, p.rows.stop, p.keys.start, p.keys.stop)


def _joined_causal(pieces: list[Piece]) -> list[Piece]:
    """Join ``causal A | full B below A | causal C right of B`` into the causal square ``A + B + C``
    (rows of A then C, keys of A then C: exactly the zigzag slot's own-block diagonal). Chains
    fold left to right; dictionary lookups keep it linear."""
    squares = {_corner(p): p for p in pieces if p.kind == "causal"}
    if len(squares) < 2:
        return pieces
    fulls = {_box(p) for p in pieces if p.kind == "full"}
    absorbed: set[Corner] = set()
    joined: dict[Corner, Piece] = {}
    for corner in sorted(squares):
        if corner in absorbed:
            continue
        a = squares[corner]
        while (c := squares.get((corner[0], a.rows.stop, a.keys.stop))) is not None:
            below = (corner[0], c.rows.start, c.rows.stop, a.keys.start, a.keys.stop)
            if below not in fulls:
                break
            fulls.discard(below)
            absorbed.add(_corner(c))
            a = Piece(slice(a.rows.start, c.rows.stop), slice(a.keys.start, c.keys.stop), "causal", batch=a.batch)
        joined[corner] = a
    out = []
    for p in pieces:
        if p.kind == "causal":
            if _corner(p) not in absorbed:
                out.append(joined[_corner(p)])
        elif p.kind != "full" or _box(p) in fulls:
            out.append(p)
    return out
