"""Ring attention: exact attention over a sequence sharded across a ring of ranks.

Each of the ``R`` ranks of ``group`` holds ``S/R`` query tokens and the matching key/value
tokens. Which local query rows see which rows of every other rank's K/V block is a
:class:`~hybridsp.masks.BlockPlan` that every rank derives without communication, for
dense causal attention, packed documents and sliding windows alike. Two transports bring
the blocks (``kv_comm``), both computing exactly the plan's pieces and merging them by
log-sum-exp in fp32 (fp64 for fp64 inputs):

- ``"ring"`` (default, :mod:`hybridsp.p2p_ring`): ``R - 1`` point-to-point steps, each
  sending only the rows the receiver reads; dK/dV go straight home in the input dtype.
  Memory: two K/V blocks in flight.
- ``"allgather"`` (:mod:`hybridsp.allgather`): K/V gathered in chunks over the ring group,
  one collective per chunk (no per-step latency), dK/dV back by a reduce-scatter. Memory:
  two gathered chunks (``2 R / kv_chunks`` blocks).

A ring of one runs one kernel call on the whole local sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridsp.allgather import AllGatherFunction, check_kv_chunks, resolve_kv_chunks
from hybridsp.comm import CommCounter
from hybridsp.kernels import AttentionKernel, check_qkv, default_softmax_scale, resolve_kernel
from hybridsp.layout import LAYOUTS
from hybridsp.masks import BlockPlan, build_plan, check_sliding_window, normalize_cu_seqlens
from hybridsp.mesh import KV_COMMS
from hybridsp.p2p_ring import P2PRingFunction, ring_size_rank

class _SingleKernelFunction(torch.autograd.Function):
    """Ring size 1: one kernel call on the whole local sequence, no communication."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, causal, scale):
        out, lse = kernel.forward(q, k, v, causal=causal, softmax_scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (kernel, causal, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, causal, scale = ctx.settings
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)
        return dq, dk, dv, None, None, None


def check_softmax_scale(softmax_scale: float | None) -> None:
    """Raise ValueError unless the scale is None or a finite positive number."""
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not (
        0 < float(softmax_scale) < float("inf")
    ):
        raise ValueError(f"softmax_scale must be a finite positive number (or None for 1/sqrt(D)); got {softmax_scale!r}")


def check_ring_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, layout: str, softmax_scale: float | None = None
) -> None:
    """Raise ValueError for inputs the ring cannot run (before any communication)."""
    check_qkv(q, k, v, causal=False)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"ring attention needs as many local queries as keys; got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"unknown token layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    check_softmax_scale(softmax_scale)
    if causal and layout == "zigzag" and q.shape[1] % 2 != 0:
        raise ValueError(
            f"the zigzag layout holds two equal chunks per rank, so the local sequence length must be "
            f"even; got {q.shape[1]}"
        )


def check_kv_comm(kv_comm: str) -> None:
    """Raise ValueError unless ``kv_comm`` names a K/V transport."""
    if kv_comm not in KV_COMMS:
        raise ValueError(f"unknown kv_comm {kv_comm!r}; choose one of {', '.join(map(repr, KV_COMMS))}")


def attention_plan(q: torch.Tensor, group, causal: bool, layout: str, cu_seqlens, sliding_window) -> BlockPlan | None:
    """The block plan of one call, or None for a ring of one that nothing masks (one kernel call).

    Validates ``cu_seqlens`` and ``sliding_window`` (ValueError, before any communication).
    """
    check_sliding_window(sliding_window)
    size, _ = ring_size_rank(group)
    seq_len = q.shape[1] * size
    docs = normalize_cu_seqlens(cu_seqlens, q.shape[0], seq_len)
    window = None if sliding_window is None or sliding_window >= seq_len else sliding_window
    if size == 1 and docs is None and window is None:
        return None
    return build_plan(seq_len, size, layout, causal=causal, docs=docs, window=window, batch=q.shape[0])


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool = True,
    cu_seqlens=None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
    backend: str | AttentionKernel = "auto",
    layout: str = "zigzag",
    counter: CommCounter | None = None,
    kv_comm: str = "ring",
    kv_chunks: int | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: [B, S_local, H, D] this rank's queries, in ``layout`` order (see :mod:`hybridsp.layout`).
        k, v: [B, S_local, Hkv, D] the matching keys and values (H % Hkv == 0).
        group: the ring's process group (explicit; ``None`` means a ring of one, no communication).
        causal: causal masking by global token position.
        cu_seqlens: packed documents: int boundaries ``[num_docs + 1]`` over the *global*
            sequence (``S_local x R`` tokens, in natural order, not layout order), the same on
            every ring rank; shared by all batch rows, or ``[B, num_docs + 1]`` / a list of B
            such boundaries (one per row). Queries attend keys of their own document only.
        sliding_window: W: query i attends keys j with ``i - W < j <= i`` (``|i - j| < W``
            when not causal); None for no window.
        softmax_scale: defaults to 1/sqrt(D).
        backend: a kernel name (``auto``, ``torch``, ``flash``, ``reference``) or kernel object.
        layout: ``zigzag`` (balanced causal work) or ``contiguous``.
        counter: optional :class:`CommCounter` that records the bytes this rank sends.
        kv_comm: ``"ring"`` (point-to-point steps) or ``"allgather"`` (chunked all-gather of
            K/V, reduce-scatter of dK/dV); see the module docstring for when to pick which.
        kv_chunks: all-gather mode only: chunks per rank's block (divides S_local); None picks
            :func:`hybridsp.allgather.default_kv_chunks` (gathered chunks of at most two blocks).

    Returns:
        out [B, S_local, H, D] in q's dtype, differentiable in q, k and v.
    """
    check_ring_inputs(q, k, v, causal, layout, softmax_scale)
    check_kv_comm(kv_comm)
    if kv_comm == "allgather":
        check_kv_chunks(kv_chunks, q.shape[1])
    plan = attention_plan(q, group, causal, layout, cu_seqlens, sliding_window)
    kernel = resolve_kernel(backend, q)
    scale = default_softmax_scale(q.shape[-1], softmax_scale)
    if plan is None:
        return _SingleKernelFunction.apply(q, k, v, kernel, causal, scale)
    if kv_comm == "allgather" and plan.ring > 1:
        chunks = resolve_kv_chunks(kv_chunks, plan.ring, q.shape[1])
        return AllGatherFunction.apply(q, k, v, group, kernel, scale, plan, chunks, counter)
    return P2PRingFunction.apply(q, k, v, group, kernel, scale, plan, counter)
