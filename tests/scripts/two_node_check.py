"""Run by ``torchrun`` on each simulated node (see tests/mesh/test_topology.py).

Builds the mesh the way a multi-node job does (degrees "auto" from the launcher's local
world size and the attention shape), records where each group's ranks live (the launcher's
node rank, and the network namespace the process runs in: its own view, not the library's),
checks hybrid attention against the float64 reference, and writes one JSON report per rank
into ``argv[1]``. Also run across two network namespaces by tests/mesh/test_two_hosts.py.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hybridsp import hybrid_attn_func, init_mesh, shard_sequence
from hybridsp.launch._gloo_interface import choose_gloo_interface
from tests.helpers.references.attention import random_qkv, reference_with_grads, rel_err

HEADS, KV_HEADS = 8, 2


def _members(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _each_member(group, value: int) -> list[int]:
    """``value`` of every member of ``group``, in group-rank order."""
    mine = torch.tensor([value], dtype=torch.int64)
    values = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(values, mine, group=group)
    return [int(v) for v in values]


def _node_of_each(group) -> list[int]:
    """The launcher's node rank of every member of ``group``, in group-rank order."""
    return _each_member(group, int(os.environ["GROUP_RANK"]))


def _netns_of_each(group) -> list[int]:
    """The network namespace (inode of /proc/self/ns/net) of every member of ``group``."""
    return _each_member(group, os.stat("/proc/self/ns/net").st_ino)


def main(report_dir: str) -> None:
    torch.set_num_threads(1)
    choose_gloo_interface()  # Note [gloo interface]: a no-op on one loopback interface
    dist.init_process_group("gloo")
    mesh = init_mesh(ulysses="auto", ring="auto", num_heads=HEADS, num_kv_heads=KV_HEADS)
    full = random_qkv(1, 64, HEADS, KV_HEADS, 16, seed=4)
    q, k, v = (shard_sequence(t, mesh).requires_grad_() for t in full[:3])
    out = hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend="torch")
    out.backward(shard_sequence(full[3], mesh))
    expected = reference_with_grads(*full, causal=True)
    errors = [rel_err(a, shard_sequence(e, mesh)) for a, e in zip([out, q.grad, k.grad, v.grad], expected)]
    report = {
        "rank": dist.get_rank(),
        "node": int(os.environ["GROUP_RANK"]),
        "ulysses": mesh.ulysses,
        "ring": mesh.ring,
        "dp": mesh.dp,
        "ulysses_members": _members(mesh.ulysses_group),
        "ulysses_nodes": _node_of_each(mesh.ulysses_group),
        "ring_members": _members(mesh.ring_group),
        "ring_nodes": _node_of_each(mesh.ring_group),
        "netns": os.stat("/proc/self/ns/net").st_ino,
        "ulysses_netns": _netns_of_each(mesh.ulysses_group),
        "ring_netns": _netns_of_each(mesh.ring_group),
        "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
        "errors": errors,
    }
    Path(report_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
