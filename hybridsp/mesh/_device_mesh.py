"""The hybrid mesh as a PyTorch ``DeviceMesh``, both ways, over one set of process groups.

Note [one set of groups]: a :class:`~hybridsp.mesh._hybrid_mesh.HybridMesh` and the ``DeviceMesh`` it
hands out (``mesh.device_mesh``) talk over the same ``ProcessGroup`` objects. From our groups,
:func:`wrap_groups` builds the DeviceMesh with ``DeviceMesh.from_group`` (no new group) and attaches
the two flattened dims, ``"cp"`` (ring x Ulysses, our ``context_group``) and ``"dp_cp"`` (data x
context, our ``data_context_group``), as the flattened meshes ``DeviceMesh._flatten`` would make, but
holding our groups (PyTorch has no public call to flatten onto an existing group; the private fields
used here are those of torch 2.13's ``_create_flatten_mesh`` and a test pins them). From a user's
DeviceMesh, :func:`groups_of_device_mesh` takes its groups and creates only the ones it lacks (the
ring and Ulysses halves of a single ``"cp"``/``"sp"`` dim, a data group of one rank when it has no
``"dp"`` dim).

Dim names: ``("dp", "ring", "ulysses")`` for ``order="ulysses_inner"`` (rank = (dp * R + r) * U + u),
``("dp", "ulysses", "ring")`` for ``"ring_inner"``, then ``"tensor"`` when T > 1. ``"dp_cp"`` is what
FSDP2 shards over: the context ranks hold different tokens of one batch, so their gradients are
partial, and the reduce-scatter over the joint dim is what sums them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hybridsp._types import MeshOrder
from hybridsp.launch._timeouts import default_group_timeout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

CONTEXT_DIMS = ("cp", "sp")  # a single context dim that we split into ring x Ulysses
FLAT_CONTEXT = "cp"
FLAT_DATA_CONTEXT = "dp_cp"


def dim_names(order: str, tensor: int) -> tuple[str, ...]:
    """The root dims of our DeviceMesh, outermost first (module docstring)."""
    inner = ("ring", "ulysses") if order == "ulysses_inner" else ("ulysses", "ring")
    return ("dp", *inner) + (("tensor",) if tensor > 1 else ())


def default_device_type() -> str:
    """ "cpu" under gloo, else the accelerator's type (``"cuda"`` under NCCL)."""
    if dist.get_backend() == "gloo" or not torch.accelerator.is_available():
        return "cpu"
    accelerator = torch.accelerator.current_accelerator()
    return "cpu" if accelerator is None else accelerator.type


def wrap_groups(mesh: Any, device_type: str) -> DeviceMesh:  # Any: a HybridMesh (it imports this module)
    """The DeviceMesh of a :class:`HybridMesh` over its own groups, with "cp" and "dp_cp" attached."""
    from torch.distributed.device_mesh import DeviceMesh

    shape = mesh.shape
    names = dim_names(shape.order, shape.tensor)
    sizes = {"dp": shape.dp, "ring": shape.ring, "ulysses": shape.ulysses, "tensor": shape.tensor}
    by_name = {"dp": mesh.data_group, "ring": mesh.ring_group, "ulysses": mesh.ulysses_group}
    by_name["tensor"] = mesh.tensor_group
    ranks = torch.arange(shape.world_size).reshape([sizes[name] for name in names])  # [DP, R|U, U|R(, T)]
    root = DeviceMesh.from_group([by_name[n] for n in names], device_type, mesh=ranks, mesh_dim_names=names)
    context = tuple(n for n in names if n in ("ring", "ulysses"))
    _attach_flat(root, context, FLAT_CONTEXT, mesh.context_group)
    _attach_flat(root, ("dp", *context), FLAT_DATA_CONTEXT, mesh.data_context_group)
    return root


def flat_mesh(root: DeviceMesh, name: str) -> DeviceMesh:
    """The attached flattened 1-D mesh ``name`` ("cp" or "dp_cp") of :func:`wrap_groups`' root."""
    return root._flatten_mapping[name]


def _attach_flat(root: DeviceMesh, dims: tuple[str, ...], name: str, group: dist.ProcessGroup) -> None:
    """Register ``group`` as the flattened dim ``name`` of ``dims`` (Note [one set of groups])."""
    from torch.distributed._mesh_layout import _MeshLayout
    from torch.distributed.device_mesh import DeviceMesh

    layout = _MeshLayout([root[dims]._layout.collapse()])
    flat = DeviceMesh(
        root.device_type,
        _layout=layout,
        _rank_map=root._rank_map,
        mesh_dim_names=(name,),
        _root_mesh=root,
        _init_backend=False,
    )
    flat._dim_group_names = [group.group_name]
    root._pg_registry[group.group_name] = group
    root._flatten_mapping[name] = flat


