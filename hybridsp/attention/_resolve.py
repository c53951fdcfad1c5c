"""Validate once, resolve once: everything one attention call needs before its first collective.

:func:`resolve_ring_call` turns a call's arguments into a :class:`RingCall` — the kernel (one
instance per process, backend and device type), the softmax scale, the K/V transport and the
block plan — after checking every argument (ValueError, quoting the numbers, before any
communication). The plan comes from the batch's :class:`~hybridsp.layout._documents.Documents`, where
it is kept: every layer of a forward over the same batch reuses it.

Note [agreement]: ranks that disagree on an input (a local length, a window, the documents)
would post mismatched sends and hang. :func:`check_agreement` compares a small fingerprint of
the call with one ``all_reduce`` over the communicating group and raises ValueError on every
rank when any field differs. It runs on *every* call: whether a rank enters a collective must
not depend on anything that can differ between ranks, and a memo of "already agreed" settings
can (rank 1 with a new window would run the check while the others, seeing settings agreed on
an earlier layer, skip it and hang in the ring; and a rank may switch to settings agreed on
another layer). The cost is one all_reduce of 38 int64 and one host read of its result per call:
one collective latency (on 2 gloo ranks sharing 2 busy CPU cores, +3 ms on a 35 ms S=2048 call);
the :class:`Documents` keeps the fingerprint tensor, so nothing is rebuilt per layer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from hybridsp._checks import check_head_chunks, check_positive
from hybridsp._comm import CommCounter
from hybridsp._formulas import auto_head_chunks, default_kv_chunks, head_chunk_kv_heads, heads_divisible
from hybridsp._types import KV_COMMS, KVComm
from hybridsp.attention._spec import CallSpec
from hybridsp.attention._transport.allgather import AllGatherTransport
from hybridsp.attention._transport.base import Transport
from hybridsp.attention._transport.local import LocalTransport
from hybridsp.attention._transport.p2p import P2PTransport
from hybridsp.kernels import AttentionKernel, check_qkv, default_softmax_scale, resolve_kernel
from hybridsp.kernels._base import FLOAT_DTYPES
from hybridsp.layout._block_plan import BlockPlan, build_plan, check_sliding_window
from hybridsp.layout._documents import Documents, as_documents
from hybridsp.layout._layouts import LAYOUTS, TokenLayout, get_layout


@dataclass(frozen=True)
class RingCall:
    """One resolved ring attention call (immutable; the autograd shell keeps it for the backward):
    the checked :class:`~hybridsp.attention._spec.CallSpec` and what was resolved from it."""

    spec: CallSpec
    group: dist.ProcessGroup | None
    ring: int
    rank: int
    kernel: AttentionKernel
    scale: float
    plan: BlockPlan | None  # None: one kernel call on the whole local sequence
    kv_chunks: int | None  # the all-gather transport's chunks per block; None for the other transports
    head_chunks: int = 1  # the head groups G the call runs in turn (hybridsp.attention._head_chunks)

    @property
    def causal(self) -> bool:
        return self.spec.causal

    @property
    def kv_comm(self) -> KVComm:
        return self.spec.kv_comm

    @property
    def counter(self) -> CommCounter | None:
        return self.spec.counter

    @property
    def softcap(self) -> float | None:
        """The kernels' soft-capping (:mod:`hybridsp.kernels._base`); None: none."""
        return None if self.spec.softcap is None else float(self.spec.softcap)

    def transport(self, k: torch.Tensor, v: torch.Tensor) -> Transport:
        """The K/V transport of one pass (Note [one shell] in :mod:`hybridsp.attention._ring_function`)."""
        if self.ring == 1:
            return LocalTransport(self, k, v)
        if self.kv_comm == "allgather":
            return AllGatherTransport(self, k, v)
        return P2PTransport(self, k, v)


def check_softmax_scale(softmax_scale: float | None) -> None:
    """Raise ValueError unless the scale is None or a finite positive number."""
    check_positive(softmax_scale, "softmax_scale", or_none="1/sqrt(D)")


def check_softcap(softcap: float | None) -> None:
    """Raise ValueError unless ``softcap`` is None or a finite positive number (scores become
    ``softcap * tanh(scores / softcap)``; Gemma 2 uses 50.0)."""
    check_positive(softcap, "softcap", or_none="no soft-capping; scores become softcap * tanh(scores / softcap)")


