"""A lower bound on the K/V rows any balanced layout ships (:mod:`hybridsp.layout._balance.tries`'s yardstick).

Pure Python (no torch); causal attention within documents, no window.

Note [rows bound]. Take one document of length ``L`` and the slots holding its tokens. A holder
whose last token of the document sits at offset ``e - 1`` attends to offsets ``0 .. e - 1`` and
holds ``n`` of the document's tokens, so it reads at least ``e - n`` rows from other slots; over
the holders, sorted by ``e`` (``e_1 <= ... <= e_m = L``), at least ``e_1 + ... + e_{m-1}`` rows
(the ``n`` sum to ``L``). Now bound each ``e_{m-j}``: the document's offsets ``>= e_{m-j}`` lie on
the ``j`` holders above it, whose ``j T`` tokens (``T = S / R``) hold those ``L - e`` rows plus
``j T - (L - e)`` other tokens, which carry at least the work of the cheapest that many tokens of
the row (the token at offset ``p`` of any document carries ``p + 1``). So if no slot carries more
than ``B`` work, ``work(e, L) + cheapest(j T - (L - e)) <= j B``, and ``e_{m-j}`` is at least the
smallest ``e`` satisfying it. Summed over documents (their rows are distinct) that is a lower
bound on the rows read from other slots, and so on what any layout whose busiest slot has at most
``balance`` x the mean work ships (hybridsp's plan ships hulls, which cover those rows).

``benchmarks/bench_balance.py`` reports it beside zigzag and the balanced layout: on lognormal
packs the bound exceeds 1.05 x zigzag's rows on about a third of the rows at R = 2, 4 and 8, so no
layout within 5% balance can ship within 5% of zigzag's rows there.
"""

from __future__ import annotations

from bisect import bisect_right

from hybridsp.layout._balance.work import piece_work, prefix_work, shortest_with_work


def kv_rows_lower_bound(bounds: tuple[int, ...], seq_len: int, ring: int, balance: float) -> int:
    """The fewest K/V rows a layout of this row over ``ring`` slots (``seq_len / ring`` tokens
    each) can ship if its busiest slot carries at most ``balance`` x the mean work (Note [rows bound])."""
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    capacity = seq_len // ring
    budget = balance * sum(prefix_work(n, None) for n in lengths) / ring
    cheapest = Cheapest(lengths)
    rows = 0
    for n in lengths:
        holders = next((m for m in range(1, ring + 1) if _fits(n, 0, m, capacity, budget, cheapest)), ring)
        rows += sum(_lowest_top(n, j, capacity, budget, cheapest) for j in range(1, holders))
    return rows


class Cheapest:
    """Work of the ``k`` cheapest tokens of a row (the token at offset p carries p + 1): per work
    value w, as many tokens as documents longer than w - 1. O(longest document) memory."""

    def __init__(self, lengths: list[int]):
        longest = max(lengths)
        longer = [0] * (longest + 2)  # longer[w]: documents with length >= w
        for n in lengths:
            longer[n] += 1
        for w in range(longest - 1, 0, -1):
            longer[w] += longer[w + 1]
        self._tokens, self._work = [0], [0]  # tokens / work with work value < w, w = 1, 2, ...
        for w in range(1, longest + 1):
            self._tokens.append(self._tokens[-1] + longer[w])
            self._work.append(self._work[-1] + w * longer[w])

    def __call__(self, k: int) -> int:
        w = bisect_right(self._tokens, k)  # the first k tokens take every value below w, some of w
        if w > len(self._tokens) - 1:
            return self._work[-1]
        return self._work[w - 1] + (k - self._tokens[w - 1]) * w


def _fits(n: int, e: int, j: int, capacity: int, budget: float, cheapest: Cheapest) -> bool:
    """Whether offsets [e, n) of a document can lie on j slots within the work budget."""
    other = j * capacity - (n - e)
    if other < 0:
        return False
    return piece_work(e, n, None) + cheapest(other) <= j * budget


def _lowest_top(n: int, j: int, capacity: int, budget: float, cheapest: Cheapest) -> int:
    """The smallest e with offsets [e, n) fitting on j slots: a scan (not monotone in e), from the
    first e that the document's own work and tokens allow (necessary conditions)."""
    by_work = shortest_with_work(prefix_work(n, None) - j * budget, n, None)  # work[e, n) <= j budget
    start = max(by_work, n - j * capacity)
    return next(e for e in range(start, n + 1) if _fits(n, e, j, capacity, budget, cheapest))