def check_device_mesh(device_mesh: DeviceMesh) -> tuple[str, ...]:
    """The dim names of a DeviceMesh we can adopt; ValueError naming what to change otherwise (no communication)."""
    names = tuple(device_mesh.mesh_dim_names or ())
    world = dist.get_world_size()
    if device_mesh.mesh.flatten().tolist() != list(range(world)):
        raise ValueError(
            f"the DeviceMesh must span the whole world of {world} ranks in rank order (got mesh "
            f"{device_mesh.mesh.tolist()}); build it with init_device_mesh(device_type, shape, mesh_dim_names=...)"
        )
    allowed = {("dp", "ring", "ulysses"), ("dp", "ulysses", "ring"), ("ring", "ulysses"), ("ulysses", "ring")}
    allowed |= {(c,) for c in CONTEXT_DIMS} | {("dp", c) for c in CONTEXT_DIMS}
    if names not in allowed:
        raise ValueError(
            f"cannot adopt a DeviceMesh with dims {names}: name them ('dp', 'ring', 'ulysses') (or "
            f"('dp', 'ulysses', 'ring'), 'dp' optional), or give one context dim 'cp' or 'sp' (after an optional 'dp') "
            "that the ulysses and ring degrees split"
        )
    return names


def order_of(names: tuple[str, ...]) -> MeshOrder | None:
    """The rank order the dims spell (None for a single context dim: the caller's order)."""
    if "ring" not in names:
        return None
    return "ulysses_inner" if names.index("ring") < names.index("ulysses") else "ring_inner"


def adopted_degrees(
    device_mesh: DeviceMesh, ulysses: int | None, ring: int | None
) -> tuple[int, int, int, MeshOrder | None]:
    """(DP, U, R, the rank order its dims spell or None) of a DeviceMesh; ValueError, no communication,
    for names we cannot adopt or degrees that disagree with its sizes."""
    names = check_device_mesh(device_mesh)
    sizes = dict(zip(names, (int(n) for n in device_mesh.mesh.shape), strict=True))
    dp = sizes.get("dp", 1)
    if "ring" in sizes:
        wrong = {k: v for k, v in {"ulysses": ulysses, "ring": ring}.items() if v is not None and v != sizes[k]}
        if wrong:
            raise ValueError(f"degrees {wrong} disagree with the DeviceMesh's dims {sizes}; omit them or match them")
        return dp, sizes["ulysses"], sizes["ring"], order_of(names)
    size, dim = sizes[names[-1]], names[-1]
    if ulysses is None and ring is None:
        raise ValueError(f"the DeviceMesh's {dim!r} dim ({size} ranks) needs ulysses= or ring= to split it")
    u = ulysses if ulysses is not None else size // ring  # type: ignore[operator]  # ring is set here
    r = ring if ring is not None else size // u
    if u * r != size:
        raise ValueError(
            f"ulysses={u} x ring={r} = {u * r} does not equal the DeviceMesh's {dim!r} dim of {size} ranks; "
            f"choose degrees whose product is {size}"
        )
    return dp, u, r, None


def context_size(device_mesh: DeviceMesh, tensor: int) -> int:
    """The context ranks (U x R) of a DeviceMesh ``init_mesh`` adopts; ValueError for a tensor axis."""
    if tensor != 1:
        raise ValueError(f"init_mesh(device_mesh=...) has no tensor axis; got tensor={tensor}: pass tensor=1")
    names = check_device_mesh(device_mesh)
    sizes = dict(zip(names, (int(n) for n in device_mesh.mesh.shape), strict=True))
    return sizes.get("ulysses", 1) * sizes.get("ring", 1) * sizes.get("cp", 1) * sizes.get("sp", 1)


def groups_of_device_mesh(device_mesh: DeviceMesh, shape: Any) -> dict[str, dist.ProcessGroup]:  # a MeshShape
    """This rank's ulysses/ring/context/data/data_context groups, the DeviceMesh's own where it has them.

    ``shape``: the :class:`MeshShape` already checked against the DeviceMesh's sizes. A collective
    over the world (the missing groups are created on every rank in the same order).
    """
    names = tuple(device_mesh.mesh_dim_names or ())
    context_dim = next((n for n in names if n in CONTEXT_DIMS), None)
    groups: dict[str, dist.ProcessGroup] = {}
    if context_dim is None:
        groups["ulysses"] = device_mesh.get_group("ulysses")
        groups["ring"] = device_mesh.get_group("ring")
        inner = tuple(n for n in names if n != "dp")
        groups["context"] = device_mesh[inner]._flatten(FLAT_CONTEXT).get_group()
    else:
        members = shape.group_members()
        groups["ulysses"] = _new_groups(members["ulysses"])
        groups["ring"] = _new_groups(members["ring"])
        groups["context"] = device_mesh.get_group(context_dim)
    groups["data"] = device_mesh.get_group("dp") if "dp" in names else _new_groups(shape.group_members()["data"])
    if shape.dp == 1:
        groups["data_context"] = groups["context"]
    elif len(names) == 2:  # ("dp", "cp"|"sp")
        groups["data_context"] = device_mesh._flatten(FLAT_DATA_CONTEXT).get_group()
    else:
        groups["data_context"] = device_mesh[names]._flatten(FLAT_DATA_CONTEXT).get_group()
    return groups


def _new_groups(all_members: list[list[int]]) -> dist.ProcessGroup:
    """Create every group of one kind (each rank, same order) and return this rank's."""
    rank, mine = dist.get_rank(), None
    for members in all_members:
        group = dist.new_group(members, timeout=default_group_timeout())
        if rank in members:
            mine = group
    assert isinstance(mine, dist.ProcessGroup)  # every rank is in one group of each kind
    return mine
