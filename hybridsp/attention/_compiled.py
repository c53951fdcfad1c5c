"""One hybrid attention call under ``torch.compile``: the whole distributed call as one custom operator.

Note [compiled call]: what a call does on the host cannot be traced into a graph: the documents'
digest, the ranks' agreement ``all_reduce`` and its host read, the block plan, point-to-point sends
with async handles (each one a graph break). Under ``torch.compile``
:func:`~hybridsp.attention._api.hybrid_attn_func` is therefore one opaque node,
``torch.ops.hybridsp.attention`` (``attention_documents`` when it gets the batch's
:class:`~hybridsp.layout._documents.Documents`), with a fake implementation that gives the output
shapes and a registered autograd formula (``attention_backward`` / ``attention_documents_backward``).
Inside the node everything runs as in eager (the same resolve, agreement check, transports and
kernels), so the compiled result is the eager one bit for bit.

The mesh and the documents enter the graph as opaque references (their ``.opaque``, a
:class:`~hybridsp._opaque.OpaqueRef`): the graph has no guard on the documents' boundaries, so a packed
batch with new documents runs the same graph (no recompilation; the plan is data the node reads).
The Ulysses degree and ``kv_comm`` are read while tracing (constants of the graph, guarded).

The node keeps for its backward what eager's autograd keeps: under Ulysses the heads-first buffers
of q/k/v after the all-to-all (:func:`~hybridsp.attention._ulysses.seq_to_heads_buffers`) and the
ring's out and lse on them; without Ulysses the inputs, out and lse. The backward rebuilds the call
(:func:`~hybridsp.attention._resolve.replay_ring_call`: kernel and plan from their caches, no
agreement collective, the forward's covered the same inputs; the byte counter is the mesh's
``comm_counter`` when the backward runs). Every output is contiguous (the fake
implementation says so, and the real one is made so), the one copy the caller's reshape would make.

Shapes: q [B, L, H, D], k [B, L, Hkv, D], v [B, L, Hkv, Dv] this rank's tokens; U the Ulysses degree;
out [B, L, H, Dv]; under Ulysses a ring slot holds U*L tokens of H/U heads.
"""

from typing import Any, Optional, Union, cast

import torch
import torch.distributed as dist

from hybridsp._comm import CommCounter
from hybridsp._formulas import expanded_kv_heads
from hybridsp._opaque import OpaqueRef
from hybridsp._types import BackendName, HeadChunks, KVComm
from hybridsp.attention._resolve import (
    check_causal,
    check_softcap,
    check_softmax_scale,
    replay_ring_call,
    resolve_ring_call,
)
from hybridsp.attention._ring_function import ring_backward, ring_forward
from hybridsp.attention._sinks import sink_grad
from hybridsp.attention._spec import CallSpec, CuSeqlens
from hybridsp.attention._ulysses import (
    expand_kv_heads_for,
    heads_of_rank,
    heads_to_seq_plain,
    seq_to_heads_buffers,
    split_heads,
)
from hybridsp.kernels import AttentionKernel, accumulation_dtype
from hybridsp.kernels._base import reduce_kv_heads
from hybridsp.layout._documents import Documents
from hybridsp.mesh._hybrid_mesh import HybridMesh

Boundaries = Union[torch.Tensor, list[torch.Tensor], list[list[int]], None]
"""``cu_seqlens`` in any form but a Documents (:data:`~hybridsp.attention._spec.CuSeqlens`)."""
Bounds = Union[OpaqueRef, list[torch.Tensor]]
"""What an operator gets for the documents: a Documents' reference, or :func:`boundary_tensors`."""


def compiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: HybridMesh,
    causal: bool,
    cu_seqlens: CuSeqlens,
    sliding_window: Optional[int],
    softmax_scale: Optional[float],
    backend: Union[BackendName, AttentionKernel],
    counter: Optional[CommCounter],
    kv_comm: Optional[KVComm],
    sinks: Optional[torch.Tensor],
    softcap: Optional[float],
    head_chunks: HeadChunks = 1,
) -> torch.Tensor:
    """:func:`~hybridsp.attention._api.hybrid_attn_func` while dynamo traces (Note [compiled call]);
    the same arguments, out [B, L, H, Dv]; all heads at once. Raises ValueError, while tracing, for a kernel
    object as ``backend`` (name one), a ``counter`` (set ``mesh.comm_counter``): neither can enter a graph;
    or an int ``head_chunks`` > 1 (eager only)."""
    if head_chunks not in (1, "auto"):
        raise ValueError(
            f'under torch.compile head_chunks must be 1 or "auto" (all heads at once); got {head_chunks!r}'
        )
    if not isinstance(backend, str):
        raise ValueError(
            f"under torch.compile, backend must be a kernel name ('auto', 'torch', 'flash', "
            f"'reference'); got a {type(backend).__name__} object"
        )
    if counter is not None:
        raise ValueError("under torch.compile, pass no counter: set mesh.comm_counter, which every call records into")
    check_causal(causal)
    check_softmax_scale(softmax_scale)
    check_softcap(softcap)
    settings = (
        causal,
        sliding_window,
        None if softmax_scale is None else float(softmax_scale),
        backend,
        mesh.kv_comm if kv_comm is None else kv_comm,
        None if softcap is None else float(softcap),
    )
    if isinstance(cu_seqlens, Documents):
        return cast(
            torch.Tensor,
            torch.ops.hybridsp.attention_documents(
                q, k, v, sinks, mesh.opaque, mesh.ulysses, cu_seqlens.opaque, *settings
            )[0],
        )
    return cast(
        torch.Tensor,
        torch.ops.hybridsp.attention(
            q, k, v, sinks, mesh.opaque, mesh.ulysses, boundary_tensors(cu_seqlens), *settings
        )[0],
    )