def check_sinks(sinks: object, q: torch.Tensor) -> None:
    """Raise ValueError unless ``sinks`` is None or a float tensor [H] on q's device (q [B, S, H, D])."""
    if sinks is None:
        return
    if not torch.is_tensor(sinks) or sinks.dtype not in FLOAT_DTYPES:
        found = type(sinks).__name__ if not torch.is_tensor(sinks) else f"a {sinks.dtype} tensor"
        raise ValueError(f"sinks must be a floating tensor of one logit per query head; got {found}")
    if tuple(sinks.shape) != (q.shape[2],):
        raise ValueError(
            f"sinks must have shape [H] = [{q.shape[2]}] (one logit per query head of q {tuple(q.shape)}); "
            f"got {tuple(sinks.shape)}: pass one sink logit for every query head q holds (all of them here; the "
            f"Ulysses head slices are taken inside)"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {q.device}: move them with .to(q.device)")


def check_kv_comm(kv_comm: str) -> None:
    """Raise ValueError unless ``kv_comm`` names a K/V transport."""
    if kv_comm not in KV_COMMS:
        raise ValueError(f"unknown kv_comm {kv_comm!r}; choose one of {', '.join(map(repr, KV_COMMS))}")


def check_causal(causal: object) -> None:
    """Raise ValueError unless ``causal`` is a bool (``causal="no"`` would silently run as causal)."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False; got {causal!r} ({type(causal).__name__})")


def check_kv_chunks(kv_chunks: int | None, local_len: int) -> None:
    """Raise ValueError unless ``kv_chunks`` is None or a positive divisor of the local length."""
    if kv_chunks is None:
        return
    if isinstance(kv_chunks, bool) or not isinstance(kv_chunks, int) or kv_chunks < 1 or local_len % kv_chunks:
        raise ValueError(
            f"kv_chunks must be a positive integer dividing the {local_len} local tokens per ring rank; "
            f"got {kv_chunks!r}"
        )


def resolve_head_chunks(
    head_chunks: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses: int, ring: int
) -> int:
    """The head groups G of a call on q [B, L, H, D], k [B, L, Hkv, D], v [B, L, Hkv, Dv] (this rank's
    tokens before the all-to-all): ``head_chunks`` checked, ``"auto"`` resolved
    (:func:`hybridsp._formulas.auto_head_chunks`). Raises ValueError (before any communication) unless
    G divides the K/V heads one Ulysses rank holds (Hkv' / U), which also makes it divide the query heads."""
    check_head_chunks(head_chunks)
    per_rank = head_chunk_kv_heads(q.shape[2], k.shape[2], ulysses)
    if head_chunks == "auto":
        b, length, heads, d = q.shape
        slot_heads = heads // ulysses * (d + v.shape[-1]) + per_rank * (d + v.shape[-1])
        return auto_head_chunks(per_rank, b * length * ulysses * slot_heads * q.element_size())
    assert isinstance(head_chunks, int)  # checked: an int or "auto"
    if per_rank % head_chunks:
        one = " (G must then be 1)" if per_rank == 1 else ""
        raise ValueError(
            f"head_chunks={head_chunks} must divide the K/V heads each Ulysses rank holds: {per_rank}{one} "
            f"({k.shape[2]} K/V heads for {q.shape[2]} query heads over ulysses={ulysses}); head groups split along "
            f'K/V heads so that no K/V head is sent twice: choose a divisor of {per_rank}, or "auto"'
        )
    return head_chunks


def resolve_kv_chunks(kv_chunks: int | None, ring: int, local_len: int) -> int:
    """The chunk count of one call: the given one, else :func:`default_kv_chunks`."""
    return default_kv_chunks(ring, local_len) if kv_chunks is None else kv_chunks


def check_ring_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: CallSpec,
    layout: TokenLayout,
    *,
    ring: int,
    ulysses: int,
    sinks: torch.Tensor | None = None,
) -> None:
    """Raise ValueError for inputs the ring cannot run (before any communication).

    ``q`` [B, S_local, H, D], ``k`` [B, S_local, Hkv, D], ``v`` [B, S_local, Hkv, Dv] are this rank's
    tokens (before the Ulysses all-to-all, which makes ``S_local x ulysses`` tokens per ring slot);
    ``layout``: ``spec.layout`` as an object; ``sinks`` [H] or None.
    """
    check_qkv(q, k, v, causal=False)
    check_sinks(sinks, q)
    check_softcap(spec.softcap)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k/v must hold the same local tokens; got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if not heads_divisible(q.shape[2], ulysses):
        raise ValueError(
            f"query heads ({q.shape[2]}) must be divisible by the Ulysses degree ({ulysses}); choose a "
            f"Ulysses degree that divides {q.shape[2]} and move the rest of the context ranks to the ring"
        )
    check_causal(spec.causal)
    check_softmax_scale(spec.softmax_scale)
    check_sliding_window(spec.sliding_window)
    check_kv_comm(spec.kv_comm)
    slot = q.shape[1] * ulysses
    chunks = spec.kv_chunks if spec.kv_comm == "allgather" else None
    if chunks is not None:
        check_kv_chunks(chunks, slot)
    layout.check_sequence_length(slot * ring, ring, ulysses, chunks)


def plan_for(
    documents: Documents, layout: TokenLayout, ring: int, causal: bool, window: int | None
) -> BlockPlan | None:
    """The block plan of a call, kept on the batch's documents; None for a ring of one that nothing masks."""
    window = None if window is None or window >= documents.seq_len else window
    if ring == 1 and not documents.packed and window is None:
        return None
    plan: BlockPlan = documents.remember(
        ("plan", layout, ring, causal, window),
        lambda: build_plan(
            documents.seq_len, ring, layout, causal=causal, docs=documents.rows, window=window, batch=documents.batch
        ),
    )
    return plan


def resolve_ring_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: CallSpec,
    *,
    group: dist.ProcessGroup | None,
    ring: int,
    ulysses: int = 1,
    agreement_group: dist.ProcessGroup | None = None,
    sinks: torch.Tensor | None = None,
) -> RingCall:
    """Check ``spec`` with this call's tensors and resolve it (see the module docstring).

    ``q``/``k``/``v`` are this rank's tokens ``[B, S_local, H(kv), D(v)]`` before any all-to-all;
    ``group``: the ring's process group (None: a ring of one); ``ring``/``ulysses`` the degrees (a
    slot holds ``S_local x ulysses`` tokens); ``agreement_group``: the group whose ranks must agree
    (Note [agreement]; None: no check); ``sinks`` [H] (checked here, merged by the autograd shell).
    """
    layout = get_layout(spec.layout)
    check_ring_inputs(q, k, v, spec, layout, ring=ring, ulysses=ulysses, sinks=sinks)
    slot = q.shape[1] * ulysses
    documents = as_documents(spec.cu_seqlens, q.shape[0], slot * ring)
    kernel = resolve_kernel(spec.backend, q, v, spec.softcap)  # ValueError for a backend that cannot run it
    chunks = resolve_kv_chunks(spec.kv_chunks, ring, slot) if spec.kv_comm == "allgather" else None
    groups = resolve_head_chunks(spec.head_chunks, q, k, v, ulysses, ring)
    fingerprint = CallFingerprint.of(q, k, v, spec, layout, chunks, sinks, groups)
    check_agreement(agreement_group, documents, fingerprint, q.device)
    return _ring_call(q, spec, kernel, group, ring, layout, documents, chunks, groups)


