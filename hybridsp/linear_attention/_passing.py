"""Exact state passing of a linear recurrence over the ring: one driver for every recurrence.

A recurrence whose state after a run is affine in the state before it (``S -> M S + E`` for the
delta rule, ``S -> a S + E`` for Mamba-2) is split over the ring exactly in three steps
(:func:`pass_states`):

1. each rank computes every run tail's transition from a zero state: the pair ``(M, E)``, whose
   size does not depend on the run's length (:meth:`Recurrence.transitions`);
2. one all-gather of the pairs over the ring (:func:`~hybridsp.linear_attention._gather.gather_ring`), and
   every rank combines them in natural token order
   (:func:`~hybridsp.linear_attention._segments.chain_initial_states`, Note [natural order] there);
3. each rank reruns its segments from their true initial states (:meth:`Recurrence.outputs`).

Backward is autograd through these steps: the all-gather's adjoint sends each rank the
gradient of its pairs summed over the ranks that used them (Note [gather adjoint]), so the
transitions' adjoints run in reverse token order and an early run's parameters get the gradient
of every later token that its state reached. Segments of equal length travel through the
recurrence together (one call per length).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from hybridsp._comm import CommCounter
from hybridsp.linear_attention._gather import gather_ring
from hybridsp.linear_attention._segments import ChainedStates, Segment, chain_initial_states
from hybridsp.linear_attention._slots import RowGroup, SlotCall


class Recurrence(Protocol):
    """One linear recurrence (its inputs are a dict of ``[b, n, ...]`` tensors over one segment)."""

    def transitions(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        """The pairs of ``m`` stacked segments from a zero state, fp32 ``[m, *pair]``."""

    def apply(self, pair: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The state after a segment with ``pair`` from ``state``: ``M state + E``."""

    def external(self, pair: torch.Tensor) -> torch.Tensor:
        """``E``: the state after the segment from a zero state."""

    def outputs(self, pieces: dict[str, torch.Tensor], initial: torch.Tensor | None) -> torch.Tensor:
        """The outputs ``[m, n, ...]`` of ``m`` stacked segments from states ``initial`` ``[m, *state]``
        (None: zero)."""

    def final_state(self, pieces: dict[str, torch.Tensor], initial: torch.Tensor | None) -> torch.Tensor:
        """The state ``[m, *state]`` after ``m`` stacked segments from ``initial`` (None: zero)."""


def pass_states(
    recurrence: Recurrence,
    inputs: dict[str, torch.Tensor],
    call: SlotCall,
    counter: CommCounter | None = None,
    chained: list[ChainedStates] | None = None,
) -> torch.Tensor:
    """The recurrence's output over the slot's tokens, exact over the ring and packed documents.

    Args:
        inputs: name -> [B, L, ...] the slot's tokens in slot order (this rank's heads).
        call: the batch's :class:`~hybridsp.linear_attention._slots.SlotCall`.
        chained: if a list, each row group's ``{(slot, run): initial state or None}`` is appended
            (the prefill's final state starts from them: :mod:`hybridsp.linear_attention._decode`).

    Returns:
        [B, L, ...] the outputs in slot order.
    """
    tails = [_tail_pairs(recurrence, inputs, group, call.slot) for group in call.rows]
    gathered = gather_ring(tails, call.group, counter)  # each [R, b, max_runs, *pair]
    outs = []
    for group, pairs in zip(call.rows, gathered):
        plan = group.plan
        table = [[pairs[s, :, j] for j in range(plan.max_runs)] for s in range(call.ring)]  # each [b, *pair]
        states = chain_initial_states(plan, table, recurrence.apply, recurrence.external)
        if chained is not None:
            chained.append(states)
        outs.append(_segment_outputs(recurrence, inputs, group, call.slot, states))
    joined = torch.cat(outs, dim=0)  # [B, L, ...] rows in group order
    return joined if len(outs) == 1 else joined[call.row_order().to(joined.device)]


def _pieces(inputs: dict[str, torch.Tensor], rows: list[int], segments: Sequence[Segment]) -> dict[str, torch.Tensor]:
    """Each input's tokens of ``segments`` (equal lengths) stacked: name -> [m * b, n, ...]."""
    return {name: torch.cat([x[rows, s.offset : s.offset + s.length] for s in segments]) for name, x in inputs.items()}


def _by_length(segments: Iterable[Segment]) -> dict[int, list[Segment]]:
    found: dict[int, list[Segment]] = {}
    for seg in segments:
        found.setdefault(seg.length, []).append(seg)
    return found


def _tail_pairs(recurrence: Recurrence, inputs: dict[str, torch.Tensor], group: RowGroup, slot: int) -> torch.Tensor:
    """The slot's run tails' pairs, zero-padded to ``max_runs``: [b, max_runs, *pair]."""
    plan, rows = group.plan, list(group.rows)
    tails = [plan.segments[slot][i] for i in plan.tails[slot]]
    by_run: dict[int, torch.Tensor] = {}
    for segments in _by_length(tails).values():
        pairs = recurrence.transitions(_pieces(inputs, rows, segments))  # [m * b, *pair]
        for seg, pair in zip(segments, pairs.split(len(rows))):
            by_run[seg.run] = pair  # [b, *pair]
    first = next(iter(by_run.values()))
    padding = [first.new_zeros(first.shape)] * (plan.max_runs - len(tails))
    return torch.stack([by_run[j] for j in range(len(tails))] + padding, dim=1)  # [b, max_runs, *pair]


def _segment_outputs(
    recurrence: Recurrence, inputs: dict[str, torch.Tensor], group: RowGroup, slot: int, states: ChainedStates
) -> torch.Tensor:
    """The slot's outputs, every segment from its true initial state: [b, L, ...]."""
    plan, rows = group.plan, list(group.rows)
    done: dict[int, torch.Tensor] = {}
    for segments in _by_length(plan.segments[slot]).values():
        initial = (
            torch.cat([_initial(states, slot, seg) for seg in segments]) if any(s.chained for s in segments) else None
        )
        out = recurrence.outputs(_pieces(inputs, rows, segments), initial)  # [m * b, n, ...]
        for seg, part in zip(segments, out.split(len(rows))):
            done[seg.offset] = part
    return torch.cat([done[offset] for offset in sorted(done)], dim=1)  # [b, L, ...]


def _initial(states: ChainedStates, slot: int, seg: Segment) -> torch.Tensor:
    """A segment's initial state [b, *state] (zeros where it starts a document)."""
    state = states[(slot, seg.run)] if seg.chained else None
    if state is not None:
        return state
    like = next(s for s in states.values() if s is not None)
    return like.new_zeros(like.shape)
