"""Document-balanced token layout: which global tokens each ring slot holds for one packed row.

Pure Python (no torch), computed on the host once per batch row from its document boundaries
``bounds = (0, b1, ..., S)`` (the row's ``cu_seqlens``). Work model: attention is causal inside
each document; the token at offset ``p`` of its document attends to ``min(p + 1, W)`` keys
(``W`` = window, unbounded if None); a slot's work is the sum over its tokens. Every slot holds
exactly ``T = S / R`` tokens. ``W*`` = total work / R.

Note [balanced layout]. One *try* (:func:`design_slot_runs`):

1. **Split documents**: each document except the largest with >= ``T`` tokens or work >=
   ``split_share`` x ``W*`` goes by per-document zigzag (TransformerEngine THD's split) to ``k``
   slots, ``k`` (2..R) just large enough that each share is under both: ``2k`` chunks, the i-th
   slot takes chunks ``i`` and ``2k-1-i`` (equal tokens +-1 and, without a window, equal work);
   most work first, to the slots with the fewest tokens.
2. **Whole units**: the other documents except the largest, in consecutive groups of at most
   ``T / 8`` tokens and ``0.02 W*`` work, go whole to one slot, most work first (LPT), keeping
   ``reserve`` (3/4) of the largest document's even share of every slot free: to the slot whose
   *projected* work (its work + its free tokens x the mean work per token not placed yet) it
   brings closest to the mean. A unit that fits nowhere is cut over the slots with the most
   free tokens (the only way a short document is split).
3. **The balancer**: the largest document fills every slot's free tokens (token counts exact).
   *Nested* (zigzag-like): from the outside in (the slot whose target is farthest from that
   document's mean work per token outermost), each slot takes a head and a tail piece, the
   head size bisected so that the slot's work is closest to ``W*``; the innermost takes the
   middle. *Contiguous*: split documents go in consecutive equal pieces (the last, densest, to
   the slot lacking work most) and the balancer in consecutive pieces in position order, the
   slot that needs the most work per free token taking the latest piece; a local search
   (:func:`_repair`) moves or swaps whole runs between slots (the balancer's pieces follow the
   free tokens) until the busiest slot is within 1.5% of ``W*``, then while it stays there
   lowers the rows the pieces ship. A contiguous piece is read only by the holders of later
   pieces, where a nested tail reads the whole middle: about half the K/V rows.

A third kind of try, *split as needed* (:func:`_build_greedy`): units most work first, each
whole to the slot whose projected work lacks the most; a document with work >= ``split_min`` x
``W*`` that would push that slot over ``W*`` leaves it only a tail (sized to fill it) and goes
on as its head.

:func:`balanced_slot_runs` runs the tries of :data:`TRIES` (contiguous and nested balancer for
split thresholds none / 0.5 / 0.35 / 0.25 / 0.15 / 0.1 ``W*`` and reserves 1/4 .. 1, two split
as needed) and keeps, among those whose busiest slot is within ``ACCEPT`` (3%) of the mean, the
one whose plan ships the fewest K/V rows (:func:`hull_rows`, what ``build_plan``'s hulls
cover), else the best balanced. Tries stop after 4,000 documents' worth (at least two) and the
local search of all tries shares min(``REPAIR_EVALS``, 100,000 / documents) layout
evaluations, so many-document rows stay linear and fast. ``benchmarks/bench_balance.py``
measures the choices: on lognormal packs (S = 16,384) the rows shipped fell from 1.33 / 1.57 /
1.81 x zigzag's at R = 2 / 4 / 8 (first nested try within 1% balance) to 1.00 / 1.25 / 1.56 x,
busiest slot <= 1.03 x the mean. The remaining gap is mostly forced: a document with k x
``W*`` work must spread over >= k slots and each holder reads all of it before its last
token, where zigzag keeps it on fewer (busier) slots.

With one document or R = 1 the result is exactly the zigzag layout (whose middle slot keeps its
two touching chunks). Otherwise a slot's runs come in two groups, each by ascending global
start with touching runs merged: the documents it holds whole, then pieces of documents other
slots hold too. A sender ships the hull of the local K/V rows a peer reads, and peers read only
shared documents, so this order tightens the hull (-6% rows at R = 4 on lognormal packs, -30%
with 100 documents at R = 8, against plain ascending order). Local offsets are the running sum
of the lengths. Time per try: O(n log n + n R) for n documents plus O(R log S) (plus the shared
local-search budget); 8,000 documents at S = 65,536, R = 4: ~9 ms CPU, a lognormal pack of
S = 16,384 at R = 8 (22 tries): ~17 ms, on a loaded 2-core machine.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right

DEFAULT_SPLIT_SHARE = math.inf
DEFAULT_SPLIT_LENGTH = 1.0
DEFAULT_UNIT_SHARE = 0.125
DEFAULT_UNIT_WORK = 0.02
DEFAULT_RESERVE = 0.75
SPLITS = ((math.inf, 0.75), (math.inf, 0.5), (0.5, 0.75), (0.5, 0.5), (0.35, 0.75), (0.35, 0.5),
           (0.35, 1.0), (0.25, 0.5), (0.15, 0.5), (0.1, 0.25))
# the tries of balanced_slot_runs, (balancer, split_share, reserve) or ("greedy", split_min, 0):
# nested / contiguous balancer for every (split_share, reserve) of SPLITS, interleaved, fewest
# split documents first, and two split-as-needed tries
TRIES = tuple(t for (share, reserve) in SPLITS[:2] for t in (("contiguous", share, reserve),
                                                              ("nested", share, reserve)))
TRIES += (("greedy", 0.5, 0.0), ("greedy", 1.0, 0.0))
TRIES += tuple(t for (share, reserve) in SPLITS[2:] for t in (("contiguous", share, reserve),
                                                               ("nested", share, reserve)))
ACCEPT = 1.03  # a try counts as balanced when its busiest slot has at most this x the mean work
REPAIR_EVALS = 3000  # layouts the contiguous tries of one call may evaluate in all (at most)
REPAIR_DOCUMENTS = 100_000  # ... and at most this / the number of documents
REPAIR_CANDIDATES = 6
REPAIR_SLACK = 0.015
ORDER_SLACK = 0.01
TRY_DOCUMENTS = 4000  # tries stop once they have handled this many documents (at least 2 tries)

Runs = tuple[tuple[int, int], ...]


def zigzag_slot_runs(seq_len: int, ring: int) -> tuple[Runs, ...]:
    """Slot r holds chunks r and 2R-1-r of 2R equal chunks: ((r c, c), ((2R-1-r) c, c)), c = S / 2R."""
    _check_sizes(seq_len, ring)
    chunk = seq_len // (2 * ring)
    return tuple(((r * chunk, chunk), ((2 * ring - 1 - r) * chunk, chunk)) for r in range(ring))


def balanced_slot_runs(
    bounds: tuple[int, ...], seq_len: int, ring: int, *, window: int | None = None
) -> tuple[Runs, ...]:
    """Per ring slot, its tokens as runs ``(global_start, length)`` (whole documents, then shared).

    ``bounds``: the row's document boundaries ``0 = b0 < b1 < ... < bn = seq_len``; ``seq_len``
    a multiple of ``2 * ring``. Every slot holds exactly ``seq_len // ring`` tokens; the runs of
    all slots partition ``range(seq_len)``. One document gives the zigzag layout. The layout of
    the :data:`TRIES` (as many as ``TRY_DOCUMENTS`` allows) that ships the fewest K/V rows
    (:func:`hull_rows`) among those whose busiest slot has <= ``ACCEPT`` x the mean work, else
    the best balanced one.
    """
    _check_bounds(bounds, seq_len, ring, window)
    if len(bounds) == 2 or ring == 1:
        return zigzag_slot_runs(seq_len, ring)
    docs = _documents(bounds, window)
    best_key, best = None, None
    budget = [min(REPAIR_EVALS, REPAIR_DOCUMENTS // len(docs[1]))]
    for kind, share, reserve in TRIES[:max(2, TRY_DOCUMENTS // len(docs[1]))]:
        if kind == "greedy":
            slots = _build_greedy(docs, seq_len, ring, window, split_min=share)
        else:
            slots = _build(docs, seq_len, ring, window, split_share=share, reserve=reserve,
                           contiguous=kind == "contiguous", budget=budget)
        works = [slot.work for slot in slots]
        ratio = max(works) * ring / sum(works)
        runs = _finish(slots, bounds)
        key = (0, hull_rows(runs, bounds), ratio) if ratio <= ACCEPT else (1, ratio, 0)
        if best_key is None or key < best_key:
            best_key, best = key, runs
        if key[:2] == (0, 0):
            break
    return best


def design_slot_runs(
    bounds: tuple[int, ...], seq_len: int, ring: int, *, window: int | None = None,
    split_share: float = DEFAULT_SPLIT_SHARE, split_length: float = DEFAULT_SPLIT_LENGTH,
    unit_share: float = DEFAULT_UNIT_SHARE, unit_work: float = DEFAULT_UNIT_WORK,
    reserve: float = DEFAULT_RESERVE, balancer: bool = True, spread_all: bool = False,
    contiguous: bool = False, greedy: float | None = None,
) -> tuple[Runs, ...]:
    """One try with explicit knobs (Note [balanced layout]; for benchmarks of the choices).

    ``split_share`` / ``split_length``: documents with work >= split_share x W* or >=
    split_length x S/R tokens are split (0: all of >= 2R tokens; inf: none) over as many slots
    as keep each share under both (``spread_all``: over every slot, as TransformerEngine THD).
    ``unit_share`` / ``unit_work``: whole documents travel in consecutive groups of at most this
    x S/R tokens and x W* work (0: one per document). ``reserve``: the share of the largest
    document's even share kept free in every slot. ``balancer=False``: no balancer (split
    documents go over every slot; units that fit nowhere are cut to make token counts exact).
    ``contiguous``: the balancer (and split documents) in consecutive pieces, whole runs moved
    between slots to balance. ``greedy``: instead the split-as-needed try with that split_min.
    """
    _check_bounds(bounds, seq_len, ring, window)
    if len(bounds) == 2 or ring == 1:
        return zigzag_slot_runs(seq_len, ring)
    docs = _documents(bounds, window)
    if greedy is not None:
        return _finish(_build_greedy(docs, seq_len, ring, window, split_min=greedy, unit_share=unit_share,
                                     unit_work=unit_work), bounds)
    slots = _build(docs, seq_len, ring, window, split_share=split_share,
                   split_length=split_length, unit_share=unit_share, unit_work=unit_work,
                   reserve=reserve, balancer=balancer, spread_all=spread_all, contiguous=contiguous,
                   budget=[REPAIR_EVALS])
    return _finish(slots, bounds)


def slot_work(runs_per_slot, bounds: tuple[int, ...], window: int | None = None) -> list[int]:
    """Cells per slot under the work model (sum over its tokens of min(offset + 1, W)).

    O(m log n) for m runs and n documents (a bisection per run, then a walk over the documents
    the run covers).
    """
    return [sum(_run_work(start, n, bounds, window) for start, n in runs) for runs in runs_per_slot]


# --------------------------------------------------------------------------------------------


def _documents(bounds, window) -> tuple:
    """(bounds, lengths, works) of the row's documents."""
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if window is None:
        works = [n * (n + 1) // 2 for n in lengths]
    else:
        works = [_prefix_work(n, window) for n in lengths]
    return bounds, lengths, works


def _build(docs, seq_len: int, ring: int, window, *, split_share: float, reserve: float,
           split_length: float = DEFAULT_SPLIT_LENGTH, unit_share: float = DEFAULT_UNIT_SHARE,
           unit_work: float = DEFAULT_UNIT_WORK, balancer: bool = True, spread_all: bool = False,
           contiguous: bool = False, budget: list | None = None):
    """The slots (runs unsorted, exact tokens and work) of one design (Note [balanced layout])."""
    bounds, lengths, works = docs
    total = sum(works)
    mean_work, capacity = total / ring, seq_len // ring
    largest = max(range(len(lengths)), key=lengths.__getitem__) if balancer else -1
    room = capacity - (int(reserve * lengths[largest] / ring) if balancer else 0)
    min_work, max_length = split_share * mean_work, split_length * capacity
    # work grows with length: "work >= min_work or length >= max_length" is one length threshold
    by_length = math.ceil(min(max_length, seq_len + 1))
    cut = max(2 * ring, min(_shortest_with_work(min_work, seq_len, window), by_length))
    split = [d for d, n in enumerate(lengths) if n >= cut and d != largest]
    whole = [d for d, n in enumerate(lengths) if n < cut and d != largest]
    slots = [_Slot() for _ in range(ring)]
    for d in sorted(split, key=works.__getitem__, reverse=True):
        spread = spread_all or not balancer
        k = ring if spread else _pieces(works[d], lengths[d], min_work, max_length, ring)
        _split_document(slots, bounds, d, k, total / seq_len, room, capacity, window, contiguous)
    units = _group_units(whole, bounds, works, unit_share * capacity, unit_work * mean_work)
    left_work = sum(u[2] for u in units) + (works[largest] if balancer else 0)
    left_tokens = sum(u[1] for u in units) + (lengths[largest] if balancer else 0)
    for start, n, work in sorted(units, key=lambda u: -u[2]):
        rho = left_work / left_tokens  # what a free token will carry on average
        _place_unit(slots, bounds, start, n, work, rho, room, capacity, window)
        left_work, left_tokens = left_work - work, left_tokens - n
    if balancer and contiguous:
        order = _repair(slots, bounds[largest], lengths[largest], mean_work, capacity, window,
                        [0] if budget is None else budget)
        _place_contiguous(slots, order, bounds[largest], mean_work, capacity, window)
    elif balancer:
        _place_balancer(slots, bounds[largest], lengths[largest], mean_work, capacity, window)
    return slots


class _Slot:
    """One ring slot while it is built: its runs, tokens and work so far."""

    __slots__ = ("runs", "tokens", "work")

    def __init__(self):
        self.runs: list[tuple[int, int]] = []
        self.tokens = 0
        self.work = 0

    def take(self, start: int, n: int, work: int) -> None:
        if n > 0:
            self.runs.append((start, n, work))
            self.tokens += n
            self.work += work


def _prefix_work(x: int, window: int | None) -> int:
    """Work of the first ``x`` tokens of a document: sum_{p < x} min(p + 1, W)."""
    if window is None or x <= window:
        return x * (x + 1) // 2
    return window * (window + 1) // 2 + (x - window) * window


def _shortest_with_work(work: float, limit: int, window: int | None) -> int:
    """The smallest document length (at most ``limit + 1``) whose work is >= ``work``."""
    lo, hi = 0, limit + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _prefix_work(mid, window) >= work:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _run_work(start: int, n: int, bounds, window: int | None) -> int:
    """Work of global tokens [start, start + n), which may cover several documents."""
    end = start + n
    d = bisect_right(bounds, start) - 1
    total = 0
    while start < end:
        lo, stop = bounds[d], min(end, bounds[d + 1])
        total += _prefix_work(stop - lo, window) - _prefix_work(start - lo, window)
        start, d = stop, d + 1
    return total


def _piece_work(lo: int, hi: int, window: int | None) -> int:
    """Work of document offsets [lo, hi)."""
    return _prefix_work(hi, window) - _prefix_work(lo, window)


def _pieces(work: int, n: int, min_work: float, max_length: float, ring: int) -> int:
    """Over how many slots (2..R) a split document goes: enough that each slot's share has less
    than ``min_work`` work and ``max_length`` tokens."""
    by_work = math.ceil(work / min_work) if min_work > 0 else ring
    by_length = math.ceil(n / max_length) if max_length > 0 else ring
    return max(2, min(ring, max(by_work, by_length)))


def _split_document(slots, bounds, d: int, k: int, rho: float, room: int, capacity: int, window,
                    contiguous: bool = False) -> None:
    """Per-document zigzag of document ``d`` over the k (or more, up to R) slots with the fewest
    tokens that stay within ``room`` (else ``capacity``), taken in order of projected work (work
    - ``rho`` x tokens, lowest first); cut like a unit if no k slots fit."""
    start, n = bounds[d], bounds[d + 1] - bounds[d]
    by_tokens = sorted(slots, key=lambda s: (s.tokens, s.work))
    for limit in (room, capacity):
        for count in range(k, len(slots) + 1):
            share = -(-n // count) + 1
            chosen = [s for s in by_tokens if s.tokens + share <= limit][:count]
            if len(chosen) == count:
                chosen.sort(key=lambda s: s.work - rho * s.tokens)
                if contiguous:
                    _consecutive(chosen, start, n, window)
                else:
                    _head_tail(chosen, start, n, window)
                return
    _cut_unit(slots, bounds, start, n, room, capacity, window)


def _head_tail(chosen: list[_Slot], start: int, n: int, window) -> None:
    """Per-document zigzag over the k chosen slots: 2k chunks of n // 2k tokens, pair i = chunks i
    and 2k-1-i. Without a window every pair has the same work (+- one token's) and pair i goes to
    the i-th slot; with one, pairs go heaviest first (the head pair, holding the document's cheap
    first W tokens, to the last chosen slot). The n % 2k surplus tokens go one at a time to the
    slot with the fewest tokens (its head chunk, then its tail chunk), so that with k = R split
    documents alone keep the slots within one token."""
    k = len(chosen)
    base, extra = divmod(n, 2 * k)
    order = list(range(k))  # order[j]: the pair the j-th chosen slot takes
    if window is not None:
        order.sort(key=lambda i: -(_piece_work(i * base, (i + 1) * base, window)
                                   + _piece_work((2 * k - 1 - i) * base, (2 * k - i) * base, window)))
    sizes = [base] * (2 * k)
    tokens = [slot.tokens + 2 * base for slot in chosen]
    for _ in range(extra):
        j = min(range(k), key=tokens.__getitem__)
        i = order[j]
        sizes[i if sizes[i] == base else 2 * k - 1 - i] += 1
        tokens[j] += 1
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    for slot, i in zip(chosen, order):
        for c in (i, 2 * k - 1 - i):
            lo, hi = offsets[c], offsets[c + 1]
            slot.take(start + lo, hi - lo, _piece_work(lo, hi, window))


def _consecutive(chosen: list[_Slot], start: int, n: int, window) -> None:
    """The document [start, start + n) in len(chosen) consecutive pieces of equal tokens (+-1),
    the last (most work) to the first chosen slot (the one that lacks work most)."""
    k = len(chosen)
    base, extra = divmod(n, k)
    cuts = [i * base + min(i, extra) for i in range(k + 1)]
    for slot, lo, hi in zip(chosen, cuts[::-1][1:], cuts[::-1]):
        slot.take(start + lo, hi - lo, _piece_work(lo, hi, window))


def _group_units(whole: list[int], bounds, works: list[int], limit: float, work_limit: float) -> list:
    """Consecutive whole documents grouped into units ``[start, tokens, work]`` of at most ``limit``
    tokens and ``work_limit`` work (a document over either is a unit alone)."""
    units: list[list[int]] = []
    end = tokens = work = -1
    unit = None
    for d in whole:
        start, n, w = bounds[d], bounds[d + 1] - bounds[d], works[d]
        if start == end and tokens + n <= limit and work + w <= work_limit:
            tokens, work = tokens + n, work + w
            unit[1], unit[2] = tokens, work
        else:
            unit = [start, n, w]
            units.append(unit)
            tokens, work = n, w
        end = start + n
    return units


def _place_unit(slots, bounds, start: int, n: int, work: int, rho: float, room: int, capacity: int,
                window) -> None:
    """Give the unit whole to the slot that most lacks work (projected: its free tokens at ``rho``
    work each), among those with room; else cut it over the slots with the most free tokens."""
    best, best_key = None, None
    for slot in slots:
        if slot.tokens + n <= room:
            # projection: the slot's work if its free tokens got ``rho`` work each; the unit
            # changes it by delta: to the lowest projection if delta > 0, else the highest
            key = (work - rho * n) * (slot.work + rho * (capacity - slot.tokens))
            if best is None or key < best_key:
                best, best_key = slot, key
    if best is not None:
        best.take(start, n, work)
        return
    _cut_unit(slots, bounds, start, n, room, capacity, window)


def _cut_unit(slots, bounds, start: int, n: int, room: int, capacity: int, window) -> None:
    """Cut [start, start + n) into consecutive pieces filling the slots with the most free tokens
    (up to ``room``, then up to ``capacity``)."""
    for limit in (room, capacity):
        for slot in sorted(slots, key=lambda s: s.tokens):
            take = min(n, limit - slot.tokens)
            if take > 0:
                slot.take(start, take, _run_work(start, take, bounds, window))
                start, n = start + take, n - take


def _place_balancer(slots, start: int, n: int, mean_work: float, capacity: int, window) -> None:
    """The largest document fills every slot's free tokens, head + tail pieces nested from the
    outside in, each slot's head size bisected so its work hits ``mean_work``."""
    rho = _prefix_work(n, window) / n
    need = [(capacity - s.tokens, mean_work - s.work, s) for s in slots]
    # the slot whose target is farthest from the average work per token takes the widest range
    need.sort(key=lambda t: -abs(t[1] - rho * t[0]) / max(t[0], 1))
    lo, hi = 0, n
    for free, target, slot in need:
        head = _best_head(lo, hi, free, target, window)
        slot.take(start + lo, head, _piece_work(lo, lo + head, window))
        tail = free - head
        slot.take(start + hi - tail, tail, _piece_work(hi - tail, hi, window))
        lo, hi = lo + head, hi - tail


def _best_head(lo: int, hi: int, free: int, target: float, window) -> int:
    """Head size h in [0, free] whose head [lo, lo+h) + tail [hi-free+h, hi) work is closest to
    ``target`` (that work does not increase with h: bisection)."""

    def work(h: int) -> int:
        return _piece_work(lo, lo + h, window) + _piece_work(hi - free + h, hi, window)

    left, right = 0, free  # smallest h with work(h) <= target, or free
    while left < right:
        mid = (left + right) // 2
        if work(mid) <= target:
            right = mid
        else:
            left = mid + 1
    if left > 0 and abs(work(left - 1) - target) <= abs(work(left) - target):
        return left - 1
    return left


def _finish(slots: list[_Slot], bounds) -> tuple[Runs, ...]:
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
        keyed = sorted((len(holders[a]) > 1 or len(holders[b]) > 1, start, n)
                       for (start, n, _), (a, b) in zip(slot.runs, it))
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


def _place_contiguous(slots, order, start: int, mean_work: float, capacity: int, window) -> None:
    """The largest document fills the slots' free tokens in consecutive pieces, in ``order``
    improved by swapping neighbours while that lowers the busiest slot's work."""
    free = [capacity - slot.tokens for slot in slots]

    def busiest(order) -> float:
        a, most = 0, 0.0
        for i in order:
            most = max(most, slots[i].work + _piece_work(a, a + free[i], window))
            a += free[i]
        return most

    best = busiest(order)
    improved = True
    while improved:
        improved = False
        for j in range(len(order) - 1):
            trial = order[:j] + [order[j + 1], order[j]] + order[j + 2:]
            value = busiest(trial)
            if value < best:
                order, best, improved = trial, value, True
    # then smaller pieces earlier (a piece is read by every later holder) while balance allows
    allowed = max(best, mean_work * (1 + ORDER_SLACK))
    improved = True
    while improved:
        improved = False
        for j in range(len(order) - 1):
            if free[order[j + 1]] < free[order[j]]:
                trial = order[:j] + [order[j + 1], order[j]] + order[j + 2:]
                if busiest(trial) <= allowed:
                    order, improved = trial, True
    a = 0
    for i in order:
        slots[i].take(start + a, free[i], _piece_work(a, a + free[i], window))
        a += free[i]


def hull_rows(runs_per_slot, bounds: tuple[int, ...]) -> int:
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
    lo = [[math.inf] * ring for _ in range(ring)]
    hi = [[-1] * ring for _ in range(ring)]
    for pieces in held.values():
        if len({p[0] for p in pieces}) < 2:
            continue
        last = {}
        for r, pos, _, _ in pieces:
            last[r] = max(last.get(r, -1), pos)
        for q, q_last in last.items():
            for s, pos, first, stop in pieces:
                if s != q and pos < q_last:
                    lo[q][s], hi[q][s] = min(lo[q][s], first), max(hi[q][s], stop)
    return sum(hi[q][s] - lo[q][s] for q in range(ring) for s in range(ring) if hi[q][s] >= 0)


def _build_greedy(docs, seq_len: int, ring: int, window, *, slack: float = 0.0, split_min: float = 0.25,
                  unit_share: float = DEFAULT_UNIT_SHARE, unit_work: float = DEFAULT_UNIT_WORK):
    """The slots of one split-as-needed try: units most work first, each whole to the slot whose
    projected work lacks the most (dense units) or has the most (sparse ones); a document that
    would push that slot over the mean gives it just a tail and goes on as its head."""
    bounds, lengths, works = docs
    capacity, mean_work = seq_len // ring, sum(works) / ring
    limit = mean_work * (1 + slack)
    units = _group_units(range(len(lengths)), bounds, works, unit_share * capacity, unit_work * mean_work)
    big = split_min * mean_work
    heap = [(-w, start, n, w >= big and _single(bounds, start, n)) for start, n, w in units]
    heapq.heapify(heap)
    left_work, left_tokens = sum(works), seq_len
    slots = [_Slot() for _ in range(ring)]
    while heap:
        work, start, n, single = heapq.heappop(heap)
        work = -work
        rho = (left_work - work) / (left_tokens - n) if left_tokens > n else 0.0
        left_work, left_tokens = left_work - work, left_tokens - n
        dense = work >= rho * n
        fits = [s for s in slots if s.tokens + n <= capacity]
        projected = {id(s): s.work + rho * (capacity - s.tokens) for s in slots}
        if dense:
            slot = min((s for s in slots if s.tokens < capacity), key=lambda s: projected[id(s)])
            over = projected[id(slot)] + work - rho * n > limit
            if (over or slot.tokens + n > capacity) and single:
                x = _tail_cut(n, capacity - slot.tokens, mean_work - projected[id(slot)], rho, window)
                if x > 0:
                    tail = _piece_work(x, n, window)
                    slot.take(start + x, n - x, tail)
                    head = work - tail
                    heapq.heappush(heap, (-head, start, x, head >= big))
                    left_work, left_tokens = left_work + head, left_tokens + x
                    continue
            if slot.tokens + n <= capacity:
                slot.take(start, n, work)
                continue
        elif fits:
            max(fits, key=lambda s: projected[id(s)]).take(start, n, work)
            continue
        for slot in sorted(slots, key=lambda s: s.tokens):
            take = min(n, capacity - slot.tokens)
            if take > 0:
                slot.take(start, take, _run_work(start, take, bounds, window))
                start, n = start + take, n - take
    return slots


def _single(bounds, start: int, n: int) -> bool:
    """Whether [start, start + n) is (a prefix of) one document."""
    d = bisect_right(bounds, start) - 1
    return bounds[d] == start and start + n <= bounds[d + 1]


def _tail_cut(n: int, free: int, budget: float, rho: float, window) -> int:
    """Where the tail [x, n) of a document prefix of n tokens starts: the smallest x with n - x <=
    ``free`` and tail work - rho x tail tokens <= ``budget`` (0 < x < n), or 0 if none is smaller
    than n (cannot happen unless the budget is negative)."""

    def excess(x: int) -> float:
        return _piece_work(x, n, window) - rho * (n - x)

    low = max(1, n - free)
    if low >= n:
        return 0
    if excess(low) <= budget:
        return low
    left = max(low, min(n - 1, math.ceil(rho) - 1))  # the excess falls from here on
    right = n - 1
    if excess(right) > budget:
        return 0
    while left < right:
        mid = (left + right) // 2
        if excess(mid) <= budget:
            right = mid
        else:
            left = mid + 1
    return left


def _repair(slots, start: int, n: int, mean_work: float, capacity: int, window, budget: list) -> list:
    """Local search for a contiguous balancer: move or swap whole runs between one slot and the
    others; the balancer (the document at ``start`` of ``n`` tokens, not yet placed) fills the
    free tokens in consecutive pieces, the slot that needs the most work per free token last.
    First the busiest slot's work goes down to ``1 + REPAIR_SLACK`` x the mean, then the rows the
    pieces ship (a piece is read by every later holder) go down while it stays there.
    ``budget[0]``: layouts it may still evaluate (it spends them; candidates are each slot's
    ``REPAIR_CANDIDATES`` runs with the most work). Returns the balancer's slot order."""
    ring, allowed = len(slots), mean_work * (1 + REPAIR_SLACK)

    def layout(work, tokens):
        order = [i for i in range(ring) if tokens[i] < capacity]
        order.sort(key=lambda i: (mean_work - work[i]) / (capacity - tokens[i]))
        out, a, shipped = list(work), 0, 0
        for j, i in enumerate(order):
            free = capacity - tokens[i]
            out[i] += _piece_work(a, a + free, window)
            a += free
            shipped += free * (len(order) - 1 - j)
        return (max(max(out), allowed), shipped), out, order

    def candidates(i: int) -> list:
        return [None] + sorted(slots[i].runs, key=lambda run: -run[2])[:REPAIR_CANDIDATES]

    work = [s.work for s in slots]
    tokens = [s.tokens for s in slots]
    best, out, order = layout(work, tokens)
    while budget[0] > 0:
        if best[0] > allowed:
            h = out.index(max(out))
        else:  # the holder whose piece is read the most
            h = max(order, key=lambda i: (capacity - tokens[i]) * (len(order) - 1 - order.index(i)))
        found, mine = None, candidates(h)
        for t in range(ring):
            if t == h:
                continue
            theirs = candidates(t)
            budget[0] -= len(mine) * len(theirs)
            for u in mine:
                for v in theirs:
                    du = (u[1], u[2]) if u else (0, 0)
                    dv = (v[1], v[2]) if v else (0, 0)
                    if u is v or max(tokens[t] + du[0] - dv[0], tokens[h] - du[0] + dv[0]) > capacity:
                        continue
                    w2, t2 = list(work), list(tokens)
                    w2[h], w2[t] = w2[h] + dv[1] - du[1], w2[t] + du[1] - dv[1]
                    t2[h], t2[t] = t2[h] + dv[0] - du[0], t2[t] + du[0] - dv[0]
                    value = layout(w2, t2)[0]
                    if value < best and (found is None or value < found[0]):
                        found = (value, t, u, v, w2, t2)
        if found is None:
            break
        _, t, u, v, work, tokens = found
        if u:
            slots[h].runs.remove(u)
            slots[t].runs.append(u)
        if v:
            slots[t].runs.remove(v)
            slots[h].runs.append(v)
        best, out, order = layout(work, tokens)
    for i, s in enumerate(slots):
        s.work, s.tokens = work[i], tokens[i]
    return order


def _check_sizes(seq_len: int, ring: int) -> None:
    if ring < 1 or seq_len <= 0 or seq_len % (2 * ring) != 0:
        raise ValueError(
            f"the balanced/zigzag layout needs a sequence length that is a positive multiple of "
            f"2 x ring = {2 * ring}; got seq_len={seq_len}, ring={ring}: pad the sequence to "
            f"{max(1, -(-seq_len // (2 * ring))) * 2 * ring} tokens"
        )


def _check_bounds(bounds, seq_len: int, ring: int, window) -> None:
    _check_sizes(seq_len, ring)
    if window is not None and window < 1:
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
