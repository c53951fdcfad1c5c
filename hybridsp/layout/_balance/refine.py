"""The plan's exact work for a windowed layout and a last local search on it (:mod:`hybridsp.layout._balance.tries`).

Pure Python (no torch). :func:`plan_work` counts, per ring slot, the cells ``build_plan``'s pieces
compute for a causal sliding window (Note [tiled work] in :mod:`hybridsp.layout._balance.work`):
every sub-run of a slot (its runs cut at document boundaries) in tiles of ``tile`` rows from its
start, each tile against every sub-run of the same document any slot holds, trimmed to what is
visible (a causal square counts its triangle, anything else its rectangle); the plan's merging of
pieces keeps their cells. ``tests/layout/test_balanced_windows.py`` checks it equals
``BlockPlan.work``.

Note [tile refine]. At R = 8 a slot holds S / R = 2,048 tokens, four 512-row tiles, and a run's
first tile costs about a quarter of a later one, so where runs start decides a slot's work more
than the tries' additive measure sees: no try came within 3% of the mean on some lognormal packs
(worst plan 1.08 at W = 512). :func:`refine` then trades tokens between the busiest slot and the
lightest: the busiest gives the head or tail ``d`` tokens of one of its sub-runs and takes as many
from an end of one of the other's, for ``d`` of a few sizes, keeping the exchange that lowers the
larger of the two slots' exact work most, until none lowers the busiest slot or the evaluation
budget is spent. Token counts stay exact; the rows shipped may grow (it runs only when no try is
balanced, where the layout with the smallest busiest slot wins anyway). The search is local and
its optimum depends on where it starts, so it runs from the ``REFINE_STARTS`` (3) least busy tries
in turn (``_refined`` in :mod:`hybridsp.layout._balance.tries`; the later ones with a third of the
evaluations), keeping the best and stopping at the first within ACCEPT. From the least busy try
alone bench_balance_windows' 30 packs at W = 512, R = 8 reached 1.071 worst (seeds 14, 19, 22 at
1.055, 1.071, 1.056, no improving swap left); the second or third least busy start reaches
1.005-1.04 on them: worst plan max/mean 1.071 -> 1.036, mean 1.024 -> 1.017, host time per row
88 -> 96 ms (W = 2048, R = 8: 1.144 -> 1.119; at W = 512, R = 2 and 4 nearly every pack has a
balanced try, no refine).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence

from hybridsp.layout._balance.work import Runs, Slot, TiledWindow, finish_runs

REFINE_SIZES = (512, 256, 128, 64, 16)  # tokens one exchange moves each way (and whole sub-runs)
REFINE_EVALS = 2500  # slot evaluations one refine may spend
REFINE_PARTNERS = 3  # the lightest slots the busiest trades with

Pieces = list[tuple[int, int]]  # one slot's (global start, length) pieces while exchanging
SubRuns = list[tuple[int, int, int]]  # one slot's (document, global start, length) sub-runs
Held = dict[int, list[tuple[int, int]]]  # per document, the (global start, length) sub-runs every slot holds
# (evaluations spent, y, x's pieces, y's pieces), y and the pieces None when no exchange was found
Exchange = tuple[int, None, None, None] | tuple[int, int, Pieces, Pieces]


def _sub_runs(runs: Iterable[tuple[int, int]], bounds: Sequence[int]) -> SubRuns:
    """``(doc, start, length)`` of a slot's runs cut at document boundaries, in run order."""
    out: SubRuns = []
    for start, n in runs:
        d, pos, end = bisect_right(bounds, start) - 1, start, start + n
        while pos < end:
            stop = min(end, bounds[d + 1])
            out.append((d, pos, stop - pos))
            pos, d = stop, d + 1
    return out


def _slot_cells(subs: SubRuns, held: Held, window: int, tile: int) -> int:
    """Cells of one slot's sub-runs against the sub-runs ``held`` (per document) by every slot."""
    total = 0
    for d, qs, ql in subs:
        keys = held[d]
        for t in range(0, ql, tile):
            n, g = min(tile, ql - t), qs + t
            for ks, m in keys:
                if ks >= g + n or ks + m <= g - window + 1:
                    continue
                shift = g - ks
                lo, hi = max(-shift, 1 - m), min(window - 1 - shift, n - 1)
                if lo > hi:
                    continue
                r0, r1, c0, c1 = max(0, lo), min(n, hi + m), max(0, -hi), min(m, n - lo)
                if r0 >= r1 or c0 >= c1:
                    continue
                rows, cols, lo, hi = r1 - r0, c1 - c0, lo - (r0 - c0), hi - (r0 - c0)
                if rows == cols and lo == 0 and hi >= rows - 1 and rows > 1:
                    total += rows * (rows + 1) // 2  # a causal square (a 1 x 1 one is full: the same)
                else:
                    total += rows * cols
    return total


