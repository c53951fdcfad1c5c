"""hybridsp.layout._balance.tries: the document-balanced slot layout against brute-force token accounting.

References are independent of the module: every token's document and offset are listed one by
one (no prefix formulas), the partition is checked token by token, and the packs are generated
here.
"""

from __future__ import annotations

import math
import random
import re
import sys

import pytest

from hybridsp._formulas import zigzag_slot_runs
from hybridsp.layout._balance import design as balance_design
from hybridsp.layout._balance import search as balance_search
from hybridsp.layout._balance import tries as balance
from hybridsp.layout._balance import work as balance_work
from hybridsp.layout._balance.tries import balanced_slot_runs, design_slot_runs
from hybridsp.layout._balance.work import slot_work
from tests.helpers.packs import lognormal_pack

# the layout's code, traced
FILES = {module.__file__ for module in (balance, balance_design, balance_search, balance_work)}

INF = math.inf


def token_work(bounds, window=None) -> list[int]:
    """Keys each global token attends to: min(offset in its document + 1, W), token by token."""
    out = []
    for a, b in zip(bounds, bounds[1:]):
        for offset in range(b - a):
            out.append(offset + 1 if window is None else min(offset + 1, window))
    return out


def check_layout(slots, seq_len: int, ring: int) -> None:
    """Exact partition of range(S), S/R tokens per slot, runs non-empty."""
    assert len(slots) == ring
    owner = [-1] * seq_len
    for r, runs in enumerate(slots):
        assert sum(n for _, n in runs) == seq_len // ring, (r, slots)
        for start, n in runs:
            assert n > 0 and 0 <= start and start + n <= seq_len
            for t in range(start, start + n):
                assert owner[t] == -1, f"token {t} in slots {owner[t]} and {r}"
                owner[t] = r
    assert -1 not in owner


def check_order(slots, bounds) -> None:
    """Each slot: runs of documents no other slot holds, then runs touching a document that
    another slot holds too; each group ascending, touching runs of a group merged."""
    doc_of = [d for d, (a, b) in enumerate(zip(bounds, bounds[1:])) for _ in range(a, b)]
    holders = {}
    for r, runs in enumerate(slots):
        for start, n in runs:
            for t in range(start, start + n):
                holders.setdefault(doc_of[t], set()).add(r)
    for runs in slots:
        shared = [any(len(holders[doc_of[t]]) > 1 for t in range(s, s + n)) for s, n in runs]
        assert shared == sorted(shared), (runs, shared)
        for (s0, n0), (s1, _), g0, g1 in zip(runs, runs[1:], shared, shared[1:]):
            assert g0 != g1 or s0 + n0 < s1, f"runs of a group not ascending or not merged: {runs}"


def brute_work(slots, bounds, window=None) -> list[int]:
    per_token = token_work(bounds, window)
    return [sum(per_token[t] for start, n in runs for t in range(start, start + n)) for runs in slots]


