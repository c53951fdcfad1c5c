"""The work model and bookkeeping of the balanced layout (:mod:`hybridsp.layout._balance.tries`).

Pure Python (no torch). Attention is causal inside each document of a packed row with boundaries
``bounds = (0, b1, ..., S)``; the token at offset ``p`` of its document attends to ``min(p + 1,
W)`` keys (``W`` = window, unbounded if None), or, for ``window`` a :class:`TiledWindow`, the
cells the block plan computes for it (Note [tiled work]: what ``layout="balanced"`` balances
for a window); a slot's work is the sum over its tokens. Here:
that work for document prefixes, pieces and global runs; the per-slot builder (:class:`Slot`);
grouping whole documents into units; the final run order (:func:`finish_runs`); the K/V rows a
layout ships (:func:`hull_rows`); and the input checks.

Note [run order]. With one document or R = 1 the result is exactly the zigzag layout (whose
middle slot keeps its two touching chunks). Otherwise a slot's runs come in two groups, each by
ascending global start with touching runs merged: the documents it holds whole, then pieces of
documents other slots hold too. A sender ships the hull of the local K/V rows a peer reads, and
peers read only shared documents, so this order tightens the hull (-6% rows at R = 4 on lognormal
packs, -30% with 100 documents at R = 8, against plain ascending order). Local offsets are the
running sum of the lengths.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_UNIT_SHARE = 0.125
DEFAULT_UNIT_WORK = 0.02
MIN_TILE = 64  # fewest query rows of a window tile in the block plan (Note [tiled work])

Runs = tuple[tuple[int, int], ...]
Docs = tuple[tuple[int, ...], list[int], list[int]]  # (bounds, lengths, works) of a row's documents


def slot_work(
    runs_per_slot: Iterable[Iterable[tuple[int, int]]], bounds: Sequence[int], window: Window = None
) -> list[int]:
    """Cells per slot under the work model (sum over its tokens of min(offset + 1, W)).

    O(m log n) for m runs and n documents (a bisection per run, then a walk over the documents
    the run covers).
    """
    return [sum(run_work(start, n, bounds, window) for start, n in runs) for runs in runs_per_slot]


def documents(bounds: tuple[int, ...], window: Window) -> Docs:
    """(bounds, lengths, works) of the row's documents."""
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if window is None:
        works = [n * (n + 1) // 2 for n in lengths]
    else:
        works = [prefix_work(n, window) for n in lengths]
    return bounds, lengths, works


class Slot:
    """One ring slot while it is built: its runs, tokens and work so far."""

    __slots__ = ("runs", "tokens", "work")

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, int]] = []  # (global start, tokens, work)
        self.tokens = 0
        self.work = 0

    def take(self, start: int, n: int, work: int) -> None:
        if n > 0:
            self.runs.append((start, n, work))
            self.tokens += n
            self.work += work


def prefix_work(x: int, window: Window) -> int:
    """Work of the first ``x`` tokens of a document: sum_{p < x} min(p + 1, W), or a cost model's
    (``window`` a :class:`TiledWindow`)."""
    if window is None:
        return x * (x + 1) // 2
    if isinstance(window, TiledWindow):
        return window.prefix_work(x)
    if x <= window:
        return x * (x + 1) // 2
    return window * (window + 1) // 2 + (x - window) * window