def replay_ring_call(
    q: torch.Tensor, v: torch.Tensor, spec: CallSpec, *, group: dist.ProcessGroup | None, ring: int
) -> RingCall:
    """The :class:`RingCall` of a call :func:`resolve_ring_call` already checked and agreed on, rebuilt
    from one ring slot's ``q`` [B, S_slot, H/U, D] and ``v`` [B, S_slot, Hkv/U, Dv] and the same spec:
    for a backward that could not keep the call (:mod:`hybridsp.attention._compiled`). No checks, no
    communication; the kernel and the plan come from their caches."""
    slot = q.shape[1]
    documents = as_documents(spec.cu_seqlens, q.shape[0], slot * ring)
    chunks = resolve_kv_chunks(spec.kv_chunks, ring, slot) if spec.kv_comm == "allgather" else None
    kernel = resolve_kernel(spec.backend, q, v, spec.softcap)
    return _ring_call(q, spec, kernel, group, ring, get_layout(spec.layout), documents, chunks)


def _ring_call(
    q: torch.Tensor,
    spec: CallSpec,
    kernel: AttentionKernel,
    group: dist.ProcessGroup | None,
    ring: int,
    layout: TokenLayout,
    documents: Documents,
    chunks: int | None,
    groups: int = 1,
) -> RingCall:
    """The :class:`RingCall` of a checked spec and its kernel: this rank's place, the plan, the scale."""
    rank = 0 if group is None else dist.get_rank(group)
    plan = plan_for(documents, layout, ring, spec.causal, spec.sliding_window)
    scale = default_softmax_scale(q.shape[-1], spec.softmax_scale)
    return RingCall(spec, group, ring, rank, kernel, scale, plan, chunks, groups)


