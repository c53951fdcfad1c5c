"""The public hybrid attention: Ulysses all-to-all around ring attention.

    q,k,v [B, S/C, H, D]  --seq_to_heads (U-group)-->  [B, S/R, H/U, D]
          --ring attention (R-group)-->  out [B, S/R, H/U, D]
          --heads_to_seq (U-group)-->  out [B, S/C, H, D]

with ``C = U * R`` the context ranks of one data-parallel replica. Tokens are laid out as
:func:`shard_sequence` places them (zigzag over the ring, contiguous over Ulysses).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hybridsp._checks import check_head_chunks
from hybridsp._comm import CommCounter
from hybridsp._types import BackendName, HeadChunks, KVComm
from hybridsp.attention._compiled import compiled_attention
from hybridsp.attention._head_chunks import head_chunked_attention
from hybridsp.attention._resolve import check_causal, check_kv_comm, check_softcap, resolve_ring_call
from hybridsp.attention._ring import run_ring
from hybridsp.attention._spec import CallSpec, CuSeqlens, placement_layout
from hybridsp.attention._ulysses import expand_kv_heads_for, heads_of_rank, heads_to_seq, seq_to_heads
from hybridsp.kernels import AttentionKernel
from hybridsp.layout._block_plan import check_sliding_window
from hybridsp.layout._documents import Rows, as_documents
from hybridsp.layout._layouts import join_shards, shard_index, take_index
from hybridsp.mesh._hybrid_mesh import HybridMesh


def check_mesh(mesh: object) -> None:
    """Raise ValueError unless ``mesh`` is a :class:`~hybridsp.mesh._hybrid_mesh.HybridMesh`."""
    if not isinstance(mesh, HybridMesh):
        raise ValueError(f"mesh must be a hybridsp.HybridMesh (from hybridsp.init_mesh); got {type(mesh).__name__}")


def hybrid_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: HybridMesh,
    causal: bool = True,
    cu_seqlens: CuSeqlens = None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
    backend: BackendName | AttentionKernel = "auto",
    counter: CommCounter | None = None,
    kv_comm: KVComm | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    head_chunks: HeadChunks | None = None,
    donate_inputs: bool = False,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across the mesh's context ranks.

    Args:
        q: [B, S_local, H, D] this rank's queries (tokens as :func:`shard_sequence` lays them out).
        k: [B, S_local, H_kv, D] (H % H_kv == 0; H_kv may be smaller than the Ulysses degree).
        v: [B, S_local, H_kv, Dv]; Dv may differ from D (DeepSeek-V3's MLA: D 192, Dv 128). No
            kernel pads anything that travels: K/V and the all-to-alls carry their own head dims.
        mesh: the :class:`~hybridsp.mesh._hybrid_mesh.HybridMesh` (explicit process groups).
        causal: causal masking by global token position.
        cu_seqlens: packed documents (flash-attn's varlen convention, but over the *global*
            sequence of ``S = S_local x C`` tokens in natural order): an int tensor
            ``[num_docs + 1]`` from 0 to S, the same on every context rank and shared by all
            batch rows; or ``[B, num_docs + 1]``, or a list of B boundary tensors/lists (rows
            may hold different numbers of documents), or the batch's
            :class:`~hybridsp.layout._documents.Documents` (``shard_batch(...)["documents"]``: checked and
            planned once per batch instead of once per call; the ranks' agreement is checked on every call). A query attends keys of its own
            document only. With ``layout="balanced"`` the same boundaries that sharded the tokens,
            and the same placement window (:func:`~hybridsp.attention._spec.placement_layout`): a ``Documents`` carries its
            own, raw boundaries get the mesh's ``sliding_window``.
        sliding_window: W: query i attends keys j with ``i - W < j <= i`` (transformers'
            convention, flash-attn's ``window_size=(W - 1, 0)``; ``|i - j| < W`` when not
            causal). Combines with ``cu_seqlens``. None: no window. This layer's mask only: where
            tokens are placed is the documents' / mesh's placement window, whatever W is.
        softmax_scale: defaults to 1/sqrt(D).
        backend: ``auto``, ``torch``, ``flash``, ``reference`` or a kernel object.
        counter: optional :class:`~hybridsp._comm.CommCounter` recording bytes sent; defaults to
            ``mesh.comm_counter`` (None unless set).
        kv_comm: how K/V travel inside the ring group: ``"ring"`` (point-to-point steps that
            send only the rows each rank reads) or ``"allgather"`` (chunked all-gather of K/V,
            dK/dV by reduce-scatter); None: ``mesh.kv_comm`` (default ``"ring"``). Both are
            exact; docs/choosing-degrees.md says when to pick which.
        sinks: learned attention sinks (GPT-OSS's ``s_aux``): a float tensor [H], one logit per
            query head q holds (all H of them: the Ulysses slices are taken inside), any float
            dtype, on q's device. Each acts as one
            more key with that logit (not scaled, not soft-capped) and value zero, seen by every
            query row of its head (:mod:`hybridsp.attention._sinks`). Differentiable: this rank's
            ``sinks.grad`` is the share of the query rows it computes (zero for heads it does not
            hold under Ulysses); summed over the context ranks, as every parameter gradient is, it
            is the one-process gradient. None: no sinks.
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``): scores become
            ``softcap * tanh(scores / softcap)`` after the softmax scale, before any mask. A finite
            positive number, or None. Needs a kernel with ``supports_softcap``: ``backend="auto"``
            picks one (``reference`` on CPU, ``flash`` with flash-attn >= 2.6 on CUDA); a named
            kernel without it raises ValueError.
        head_chunks: G, the head groups the call runs in turn (:mod:`hybridsp.attention._head_chunks`):
            each group's all-to-all, ring and reverse all-to-all, forward and backward, so that one
            group's ring-slot buffers exist at a time; the same result and the same bytes on the wire
            as G = 1 (all heads at once). G must divide the K/V heads each Ulysses rank holds
            (``Hkv' / U``; groups split along K/V heads, query heads follow theirs). ``"auto"``: the
            smallest such G whose groups keep at most 64 MiB of ring-slot q/k/v/out each
            (:func:`hybridsp._formulas.auto_head_chunks`). None: ``mesh.head_chunks`` (default 1).
            Under ``torch.compile`` the call runs all heads at once (an int G > 1 raises ValueError).
        donate_inputs: the caller's promise that nothing reads q, k or v after this call (neither its
            code nor another autograd node): the head-chunked backward without Ulysses (G > 1, U = 1)
            then writes dq, dk, dv into q, k, v's storage instead of three new tensors, and returns
            them as the gradients (Note [donated inputs] in :mod:`hybridsp.attention._head_chunks`;
            version counters bumped, so autograd refuses a later use). Ignored elsewhere. The
            transformers switch sets it where it can tell (:mod:`hybridsp.memory._qkv_donation`).

    Returns:
        out [B, S_local, H, Dv] in q's dtype, differentiable in q, k, v (and sinks).

    Under ``torch.compile`` (``fullgraph=True`` included) the call is one custom operator of the graph
    with the same results (Note [compiled call] in :mod:`hybridsp.attention._compiled`): pass the
    documents as a ``Documents`` or a tensor, ``backend`` as a name, no ``counter``.

    Raises:
        ValueError, on every rank and before any communication, for inputs the mesh or the
        kernel cannot run (shapes, dtypes, devices, heads, sequence length, backend), and on
        every rank when the context ranks disagree on them (Note [agreement] in :mod:`hybridsp.attention._resolve`).
    """
    check_mesh(mesh)
    if torch.compiler.is_compiling():  # one custom operator in the graph (Note [compiled call])
        return compiled_attention(
            q,
            k,
            v,
            mesh=mesh,
            causal=causal,
            cu_seqlens=cu_seqlens,
            sliding_window=sliding_window,
            softmax_scale=softmax_scale,
            backend=backend,
            counter=counter,
            kv_comm=kv_comm,
            sinks=sinks,
            softcap=softcap,
            head_chunks=mesh.head_chunks if head_chunks is None else head_chunks,
        )
    spec = CallSpec.on_mesh(
        mesh,
        kv_comm=kv_comm,
        counter=counter,
        head_chunks=head_chunks,
        causal=causal,
        cu_seqlens=cu_seqlens,
        sliding_window=sliding_window,
        softmax_scale=softmax_scale,
        backend=backend,
        softcap=softcap,
    )
    call = resolve_ring_call(
        q,
        k,
        v,
        spec,
        group=mesh.ring_group if mesh.ring > 1 else None,
        ring=mesh.ring,
        ulysses=mesh.ulysses,
        agreement_group=mesh.context_group if mesh.context > 1 else None,
        sinks=sinks,
    )
    if call.head_chunks > 1:
        return head_chunked_attention(q, k, v, call, mesh, sinks, donate_inputs)  # [B, S/C, H, Dv]
    if mesh.ulysses == 1:
        return run_ring(q, k, v, call, sinks)  # [B, S/C, H, Dv]
    heads = q.shape[2]
    k, v = expand_kv_heads_for(k, heads, mesh.ulysses), expand_kv_heads_for(v, heads, mesh.ulysses)
    q, k, v = seq_to_heads([q, k, v], mesh.ulysses_group, call.counter)  # [B, S/R, H/U, D], v [B, S/R, H/U, Dv]
    out = run_ring(q, k, v, call, heads_of_rank(sinks, mesh))  # [B, S/R, H/U, Dv]
    (out,) = heads_to_seq([out], mesh.ulysses_group, call.counter)  # [B, S/C, H, Dv]
    return out