@dataclass(frozen=True)
class TiledWindow:
    """The cells the block plan computes for a sliding window ``window`` (Note [tiled work]).

    Note [tiled work]. ``build_plan`` cuts a windowed query run into tiles of ``tile = max(W,
    64)`` rows from the run's start and computes each tile's rectangle of visible columns: at
    document offset ``t``, ``n`` rows x ``n + min(t, W - 1)`` columns, except a run's first tile:
    against the run's own keys its causal square (``W >= n``; else ``n x n``), against the keys
    before the run (another run, another slot) ``min(n, W - 1) x min(t, W - 1)``. So a token past
    a run's first tile costs about ``tile + W - 1`` cells (``2W - 1`` for ``W >= 64``), twice the
    ``W`` keys it sees, while short documents cost their visible cells: the layout balances this
    (what ``BlockPlan.work`` counts and a kernel that computes whole pieces does), not the
    visible cells alone. :meth:`piece_work` is exact when the keys before a run are one run; split
    over slots they cost a little less (each rectangle is trimmed), and touching runs a slot
    holds are merged (tiled as one).
    """

    window: int
    tile: int

    @classmethod
    def of(cls, window: int) -> TiledWindow:
        """The plan's tiles for window ``window``."""
        return cls(window, max(window, MIN_TILE))

    def prefix_work(self, x: int) -> int:
        """Cells of a run of a document's first ``x`` tokens."""
        return self.piece_work(0, x)

    def piece_work(self, lo: int, hi: int) -> int:
        """Cells of a query run of document offsets [lo, hi) (O(1): its tiles in closed form)."""
        w, t = self.window, self.tile
        if hi <= lo:
            return 0
        n = min(t, hi - lo)
        own = n * (n + 1) // 2 if w >= n else n * n  # the first tile against its own keys
        earlier = min(n, w - 1) * min(lo, w - 1)  # ... against the keys before lo (another run)
        full, rest = divmod(hi - lo - n, t)
        first = own + earlier
        return first + full * t * (t + w - 1) + rest * (rest + w - 1)


Window = int | TiledWindow | None  # the work model's window: none, W tokens, or the plan's tiles for W


def shortest_with_work(work: float, limit: int, window: Window) -> int:
    """The smallest document length (at most ``limit + 1``) whose work is >= ``work``."""
    lo, hi = 0, limit + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if prefix_work(mid, window) >= work:
            hi = mid
        else:
            lo = mid + 1
    return lo


def run_work(start: int, n: int, bounds: Sequence[int], window: Window) -> int:
    """Work of global tokens [start, start + n), which may cover several documents."""
    end = start + n
    d = bisect_right(bounds, start) - 1
    total = 0
    while start < end:
        lo, stop = bounds[d], min(end, bounds[d + 1])
        total += piece_work(start - lo, stop - lo, window)
        start, d = stop, d + 1
    return total


def piece_work(lo: int, hi: int, window: Window) -> int:
    """Work of document offsets [lo, hi) (a :class:`TiledWindow`: of that one run)."""
    if isinstance(window, TiledWindow):
        return window.piece_work(lo, hi)
    return prefix_work(hi, window) - prefix_work(lo, window)


def group_units(
    whole: Iterable[int], bounds: Sequence[int], works: Sequence[int], limit: float, work_limit: float
) -> list[list[int]]:
    """Consecutive whole documents grouped into units ``[start, tokens, work]`` of at most ``limit``
    tokens and ``work_limit`` work (a document over either is a unit alone)."""
    units: list[list[int]] = []
    end = tokens = work = -1
    unit: list[int] | None = None
    for d in whole:
        start, n, w = bounds[d], bounds[d + 1] - bounds[d], works[d]
        if start == end and tokens + n <= limit and work + w <= work_limit:
            tokens, work = tokens + n, work + w
            assert unit is not None  # start == end: a unit is open
            unit[1], unit[2] = tokens, work
        else:
            unit = [start, n, w]
            units.append(unit)
            tokens, work = n, w
        end = start + n
    return units


