"""The balancers and searches of the balanced layout (:mod:`hybridsp.layout._balance.tries`): the contiguous
balancer with its run-moving repair, the nested balancer (:func:`place_nested`), and the split-as-needed try.

Pure Python (no torch); the work model is :mod:`hybridsp.layout._balance.work`.

Note [contiguous balancer]. Split documents go in consecutive equal pieces (the last, densest, to
the slot lacking work most) and the balancer (the row's largest document) in consecutive pieces in
position order, the slot that needs the most work per free token taking the latest piece; a local
search (:func:`repair`) moves or swaps whole runs between slots (the balancer's pieces follow the
free tokens) until the busiest slot is within 1.5% of ``W*`` (total work / R), then while it stays
there lowers the rows the pieces ship. A contiguous piece is read only by the holders of later
pieces, where a nested tail reads the whole middle: about half the K/V rows.

Note [split as needed] (:func:`build_greedy`): units most work first, each whole to the slot whose
projected work lacks the most; a document with work >= ``split_min`` x ``W*`` that would push that
slot over ``W*`` leaves it only a tail (sized to fill it) and goes on as its head.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Sequence

from hybridsp.layout._balance.work import (
    DEFAULT_UNIT_SHARE,
    DEFAULT_UNIT_WORK,
    Docs,
    Slot,
    Window,
    group_units,
    piece_work,
    prefix_work,
    run_work,
)

Run = tuple[int, int, int]  # a slot's (global start, tokens, work)

REPAIR_CANDIDATES = 6
REPAIR_SLACK = 0.015
ORDER_SLACK = 0.01


def place_contiguous(
    slots: list[Slot], order: list[int], start: int, mean_work: float, capacity: int, window: Window
) -> None:
    """The largest document fills the slots' free tokens in consecutive pieces, in ``order``
    improved by swapping neighbours while that lowers the busiest slot's work."""
    free = [capacity - slot.tokens for slot in slots]

    def busiest(order: list[int]) -> float:
        a, most = 0, 0.0
        for i in order:
            most = max(most, slots[i].work + piece_work(a, a + free[i], window))
            a += free[i]
        return most

    best = busiest(order)
    improved = True
    while improved:
        improved = False
        for j in range(len(order) - 1):
            trial = order[:j] + [order[j + 1], order[j]] + order[j + 2 :]
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
                trial = order[:j] + [order[j + 1], order[j]] + order[j + 2 :]
                if busiest(trial) <= allowed:
                    order, improved = trial, True
    a = 0
    for i in order:
        slots[i].take(start + a, free[i], piece_work(a, a + free[i], window))
        a += free[i]


def build_greedy(
    docs: Docs,
    seq_len: int,
    ring: int,
    window: Window,
    *,
    slack: float = 0.0,
    split_min: float = 0.25,
    unit_share: float = DEFAULT_UNIT_SHARE,
    unit_work: float = DEFAULT_UNIT_WORK,
) -> list[Slot]:
    """The slots of one split-as-needed try: units most work first, each whole to the slot whose
    projected work lacks the most (dense units) or has the most (sparse ones); a document that
    would push that slot over the mean gives it just a tail and goes on as its head."""
    bounds, lengths, works = docs
    capacity, mean_work = seq_len // ring, sum(works) / ring
    limit = mean_work * (1 + slack)
    units = group_units(range(len(lengths)), bounds, works, unit_share * capacity, unit_work * mean_work)
    big = split_min * mean_work
    heap = [(-w, start, n, w >= big and _single(bounds, start, n)) for start, n, w in units]
    heapq.heapify(heap)
    left_work, left_tokens = sum(works), seq_len
    slots = [Slot() for _ in range(ring)]
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
                    tail = piece_work(x, n, window)
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
                slot.take(start, take, run_work(start, take, bounds, window))
                start, n = start + take, n - take
    return slots