def _held(per_slot: Iterable[SubRuns]) -> Held:
    held: Held = {}
    for subs in per_slot:
        for d, start, n in subs:
            held.setdefault(d, []).append((start, n))
    return held


def plan_work(
    runs_per_slot: Iterable[Iterable[tuple[int, int]]], bounds: Sequence[int], window: TiledWindow
) -> list[int]:
    """Per slot, the cells ``build_plan`` computes for causal sliding window ``window`` (a
    :class:`~hybridsp.layout._balance.work.TiledWindow`) on these runs (Note [tiled work])."""
    per_slot = [_sub_runs(runs, bounds) for runs in runs_per_slot]
    held = _held(per_slot)
    return [_slot_cells(subs, held, window.window, window.tile) for subs in per_slot]


def refine(
    runs_per_slot: tuple[Runs, ...], bounds: Sequence[int], window: TiledWindow, evals: int = REFINE_EVALS
) -> tuple[tuple[Runs, ...], list[int]]:
    """``(runs, work)``: the layout after token exchanges that lower its busiest slot's exact
    work (Note [tile refine]), and each slot's :func:`plan_work`."""
    w, tile = window.window, window.tile
    pieces = [[(s, n) for _, s, n in _sub_runs(runs, bounds)] for runs in runs_per_slot]
    runs = runs_per_slot
    work = plan_work(runs, bounds, window)
    ring = len(pieces)
    while evals > 0:
        x = max(range(ring), key=work.__getitem__)
        found = _exchange(pieces, work, x, bounds, w, tile, evals)
        evals -= found[0]
        if found[1] is None:
            break
        trial = list(pieces)
        trial[x], trial[found[1]] = _merged(found[2]), _merged(found[3])
        slots = []
        for p in trial:
            slot = Slot()
            for s, n in p:
                slot.take(s, n, 0)
            slots.append(slot)
        new_runs = finish_runs(slots, bounds)
        new_work = plan_work(new_runs, bounds, window)
        if _key(new_work) >= _key(work):
            break
        pieces, runs, work = trial, new_runs, new_work
    return runs, work


def _exchange(
    pieces: list[Pieces], work: list[int], x: int, bounds: Sequence[int], w: int, tile: int, evals: int
) -> Exchange:
    """``(evaluations spent, y, x's pieces, y's pieces)``: the first exchange between the busiest
    slot ``x`` and one of the lightest that lowers the busiest slot's share (y None: none)."""
    spent = 0
    for y in sorted(range(len(pieces)), key=work.__getitem__)[:REFINE_PARTNERS]:
        if y == x:
            continue
        held = _held([_sub_runs(p, bounds) for r, p in enumerate(pieces) if r not in (x, y)])
        others = [v for r, v in enumerate(work) if r not in (x, y)]
        now = _key(work)
        for size in REFINE_SIZES:
            for gx, lx, rest_x in _ends(pieces[x], size):
                for gy, ly, rest_y in _ends(pieces[y], lx):
                    if ly != lx:
                        continue
                    if spent >= evals:
                        return spent, None, None, None
                    spent += 2
                    new_x, new_y = rest_x + [(gy, ly)], rest_y + [(gx, lx)]
                    sx, sy = _sub_runs(_merged(new_x), bounds), _sub_runs(_merged(new_y), bounds)
                    both = dict(held)
                    for d, s, n in sx + sy:
                        both[d] = both.get(d, []) + [(s, n)]
                    cx, cy = _slot_cells(sx, both, w, tile), _slot_cells(sy, both, w, tile)
                    if _key([cx, cy, *others]) < now:
                        return spent, y, new_x, new_y
    return spent, None, None, None


def _key(work: Sequence[int]) -> tuple[float, ...]:
    """The slots' shares of the work, largest first: lower is better (ties at the top move on)."""
    total = sum(work)
    return tuple(sorted((v / total for v in work), reverse=True))


def _ends(pieces: Pieces, size: int) -> Iterator[tuple[int, int, Pieces]]:
    """``(start, length, the other pieces)`` for the head and the tail ``size`` tokens (or the
    whole piece, when not longer) of every piece."""
    for i, (s, n) in enumerate(pieces):
        others = pieces[:i] + pieces[i + 1 :]
        if n <= size:
            yield s, n, others
            continue
        yield s, size, others + [(s + size, n - size)]
        yield s + n - size, size, others + [(s, n - size)]


def _merged(pieces: Iterable[tuple[int, int]]) -> Pieces:
    """Pieces by start, touching ones joined."""
    out: list[list[int]] = []
    for s, n in sorted(pieces):
        if out and out[-1][0] + out[-1][1] == s:
            out[-1][1] += n
        else:
            out.append([s, n])
    return [(s, n) for s, n in out]
