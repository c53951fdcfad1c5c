"""The formulas both the runtime and the planner use: one definition each, no torch.

Heads under Ulysses: ``U`` must divide the query heads (:func:`heads_divisible`); K/V heads
are repeated :func:`kv_repeats_for` times before the head scatter, so ``Hkv' =
Hkv x repeats`` (:func:`expanded_kv_heads`) and ``Hkv' % U == 0``.

Bytes one rank sends (dense masks; per rank of a U x R mesh, ``L = S / R`` tokens per ring
slot after the all-to-all, ``row`` = the bytes of one token's K *and* V for the rank's heads,
``B (Hkv' / U) (D + Dv) e``, :func:`kv_row_bytes`; ``Dv`` is v's head dim, D unless a model's
values differ, as MLA's do; nothing is padded on the wire):

``all_to_all`` (U > 1): ``(U - 1) / U`` of q, k, v and out in the forward, of dout, dq, dk
and dv in the backward (the tokens of one rank before the all-to-all; :func:`all_to_all_sent`).

``ring`` (``kv_comm="ring"``): the forward sends the K/V rows other ranks read
(:func:`ring_rows`), the backward sends them again plus the dK/dV of every block this rank
read back to its owner, once, in the input dtype::

    2 * rows_sent(r) * row + rows_read(r) * row

``allgather`` / ``reduce_scatter`` (``kv_comm="allgather"``): whole blocks, as a bandwidth-
optimal all-gather sends them, forward and backward, and the dK/dV of all of them::

    allgather = 2 (R - 1) L row,    reduce_scatter = (R - 1) L row

(:func:`kv_transport`). These are minima for each transport: the ring sends no row nobody
reads and no gradient twice; a collective cannot skip rows one receiver does not read
without becoming point-to-point sends.

Chunk rules: the fused loss's rows per chunk (:func:`default_chunk_size`) and the
all-gather transport's chunks per block (:func:`default_kv_chunks`).

Token layout: the zigzag slots' runs (:func:`zigzag_slot_runs`), shared by the layout object
(:class:`hybridsp.layout._layouts.Zigzag`) and the torch-free balanced layout.
"""

from __future__ import annotations

import math
from typing import overload

SPILL_WRITES_IN_FLIGHT = 2  # the offload's disk tier: writes queued before the forward waits (its staging copies)
FP32 = 4  # bytes of one float32
CHUNK_LOGITS_BYTES = 64 * 2**20  # default fused-loss chunk: its fp32 logits take at most 64 MiB


# ----------------------------------------------------------------------------- heads


def heads_divisible(num_heads: int, ulysses: int) -> bool:
    """Whether a U-way head scatter can split ``num_heads`` query heads evenly."""
    return num_heads % ulysses == 0


def kv_repeats_for(num_heads: int, num_kv_heads: int, ulysses: int) -> int:
    """How many times each K/V head must be repeated before a U-way head scatter.

    With query group size ``g = H / Hkv`` and ``H/U`` query heads per rank, the local
    group size becomes ``gcd(g, H/U)``, so each K/V head is repeated ``g / gcd(g, H/U)``
    times: 1 when Hkv % U == 0 (no copies), Hkv' = U copies in total when a rank's
    queries all share one K/V head.
    """
    group = num_heads // num_kv_heads
    return group // math.gcd(group, num_heads // ulysses)


def expanded_kv_heads(num_heads: int, num_kv_heads: int, ulysses: int) -> int:
    """K/V heads after the :func:`kv_repeats_for` expansion (Hkv'; Hkv' % U == 0)."""
    return num_kv_heads * kv_repeats_for(num_heads, num_kv_heads, ulysses)


HEAD_CHUNK_BYTES = 64 * 2**20  # head_chunks="auto": one head group's ring-slot q/k/v/out take at most 64 MiB


def head_chunk_kv_heads(num_heads: int, num_kv_heads: int, ulysses: int) -> int:
    """K/V heads one Ulysses rank holds after the head scatter (Hkv' / U): what ``head_chunks`` G must
    divide (the groups split along K/V heads, so no K/V head travels twice)."""
    return expanded_kv_heads(num_heads, num_kv_heads, ulysses) // ulysses


def auto_head_chunks(kv_heads_per_rank: int, slot_bytes: int, target: int = HEAD_CHUNK_BYTES) -> int:
    """``head_chunks="auto"``: the smallest divisor G of a rank's K/V heads whose groups keep at most
    ``target`` bytes of ring-slot q/k/v/out each (``slot_bytes / G``; ``slot_bytes`` = the rank's
    ``B (S/R) (h D + hkv (D + Dv) + h Dv) e`` after the all-to-all); one K/V head per group when no
    divisor is small enough. 1 (no chunking) for a slot of at most ``target`` bytes."""
    for groups in range(1, kv_heads_per_rank + 1):
        if kv_heads_per_rank % groups == 0 and slot_bytes <= target * groups:
            return groups
    return kv_heads_per_rank


# ----------------------------------------------------------------------------- bytes


def all_to_all_sent(nbytes: int, ulysses: int) -> int:
    """Bytes of a ``nbytes`` tensor that leave a rank in a U-way all-to-all: (U - 1) / U."""
    return nbytes * (ulysses - 1) // ulysses


