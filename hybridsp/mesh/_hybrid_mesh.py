"""The data-parallel x ring x Ulysses (x tensor) device mesh.

World ``W = DP * R * U * T`` (``T``, the tensor-parallel degree, defaults to 1; see
Note [tensor axis] below). With the default ``order="ulysses_inner"`` a rank's coordinates are

    rank = (dp * R + r) * U + u

so the ``U`` ranks of a Ulysses group are consecutive and sit inside one node (the
all-to-all wants the fast intra-node links) while the ring, whose point-to-point traffic
hides behind compute, spans nodes. ``order="ring_inner"`` flips the two:
``rank = (dp * U + u) * R + r``.

Groups (each created once, on every rank, in the same order):
    ulysses_group   the U ranks that share (dp, r)         all-to-all
    ring_group      the R ranks that share (dp, u)         ring send/recv
    context_group   the U*R ranks of one replica (dp)      gathering a sequence
    data_group      the DP ranks that share (r, u)         pure data parallelism
    data_context_group  the DP*U*R ranks that share t       ZeRO's gradient/optimizer group
    tensor_group    the T ranks that share (dp, r, u)       tensor-parallel all-reduce / all-gather

Note [tensor axis]: the tensor axis is the innermost of all: ``rank = T * base + t`` where
``base`` is the rank the ``DP x R x U`` order above gives (T consecutive ranks share one
Ulysses/ring slot; tensor parallelism talks at every linear layer and wants the fastest
links). Every group above except ``tensor_group`` holds the ranks of one tensor rank ``t``
only: each tensor rank holds a different shard of the weights, so ZeRO and the context
collectives never mix shards. With ``T = 1`` every group is what it was without the axis.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist

from hybridsp._checks import check_head_chunks, check_positive
from hybridsp._opaque import OpaqueRef
from hybridsp._types import KV_COMMS, MESH_ORDERS, HeadChunks, KVComm, LayoutName, MeshOrder
from hybridsp.launch._launcher import ranks_per_node
from hybridsp.launch._timeouts import default_group_timeout
from hybridsp.layout._layouts import TokenLayout, get_layout, required_multiple
from hybridsp.mesh import _device_mesh
from hybridsp.mesh._auto_degrees import choose_degrees

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class MeshShape:
    """Sizes and rank order of a mesh, validated without any communication."""

    world_size: int
    ulysses: int
    ring: int
    order: MeshOrder = "ulysses_inner"
    layout: LayoutName = "zigzag"
    kv_comm: KVComm = "ring"
    kv_chunks: int | None = None
    tensor: int = 1
    sliding_window: int | None = None  # the window layouts that place by document balance for
    head_chunks: HeadChunks = 1  # the default head groups of every attention call (hybridsp.attention._head_chunks)

    def __post_init__(self) -> None:
        for name in ("ulysses", "ring", "tensor"):
            check_positive(getattr(self, name), f"{name} degree", integer=True)
        if self.order not in MESH_ORDERS:
            raise ValueError(f"unknown rank order {self.order!r}; choose one of {', '.join(MESH_ORDERS)}")
        get_layout(self.layout)  # ValueError for an unknown name
        get_layout("balanced", self.sliding_window)  # ValueError for a window that is not a positive int
        if self.kv_comm not in KV_COMMS:
            raise ValueError(f"unknown kv_comm {self.kv_comm!r}; choose one of {', '.join(KV_COMMS)}")
        check_positive(self.kv_chunks, "kv_chunks", integer=True, or_none="")
        check_head_chunks(self.head_chunks)
        context = self.ulysses * self.ring
        if self.world_size % (context * self.tensor) != 0:
            what = f"ulysses={self.ulysses} x ring={self.ring}" + (
                f" x tensor={self.tensor}" if self.tensor > 1 else ""
            )
            raise ValueError(
                f"{what} = {context * self.tensor} {'context ' if self.tensor == 1 else ''}ranks do not divide the "
                f"world size {self.world_size}; choose degrees whose product divides {self.world_size}"
            )

    @property
    def context(self) -> int:
        return self.ulysses * self.ring

    @property
    def dp(self) -> int:
        return self.world_size // (self.context * self.tensor)

    def rank_of(self, dp: int, r: int, u: int, t: int = 0) -> int:
        """Global rank of the coordinates (dp, ring rank r, Ulysses rank u, tensor rank t)."""
        if self.order == "ulysses_inner":
            base = (dp * self.ring + r) * self.ulysses + u
        else:
            base = (dp * self.ulysses + u) * self.ring + r
        return base * self.tensor + t  # Note [tensor axis]: innermost

    def tensor_rank_of(self, rank: int) -> int:
        """t of a global rank."""
        return rank % self.tensor

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """(dp, r, u) of a global rank (its tensor rank: :meth:`tensor_rank_of`)."""
        rank //= self.tensor
        if self.order == "ulysses_inner":
            rest, u = divmod(rank, self.ulysses)
            dp, r = divmod(rest, self.ring)
        else:
            rest, r = divmod(rank, self.ring)
            dp, u = divmod(rest, self.ulysses)
        return dp, r, u

    def group_members(self) -> dict[str, list[list[int]]]:
        """Every group of every kind as sorted global ranks, in a fixed order."""
        dps, rings, ulys, ts = range(self.dp), range(self.ring), range(self.ulysses), range(self.tensor)
        at = self.rank_of
        return {
            "ulysses": [sorted(at(d, r, u, t) for u in ulys) for d in dps for r in rings for t in ts],
            "ring": [sorted(at(d, r, u, t) for r in rings) for d in dps for u in ulys for t in ts],
            "context": [sorted(at(d, r, u, t) for r in rings for u in ulys) for d in dps for t in ts],
            "data": [sorted(at(d, r, u, t) for d in dps) for r in rings for u in ulys for t in ts],
            "data_context": [list(range(t, self.world_size, self.tensor)) for t in ts],
            "tensor": [sorted(at(d, r, u, t) for t in ts) for d in dps for r in rings for u in ulys],
        }


class HybridMesh:
    """A validated :class:`MeshShape` plus this rank's coordinates and process groups.

    Build it with :func:`init_mesh`; pass it explicitly to everything that communicates.
    ``comm_counter`` (default None) is an optional :class:`~hybridsp._comm.CommCounter` that
    every :func:`~hybridsp.hybrid_attn_func` call over this mesh records into when the call
    passes no counter of its own (the way to count bytes through a switched HF model).
    """

    def __init__(
        self, shape: MeshShape, rank: int, groups: dict[str, dist.ProcessGroup], device_type: str | None = None
    ) -> None:
        self.shape = shape
        self._device_type = device_type  # of device_mesh; None: the backend's (gloo: "cpu")
        self._device_mesh: DeviceMesh | None = None
        # a hybridsp._comm.CommCounter or None; Any: the mesh sits below _comm in the layers (tests/test_layers.py)
        self.comm_counter: Any = None
        self.opaque = OpaqueRef(self)  # what a compiled graph hands the attention operator
        self.rank = rank
        self.dp_rank, self.ring_rank, self.ulysses_rank = shape.coords_of(rank)
        self.tensor_rank = shape.tensor_rank_of(rank)
        self.tensor_group = groups.get("tensor")  # None in a group-less mesh (tests of coordinates)
        self.ulysses_group = groups["ulysses"]
        self.ring_group = groups["ring"]
        self.context_group = groups["context"]
        self.data_group = groups["data"]
        self.data_context_group = groups["data_context"]

    @property
    def ulysses(self) -> int:
        return self.shape.ulysses

    @property
    def ring(self) -> int:
        return self.shape.ring

    @property
    def dp(self) -> int:
        return self.shape.dp

    @property
    def context(self) -> int:
        return self.shape.context

    @property
    def layout(self) -> LayoutName:
        """The layout's name."""
        return self.shape.layout

    @property
    def token_layout(self) -> TokenLayout:
        """The :class:`~hybridsp.layout._layouts.TokenLayout` object of ``layout``, placing for
        ``sliding_window`` (Note [placement window] in :mod:`hybridsp.layout._layouts`)."""
        return get_layout(self.shape.layout).placing(self.shape.sliding_window)

    @property
    def sliding_window(self) -> int | None:
        """The layout's default window."""
        return self.shape.sliding_window

    @property
    def kv_comm(self) -> KVComm:
        return self.shape.kv_comm

    @property
    def kv_chunks(self) -> int | None:
        return self.shape.kv_chunks

    @property
    def head_chunks(self) -> HeadChunks:
        """The default ``head_chunks`` of every attention call over the mesh."""
        return self.shape.head_chunks

    @property
    def tensor(self) -> int:
        return self.shape.tensor

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    @property
    def context_rank(self) -> int:
        """This rank's shard index inside its replica: r * U + u (the token layout's order)."""
        return self.ring_rank * self.ulysses + self.ulysses_rank

    def context_members(self) -> list[int]:
        """Global ranks of this rank's context group, ordered by shard index r * U + u."""
        dp, t = self.dp_rank, self.tensor_rank
        return [self.shape.rank_of(dp, r, u, t) for r in range(self.ring) for u in range(self.ulysses)]

    @property
    def device_mesh(self) -> DeviceMesh:
        """This mesh as a ``torch.distributed.device_mesh.DeviceMesh`` over the same process groups.

        Dims ``("dp", "ring", "ulysses")`` (``order="ring_inner"``: ``("dp", "ulysses", "ring")``; then
        ``"tensor"`` when T > 1), with the flattened ``"cp"`` (ring x Ulysses) and ``"dp_cp"`` (data x
        context: what FSDP2 shards over, :attr:`fsdp_mesh`) attached. Built on first use, no
        communication (Note [one set of groups] in :mod:`hybridsp.mesh._device_mesh`).
        """
        if self._device_mesh is None:
            device_type = self._device_type or _device_mesh.default_device_type()
            self._device_mesh = _device_mesh.wrap_groups(self, device_type)
        return self._device_mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The 1-D ``"dp_cp"`` DeviceMesh (all ``DP x R x U`` ranks of this tensor rank): ``fully_shard(mesh=)``."""
        return _device_mesh.flat_mesh(self.device_mesh, _device_mesh.FLAT_DATA_CONTEXT)

    @classmethod
    def from_device_mesh(
        cls,
        device_mesh: DeviceMesh,
        ulysses: int | None = None,
        ring: int | None = None,
        *,
        order: MeshOrder = "ulysses_inner",
        layout: LayoutName = "zigzag",
        kv_comm: KVComm = "ring",
        kv_chunks: int | None = None,
        sliding_window: int | None = None,
    ) -> HybridMesh:
        """Adopt a DeviceMesh over the whole world (a collective: creates only the groups it lacks).

        Dims ``("dp", "ring", "ulysses")`` or ``("dp", "ulysses", "ring")`` (``"dp"`` optional; the
        order of the two is the rank order, ``order`` is then ignored), or one context dim ``"cp"`` or
        ``"sp"`` (after an optional ``"dp"``) that ``ulysses`` x ``ring`` splits (give either). ValueError,
        before any collective, for other names or degrees that disagree with the dims' sizes.
        """
        dp, ulysses, ring, named = _device_mesh.adopted_degrees(device_mesh, ulysses, ring)
        order = named or order
        shape = MeshShape(dp * ulysses * ring, ulysses, ring, order, layout, kv_comm, kv_chunks, 1, sliding_window)
        groups = _device_mesh.groups_of_device_mesh(device_mesh, shape)
        return cls(shape, dist.get_rank(), groups, device_type=device_mesh.device_type)

    def __repr__(self) -> str:
        return (
            f"HybridMesh(dp={self.dp}, ring={self.ring}, ulysses={self.ulysses}, tensor={self.tensor}, "
            f"order={self.shape.order!r}, layout={self.layout!r}, kv_comm={self.kv_comm!r}, rank={self.rank} -> "
            f"dp={self.dp_rank}, r={self.ring_rank}, u={self.ulysses_rank}, t={self.tensor_rank})"
        )


def _local_world_size(explicit: int | None, world_size: int) -> int:
    """Ranks per node: the argument, else the launcher's (:mod:`hybridsp.launch._launcher`), else the world."""
    if explicit is not None:
        return explicit
    return ranks_per_node(world_size)