class HybridAttention(nn.Module):
    """``nn.Module`` around :func:`hybrid_attn_func`:
    ``forward(q, k, v, cu_seqlens=None, *, sinks=None, counter=None) -> out``.

    ``sliding_window``, ``kv_comm``, ``softcap`` and ``head_chunks`` are fixed per module (a layer's property;
    ``kv_comm=None``, ``head_chunks=None``: the mesh's); ``cu_seqlens`` may be given at construction or per call (packed
    batches change every step). ``sinks``: a tensor [H] given at construction is registered as the
    module's parameter ``sinks`` (an ``nn.Parameter`` is kept as it is, so it can be shared with the
    model that owns it); a ``sinks=`` passed to ``forward`` is used instead for that call. Shapes as there.
    """

    def __init__(
        self,
        mesh: HybridMesh,
        *,
        causal: bool = True,
        cu_seqlens: CuSeqlens = None,
        sliding_window: int | None = None,
        softmax_scale: float | None = None,
        backend: BackendName | AttentionKernel = "auto",
        kv_comm: KVComm | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        head_chunks: HeadChunks | None = None,
    ) -> None:
        super().__init__()
        check_causal(causal)
        if head_chunks is not None:
            check_head_chunks(head_chunks)
        check_sliding_window(sliding_window)
        check_softcap(softcap)
        if kv_comm is not None:
            check_kv_comm(kv_comm)
        self.mesh, self.causal, self.softmax_scale, self.backend = mesh, causal, softmax_scale, backend
        self.kv_comm, self.softcap, self.head_chunks = kv_comm, softcap, head_chunks
        self.cu_seqlens, self.sliding_window = cu_seqlens, sliding_window
        self.sinks: nn.Parameter | None
        if sinks is not None:
            self.sinks = sinks if isinstance(sinks, nn.Parameter) else nn.Parameter(sinks.detach().clone())
        else:
            self.sinks = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: CuSeqlens = None,
        *,
        sinks: torch.Tensor | None = None,
        counter: CommCounter | None = None,
    ) -> torch.Tensor:
        """q [B, S_local, H, D], k [B, S_local, Hkv, D], v [B, S_local, Hkv, Dv] -> out [B, S_local, H, Dv];
        ``cu_seqlens`` and ``sinks`` [H] as in :func:`hybrid_attn_func` (default: the module's own)."""
        return hybrid_attn_func(
            q,
            k,
            v,
            mesh=self.mesh,
            causal=self.causal,
            softmax_scale=self.softmax_scale,
            backend=self.backend,
            counter=counter,
            kv_comm=self.kv_comm,
            cu_seqlens=self.cu_seqlens if cu_seqlens is None else cu_seqlens,
            sliding_window=self.sliding_window,
            sinks=self.sinks if sinks is None else sinks,
            softcap=self.softcap,
            head_chunks=self.head_chunks,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.mesh!r}, causal={self.causal}, sliding_window={self.sliding_window}, "
            f"softcap={self.softcap}, sinks={self.sinks is not None}, backend={self.backend!r}"
        )