def boundary_tensors(cu_seqlens: Boundaries) -> list[torch.Tensor]:
    """``cu_seqlens`` in any form but a Documents as a list of tensors: [] for None, [one] for a
    tensor shared by the rows or [B, N + 1], else one per row (Python ints become constants)."""
    if cu_seqlens is None:
        return []
    if torch.is_tensor(cu_seqlens):
        return [cu_seqlens]
    if all(isinstance(bound, int) for bound in cu_seqlens):
        return [torch.tensor(list(cu_seqlens), dtype=torch.int64)]
    return [row if torch.is_tensor(row) else torch.tensor(list(row), dtype=torch.int64) for row in cu_seqlens]


def _as_cu_seqlens(bounds: Bounds) -> CuSeqlens:
    """The inverse of :func:`boundary_tensors` (a Documents' reference gives the Documents)."""
    if isinstance(bounds, OpaqueRef):
        documents: Documents = bounds.value
        return documents
    return None if not bounds else bounds[0] if len(bounds) == 1 else list(bounds)


def _spec(
    mesh: HybridMesh,
    bounds: Bounds,
    causal: bool,
    window: Optional[int],
    scale: Optional[float],
    backend: BackendName,
    kv_comm: KVComm,
    softcap: Optional[float],
) -> CallSpec:
    """The :class:`CallSpec` :func:`resolve_ring_call` and :func:`replay_ring_call` share."""
    return CallSpec.on_mesh(
        mesh,
        kv_comm=kv_comm,
        head_chunks=1,  # all heads at once (compiled_attention)
        causal=causal,
        cu_seqlens=_as_cu_seqlens(bounds),
        sliding_window=window,
        softmax_scale=scale,
        backend=backend,
        softcap=softcap,
    )


def _ring_group(mesh: HybridMesh) -> Optional[dist.ProcessGroup]:
    return mesh.ring_group if mesh.ring > 1 else None


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: Optional[torch.Tensor],
    mesh_ref: OpaqueRef,
    ulysses: int,
    bounds: Bounds,
    *settings: Any,
) -> list[torch.Tensor]:
    """[out, lse] without Ulysses, [out, lse, out_slot, *q/k/v buffers] with (Note [compiled call])."""
    mesh: HybridMesh = mesh_ref.value
    call = resolve_ring_call(
        q,
        k,
        v,
        _spec(mesh, bounds, *settings),
        group=_ring_group(mesh),
        ring=mesh.ring,
        ulysses=mesh.ulysses,
        sinks=sinks,
        agreement_group=mesh.context_group if mesh.context > 1 else None,
    )
    acc = accumulation_dtype(q.dtype)
    if mesh.ulysses == 1:
        out, lse = ring_forward(q, k, v, sinks, call)
        return [out.contiguous(), lse.to(acc).contiguous()]
    heads, kv_heads = q.shape[2], k.shape[2]
    k, v = expand_kv_heads_for(k, heads, mesh.ulysses), expand_kv_heads_for(v, heads, mesh.ulysses)
    buffers = seq_to_heads_buffers([q, k, v], mesh.ulysses_group, call.counter)
    q_slot, k_slot, v_slot = _slot_views(buffers, heads, expanded_kv_heads(heads, kv_heads, mesh.ulysses), mesh.ulysses)
    out_slot, lse = ring_forward(q_slot, k_slot, v_slot, heads_of_rank(sinks, mesh), call)
    out_slot = out_slot.contiguous()  # [B, U*L, H/U, Dv]
    (out,) = heads_to_seq_plain([out_slot], mesh.ulysses_group, call.counter)  # [B, L, H, Dv]
    return [out.contiguous(), lse.to(acc).contiguous(), out_slot, *buffers]