def _single(bounds: Sequence[int], start: int, n: int) -> bool:
    """Whether [start, start + n) is (a prefix of) one document."""
    d = bisect_right(bounds, start) - 1
    return bounds[d] == start and start + n <= bounds[d + 1]


def _tail_cut(n: int, free: int, budget: float, rho: float, window: Window) -> int:
    """Where the tail [x, n) of a document prefix of n tokens starts: the smallest x with n - x <=
    ``free`` and tail work - rho x tail tokens <= ``budget`` (0 < x < n), or 0 if none is smaller
    than n (cannot happen unless the budget is negative)."""

    def excess(x: int) -> float:
        return piece_work(x, n, window) - rho * (n - x)

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


def repair(
    slots: list[Slot], start: int, n: int, mean_work: float, capacity: int, window: Window, budget: list[int]
) -> list[int]:
    """Local search for a contiguous balancer: move or swap whole runs between one slot and the
    others; the balancer (the document at ``start`` of ``n`` tokens, not yet placed) fills the
    free tokens in consecutive pieces, the slot that needs the most work per free token last.
    First the busiest slot's work goes down to ``1 + REPAIR_SLACK`` x the mean, then the rows the
    pieces ship (a piece is read by every later holder) go down while it stays there.
    ``budget[0]``: layouts it may still evaluate (it spends them; candidates are each slot's
    ``REPAIR_CANDIDATES`` runs with the most work). Returns the balancer's slot order."""
    ring, allowed = len(slots), mean_work * (1 + REPAIR_SLACK)

    def layout(work: list[int], tokens: list[int]) -> tuple[tuple[float, int], list[int], list[int]]:
        order = [i for i in range(ring) if tokens[i] < capacity]
        order.sort(key=lambda i: (mean_work - work[i]) / (capacity - tokens[i]))
        out, a, shipped = list(work), 0, 0
        for j, i in enumerate(order):
            free = capacity - tokens[i]
            out[i] += piece_work(a, a + free, window)
            a += free
            shipped += free * (len(order) - 1 - j)
        return (max(max(out), allowed), shipped), out, order

    def candidates(i: int) -> list[Run | None]:
        return [None] + sorted(slots[i].runs, key=lambda run: -run[2])[:REPAIR_CANDIDATES]

    work = [s.work for s in slots]
    tokens = [s.tokens for s in slots]
    best, out, order = layout(work, tokens)
    while budget[0] > 0:
        if best[0] > allowed:
            h = out.index(max(out))
        else:  # the holder whose piece is read the most
            h = max(order, key=lambda i: (capacity - tokens[i]) * (len(order) - 1 - order.index(i)))
        found: tuple[tuple[float, int], int, Run | None, Run | None, list[int], list[int]] | None = None
        mine = candidates(h)
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


def place_nested(slots: list[Slot], start: int, n: int, mean_work: float, capacity: int, window: Window) -> None:
    """The largest document fills every slot's free tokens, head + tail pieces nested from the
    outside in, each slot's head size bisected so its work hits ``mean_work``."""
    rho = prefix_work(n, window) / n
    need = [(capacity - s.tokens, mean_work - s.work, s) for s in slots]
    # the slot whose target is farthest from the average work per token takes the widest range
    need.sort(key=lambda t: -abs(t[1] - rho * t[0]) / max(t[0], 1))
    lo, hi = 0, n
    for free, target, slot in need:
        head = _best_head(lo, hi, free, target, window)
        slot.take(start + lo, head, piece_work(lo, lo + head, window))
        tail = free - head
        slot.take(start + hi - tail, tail, piece_work(hi - tail, hi, window))
        lo, hi = lo + head, hi - tail


def _best_head(lo: int, hi: int, free: int, target: float, window: Window) -> int:
    """Head size h in [0, free] whose head [lo, lo+h) + tail [hi-free+h, hi) work is closest to
    ``target`` (that work does not increase with h: bisection)."""

    def work(h: int) -> int:
        return piece_work(lo, lo + h, window) + piece_work(hi - free + h, hi, window)

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