def shard_sequence(
    x: torch.Tensor, mesh: HybridMesh, dim: int = 1, cu_seqlens: CuSeqlens = None, *, sliding_window: int | None = None
) -> torch.Tensor:
    """This rank's tokens of the full tensor ``x`` along ``dim``, in the mesh's token layout.

    ``cu_seqlens``: the batch's global document boundaries (any form :func:`hybrid_attn_func`
    takes); needed by ``layout="balanced"``, which places tokens by document (ignored by the
    other layouts). ``sliding_window``: the window ``layout="balanced"`` balances work for
    (default: the one a ``Documents`` carries, else the mesh's; :func:`~hybridsp.attention._spec.placement_layout`):
    :func:`gather_sequence` must get the same, and :func:`hybrid_attn_func` the same through a
    ``Documents`` (``Documents.window``) or the mesh. No communication; identical across
    data-parallel replicas. Raises ValueError when the layout cannot split ``x.shape[dim]`` evenly.
    """
    return shard_tensors([x], mesh, dim, cu_seqlens, sliding_window=sliding_window)[0]


def shard_tensors(
    tensors: list[torch.Tensor],
    mesh: HybridMesh,
    dim: int = 1,
    cu_seqlens: CuSeqlens = None,
    *,
    sliding_window: int | None = None,
) -> list[torch.Tensor]:
    """:func:`shard_sequence` of tensors of one shape along ``dim`` ([B, S, ...]), the layout's
    positions computed once for all of them (each row's runs once)."""
    x = tensors[0]
    layout = placement_layout(mesh, cu_seqlens, sliding_window)
    bounds = _layout_bounds(x, mesh, dim, cu_seqlens)
    rows = x.shape[0] if dim != 0 else 1
    index = shard_index(
        x.shape[dim], rows, mesh.ring_rank, mesh.ulysses_rank, mesh.ring, mesh.ulysses, layout, bounds
    )  # [1 or B, S / C]
    return [take_index(t, index, dim) for t in tensors]