def random_pack(rng: random.Random, seq_len: int, ring: int) -> tuple[int, ...]:
    """Documents of mixed kinds: length 1, longer than S/2, cuts on slot/chunk edges, random."""
    kind = rng.randrange(6)
    if kind == 0:
        return (0, seq_len)
    if kind == 1:
        return (0, rng.randrange(1, seq_len), seq_len)
    if kind == 2 and seq_len >= 4:  # one document longer than S/2 plus short ones, some of length 1
        big = rng.randrange(seq_len // 2 + 1, seq_len)
        cuts = {big} | {rng.randrange(big, seq_len) for _ in range(rng.randrange(4))}
        cuts |= {c + 1 for c in list(cuts) if c + 1 < seq_len}
        return (0, *sorted(c for c in cuts if 0 < c < seq_len), seq_len)
    if kind == 3:  # boundaries exactly on slot and zigzag chunk edges
        edges = [seq_len * i // (2 * ring) for i in range(1, 2 * ring)]
        return (0, *sorted(rng.sample(edges, rng.randrange(1, len(edges) + 1))), seq_len)
    if kind == 4:  # many documents of length 1 and 2
        cuts = set(range(1, seq_len, rng.choice((1, 2))))
        return (0, *sorted(rng.sample(sorted(cuts), max(1, len(cuts) // 2))), seq_len)
    count = rng.randrange(1, min(seq_len, 40))
    return (0, *sorted(rng.sample(range(1, seq_len), count)), seq_len)


@pytest.mark.parametrize("ring", [1, 2, 3, 4, 8])
def test_one_document_is_zigzag(ring):
    seq_len = 2 * ring * 5
    c = seq_len // (2 * ring)
    expected = tuple(((r * c, c), ((2 * ring - 1 - r) * c, c)) for r in range(ring))
    assert zigzag_slot_runs(seq_len, ring) == expected
    for window in (None, 3):
        assert balanced_slot_runs((0, seq_len), seq_len, ring, window=window) == expected


def test_exact_partition_on_random_packs():
    rng = random.Random(0)
    for case in range(400):
        ring = rng.choice((1, 2, 3, 4, 8))
        seq_len = 2 * ring * rng.choice((1, 2, 3, 8, 32, 100))
        bounds = random_pack(rng, seq_len, ring)
        window = rng.choice((None, None, 1, 4, 64))
        slots = balanced_slot_runs(bounds, seq_len, ring, window=window)
        check_layout(slots, seq_len, ring)
        if len(bounds) > 2 and ring > 1:  # (zigzag, for one document or R = 1, keeps 2 chunks)
            check_order(slots, bounds)
        assert slot_work(slots, bounds, window) == brute_work(slots, bounds, window), (case, bounds)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(split_share=0, split_length=0, unit_share=0, unit_work=0, balancer=False, spread_all=True),
        dict(split_share=INF, split_length=INF, unit_share=0, unit_work=0, balancer=False),
        dict(split_share=INF, split_length=INF, unit_share=0, unit_work=0),
        dict(balancer=False),
        dict(spread_all=True),
        dict(split_share=0.1, reserve=0.0),
        dict(split_share=0.5, reserve=1.5, unit_share=1.0, unit_work=1.0),
        dict(contiguous=True, host_share=0.0),
        dict(contiguous=True, host_share=0.5, reserve=0.5),
        dict(contiguous=True, host_share=1.0, reserve=1.0, split_share=0.35),
    ],
)
def test_every_design_is_an_exact_partition(knobs):
    rng = random.Random(1)
    for _ in range(60):
        ring = rng.choice((2, 3, 4, 8))
        seq_len = 2 * ring * rng.choice((1, 4, 16, 64))
        bounds = random_pack(rng, seq_len, ring)
        window = rng.choice((None, 8))
        check_layout(design_slot_runs(bounds, seq_len, ring, window=window, **knobs), seq_len, ring)


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_work_balance_on_lognormal_packs(ring):
    seq_len, ratios, zigzag = 16384, [], []
    for seed in range(12):
        bounds = lognormal_pack(seq_len, seed)
        slots = balanced_slot_runs(bounds, seq_len, ring)
        check_layout(slots, seq_len, ring)
        work = brute_work(slots, bounds)
        ratios.append(max(work) * ring / sum(work))
        zz = brute_work(zigzag_slot_runs(seq_len, ring), bounds)
        zigzag.append(max(zz) * ring / sum(zz))
    assert max(ratios) <= 1.05, ratios
    assert sum(zigzag) / len(zigzag) >= 1.2, zigzag  # the packs are the hard case for zigzag


def test_work_balance_on_a_ten_document_pack_and_with_a_window():
    lengths = (2396, 840, 420, 1731, 708, 1070, 135, 296, 595, 1)
    bounds = tuple(sum(lengths[:i]) for i in range(len(lengths) + 1))
    for window in (None, 256):
        work = brute_work(balanced_slot_runs(bounds, 8192, 4, window=window), bounds, window)
        zz = brute_work(zigzag_slot_runs(8192, 4), bounds, window)
        assert max(work) * 4 / sum(work) <= 1.05
        assert max(work) < max(zz)
    for seed in range(4):
        bounds = lognormal_pack(16384, seed)
        work = slot_work(balanced_slot_runs(bounds, 16384, 4, window=512), bounds, 512)
        assert max(work) * 4 / sum(work) <= 1.05


def test_short_documents_stay_whole_and_runs_stay_few():
    rng = random.Random(3)
    seq_len, ring = 16384, 4
    # 64 documents of 256 tokens: at most R - 1 of them are cut (to make token counts exact)
    # besides the largest (the balancer), so at most R documents span two or more slots
    bounds = tuple(range(0, seq_len + 1, 256))
    slots = balanced_slot_runs(bounds, seq_len, ring)
    spans = [
        {r for r, runs in enumerate(slots) for s, n in runs if s < b and s + n > a} for a, b in zip(bounds, bounds[1:])
    ]
    assert sum(len(s) > 1 for s in spans) <= ring
    # 8,000 short documents: consecutive ones travel together, a few hundred runs at most
    bounds = (0, *sorted(rng.sample(range(1, 65536), 7999)), 65536)
    slots = balanced_slot_runs(bounds, 65536, ring)
    check_layout(slots, 65536, ring)
    assert sum(len(runs) for runs in slots) <= 64 * ring


# rows shipped / zigzag's on the 12 lognormal packs below, pinned just above what the tries reach
# (1.89 / 1.45 / 1.79 at R = 2 / 4 / 8; the nested-balancer tries alone shipped 2.50 / 1.80 / 2.02)
SHIPPED_VS_ZIGZAG = {2: 1.85, 4: 1.45, 8: 1.75}


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_kv_rows_shipped_against_zigzag(ring):
    """K/V rows the ring ships per forward, from build_plan's hulls (not timed), summed over packs:
    pinned against zigzag on the same packs; hull_rows (the tries' objective) equals the plan's."""
    from hybridsp.layout._block_plan import build_plan

    shipped = {"balanced": 0, "zigzag": 0}
    for seed in range(12):
        bounds = lognormal_pack(16384, seed)
        for layout in shipped:
            plan = build_plan(16384, ring, layout, causal=True, docs=(bounds,), window=None, batch=1)
            rows = sum(plan.rows_received(r) for r in range(ring))
            runs = balanced_slot_runs(bounds, 16384, ring) if layout == "balanced" else zigzag_slot_runs(16384, ring)
            assert balance.hull_rows(runs, bounds) == rows, (layout, seed)
            shipped[layout] += rows
    assert shipped["balanced"] <= SHIPPED_VS_ZIGZAG[ring] * shipped["zigzag"], shipped


def count_lines(fn, *args) -> int:
    """Lines of hybridsp/layout/_balance/tries.py executed by fn(*args) (a timing-free measure of its cost)."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename in FILES else None

    sys.settrace(tracer)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
    return count


def test_cost_grows_linearly_with_documents():
    rng = random.Random(4)
    lines = {}
    for documents in (500, 4000):
        bounds = (0, *sorted(rng.sample(range(1, 65536), documents - 1)), 65536)
        lines[documents] = count_lines(balanced_slot_runs, bounds, 65536, 4)
    # 8x the documents: at most ~8x the executed lines (plus slack), nowhere near 64x
    assert lines[4000] <= 10 * lines[500], lines


@pytest.mark.parametrize(
    "bounds, seq_len, ring, window, message",
    [
        ((0, 5, 12), 12, 4, None, "multiple of 2 x ring = 8"),
        ((1, 5, 16), 16, 2, None, "start at 0 and end at seq_len=16"),
        ((0, 5, 15), 16, 2, None, "start at 0 and end at seq_len=16"),
        ((0, 5, 5, 16), 16, 2, None, "bounds[1]=5 and bounds[2]=5"),
        ((0, 16), 16, 2, 0, "window must be >= 1"),
    ],
)
def test_bad_input_is_a_clear_value_error(bounds, seq_len, ring, window, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        balanced_slot_runs(bounds, seq_len, ring, window=window)
