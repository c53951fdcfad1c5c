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

from hybridsp.ulysses import kv_repeats_for


def ring_rows(ring: int, rank: int, local_len: int, layout: str, causal: bool) -> tuple[int, int]:
    """(rows of its own K/V block ``rank`` sends to others, rows of others' blocks it reads), per pass.

    Zigzag causal: a later slot reads the first half of an earlier slot's block, an earlier
    slot reads all of a later one; contiguous causal: only later slots read, all of it.
    """
    others = ring - 1
    if not causal:
        return others * local_len, others * local_len
    if layout == "contiguous":
        return (ring - 1 - rank) * local_len, rank * local_len
    half = local_len // 2
    return rank * local_len + (ring - 1 - rank) * half, rank * half + (ring - 1 - rank) * local_len


def hybrid_bytes(
    *, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
    ring_rank: int, element_size: int, layout: str = "zigzag", causal: bool = True, kv_comm: str = "ring",
    plan=None,
) -> dict[str, int]:
    """Bytes one rank sends per forward + backward, by collective kind (only kinds that send).

    ``plan``: the call's :class:`~hybridsp.masks.BlockPlan` (packed documents, windows, the balanced
    layout): the ring rows are then the plan's hulls (``rows_sent``/``rows_received``) instead of the
    dense formula :func:`ring_rows`."""
    sent: dict[str, int] = {}
    kv_heads_sent = kv_heads * kv_repeats_for(heads, kv_heads, ulysses)
    if ulysses > 1:
        token = batch * head_dim * element_size  # one token of one head
        local = seq_len // (ulysses * ring)
        per_pass = local * token * (heads + 2 * kv_heads_sent + heads)  # q, k, v and out
        sent["all_to_all"] = 2 * per_pass * (ulysses - 1) // ulysses
    if ring == 1:
        return sent
    slot = seq_len // ring
    row = 2 * batch * (kv_heads_sent // ulysses) * head_dim * element_size
    if kv_comm == "allgather":
        sent["allgather"] = 2 * (ring - 1) * slot * row
        sent["reduce_scatter"] = (ring - 1) * slot * row
        return sent
    if plan is None:
        rows_sent, rows_read = ring_rows(ring, ring_rank, slot, layout, causal)
    else:
        rows_sent, rows_read = plan.rows_sent(ring_rank), plan.rows_received(ring_rank)
    sent["ring"] = (2 * rows_sent + rows_read) * row
    return sent
