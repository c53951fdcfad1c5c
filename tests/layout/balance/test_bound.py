"""kv_rows_lower_bound (Note [rows bound]): never above the rows any layout reads, by brute force over
every layout of tiny rows; below zigzag's and the balanced layout's hulls on lognormal packs."""

from __future__ import annotations

import math
import random
from itertools import combinations

import pytest

from hybridsp._formulas import zigzag_slot_runs
from hybridsp.layout._balance.bound import kv_rows_lower_bound
from hybridsp.layout._balance.tries import balanced_slot_runs
from hybridsp.layout._balance.work import hull_rows, slot_work
from tests.helpers.packs import lognormal_pack


def every_layout(seq_len: int, ring: int):
    """Every owner map (token -> slot) with seq_len / ring tokens per slot."""
    capacity = seq_len // ring

    def fill(free: tuple[int, ...], owner: list[int | None], slot: int):
        if slot == ring - 1:
            for p in free:
                owner[p] = slot
            yield tuple(owner)
            return
        for chosen in combinations(free[1:], capacity - 1):  # the first free token picks the slot: no repeats
            mine = (free[0], *chosen)
            for p in mine:
                owner[p] = slot
            yield from fill(tuple(p for p in free if p not in mine), owner, slot + 1)

    yield from fill(tuple(range(seq_len)), [None] * seq_len, 0)


def rows_read(owner, bounds) -> int:
    """Rows each slot reads from other slots: per document, its offsets before the slot's last one."""
    total = 0
    for a, b in zip(bounds, bounds[1:]):
        last, held = {}, {}
        for p in range(a, b):
            last[owner[p]] = p - a + 1
            held[owner[p]] = held.get(owner[p], 0) + 1
        total += sum(last[s] - held[s] for s in last)
    return total


def balance_of(owner, bounds, ring: int) -> float:
    work = [0] * ring
    for a, b in zip(bounds, bounds[1:]):
        for p in range(a, b):
            work[owner[p]] += p - a + 1
    return max(work) * ring / sum(work)


@pytest.mark.parametrize("seq_len, ring", [(10, 2), (12, 2), (9, 3), (8, 4)])
def test_bound_never_above_the_best_layout(seq_len, ring):
    rng = random.Random(seq_len * 10 + ring)
    layouts = list(every_layout(seq_len, ring))
    assert len(layouts) == math.factorial(seq_len) // (math.factorial(seq_len // ring) ** ring * math.factorial(ring))
    positive = 0
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, seq_len), rng.randint(0, 3)))
        bounds = (0, *cuts, seq_len)
        seen = [(balance_of(o, bounds, ring), rows_read(o, bounds)) for o in layouts]
        for balance in (1.0, 1.1, 1.25, 1.5, 2.0, 4.0):
            feasible = [rows for b, rows in seen if b <= balance + 1e-12]
            if feasible:
                bound = kv_rows_lower_bound(bounds, seq_len, ring, balance)
                assert bound <= min(feasible), (bounds, balance, bound, min(feasible))
                positive += bound > 0
    assert positive > 0  # not vacuous


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_bound_below_zigzag_and_balanced(ring):
    seq_len = 16384
    for seed in range(4):
        bounds = lognormal_pack(seq_len, seed)
        for runs in (zigzag_slot_runs(seq_len, ring), balanced_slot_runs(bounds, seq_len, ring)):
            work = slot_work(runs, bounds)
            bound = kv_rows_lower_bound(bounds, seq_len, ring, max(work) * ring / sum(work))
            assert 0 <= bound <= hull_rows(runs, bounds), (seed, bound)
