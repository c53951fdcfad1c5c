"""One attention call's settings as one frozen object, built once per call and handed whole to
:func:`~hybridsp.attention._resolve.resolve_ring_call`, which checks it and keeps it on the
:class:`~hybridsp.attention._resolve.RingCall` that the ring, the transports, the pieces and the
varlen groups read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import torch

from hybridsp._types import BackendName, HeadChunks, KVComm, LayoutName
from hybridsp.layout._documents import Documents

if TYPE_CHECKING:
    from hybridsp._comm import CommCounter
    from hybridsp.kernels._base import AttentionKernel
    from hybridsp.layout._layouts import TokenLayout
    from hybridsp.mesh._hybrid_mesh import HybridMesh

CuSeqlens = Union[torch.Tensor, "list[torch.Tensor]", "list[list[int]]", "Documents", None]
"""Packed-document boundaries over the global sequence: ``[num_docs + 1]``, ``[B, num_docs + 1]``,
a list of B boundary tensors/lists, or a batch's :class:`~hybridsp.layout.Documents`."""


@dataclass(frozen=True, eq=False)
class CallSpec:
    """What one attention call computes and how, apart from its tensors (q, k, v, sinks).

    ``layout`` is the token layout the tokens were sharded with (a name or a
    :class:`~hybridsp.layout.TokenLayout`, placed for the window that applies); ``kv_chunks`` the
    all-gather transport's chunk count (None: the default); ``counter`` records bytes sent;
    ``head_chunks`` the head groups the call runs in turn (:mod:`hybridsp.attention._head_chunks`). The
    other fields are :func:`~hybridsp.attention.hybrid_attn_func`'s arguments of the same names.
    Nothing is checked here: :func:`~hybridsp.attention._resolve.resolve_ring_call` checks the spec
    together with the tensors, before any communication.
    """

    causal: bool = True
    cu_seqlens: CuSeqlens = None
    sliding_window: int | None = None
    softmax_scale: float | None = None
    backend: BackendName | AttentionKernel = "auto"
    layout: LayoutName | TokenLayout = "zigzag"
    kv_comm: KVComm = "ring"
    kv_chunks: int | None = None
    softcap: float | None = None
    counter: CommCounter | None = None
    head_chunks: HeadChunks = 1

    @classmethod
    def on_mesh(
        cls,
        mesh: HybridMesh,
        *,
        kv_comm: KVComm | None = None,
        counter: CommCounter | None = None,
        head_chunks: HeadChunks | None = None,
        **settings: Any,
    ) -> CallSpec:
        """The spec of a call on ``mesh``: its K/V transport, chunking, head groups and byte counter unless
        given, and its token layout placed for the window the documents carry (``settings``: the other fields)."""
        return cls(
            layout=placement_layout(mesh, settings.get("cu_seqlens")),
            kv_comm=mesh.kv_comm if kv_comm is None else kv_comm,
            kv_chunks=mesh.kv_chunks,
            counter=mesh.comm_counter if counter is None else counter,
            head_chunks=mesh.head_chunks if head_chunks is None else head_chunks,
            **settings,
        )


def placement_layout(mesh: HybridMesh, cu_seqlens: CuSeqlens = None, sliding_window: int | None = None) -> TokenLayout:
    """The mesh's token layout placing for the window that applies (Note [placement window] in
    :mod:`hybridsp.layout._layouts`): ``sliding_window`` if given, else the one ``cu_seqlens``
    carries (a :class:`~hybridsp.layout._documents.Documents`' ``window``), else the mesh's.

    Raises ValueError, before any collective, when ``sliding_window`` and the documents' differ.
    """
    carried = cu_seqlens.window if isinstance(cu_seqlens, Documents) else None
    if sliding_window is not None and carried is not None and sliding_window != carried:
        raise ValueError(
            f"sliding_window={sliding_window} was given but the documents were placed for window {carried}: "
            f"pass the same window that sharded them (or none: the documents carry theirs)"
        )
    window = next((w for w in (sliding_window, carried, mesh.sliding_window) if w is not None), None)
    return mesh.token_layout.placing(window)
