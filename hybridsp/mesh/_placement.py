"""Where the mesh's ranks actually run: which host holds which ranks, and which groups cross hosts.

    placement = gather_placement(mesh)      # a collective on every rank (one small all_gather)
    print(placement.describe())             # one line: hosts, their ranks, the groups
    placement.ulysses_crossing_hosts()      # Ulysses groups whose all-to-all leaves a host

The mesh only *believes* the launcher about ranks per node (:mod:`hybridsp.launch._launcher`);
this asks every process where it is: the host's name and the local address the kernel uses
to reach ``MASTER_ADDR`` (two network namespaces on one machine share a name but not an
address). ``examples/train.py`` prints the line before the first step and writes
``placement.json`` into the run directory; ``python -m hybridsp check-mesh`` prints it
without building a model.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

from hybridsp.launch._gloo_interface import route_source_address
from hybridsp.mesh._hybrid_mesh import HybridMesh


def host_identity(master_addr: str | None = None) -> str:
    """``"<host name>/<address used to reach MASTER_ADDR>"`` for this process."""
    master = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        master = socket.gethostbyname(master)
    except OSError:
        pass
    return f"{socket.gethostname()}/{route_source_address(master) or '?'}"


def _spans(ranks: list[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``"0-3,6"``."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(parts)


@dataclass(frozen=True)
class Placement:
    """Every rank's host (``hosts[rank]``) and the mesh's Ulysses and ring groups (global ranks)."""

    hosts: list[str]
    ulysses: list[list[int]]
    ring: list[list[int]]

    def ranks_by_host(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            found.setdefault(host, []).append(rank)
        return found

    def hosts_of(self, group: list[int]) -> set[str]:
        return {self.hosts[rank] for rank in group}

    def ulysses_crossing_hosts(self) -> list[list[int]]:
        """Ulysses groups whose ranks sit on more than one host (their all-to-all crosses the network)."""
        return [group for group in self.ulysses if len(self.hosts_of(group)) > 1]

    def describe(self) -> str:
        """One line: every host with its ranks, then where the Ulysses and ring groups lie."""
        hosts = "; ".join(f"{host} ranks {_spans(ranks)}" for host, ranks in self.ranks_by_host().items())
        crossing = self.ulysses_crossing_hosts()
        ulysses = (
            f"{len(crossing)} of {len(self.ulysses)} Ulysses groups CROSS hosts: {crossing}"
            if crossing
            else f"{len(self.ulysses)} Ulysses groups each inside one host"
        )
        ring_hosts = sorted({len(self.hosts_of(group)) for group in self.ring})
        ring = f"ring groups span {'/'.join(map(str, ring_hosts))} host(s)"
        return f"placement: {len(self.ranks_by_host())} host(s): {hosts}; {ulysses}; {ring}"

    def to_json(self) -> dict[str, list[str] | list[list[int]]]:
        return {"hosts": self.hosts, "ulysses": self.ulysses, "ring": self.ring}


def gather_placement(mesh: HybridMesh) -> Placement:
    """Every rank's :func:`host_identity`, gathered over the world (a collective on every rank)."""
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host_identity())
    members = mesh.shape.group_members()
    return Placement([str(h) for h in hosts], members["ulysses"], members["ring"])