def _resolve_degrees(
    ulysses: int | Literal["auto"],
    ring: int | Literal["auto"],
    world_size: int,
    local_world_size: int,
    attention: dict[str, int | None],
) -> tuple[int, int]:
    """Explicit degrees as given; "auto" ones from :func:`hybridsp.mesh._auto_degrees.choose_degrees`."""
    if ulysses != "auto" and ring != "auto":
        return ulysses, ring
    heads = attention.get("num_heads")
    if heads is None:
        raise ValueError(
            "ulysses='auto' or ring='auto' needs the attention shape: pass num_heads= (and num_kv_heads=, "
            "head_dim=, seq_len= when known) to init_mesh"
        )
    return choose_degrees(
        world_size,
        local_world_size,
        heads,
        attention.get("num_kv_heads") or heads,
        attention.get("head_dim") or 128,
        attention.get("seq_len"),
        context_size=attention.get("context_size"),
        ulysses=None if ulysses == "auto" else ulysses,
        ring=None if ring == "auto" else ring,
    )


def _warn_if_ulysses_crosses_nodes(shape: MeshShape, local_world_size: int) -> None:
    if shape.order == "ulysses_inner" and local_world_size % (shape.ulysses * shape.tensor) != 0:
        warnings.warn(
            f"Ulysses degree {shape.ulysses} does not divide the {local_world_size} ranks per node, so its "
            f"all-to-all crosses nodes; prefer a Ulysses degree that divides {local_world_size} and a larger ring",
            stacklevel=3,
        )