class CallFingerprint(NamedTuple):
    """The call settings every rank of a group must share, as small integers (Note [agreement])."""

    batch: int
    local_tokens: int
    query_heads: int
    head_dim: int  # q's and k's
    kv_heads: int
    v_head_dim: int
    dtype: int  # index into FLOAT_DTYPES
    causal: int
    sliding_window: int  # -1: none
    softmax_scale: int  # the float64 bits >> 2 (0: the default 1/sqrt(D))
    layout: int  # index into LAYOUTS
    placement_window: int  # the window the layout placed tokens for (Note [placement window]); -1: none
    kv_comm: int  # index into KV_COMMS
    kv_chunks: int  # 0: not the all-gather transport
    sinks: int  # 0: none, else 1 + the index of their dtype in FLOAT_DTYPES
    softcap: int  # the float64 bits >> 2 (0: none)
    head_chunks: int  # the resolved head groups G

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: CallSpec,
        layout: TokenLayout,
        chunks: int | None,
        sinks: torch.Tensor | None = None,
        head_chunks: int = 1,
    ) -> CallFingerprint:
        """The fingerprint of a call on q [B, S_local, H, D], k [B, S_local, Hkv, D], v [B, S_local, Hkv, Dv]
        (``layout``: the spec's layout object; ``chunks``: the resolved all-gather chunks)."""
        window = spec.sliding_window
        batch, local_tokens, query_heads, head_dim = q.shape  # 4-D (checked): the first four fields
        return cls(
            batch,
            local_tokens,
            query_heads,
            head_dim,
            k.shape[2],
            v.shape[-1],
            FLOAT_DTYPES.index(q.dtype),
            int(spec.causal),
            -1 if window is None else window,
            _float_bits(spec.softmax_scale),
            LAYOUTS.index(layout.name),
            -1 if layout.window is None else layout.window,
            KV_COMMS.index(spec.kv_comm),
            chunks or 0,
            0 if sinks is None else 1 + FLOAT_DTYPES.index(sinks.dtype),
            _float_bits(spec.softcap),
            head_chunks,
        )


def _float_bits(value: float | None) -> int:
    """A positive float as an int64-safe integer (its float64 bits >> 2); 0 for None."""
    return 0 if value is None else struct.unpack("<Q", struct.pack("<d", float(value)))[0] >> 2


# what an error calls each field; the two halves of the documents' digest follow the fingerprint
_LABELS = {
    "local_tokens": "local tokens",
    "query_heads": "query heads",
    "head_dim": "head dim",
    "kv_heads": "K/V heads",
    "v_head_dim": "value head dim",
    "placement_window": "placement window",
    "head_chunks": "head_chunks",
}
_NAMES = tuple(_LABELS.get(field, field) for field in CallFingerprint._fields) + ("documents", "documents")


def check_agreement(
    group: dist.ProcessGroup | None, documents: Documents, fields: CallFingerprint, device: torch.device
) -> None:
    """Raise ValueError on every rank of ``group`` unless all ranks call with the same settings and
    documents (Note [agreement]); one small all_reduce on every call, whatever was agreed before."""
    if group is None or dist.get_world_size(group) == 1:
        return
    mine: torch.Tensor = documents.remember(  # [17 + 2] int64: the fields, then the documents' digest
        ("fingerprint", fields, device),
        lambda: torch.tensor([*fields, *documents.digest()], dtype=torch.int64, device=device),
    )
    extremes = torch.cat([mine, -mine])  # [38]: max of x and of -x give the max and the min
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    high, low = extremes[: mine.numel()], -extremes[mine.numel() :]
    differ = (high != low).nonzero().flatten().tolist()
    if differ:
        names = sorted({_NAMES[i] for i in differ})
        raise ValueError(
            f"the ranks of one attention call disagree on {', '.join(names)} (this rank, {dist.get_rank()}: batch "
            f"{fields.batch}, local tokens {fields.local_tokens}, heads {fields.query_heads}/{fields.kv_heads}, "
            f"sliding_window {None if fields.sliding_window < 0 else fields.sliding_window}, {documents!r}): every "
            f"rank of a context group must pass the same settings, the same cu_seqlens and equally long shards "
            f"(shard them with hybridsp.shard_batch)"
        )