def kv_row_bytes(
    batch: int, kv_heads_expanded: int, ulysses: int, head_dim: int, element_size: int, v_head_dim: int | None = None
) -> int:
    """Bytes of one token's K and V for one rank's heads after the all-to-all: B (Hkv'/U) (D + Dv) e
    (``v_head_dim`` Dv defaults to D: 2 B (Hkv'/U) D e)."""
    dims = head_dim + (head_dim if v_head_dim is None else v_head_dim)
    return batch * (kv_heads_expanded // ulysses) * dims * element_size


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


@overload
def kv_transport(kv_comm: str, ring: int, block: int, sent: int, read: int) -> tuple[int, int, int]: ...


@overload
def kv_transport(kv_comm: str, ring: int, block: float, sent: float, read: float) -> tuple[float, float, float]: ...


def kv_transport(kv_comm: str, ring: int, block: float, sent: float, read: float) -> tuple[float, float, float]:
    """(forward K/V, backward K/V, backward dK/dV) one rank sends per layer, in the unit of
    ``block`` (one whole K/V block): the all-gather ships ``R - 1`` whole blocks each way and
    reduce-scatters ``R - 1`` blocks of dK/dV; the ring sends what others read (``sent``)
    each pass and the dK/dV of what it read (``read``) home once."""
    if kv_comm == "allgather":
        whole = (ring - 1) * block
        return whole, whole, whole
    return sent, sent, read


def hybrid_bytes(
    *,
    batch: int,
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ulysses: int,
    ring: int,
    ring_rank: int,
    element_size: int,
    layout: str = "zigzag",
    causal: bool = True,
    kv_comm: str = "ring",
    rows: tuple[int, int] | None = None,
    v_head_dim: int | None = None,
) -> dict[str, int]:
    """Bytes one rank sends per forward + backward, by collective kind (only kinds that send).

    ``rows``: (rows sent, rows read) per pass when a block plan knows them (packed documents,
    windows, the balanced layout; :func:`hybridsp.attention._volume.hybrid_bytes` takes the plan);
    default the dense formula :func:`ring_rows`. ``v_head_dim``: v's (and out's) head dim when it
    differs from ``head_dim`` (q's and k's). Sinks add nothing: they never travel."""
    sent: dict[str, int] = {}
    kv_heads_sent = expanded_kv_heads(heads, kv_heads, ulysses)
    dv = head_dim if v_head_dim is None else v_head_dim
    if ulysses > 1:
        token = batch * element_size  # one token of one head, per head-dim column
        local = seq_len // (ulysses * ring)
        qkv = local * token * ((heads + kv_heads_sent) * head_dim + kv_heads_sent * dv)
        out = local * token * heads * dv
        # forward q/k/v and out; backward dout (like out) and dq/dk/dv (like q/k/v)
        sent["all_to_all"] = 2 * (all_to_all_sent(qkv, ulysses) + all_to_all_sent(out, ulysses))
    if ring == 1:
        return sent
    slot = seq_len // ring
    row = kv_row_bytes(batch, kv_heads_sent, ulysses, head_dim, element_size, dv)
    rows_sent, rows_read = ring_rows(ring, ring_rank, slot, layout, causal) if rows is None else rows
    forward, backward, grads = kv_transport(kv_comm, ring, slot, rows_sent, rows_read)
    if kv_comm == "allgather":
        sent["allgather"] = (forward + backward) * row
        sent["reduce_scatter"] = grads * row
    else:
        sent["ring"] = (forward + backward + grads) * row
    return sent


# ----------------------------------------------------------------------------- token layout


def zigzag_slot_runs(seq_len: int, ring: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per ring slot, its ``(global start, length)`` runs under zigzag: slot ``r`` holds chunks ``r``
    and ``2R-1-r`` of ``2R`` equal chunks of ``c = S / 2R`` tokens: ``((r c, c), ((2R-1-r) c, c))``.
    ``seq_len`` must be a multiple of ``2 * ring`` (the callers check)."""
    chunk = seq_len // (2 * ring)
    return tuple(((r * chunk, chunk), ((2 * ring - 1 - r) * chunk, chunk)) for r in range(ring))


# ----------------------------------------------------------------------------- chunk rules


def default_chunk_size(vocab_size: int, tokens: int | None = None, hidden_size: int | None = None) -> int:
    """Fused-loss tokens per chunk when ``chunk_size=None``.

    ``ceil(tokens x hidden_size / vocab_size)`` rows: the chunk's logits [c, V] are as large as the
    hidden states [T, h] (the rule of Liger-Kernel's fused linear cross-entropy), so the loss's
    memory grows like the activations' rather than like V; at most 64 MiB of fp32 logits
    (``CHUNK_LOGITS_BYTES``), at least one token. Without ``tokens`` / ``hidden_size``: the cap.
    """
    cap = max(1, CHUNK_LOGITS_BYTES // (FP32 * vocab_size))
    if tokens is None or hidden_size is None:
        return cap
    return max(1, min(cap, -(-tokens * hidden_size // vocab_size)))


def default_kv_chunks(ring: int, local_len: int) -> int:
    """All-gather chunks per block so a gathered chunk holds at most two blocks: the largest
    divisor of ``local_len`` not above ``max(1, ring // 2)``."""
    chunks = max(1, ring // 2)
    while local_len % chunks:
        chunks -= 1
    return chunks
