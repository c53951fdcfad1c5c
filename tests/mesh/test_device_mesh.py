"""hybridsp.mesh: the mesh as a PyTorch DeviceMesh both ways, over one set of process groups (4 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from hybridsp.testing import run_distributed

pytestmark = [pytest.mark.distributed]


def _members(group) -> list[int]:
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(group))


def _ours_to_device_mesh(rank: int) -> dict:
    """init_mesh's own groups behind mesh.device_mesh; FSDP2 shards over "dp_cp"."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import hybridsp

    mesh = hybridsp.init_mesh(ulysses=2, ring=1)  # DP 2 x R 1 x U 2
    dm = mesh.device_mesh
    same = {
        "ulysses": dm.get_group("ulysses") is mesh.ulysses_group,
        "ring": dm.get_group("ring") is mesh.ring_group,
        "dp": dm.get_group("dp") is mesh.data_group,
        "dp_cp": mesh.fsdp_mesh.get_group() is mesh.data_context_group,
        "cp": dm["ring", "ulysses"]._flatten("cp").get_group() is mesh.context_group,  # the attached one, no new group
        "flatten again": dm["dp", "ring", "ulysses"]._flatten("dp_cp") is mesh.fsdp_mesh,
    }
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 6, bias=False)
    full = layer.weight.detach().clone()  # [6, 8]
    fully_shard(layer, mesh=mesh.fsdp_mesh)
    x = torch.full((2, 8), float(rank + 1))  # [B, 8] a different batch per rank
    layer(x).sum().backward()
    grad = layer.weight.grad.full_tensor()  # [6, 8] FSDP2's reduce-scatter (mean over the 4 ranks)
    expected = torch.ones(6, 1) * torch.full((1, 8), 2.0 * (1 + 2 + 3 + 4) / 4)  # [6, 8]
    return {
        "names": dm.mesh_dim_names,
        "shape": tuple(dm.mesh.shape),
        "coordinate": dm.get_coordinate(),
        "hybrid": (mesh.dp_rank, mesh.ring_rank, mesh.ulysses_rank),
        "same": same,
        "dtensor": isinstance(layer.weight, DTensor),
        "local_rows": layer.weight.to_local().shape[0],
        "weight_whole": torch.equal(layer.weight.full_tensor(), full),
        "grad_ok": torch.allclose(grad, expected),
        "world": dist.get_world_size(),
    }


def _adopted(rank: int) -> dict:
    """init_mesh(device_mesh=) with named dims and with one "cp" dim; the DeviceMesh's groups are ours."""
    from torch.distributed.device_mesh import init_device_mesh

    import hybridsp

    named = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "ulysses", "ring"))
    a = hybridsp.init_mesh(device_mesh=named)
    split = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    b = hybridsp.HybridMesh.from_device_mesh(split, ring=2)
    sp = init_device_mesh("cpu", (4,), mesh_dim_names=("sp",))
    c = hybridsp.init_mesh(ulysses=2, ring=2, device_mesh=sp)
    return {
        "a": (a.dp, a.ring, a.ulysses, a.shape.order, a.ring_rank, a.ulysses_rank),
        "a same": (a.ulysses_group is named.get_group("ulysses"), a.ring_group is named.get_group("ring")),
        "a members": (_members(a.context_group), _members(a.data_context_group)),
        "a names": a.device_mesh.mesh_dim_names,
        "b": (b.dp, b.ring, b.ulysses, b.dp_rank, b.ring_rank),
        "b same": (b.context_group is split.get_group("cp"), b.data_group is split.get_group("dp")),
        "b members": (_members(b.ring_group), _members(b.ulysses_group), _members(b.data_context_group)),
        "c": (c.dp, c.ring, c.ulysses, c.ring_rank, c.ulysses_rank, c.context_group is sp.get_group("sp")),
        "c members": (_members(c.ulysses_group), _members(c.ring_group)),
    }


def _refusals(rank: int) -> list[str]:
    """Every refusal is a ValueError raised before any collective (all ranks raise alike)."""
    from torch.distributed.device_mesh import init_device_mesh

    import hybridsp

    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cp = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    messages = []
    for call in (
        lambda: hybridsp.init_mesh(device_mesh=dm),
        lambda: hybridsp.HybridMesh.from_device_mesh(cp, ulysses=3),
        lambda: hybridsp.HybridMesh.from_device_mesh(cp),
        lambda: hybridsp.HybridMesh.from_device_mesh(named, ulysses=4),
        lambda: hybridsp.init_mesh(1, 4, tensor=2, device_mesh=cp),
    ):
        with pytest.raises(ValueError) as error:
            call()
        messages.append(str(error.value))
    return messages


def _all(rank: int, world_size: int) -> dict:
    return {"ours": _ours_to_device_mesh(rank), "adopted": _adopted(rank), "refusals": _refusals(rank)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_all, 4)


def test_our_groups_are_the_device_meshs_groups_and_fsdp2_shards_over_dp_cp(results):
    for rank, got in enumerate(results):
        ours = got["ours"]
        assert ours["names"] == ("dp", "ring", "ulysses") and ours["shape"] == (2, 1, 2)
        assert tuple(ours["coordinate"]) == (rank // 2, 0, rank % 2) == ours["hybrid"]
        assert all(ours["same"].values()), ours["same"]
        assert ours["dtensor"] and ours["local_rows"] < 6 and ours["weight_whole"] and ours["grad_ok"]


def test_a_users_device_mesh_is_adopted_with_its_groups(results):
    for rank, got in enumerate(results):
        a = got["adopted"]
        # ("dp", "ulysses", "ring"): rank = u * R + r, the ring_inner order
        assert a["a"] == (1, 2, 2, "ring_inner", rank % 2, rank // 2) and a["a same"] == (True, True)
        assert a["a members"] == ([0, 1, 2, 3], [0, 1, 2, 3])
        assert a["a names"] == ("dp", "ulysses", "ring")
        assert a["b"] == (2, 2, 1, rank // 2, rank % 2) and a["b same"] == (True, True)
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert a["b members"] == (pair, [rank], [0, 1, 2, 3])
        assert a["c"] == (1, 2, 2, rank // 2, rank % 2, True)
        assert a["c members"] == (pair, [rank % 2, rank % 2 + 2])


def test_device_meshes_we_cannot_adopt_are_refused_in_words(results):
    messages = results[0]["refusals"]
    assert "cannot adopt a DeviceMesh with dims ('dp', 'tp')" in messages[0]
    assert "ulysses=3 x ring=1 = 3 does not equal the DeviceMesh's 'cp' dim of 4 ranks" in messages[1]
    assert "needs ulysses= or ring= to split it" in messages[2]
    assert "disagree with the DeviceMesh's dims" in messages[3] and "'ulysses': 4" in messages[3]
    assert "has no tensor axis; got tensor=2" in messages[4]
    assert all(r["refusals"] == messages for r in results)