def check_tensor_heads(num_heads: int, num_kv_heads: int | None, tensor: int, ulysses: int = 1) -> None:
    """Raise ValueError (naming the numbers) unless ``tensor`` x ``ulysses`` can split the heads.

    Each tensor rank holds ``H/T`` query heads and ``Hkv/T`` K/V heads; the Ulysses all-to-all
    then scatters ``H/(T x U)`` query heads (K/V heads are repeated as far as it needs).
    """
    if num_heads % (tensor * ulysses) != 0:
        raise ValueError(
            f"the model's {num_heads} query heads are not divisible by tensor={tensor} x ulysses={ulysses} = "
            f"{tensor * ulysses}; choose tensor and Ulysses degrees whose product divides {num_heads}"
        )
    kv = num_heads if num_kv_heads is None else num_kv_heads
    if kv % tensor != 0:
        raise ValueError(
            f"the model's {kv} key/value heads are not divisible by tensor={tensor}; choose a tensor degree that "
            f"divides {kv} (each tensor rank holds {kv}/T whole K/V heads)"
        )


def init_mesh(
    ulysses: int | Literal["auto"] = "auto",
    ring: int | Literal["auto"] = "auto",
    *,
    tensor: int = 1,
    order: MeshOrder = "ulysses_inner",
    layout: LayoutName = "zigzag",
    kv_comm: KVComm = "ring",
    kv_chunks: int | None = None,
    sliding_window: int | None = None,
    head_chunks: HeadChunks = 1,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    seq_len: int | None = None,
    context_size: int | None = None,
    local_world_size: int | None = None,
    device_mesh: DeviceMesh | None = None,
) -> HybridMesh:
    """Build the DP x ring x Ulysses x tensor mesh over the initialised world (a collective on all ranks).

    ``DP = world_size / (ulysses * ring * tensor)``; ``tensor`` (default 1) is the
    tensor-parallel degree, the innermost axis (Note [tensor axis]); with ``num_heads`` given it
    must divide them together with the Ulysses degree (:func:`check_tensor_heads`). Either degree may be ``"auto"``: the planner then
    picks the largest Ulysses degree that divides the query heads and fits inside a node
    (``local_world_size``, default the launcher's ranks per node, see :mod:`hybridsp.launch._launcher`) and puts the rest on
    the ring; that needs ``num_heads`` (and uses ``num_kv_heads``, ``head_dim``, ``seq_len``
    and ``context_size`` (default: the whole world) when given). Raises ValueError, before any
    collective, when the degrees do not divide the world size or cannot be chosen.
    ``kv_comm`` (``"ring"`` or ``"allgather"``) and ``kv_chunks`` are the default K/V transport
    of every :func:`~hybridsp.hybrid_attn_func` call over the mesh (see :mod:`hybridsp.attention._ring`), and
    ``head_chunks`` its default head groups (an int G >= 1 or ``"auto"``; :mod:`hybridsp.attention._head_chunks`).
    ``sliding_window``: the model's window, for ``layout="balanced"`` to balance windowed work
    (the default of :func:`~hybridsp.shard_sequence`, :func:`~hybridsp.shard_batch` and the
    attention; Note [placement window] in :mod:`hybridsp.layout._layouts`); other layouts ignore it.
    ``device_mesh``: adopt it and its groups (:meth:`HybridMesh.from_device_mesh`; no tensor axis).
    """
    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs torch.distributed to be initialised first (init_process_group)")
    world_size = dist.get_world_size()
    local = _local_world_size(local_world_size, world_size)
    attention = dict(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seq_len=seq_len, context_size=context_size
    )
    if device_mesh is not None:  # "auto" splits its context dim by the rule below, over that dim's ranks
        size = _device_mesh.context_size(device_mesh, tensor)
        if "ring" in (device_mesh.mesh_dim_names or ()):  # named dims: their sizes are the degrees
            ulysses, ring = (None if d == "auto" else d for d in (ulysses, ring))  # type: ignore[assignment]
        else:
            ulysses, ring = _resolve_degrees(ulysses, ring, size, min(local, size), attention | {"context_size": size})
        settings = dict(layout=layout, kv_comm=kv_comm, kv_chunks=kv_chunks, sliding_window=sliding_window)
        return HybridMesh.from_device_mesh(device_mesh, ulysses, ring, order=order, **settings)  # type: ignore[arg-type]
    MeshShape(world_size, 1, 1, tensor=tensor)  # the tensor degree alone must divide the world
    if num_heads is not None and tensor > 1:
        check_tensor_heads(num_heads, num_kv_heads, tensor)
        attention.update(num_heads=num_heads // tensor, num_kv_heads=(num_kv_heads or num_heads) // tensor)
    ulysses, ring = _resolve_degrees(ulysses, ring, world_size // tensor, max(local // tensor, 1), attention)
    shape = MeshShape(world_size, ulysses, ring, order, layout, kv_comm, kv_chunks, tensor, sliding_window, head_chunks)
    if num_heads is not None and tensor > 1:
        check_tensor_heads(num_heads, num_kv_heads, tensor, ulysses)
    _warn_if_ulysses_crosses_nodes(shape, local)
    rank = dist.get_rank()
    groups = {}
    timeout = default_group_timeout()  # Note [group timeouts] in hybridsp/launch/_timeouts.py
    for kind, all_members in shape.group_members().items():
        for members in all_members:
            group = dist.new_group(members, timeout=timeout)
            if rank in members:
                groups[kind] = group
    return HybridMesh(shape, rank, groups)


def padded_length(seq_len: int, mesh: HybridMesh) -> int:
    """The shortest length >= ``seq_len`` that the mesh's token layout splits evenly."""
    step = required_multiple(mesh.ring, mesh.ulysses, mesh.token_layout, mesh.kv_chunks)
    return -(-seq_len // step) * step
