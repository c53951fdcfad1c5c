"""Ring attention: exact attention over a sequence sharded across a ring of ranks.

Each of the ``R`` ranks of ``group`` holds ``S/R`` query tokens and the matching key/value
tokens. Which local query rows see which rows of every other rank's K/V block is a
:class:`~hybridsp.layout._block_plan.BlockPlan` that every rank derives without communication, for
dense causal attention, packed documents and sliding windows alike. Two transports bring
the blocks (``kv_comm``), both computing exactly the plan's pieces and merging them by
log-sum-exp in fp32 (fp64 for fp64 inputs) in one autograd shell (:mod:`hybridsp.attention._ring_function`):

- ``"ring"`` (default, :mod:`hybridsp.attention._transport.p2p`): ``R - 1`` point-to-point steps, each
  sending only the rows the receiver reads; dK/dV go straight home in the input dtype.
  Memory: two K/V blocks in flight.
- ``"allgather"`` (:mod:`hybridsp.attention._transport.allgather`): K/V gathered in chunks over the ring group,
  one collective per chunk (no per-step latency), dK/dV back by a reduce-scatter. Memory:
  two gathered chunks (``2 R / kv_chunks`` blocks).

A ring of one that nothing masks runs one kernel call on the whole local sequence.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist

from hybridsp._comm import CommCounter
from hybridsp._types import BackendName, KVComm, LayoutName
from hybridsp.attention._resolve import RingCall, resolve_ring_call
from hybridsp.attention._ring_function import RingAttentionFunction
from hybridsp.attention._spec import CallSpec, CuSeqlens
from hybridsp.kernels import AttentionKernel
from hybridsp.layout._layouts import TokenLayout


def run_ring(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: RingCall, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """A resolved call on one ring slot's q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] -> out
    [B, S, H, Dv]; ``sinks`` [H]: the sink logits of these H heads (:mod:`hybridsp.attention._sinks`)."""
    return cast(torch.Tensor, RingAttentionFunction.apply(q, k, v, sinks, call))


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool = True,
    cu_seqlens: CuSeqlens = None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
    backend: BackendName | AttentionKernel = "auto",
    layout: LayoutName | TokenLayout = "zigzag",
    counter: CommCounter | None = None,
    kv_comm: KVComm = "ring",
    kv_chunks: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: [B, S_local, H, D] this rank's queries, in ``layout`` order (see :mod:`hybridsp.layout._layouts`).
        k, v: [B, S_local, Hkv, D] and [B, S_local, Hkv, Dv] the matching keys and values (H % Hkv == 0;
            Dv may differ from D).
        group: the ring's process group (explicit; ``None`` means a ring of one, no communication).
        causal: causal masking by global token position.
        cu_seqlens: packed documents: int boundaries ``[num_docs + 1]`` over the *global*
            sequence (``S_local x R`` tokens, in natural order, not layout order), the same on
            every ring rank; shared by all batch rows, or ``[B, num_docs + 1]`` / a list of B
            such boundaries (one per row), or a :class:`~hybridsp.layout._documents.Documents`.
            Queries attend keys of their own document only.
        sliding_window: W: query i attends keys j with ``i - W < j <= i`` (``|i - j| < W``
            when not causal); None for no window.
        softmax_scale: defaults to 1/sqrt(D).
        backend: a kernel name (``auto``, ``torch``, ``flash``, ``reference``) or kernel object.
        layout: ``zigzag`` (balanced causal work), ``contiguous``, ``balanced`` (by documents) or a
            :class:`~hybridsp.layout._layouts.TokenLayout`.
        counter: optional :class:`CommCounter` that records the bytes this rank sends.
        kv_comm: ``"ring"`` (point-to-point steps) or ``"allgather"`` (chunked all-gather of
            K/V, reduce-scatter of dK/dV); see the module docstring for when to pick which.
        kv_chunks: all-gather mode only: chunks per rank's block (divides S_local); None picks
            :func:`hybridsp._formulas.default_kv_chunks` (gathered chunks of at most two blocks).
        sinks: learned attention sinks [H], as in :func:`hybridsp.attention._api.hybrid_attn_func`.
        softcap: logit soft-capping, as there.

    Returns:
        out [B, S_local, H, Dv] in q's dtype, differentiable in q, k, v (and sinks).

    Raises:
        ValueError, on every rank and before any K/V moves, for inputs the ring cannot run or
        ranks that disagree (one small agreement check per call; see :mod:`hybridsp.attention._resolve`).
    """
    ring = 1 if group is None else dist.get_world_size(group)
    spec = CallSpec(
        causal=causal,
        cu_seqlens=cu_seqlens,
        sliding_window=sliding_window,
        softmax_scale=softmax_scale,
        backend=backend,
        layout=layout,
        kv_comm=kv_comm,
        kv_chunks=kv_chunks,
        softcap=softcap,
        counter=counter,
    )
    call = resolve_ring_call(q, k, v, spec, group=group, ring=ring, agreement_group=group, sinks=sinks)
    return run_ring(q, k, v, call, sinks)