def _forward_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: Optional[torch.Tensor],
    mesh_ref: OpaqueRef,
    ulysses: int,
    bounds: Bounds,
    *settings: Any,
) -> list[torch.Tensor]:
    """The shapes and dtypes of :func:`_forward`."""
    b, length, heads, d = q.shape
    dv, u, acc = v.shape[-1], ulysses, accumulation_dtype(q.dtype)
    out = q.new_empty(b, length, heads, dv)
    if u == 1:
        return [out, q.new_empty(b, heads, length, dtype=acc)]
    kv_heads = expanded_kv_heads(heads, k.shape[2], u)
    lse = q.new_empty(b, heads // u, u * length, dtype=acc)
    out_slot = q.new_empty(b, u * length, heads // u, dv)
    if d == dv:
        buffers = [q.new_empty(b, (heads + 2 * kv_heads) // u, u * length, d)]
    else:
        buffers = [
            q.new_empty(b, (heads + kv_heads) // u, u * length, d),
            q.new_empty(b, kv_heads // u, u * length, dv),
        ]
    return [out, lse, out_slot, *buffers]


def _slot_views(buffers: list[torch.Tensor], heads: int, kv_heads: int, ulysses: int) -> list[torch.Tensor]:
    """q, k, v [B, U*L, H(kv)/U, D(v)] of the heads-first buffers of :func:`seq_to_heads_buffers`."""
    h, hkv = heads // ulysses, kv_heads // ulysses
    if len(buffers) == 1:
        return split_heads(buffers[0], [h, hkv, hkv])
    return [*split_heads(buffers[0], [h, hkv]), *split_heads(buffers[1], [hkv])]


def _backward(
    dout: torch.Tensor,
    saved: list[torch.Tensor],
    sinks: Optional[torch.Tensor],
    mesh_ref: OpaqueRef,
    ulysses: int,
    bounds: Bounds,
    kv_heads: int,
    *settings: Any,
) -> list[torch.Tensor]:
    """[dq, dk, dv] (+ [dsinks [H]]) from the forward's saved tensors (Note [compiled call])."""
    mesh: HybridMesh = mesh_ref.value
    spec = _spec(mesh, bounds, *settings)
    if mesh.ulysses == 1:
        q, k, v, out, lse = saved
        call = replay_ring_call(q, v, spec, group=_ring_group(mesh), ring=mesh.ring)
        grads = [g.contiguous() for g in ring_backward(dout, q, k, v, out, lse, call)]
        return grads + ([] if sinks is None else [sink_grad(dout, out, lse, sinks)])
    out_slot, lse, *buffers = saved
    u, heads = mesh.ulysses, out_slot.shape[2] * mesh.ulysses
    q_slot, k_slot, v_slot = _slot_views(buffers, heads, expanded_kv_heads(heads, kv_heads, u), u)
    call = replay_ring_call(q_slot, v_slot, spec, group=_ring_group(mesh), ring=mesh.ring)
    (dout_slot,) = split_heads(seq_to_heads_buffers([dout], mesh.ulysses_group, call.counter)[0], [heads // u])
    slot_grads = ring_backward(dout_slot, q_slot, k_slot, v_slot, out_slot, lse, call)
    dq, dk, dv = heads_to_seq_plain(slot_grads, mesh.ulysses_group, call.counter)  # [B, L, H(kv'), D(v)]
    if dk.shape[2] != kv_heads:
        dk, dv = reduce_kv_heads(dk, kv_heads), reduce_kv_heads(dv, kv_heads)  # [B, L, Hkv, D(v)]
    grads = [dq.contiguous(), dk.contiguous(), dv.contiguous()]
    if sinks is None:
        return grads
    full = torch.zeros_like(sinks)  # [H]: zero for the heads this rank does not hold
    heads_of_rank(full, mesh).copy_(sink_grad(dout_slot, out_slot, lse, heads_of_rank(sinks, mesh)))
    return grads + [full]


def _backward_fake(
    dout: torch.Tensor,
    saved: list[torch.Tensor],
    sinks: Optional[torch.Tensor],
    mesh_ref: OpaqueRef,
    ulysses: int,
    bounds: Bounds,
    kv_heads: int,
    *settings: Any,
) -> list[torch.Tensor]:
    """The shapes of :func:`_backward`: q's, k's, v's (and the sinks')."""
    shapes: list[tuple[torch.Tensor, tuple[int, ...]]]
    if ulysses == 1:
        q, k, v = saved[:3]
        shapes = [(q, q.shape), (k, k.shape), (v, v.shape)]
    else:
        b, length, heads, dv = dout.shape
        d = saved[2].shape[-1]
        shapes = [(dout, (b, length, heads, d)), (dout, (b, length, kv_heads, d)), (dout, (b, length, kv_heads, dv))]
    grads = [like.new_empty(shape) for like, shape in shapes]
    return grads + ([] if sinks is None else [torch.empty_like(sinks)])


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    q, k, v, sinks, mesh_ref, ulysses, bounds, *settings = inputs
    ctx.mesh, ctx.ulysses, ctx.settings, ctx.kv_heads = mesh_ref, ulysses, settings, k.shape[2]
    ctx.has_sinks = sinks is not None
    saved = [q, k, v, output[0], output[1]] if ulysses == 1 else [output[2], output[1], *output[3:]]
    ctx.saved_count = len(saved)
    ctx.documents = bounds if isinstance(bounds, OpaqueRef) else None
    rest = [] if ctx.documents is not None else list(bounds)
    ctx.save_for_backward(*saved, *([sinks] if sinks is not None else []), *rest)


def _autograd_backward(ctx: Any, grads: list[torch.Tensor]) -> tuple[Union[torch.Tensor, list[None], None], ...]:
    """grads: one per output of the forward (a list output's gradients arrive as one list)."""
    tensors = list(ctx.saved_tensors)
    saved, rest = tensors[: ctx.saved_count], tensors[ctx.saved_count :]
    sinks = rest.pop(0) if ctx.has_sinks else None
    if ctx.documents is not None:
        result = torch.ops.hybridsp.attention_documents_backward(
            grads[0], saved, sinks, ctx.mesh, ctx.ulysses, ctx.documents, ctx.kv_heads, *ctx.settings
        )
    else:
        result = torch.ops.hybridsp.attention_backward(
            grads[0], saved, sinks, ctx.mesh, ctx.ulysses, rest, ctx.kv_heads, *ctx.settings
        )
    dsinks = result[3] if ctx.has_sinks else None
    no_bounds = None if ctx.documents is not None else [None] * len(rest)  # the structure of the input
    return (result[0], result[1], result[2], dsinks, None, None, no_bounds, *([None] * len(ctx.settings)))


# The four operators: the call with boundaries as tensors (or none), and with the batch's Documents.
@torch.library.custom_op("hybridsp::attention", mutates_args=())
def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: Optional[torch.Tensor],
    mesh: OpaqueRef,
    ulysses: int,
    bounds: list[torch.Tensor],
    causal: bool,
    window: Optional[int],
    scale: Optional[float],
    backend: str,
    kv_comm: str,
    softcap: Optional[float],
) -> list[torch.Tensor]:
    return _forward(q, k, v, sinks, mesh, ulysses, bounds, causal, window, scale, backend, kv_comm, softcap)


@torch.library.custom_op("hybridsp::attention_documents", mutates_args=())
def _attention_documents(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: Optional[torch.Tensor],
    mesh: OpaqueRef,
    ulysses: int,
    documents: OpaqueRef,
    causal: bool,
    window: Optional[int],
    scale: Optional[float],
    backend: str,
    kv_comm: str,
    softcap: Optional[float],
) -> list[torch.Tensor]:
    return _forward(q, k, v, sinks, mesh, ulysses, documents, causal, window, scale, backend, kv_comm, softcap)


@torch.library.custom_op("hybridsp::attention_backward", mutates_args=())
def _attention_backward(
    dout: torch.Tensor,
    saved: list[torch.Tensor],
    sinks: Optional[torch.Tensor],
    mesh: OpaqueRef,
    ulysses: int,
    bounds: list[torch.Tensor],
    kv_heads: int,
    causal: bool,
    window: Optional[int],
    scale: Optional[float],
    backend: str,
    kv_comm: str,
    softcap: Optional[float],
) -> list[torch.Tensor]:
    return _backward(
        dout, saved, sinks, mesh, ulysses, bounds, kv_heads, causal, window, scale, backend, kv_comm, softcap
    )


@torch.library.custom_op("hybridsp::attention_documents_backward", mutates_args=())
def _attention_documents_backward(
    dout: torch.Tensor,
    saved: list[torch.Tensor],
    sinks: Optional[torch.Tensor],
    mesh: OpaqueRef,
    ulysses: int,
    documents: OpaqueRef,
    kv_heads: int,
    causal: bool,
    window: Optional[int],
    scale: Optional[float],
    backend: str,
    kv_comm: str,
    softcap: Optional[float],
) -> list[torch.Tensor]:
    return _backward(
        dout, saved, sinks, mesh, ulysses, documents, kv_heads, causal, window, scale, backend, kv_comm, softcap
    )


for _op in (_attention, _attention_documents):
    _op.register_fake(_forward_fake)
    _op.register_autograd(_autograd_backward, setup_context=_setup_context)
for _op in (_attention_backward, _attention_documents_backward):
    _op.register_fake(_backward_fake)