def gather_sequence(
    x_local: torch.Tensor,
    mesh: HybridMesh,
    dim: int = 1,
    cu_seqlens: CuSeqlens = None,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full tensor in original order, on every rank of the context group.

    A collective over ``mesh.context_group``; not differentiable. ``cu_seqlens`` and
    ``sliding_window`` as there (the same values that sharded ``x``; checked before the collective).
    """
    x_local = x_local.contiguous()
    if mesh.context == 1:
        return x_local
    layout = placement_layout(mesh, cu_seqlens, sliding_window)
    bounds = _layout_bounds(x_local, mesh, dim, cu_seqlens, local=True)
    gathered = [torch.empty_like(x_local) for _ in range(mesh.context)]
    dist.all_gather(gathered, x_local, group=mesh.context_group)  # in ascending global rank order
    by_rank = dict(zip(sorted(mesh.context_members()), gathered))
    shards = [by_rank[member] for member in mesh.context_members()]  # in shard order r * U + u
    return join_shards(shards, mesh.ring, mesh.ulysses, layout, dim, bounds)


def _layout_bounds(
    x: torch.Tensor, mesh: HybridMesh, dim: int, cu_seqlens: CuSeqlens, local: bool = False
) -> Rows | None:
    """Per-row document boundaries for a layout that places tokens by document, else None."""
    if not mesh.token_layout.uses_documents or cu_seqlens is None:
        return None
    seq_len = x.shape[dim] * (mesh.context if local else 1)
    return as_documents(cu_seqlens, x.shape[0] if dim != 0 else 1, seq_len).rows