def finish_runs(slots: list[Slot], bounds: Sequence[int]) -> tuple[Runs, ...]:
    """Each slot's runs: those of documents no other slot holds first, then those touching a
    document another slot holds too; each group by ascending start, touching runs merged. (Only
    the first and last document of a run can be shared: the ones between lie wholly inside it.)"""
    holders: dict[int, set[int]] = {}
    ends = []
    for r, slot in enumerate(slots):
        for start, n, _ in slot.runs:
            first, last = bisect_right(bounds, start) - 1, bisect_right(bounds, start + n - 1) - 1
            holders.setdefault(first, set()).add(r)
            holders.setdefault(last, set()).add(r)
            ends.append((first, last))
    out = []
    it = iter(ends)
    for slot in slots:
        keyed = sorted(
            (len(holders[a]) > 1 or len(holders[b]) > 1, start, n) for (start, n, _), (a, b) in zip(slot.runs, it)
        )
        runs: list[list[int]] = []
        group = None
        for shared, start, n in keyed:
            if runs and shared == group and runs[-1][0] + runs[-1][1] == start:
                runs[-1][1] += n
            else:
                runs.append([start, n])
            group = shared
        out.append(tuple((s, n) for s, n in runs))
    return tuple(out)


def hull_rows(runs_per_slot: Sequence[Iterable[tuple[int, int]]], bounds: Sequence[int]) -> int:
    """Key rows the ring ships per forward without a window: per ordered slot pair (q, s) the span
    of s's local rows from the first to the last of its document sub-runs that start before a
    sub-run q holds of the same document (what ``build_plan``'s hulls cover)."""
    ring = len(runs_per_slot)
    held: dict[int, list[tuple[int, int, int, int]]] = {}  # doc -> (slot, start, local, local end)
    for r, runs in enumerate(runs_per_slot):
        local = 0
        for start, n in runs:
            end = start + n
            first, last = bisect_right(bounds, start) - 1, bisect_right(bounds, end - 1) - 1
            # only a run's first and last document can be shared: the others lie inside it
            for d in {first, last}:
                pos, stop = max(start, bounds[d]), min(end, bounds[d + 1])
                held.setdefault(d, []).append((r, pos, local + pos - start, local + stop - start))
            local += n
    lo: list[list[float]] = [[math.inf] * ring for _ in range(ring)]
    hi = [[-1] * ring for _ in range(ring)]
    for pieces in held.values():
        if len({p[0] for p in pieces}) < 2:
            continue
        last_pos: dict[int, int] = {}
        for r, pos, _, _ in pieces:
            last_pos[r] = max(last_pos.get(r, -1), pos)
        for q, q_last in last_pos.items():
            for s, pos, first, stop in pieces:
                if s != q and pos < q_last:
                    lo[q][s], hi[q][s] = min(lo[q][s], first), max(hi[q][s], stop)
    # lo[q][s] is set (an int) together with hi[q][s], so every term is an int; lo's float is only its inf marker
    return sum(hi[q][s] - lo[q][s] for q in range(ring) for s in range(ring) if hi[q][s] >= 0)  # type: ignore[misc]


def check_sizes(seq_len: int, ring: int) -> None:
    if ring < 1 or seq_len <= 0 or seq_len % (2 * ring) != 0:
        raise ValueError(
            f"the balanced/zigzag layout needs a sequence length that is a positive multiple of "
            f"2 x ring = {2 * ring}; got seq_len={seq_len}, ring={ring}: pad the sequence to "
            f"{max(1, -(-seq_len // (2 * ring))) * 2 * ring} tokens"
        )


def check_bounds(bounds: Sequence[int], seq_len: int, ring: int, window: Window) -> None:
    check_sizes(seq_len, ring)
    if type(window) is int and window < 1:
        raise ValueError(f"window must be >= 1 or None; got {window}")
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len:
        raise ValueError(
            f"document boundaries must start at 0 and end at seq_len={seq_len}; got "
            f"{tuple(bounds[:3])}...{tuple(bounds[-2:])} ({len(bounds)} entries)"
        )
    if not all(a < b for a, b in zip(bounds, bounds[1:])):
        i = next(i for i in range(len(bounds) - 1) if bounds[i + 1] <= bounds[i])
        raise ValueError(
            f"document boundaries must be strictly increasing; got bounds[{i}]={bounds[i]} and "
            f"bounds[{i + 1}]={bounds[i + 1]} (empty documents are not allowed)"
        )
