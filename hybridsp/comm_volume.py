"""Analytic bytes each rank sends in one hybrid attention forward + backward (dense masks).

The formulas the byte counter is tested against and the planner prices communication with.
Per rank of a U x R mesh, ``L = S / R`` tokens per ring slot after the all-to-all,
``row`` = the bytes of one token's K *and* V for the rank's heads
(``2 B (Hkv' / U) D e``, ``Hkv'`` the K/V heads after :func:`~hybridsp.ulysses.kv_repeats_for`):

``all_to_all`` (U > 1): ``(U - 1) / U`` of q, k, v and out in the forward, of dout, dq, dk
and dv in the backward (the tokens of one rank before the all-to-all).

``ring`` (``kv_comm="ring"``): the forward sends the K/V rows other ranks read
(:func:`ring_rows`), the backward sends them again plus the dK/dV of every block this rank
read back to its owner, once, in the input dtype::

    2 * rows_sent(r) * row + rows_read(r) * row

``allgather`` / ``reduce_scatter`` (``kv_comm="allgather"``): whole blocks, as a bandwidth-
optimal all-gather sends them, forward and backward, and the dK/dV of all of them::

    allgather = 2 (R - 1) L row,    reduce_scatter = (R - 1) L row

These are minima for each transport: the ring sends no row nobody reads and no gradient
twice; a collective cannot skip rows one receiver does not read without becoming point-to-
point sends.
"""

from __future__ import annotations

from hybridsp import formulas
from hybridsp.formulas import ring_rows  # noqa: F401  (the definitions live there)


def hybrid_bytes(*, plan=None, **shape) -> dict[str, int]:
    """:func:`hybridsp.formulas.hybrid_bytes`; with ``plan`` (the call's
    :class:`~hybridsp.masks.BlockPlan`: packed documents, windows, the balanced layout) the ring rows
    are the plan's hulls (``rows_sent`` / ``rows_received``) instead of the dense formula."""
    rank = shape.get("ring_rank", 0)
    rows = None if plan is None else (plan.rows_sent(rank), plan.rows_received(rank))
    return formulas.hybrid_bytes(**shape, rows=rows)
