"""The sequence-order plan of one ring slot's tokens for a recurrent (linear-attention) layer.

A ring slot holds its tokens as *runs* of consecutive global positions (the token layout's
``slot_runs``: zigzag two per slot, balanced many, contiguous one). A recurrent layer needs the
state left by the token just before each run, whichever slot holds it, and packed documents
restart that state (and the short convolution's window) at every document start. This module
turns (layout, document boundaries) into host data every rank computes alike, no communication:

- per slot, its runs cut at document starts into :class:`Segment` s (the pieces the local
  recurrence runs on, each from one initial state);
- per run its *tail*: the last segment of the run, whose zero-start transition the run hands on
  (:func:`chain_initial_states`), and whether that tail restarts (a document starts inside the run,
  so the run's own initial state does not reach its end);
- ``order``: every (slot, run) in natural token order, the order the states are combined in;
- :func:`conv_taps`: for every token of the slot, where each of the convolution's ``K`` inputs
  lives: in the slot itself, in a gathered run tail (the last ``K - 1`` tokens of some run, the
  halo) or nowhere (before a document start: zero).

Note [natural order]: the state order is the token order, never the rank order. At U2xR2 zigzag a
120-token row lives on r0u0, r1u0, r1u1, r0u1 as [0,30), [30,60), [60,90), [90,120); slot 0 holds
the runs [0,30) and [90,120), slot 1 the run [30,90), so the chain reads slot 0 run 0, slot 1 run
0, slot 0 run 1.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch

from hybridsp.layout._layouts import TokenLayout


@dataclass(frozen=True)
class Segment:
    """One piece of a slot's tokens that the recurrence runs on from one initial state.

    offset: index of its first token among the slot's tokens; length: tokens; start: global
    position of its first token; run: index of its run in the slot; chained: it starts in the
    middle of a document, so its initial state and convolution halo come from the tokens before it.
    """

    offset: int
    length: int
    start: int
    run: int
    chained: bool


@dataclass(frozen=True)
class SegmentChain:
    """The plan of one row (one set of document boundaries) over every ring slot.

    runs: per slot, its ``(global start, length)`` runs in slot order. segments: per slot, its
    segments in slot order. tails: per slot, per run, the index (into that slot's segments) of the
    run's last segment. restarts: per slot, per run, whether that tail starts at a document start.
    starts: per slot, per run, whether the run starts at a document start. order: every
    ``(slot, run)`` in natural token order. max_runs: the most runs any slot holds.
    """

    runs: tuple[tuple[tuple[int, int], ...], ...]
    segments: tuple[tuple[Segment, ...], ...]
    tails: tuple[tuple[int, ...], ...]
    restarts: tuple[tuple[bool, ...], ...]
    starts: tuple[tuple[bool, ...], ...]
    order: tuple[tuple[int, int], ...]
    max_runs: int


ChainedStates = dict[tuple[int, int], torch.Tensor | None]
"""Every run's true initial state: ``{(slot, run): S or None}`` (None: a zero state)."""


def row_plan(layout: TokenLayout, seq_len: int, ring: int, bounds: tuple[int, ...]) -> SegmentChain:
    """The :class:`SegmentChain` of one row with document boundaries ``bounds`` ``(0, ..., S)``."""
    slots = layout.slot_runs(seq_len, ring, tuple(bounds))
    doc_starts = sorted(set(bounds[:-1]))
    segments, tails, restarts, starts = [], [], [], []
    for runs in slots:
        slot_segments, slot_tails, slot_restarts, slot_starts, offset = [], [], [], [], 0
        for index, (start, length) in enumerate(runs):
            cuts = _cuts(doc_starts, start, start + length)
            for lo, hi in zip(cuts[:-1], cuts[1:]):
                chained = not _is_doc_start(doc_starts, lo)
                slot_segments.append(Segment(offset + lo - start, hi - lo, lo, index, chained))
            slot_tails.append(len(slot_segments) - 1)
            slot_restarts.append(not slot_segments[-1].chained)
            slot_starts.append(not slot_segments[len(slot_segments) - len(cuts) + 1].chained)
            offset += length
        segments.append(tuple(slot_segments))
        tails.append(tuple(slot_tails))
        restarts.append(tuple(slot_restarts))
        starts.append(tuple(slot_starts))
    order = tuple(
        sorted(
            ((s, j) for s, runs in enumerate(slots) for j in range(len(runs))), key=lambda sj: slots[sj[0]][sj[1]][0]
        )
    )
    return SegmentChain(
        tuple(slots),
        tuple(segments),
        tuple(tails),
        tuple(restarts),
        tuple(starts),
        order,
        max(len(runs) for runs in slots),
    )


def _cuts(doc_starts: list[int], lo: int, hi: int) -> list[int]:
    """``lo``, the document starts strictly inside ``(lo, hi)``, and ``hi``."""
    first = bisect.bisect_right(doc_starts, lo)
    last = bisect.bisect_left(doc_starts, hi)
    return [lo, *doc_starts[first:last], hi]


def _is_doc_start(doc_starts: list[int], position: int) -> bool:
    """Whether a document starts at ``position`` (``doc_starts`` sorted)."""
    index = bisect.bisect_left(doc_starts, position)
    return index < len(doc_starts) and doc_starts[index] == position


def chain_initial_states(
    plan: SegmentChain,
    pairs: Sequence[Sequence[torch.Tensor]],
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    external: Callable[[torch.Tensor], torch.Tensor],
) -> ChainedStates:
    """Every run's true initial state, combined in natural order (Note [natural order]).

    ``pairs[slot][run]`` is the run tail's transition pair: the state after the run is
    ``apply(pair, S)`` from initial state ``S``, ``external(pair)`` from a zero state or when the
    tail restarts. Returns ``{(slot, run): S or None}`` (None: a zero state, the run starts a
    document). Differentiable through ``apply`` and ``external``.
    """
    states: ChainedStates = {}
    state: torch.Tensor | None = None
    for slot, run in plan.order:
        initial = None if plan.starts[slot][run] else state
        states[(slot, run)] = initial
        pair = pairs[slot][run]
        if plan.restarts[slot][run] or initial is None:  # restarted
            state = external(pair)
        else:
            state = apply(pair, initial)
    return states


def run_of(plan: SegmentChain, position: int) -> tuple[int, int, int]:
    """(slot, run, end) of the run holding global ``position``."""
    for slot, runs in enumerate(plan.runs):
        for index, (start, length) in enumerate(runs):
            if start <= position < start + length:
                return slot, index, start + length
    raise ValueError(f"position {position} is in no run")


def tail_index(plan: SegmentChain, slot: int, halo: int) -> torch.Tensor:
    """Indices into ``[slot tokens..., zero]`` of each run's last ``halo`` tokens, right-aligned,
    padded to ``max_runs`` runs: int64 [max_runs * halo] (the zero index where a run is short)."""
    runs = plan.runs[slot]
    total = sum(length for _, length in runs)
    index = torch.full((plan.max_runs, halo), total, dtype=torch.int64)  # [max_runs, K-1]
    offset = 0
    for j, (_, length) in enumerate(runs):
        take = min(halo, length)
        index[j, halo - take :] = torch.arange(offset + length - take, offset + length)
        offset += length
    return index.reshape(-1)  # [max_runs * (K-1)]


def conv_taps(plan: SegmentChain, slot: int, kernel: int, doc_bounds: tuple[int, ...]) -> torch.Tensor:
    """Where each of the ``kernel`` convolution inputs of every token of ``slot`` lives, int64
    [L, kernel], indexing ``ext = [slot tokens (L), gathered tails (R * max_runs * (K-1)), zero]``:
    tap ``i`` of token ``t`` is the input at global position ``pos(t) - (K-1) + i``; zero before
    the token's document start."""
    halo = kernel - 1
    total = sum(length for _, length in plan.runs[slot])
    zero = total + len(plan.runs) * plan.max_runs * halo
    taps = torch.full((total, kernel), zero, dtype=torch.int64)  # [L, K]
    shift = torch.arange(kernel) - halo  # [K]
    for seg in plan.segments[slot]:
        local = torch.arange(seg.length)[:, None] + shift  # [n, K] offsets from the segment start
        inside = local >= 0
        taps[seg.offset : seg.offset + seg.length][inside] = (seg.offset + local)[inside]
        if seg.chained:
            doc_start = doc_bounds[bisect.bisect_right(doc_bounds, seg.start) - 1]
            for back in range(1, halo + 1):
                position = seg.start - back
                if position < doc_start:
                    break
                source, run, end = run_of(plan, position)
                flat = total + (source * plan.max_runs + run) * halo + halo - (end - position)
                taps[seg.offset : seg.offset + seg.length][local == -back] = flat
    return taps
