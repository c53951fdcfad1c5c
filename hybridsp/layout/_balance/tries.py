"""Document-balanced token layout: which global tokens each ring slot holds for one packed row.

Pure Python (no torch), computed on the host once per batch row from its document boundaries
``bounds = (0, b1, ..., S)`` (the row's ``cu_seqlens``). Work model
(:mod:`hybridsp.layout._balance.work`): attention is causal inside each document; the token at offset
``p`` of its document attends to ``min(p + 1, W)`` keys (``W`` = window, unbounded if None); a
slot's work is the sum over its tokens. Every slot holds exactly ``T = S / R`` tokens. ``W*`` =
total work / R.

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
   middle. *Contiguous*: consecutive pieces balanced by a local search over whole runs
   (Note [contiguous balancer] in :mod:`hybridsp.layout._balance.search`).

A third kind of try, *split as needed* (:func:`hybridsp.layout._balance.search.build_greedy`, Note [split
as needed] there), splits a document only where it would push a slot over ``W*``.

Note [hosts]. A holder of a piece of a document reads the document's rows before its last token
that other slots hold, so a document's pieces cost about the sum of their end offsets (Note [rows
bound] in :mod:`hybridsp.layout._balance.bound`). A balancer spread over every slot pays that R - 1
times. The *hosted* tries keep room for the contiguous balancer in only ``k`` slots (1, R // 2
or R - 1, :func:`host_count`); units fill the others, and a unit that fits nowhere is cut head
first into the slot with the fewest free tokens (the holder of the rest reads only that short
head). On lognormal packs (S = 16,384) a hosted try wins on about half the packs at R = 2 and
4 (rows shipped 1.00 -> 0.96 and 1.25 -> 1.20 x zigzag's).

:func:`balanced_slot_runs` runs the tries of :data:`TRIES` (contiguous and nested balancer for
split thresholds none / 0.5 / 0.35 / 0.25 / 0.15 / 0.1 ``W*`` and reserves 1/4 .. 1, two split
as needed, six hosted) and keeps, among those whose busiest slot is within ``ACCEPT`` (3%) of
the mean, the one whose plan ships the fewest K/V rows (:func:`hull_rows`, what
``build_plan``'s hulls cover), else the best balanced. Tries stop after 4,000 documents' worth
(at least two) and the local search of the tries shares min(``REPAIR_EVALS``, 100,000 /
documents) layout evaluations (the hosted tries another such budget), so many-document rows
stay linear and fast. ``benchmarks/bench_balance.py``
measures the choices: on lognormal packs (S = 16,384) the rows shipped fell from 1.33 / 1.57 /
1.81 x zigzag's at R = 2 / 4 / 8 (first nested try within 1% balance) to 0.96 / 1.20 / 1.54 x,
busiest slot <= 1.03 x the mean. Part of the gap is forced: a document with k x ``W*`` work
must spread over >= k slots and each holder reads all of it before its last token, where
zigzag keeps it on fewer (busier) slots; on about a third of these packs no layout within 5%
balance can ship within 5% of zigzag's rows (:func:`hybridsp.layout._balance.bound.kv_rows_lower_bound`).

With one document or R = 1 the result is exactly the zigzag layout. Otherwise each slot's runs
come whole documents first, then shared pieces (Note [run order] in
:mod:`hybridsp.layout._balance.work`). Time per try: O(n log n + n R) for n documents plus O(R log S)
(plus the local-search budgets, one shared by the hosted tries and one by the others); 8,000
documents at S = 65,536, R = 4: ~9 ms CPU (two tries), a lognormal pack of S = 16,384 at R = 8
(28 tries): ~27 ms, R = 4: ~20 ms.

Layout of the code: this module has the public entry points and the tries (small strategy
objects, :data:`TRIES`); :mod:`hybridsp.layout._balance.design` the slots of one design (split
documents, whole units, the balancer's room: :func:`~hybridsp.layout._balance.design.build_slots`);
:mod:`hybridsp.layout._balance.bound` the lower bound on rows shipped;
:mod:`hybridsp.layout._balance.work` the work model and bookkeeping (``slot_work``, ``hull_rows``);
:mod:`hybridsp._formulas` the zigzag runs (``zigzag_slot_runs``); :mod:`hybridsp.layout._balance.search` the
balancers' placement (nested, and contiguous with its local search) and the split-as-needed try.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridsp._formulas import zigzag_slot_runs
from hybridsp.layout._balance.design import DEFAULT_SPLIT_LENGTH, build_slots
from hybridsp.layout._balance.refine import REFINE_EVALS, plan_work, refine
from hybridsp.layout._balance.search import build_greedy
from hybridsp.layout._balance.work import (
    DEFAULT_UNIT_SHARE,
    DEFAULT_UNIT_WORK,
    Docs,
    Runs,
    Slot,
    TiledWindow,
    Window,
    check_bounds,
    documents,
    finish_runs,
    hull_rows,
)

DEFAULT_SPLIT_SHARE = math.inf
DEFAULT_RESERVE = 0.75
SPLITS = (
    (math.inf, 0.75),
    (math.inf, 0.5),
    (0.5, 0.75),
    (0.5, 0.5),
    (0.35, 0.75),
    (0.35, 0.5),
    (0.35, 1.0),
    (0.25, 0.5),
    (0.15, 0.5),
    (0.1, 0.25),
)


@dataclass(frozen=True)
class SearchBudgets:
    """The local-search budgets of one :func:`balanced_slot_runs` call, each a one-element list that
    the tries spend in place: ``shared`` by the contiguous tries, ``hosted`` by the hosted ones."""

    shared: list[int]
    hosted: list[int]


@dataclass(frozen=True)
class BalancerTry:
    """Documents with work >= ``split_share`` x W* split, whole units placed keeping ``reserve`` of
    the largest document's even share free, then the largest as the balancer: ``contiguous`` pieces
    (local search) or nested head and tail pieces (Note [balanced layout])."""

    split_share: float
    reserve: float
    contiguous: bool

    def duplicate_key(self, ring: int) -> None:
        return None  # no two balancer tries coincide

    def slots(self, docs: Docs, seq_len: int, ring: int, window: Window, budgets: SearchBudgets) -> list[Slot]:
        return build_slots(
            docs,
            seq_len,
            ring,
            window,
            split_share=self.split_share,
            reserve=self.reserve,
            contiguous=self.contiguous,
            budget=budgets.shared,
        )


@dataclass(frozen=True)
class GreedyTry:
    """Split as needed (:func:`hybridsp.layout._balance.search.build_greedy`) with ``split_min``."""

    split_min: float

    def duplicate_key(self, ring: int) -> None:
        return None

    def slots(self, docs: Docs, seq_len: int, ring: int, window: Window, budgets: SearchBudgets) -> list[Slot]:
        return build_greedy(docs, seq_len, ring, window, split_min=self.split_min)


@dataclass(frozen=True)
class HostedTry:
    """The contiguous balancer hosted by :func:`host_count` slots (``part`` of the way from 1 to
    R - 1), nothing split beforehand, ``reserve`` as in :class:`BalancerTry` (Note [hosts])."""

    part: float
    reserve: float

    def duplicate_key(self, ring: int) -> tuple[int, float]:
        return host_count(self.part, ring), self.reserve  # at small R the counts coincide

    def slots(self, docs: Docs, seq_len: int, ring: int, window: Window, budgets: SearchBudgets) -> list[Slot]:
        return build_slots(
            docs,
            seq_len,
            ring,
            window,
            split_share=math.inf,
            reserve=self.reserve,
            contiguous=True,
            budget=budgets.hosted,
            hosts=host_count(self.part, ring),
        )


# the tries of balanced_slot_runs, in order: the contiguous and the nested balancer for every
# (split_share, reserve) of SPLITS, interleaved, fewest split documents first, the two
# split-as-needed tries after the first two SPLITS; then the hosted tries (host count 1, R // 2
# or R - 1: fractions 0, 0.5, 1 of the way from 1 to R - 1)
TRIES: tuple[BalancerTry | GreedyTry | HostedTry, ...] = tuple(
    BalancerTry(share, reserve, contiguous) for share, reserve in SPLITS[:2] for contiguous in (True, False)
)
TRIES += (GreedyTry(0.5), GreedyTry(1.0))
TRIES += tuple(BalancerTry(share, reserve, contiguous) for share, reserve in SPLITS[2:] for contiguous in (True, False))
TRIES += tuple(HostedTry(part, reserve) for part in (0.0, 0.5, 1.0) for reserve in (0.5, 1.0))
REFINE_STARTS = 3  # the least busy unbalanced tries the refine search starts from (Note [tile refine])
ACCEPT = 1.03  # a try counts as balanced when its busiest slot has at most this x the mean work
REPAIR_EVALS = 3000  # layouts the contiguous tries of one call may evaluate in all (at most)
REPAIR_DOCUMENTS = 100_000  # ... and at most this / the number of documents
TRY_DOCUMENTS = 4000  # tries stop once they have handled this many documents (at least 2 tries)


def balanced_slot_runs(bounds: tuple[int, ...], seq_len: int, ring: int, *, window: Window = None) -> tuple[Runs, ...]:
    """Per ring slot, its tokens as runs ``(global_start, length)`` (whole documents, then shared).

    ``bounds``: the row's document boundaries ``0 = b0 < b1 < ... < bn = seq_len``; ``seq_len``
    a multiple of ``2 * ring``. Every slot holds exactly ``seq_len // ring`` tokens; the runs of
    all slots partition ``range(seq_len)``. One document gives the zigzag layout. The layout of
    the :data:`TRIES` (as many as ``TRY_DOCUMENTS`` allows) that ships the fewest K/V rows
    (:func:`hull_rows`) among those whose busiest slot has <= ``ACCEPT`` x the mean work, else
    the best balanced one.
    """
    check_bounds(bounds, seq_len, ring, window)
    if len(bounds) == 2 or ring == 1:
        return zigzag_slot_runs(seq_len, ring)
    docs = documents(bounds, window)
    best_key, best = None, None
    tried: list[tuple[float, int, tuple[Runs, ...]]] = []  # (ratio, index, runs)
    budget = min(REPAIR_EVALS, REPAIR_DOCUMENTS // len(docs[1]))
    budgets = SearchBudgets([budget], [budget])  # the hosted tries come last: a budget of their own
    seen: set[tuple[int, float]] = set()
    for strategy in TRIES[: max(2, TRY_DOCUMENTS // len(docs[1]))]:
        duplicate = strategy.duplicate_key(ring)
        if duplicate is not None:
            if duplicate in seen:
                continue
            seen.add(duplicate)
        slots = strategy.slots(docs, seq_len, ring, window, budgets)
        runs = finish_runs(slots, bounds)
        works = _final_work(slots, runs, bounds, window)
        ratio = max(works) * ring / sum(works)
        key: tuple[int, float, float] = (0, hull_rows(runs, bounds), ratio) if ratio <= ACCEPT else (1, ratio, 0)
        tried.append((ratio, len(tried), runs))
        if best_key is None or key < best_key:
            best_key, best = key, runs
        if key[:2] == (0, 0):
            break
    assert best_key is not None and best is not None  # set together by the first try (at least two tries run)
    if best_key[0] == 1 and isinstance(window, TiledWindow):  # no try balanced: trade tokens on the plan's cells
        best = _refined(sorted(tried)[:REFINE_STARTS], bounds, ring, window)
    return best


def _refined(
    starts: list[tuple[float, int, tuple[Runs, ...]]], bounds: tuple[int, ...], ring: int, window: TiledWindow
) -> tuple[Runs, ...]:
    """The best of :func:`~hybridsp.layout._balance.refine.refine` from each of ``starts``
    (``(ratio, index, runs)``, least busy first), stopping at the first within ``ACCEPT``
    (Note [tile refine] in balance.refine: a local search; later starts get a third of the budget)."""
    best_ratio, best = None, None
    for i, (_, _, runs) in enumerate(starts):
        runs, work = refine(runs, bounds, window, REFINE_EVALS if i == 0 else REFINE_EVALS // 3)
        ratio = max(work) * ring / sum(work)
        if best_ratio is None or ratio < best_ratio:  # (best_ratio and best are set together)
            best_ratio, best = ratio, runs
        if ratio <= ACCEPT:
            break
    assert best is not None  # starts is never empty
    return best


def _final_work(slots: list[Slot], runs: tuple[Runs, ...], bounds: tuple[int, ...], window: Window) -> list[int]:
    """Each slot's work as placed: what the try summed, except under a cost model whose pieces'
    work is not additive (:class:`~hybridsp.layout._balance.work.TiledWindow`: merged runs tile
    as one), where the finished runs are measured as the plan computes them
    (:func:`~hybridsp.layout._balance.refine.plan_work`)."""
    if not isinstance(window, TiledWindow):
        return [slot.work for slot in slots]
    return plan_work(runs, bounds, window)


def host_count(share: float, ring: int) -> int:
    """How many slots host the balancer: 1 at ``share`` 0, R - 1 at 1 (Note [hosts])."""
    return max(1, 1 + round(share * (ring - 2)))


def design_slot_runs(
    bounds: tuple[int, ...],
    seq_len: int,
    ring: int,
    *,
    window: Window = None,
    split_share: float = DEFAULT_SPLIT_SHARE,
    split_length: float = DEFAULT_SPLIT_LENGTH,
    unit_share: float = DEFAULT_UNIT_SHARE,
    unit_work: float = DEFAULT_UNIT_WORK,
    reserve: float = DEFAULT_RESERVE,
    balancer: bool = True,
    spread_all: bool = False,
    contiguous: bool = False,
    greedy: float | None = None,
    host_share: float | None = None,
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
    ``host_share``: only :func:`host_count` slots keep room for the balancer (Note [hosts]).
    """
    check_bounds(bounds, seq_len, ring, window)
    if len(bounds) == 2 or ring == 1:
        return zigzag_slot_runs(seq_len, ring)
    docs = documents(bounds, window)
    if greedy is not None:
        return finish_runs(
            build_greedy(docs, seq_len, ring, window, split_min=greedy, unit_share=unit_share, unit_work=unit_work),
            bounds,
        )
    slots = build_slots(
        docs,
        seq_len,
        ring,
        window,
        split_share=split_share,
        split_length=split_length,
        unit_share=unit_share,
        unit_work=unit_work,
        reserve=reserve,
        balancer=balancer,
        spread_all=spread_all,
        contiguous=contiguous,
        budget=[REPAIR_EVALS],
        hosts=None if host_share is None else host_count(host_share, ring),
    )
    return finish_runs(slots, bounds)
