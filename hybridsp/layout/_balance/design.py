"""One design of the balanced layout (:mod:`hybridsp.layout._balance.tries`): the slots that its knobs
give, built in the three steps of Note [balanced layout] there (split documents by per-document zigzag
or in consecutive pieces, whole units most work first, then the largest document as the balancer) and,
for the hosted tries, with the balancer's room kept in a few slots only (Note [hosts] there).

Pure Python (no torch); the work model is :mod:`hybridsp.layout._balance.work`, the balancers'
placement :mod:`hybridsp.layout._balance.search`.
"""

from __future__ import annotations

import math

from hybridsp.layout._balance.search import place_contiguous, place_nested, repair
from hybridsp.layout._balance.work import (
    DEFAULT_UNIT_SHARE,
    DEFAULT_UNIT_WORK,
    Docs,
    Slot,
    Window,
    group_units,
    piece_work,
    run_work,
    shortest_with_work,
)

DEFAULT_SPLIT_LENGTH = 1.0


def build_slots(
    docs: Docs,
    seq_len: int,
    ring: int,
    window: Window,
    *,
    split_share: float,
    reserve: float,
    split_length: float = DEFAULT_SPLIT_LENGTH,
    unit_share: float = DEFAULT_UNIT_SHARE,
    unit_work: float = DEFAULT_UNIT_WORK,
    balancer: bool = True,
    spread_all: bool = False,
    contiguous: bool = False,
    budget: list[int] | None = None,
    hosts: int | None = None,
) -> list[Slot]:
    """The slots (runs unsorted, exact tokens and work) of one design (Note [balanced layout]).
    ``hosts``: only the first ``hosts`` slots keep room for the (contiguous) balancer; the others
    are filled by units, a unit that fits nowhere cut head first into the fullest (Note [hosts])."""
    bounds, lengths, works = docs
    total = sum(works)
    mean_work, capacity = total / ring, seq_len // ring
    largest = max(range(len(lengths)), key=lengths.__getitem__) if balancer else -1
    room = capacity - (int(reserve * lengths[largest] / (hosts or ring)) if balancer else 0)
    rooms = [room if hosts is None or i < hosts else capacity for i in range(ring)]
    min_work, max_length = split_share * mean_work, split_length * capacity
    # work grows with length: "work >= min_work or length >= max_length" is one length threshold
    by_length = math.ceil(min(max_length, seq_len + 1))
    cut = max(2 * ring, min(shortest_with_work(min_work, seq_len, window), by_length))
    split = [d for d, n in enumerate(lengths) if n >= cut and d != largest]
    whole = [d for d, n in enumerate(lengths) if n < cut and d != largest]
    slots = [Slot() for _ in range(ring)]
    for d in sorted(split, key=works.__getitem__, reverse=True):
        spread = spread_all or not balancer
        k = ring if spread else _pieces(works[d], lengths[d], min_work, max_length, ring)
        _split_document(slots, bounds, d, k, total / seq_len, room, capacity, window, contiguous)
    units = group_units(whole, bounds, works, unit_share * capacity, unit_work * mean_work)
    left_work = sum(u[2] for u in units) + (works[largest] if balancer else 0)
    left_tokens = sum(u[1] for u in units) + (lengths[largest] if balancer else 0)
    for start, n, work in sorted(units, key=lambda u: -u[2]):
        rho = left_work / left_tokens  # what a free token will carry on average
        _place_unit(slots, bounds, start, n, work, rho, rooms, capacity, window, hosts is not None)
        left_work, left_tokens = left_work - work, left_tokens - n
    if balancer and contiguous:
        order = repair(
            slots, bounds[largest], lengths[largest], mean_work, capacity, window, [0] if budget is None else budget
        )
        place_contiguous(slots, order, bounds[largest], mean_work, capacity, window)
    elif balancer:
        place_nested(slots, bounds[largest], lengths[largest], mean_work, capacity, window)
    return slots


def _pieces(work: int, n: int, min_work: float, max_length: float, ring: int) -> int:
    """Over how many slots (2..R) a split document goes: enough that each slot's share has less
    than ``min_work`` work and ``max_length`` tokens."""
    by_work = math.ceil(work / min_work) if min_work > 0 else ring
    by_length = math.ceil(n / max_length) if max_length > 0 else ring
    return max(2, min(ring, max(by_work, by_length)))


def _split_document(
    slots: list[Slot],
    bounds: tuple[int, ...],
    d: int,
    k: int,
    rho: float,
    room: int,
    capacity: int,
    window: Window,
    contiguous: bool = False,
) -> None:
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
    _cut_unit(slots, bounds, start, n, [room] * len(slots), capacity, window)


def _head_tail(chosen: list[Slot], start: int, n: int, window: Window) -> None:
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
        order.sort(
            key=lambda i: (
                -(
                    piece_work(i * base, (i + 1) * base, window)
                    + piece_work((2 * k - 1 - i) * base, (2 * k - i) * base, window)
                )
            )
        )
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
            slot.take(start + lo, hi - lo, piece_work(lo, hi, window))


def _consecutive(chosen: list[Slot], start: int, n: int, window: Window) -> None:
    """The document [start, start + n) in len(chosen) consecutive pieces of equal tokens (+-1),
    the last (most work) to the first chosen slot (the one that lacks work most)."""
    k = len(chosen)
    base, extra = divmod(n, k)
    cuts = [i * base + min(i, extra) for i in range(k + 1)]
    for slot, lo, hi in zip(chosen, cuts[::-1][1:], cuts[::-1]):
        slot.take(start + lo, hi - lo, piece_work(lo, hi, window))


def _place_unit(
    slots: list[Slot],
    bounds: tuple[int, ...],
    start: int,
    n: int,
    work: int,
    rho: float,
    rooms: list[int],
    capacity: int,
    window: Window,
    short_heads: bool = False,
) -> None:
    """Give the unit whole to the slot that most lacks work (projected: its free tokens at ``rho``
    work each), among those with room (``rooms[i]`` tokens for slot i); else cut it (:func:`_cut_unit`)."""
    best, best_key = None, None
    for slot, room in zip(slots, rooms):
        if slot.tokens + n <= room:
            # projection: the slot's work if its free tokens got ``rho`` work each; the unit
            # changes it by delta: to the lowest projection if delta > 0, else the highest
            key = (work - rho * n) * (slot.work + rho * (capacity - slot.tokens))
            if best_key is None or key < best_key:  # (best and best_key are set together)
                best, best_key = slot, key
    if best is not None:
        best.take(start, n, work)
        return
    _cut_unit(slots, bounds, start, n, rooms, capacity, window, short_heads)


def _cut_unit(
    slots: list[Slot],
    bounds: tuple[int, ...],
    start: int,
    n: int,
    rooms: list[int],
    capacity: int,
    window: Window,
    short_heads: bool = False,
) -> None:
    """Cut [start, start + n) into consecutive pieces filling slots up to their room, then up to
    ``capacity``: the slots with the most free tokens first, or (``short_heads``) the fewest, so
    that the head cut off is short (a holder of a later piece reads it)."""
    for limits in (rooms, [capacity] * len(slots)):
        by_free = sorted(zip(slots, limits), key=lambda sl: sl[1] - sl[0].tokens if short_heads else sl[0].tokens)
        for slot, limit in by_free:
            take = min(n, limit - slot.tokens)
            if take > 0:
                slot.take(start, take, run_work(start, take, bounds, window))
                start, n = start + take, n - take
