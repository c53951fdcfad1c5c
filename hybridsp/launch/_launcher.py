"""What the launcher told this process: its rank, its node, and how many ranks share the node.

    env = read_launch_env()          # os.environ by default; any mapping for tests
    env.local_world_size             # ranks on this node, or None when no launcher said

Launchers spell the same facts differently, and reading the wrong variable is silently wrong:

=============  ==================  ==============  ===============  =====================
launcher       ranks on this node  local rank      node index       marker read
=============  ==================  ==============  ===============  =====================
deepspeed      ``LOCAL_SIZE``      ``LOCAL_RANK``  ``CROSS_RANK``   ``CROSS_RANK`` + ``LOCAL_SIZE``
torchrun       ``LOCAL_WORLD_SIZE`` ``LOCAL_RANK`` ``GROUP_RANK``   ``GROUP_RANK``
other env://   ``LOCAL_WORLD_SIZE`` ``LOCAL_RANK`` (none)           ``LOCAL_WORLD_SIZE``
Open MPI       ``OMPI_COMM_WORLD_LOCAL_SIZE`` ...  (none)           ``OMPI_COMM_WORLD_LOCAL_SIZE``
SLURM srun     ``SLURM_STEP_TASKS_PER_NODE``       ``SLURM_NODEID`` ``SLURM_PROCID``
=============  ==================  ==============  ===============  =====================

The first row that matches wins, in that order. DeepSpeed's launcher comes first because it sets
``LOCAL_SIZE`` but not ``LOCAL_WORLD_SIZE``, and accelerate (inside the HF Trainer) then writes
``LOCAL_WORLD_SIZE=1`` into such a process: reading ``LOCAL_WORLD_SIZE`` there gave "1 rank
per node", a false Ulysses-crosses-nodes warning, and all cores' worth of threads per rank.
torchrun comes before SLURM so that ``srun torchrun ...`` reads torchrun's values. Pure: no
communication, no mutation of the environment.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class LaunchEnv:
    """The launcher's facts for this process; ``None`` where the launcher did not say."""

    launcher: str  # "deepspeed", "torchrun", "env", "mpi", "slurm" or "none"
    rank: int | None
    world_size: int | None
    local_rank: int | None
    local_world_size: int | None
    node_rank: int | None
    nodes: int | None


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or not value.strip().lstrip("-").isdigit():
        return None
    return int(value)


def slurm_tasks_on_node(spec: str, node: int) -> int | None:
    """Tasks on node ``node`` from SLURM's compressed list, e.g. ``"4(x2),3"`` -> 4, 4, 3."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def _deepspeed(env: Mapping[str, str]) -> LaunchEnv:
    return LaunchEnv(
        "deepspeed",
        _int(env, "RANK"),
        _int(env, "WORLD_SIZE"),
        _int(env, "LOCAL_RANK"),
        _int(env, "LOCAL_SIZE"),
        _int(env, "CROSS_RANK"),
        _int(env, "CROSS_SIZE"),
    )


def _torchrun(env: Mapping[str, str]) -> LaunchEnv:
    return LaunchEnv(
        "torchrun",
        _int(env, "RANK"),
        _int(env, "WORLD_SIZE"),
        _int(env, "LOCAL_RANK"),
        _int(env, "LOCAL_WORLD_SIZE"),
        _int(env, "GROUP_RANK"),
        _int(env, "GROUP_WORLD_SIZE"),
    )


def _plain(env: Mapping[str, str]) -> LaunchEnv:
    return LaunchEnv(
        "env",
        _int(env, "RANK"),
        _int(env, "WORLD_SIZE"),
        _int(env, "LOCAL_RANK"),
        _int(env, "LOCAL_WORLD_SIZE"),
        None,
        None,
    )


def _mpi(env: Mapping[str, str]) -> LaunchEnv:
    return LaunchEnv(
        "mpi",
        _int(env, "OMPI_COMM_WORLD_RANK"),
        _int(env, "OMPI_COMM_WORLD_SIZE"),
        _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
        _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        None,
        None,
    )


def _slurm(env: Mapping[str, str]) -> LaunchEnv:
    node = _int(env, "SLURM_NODEID")
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    local = slurm_tasks_on_node(spec, node) if node is not None and spec else None
    return LaunchEnv(
        "slurm",
        _int(env, "SLURM_PROCID"),
        _int(env, "SLURM_NTASKS"),
        _int(env, "SLURM_LOCALID"),
        local,
        node,
        _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES"),
    )


_READERS = (  # (marker variables that must all be set, reader), first match wins
    (("CROSS_RANK", "LOCAL_SIZE"), _deepspeed),
    (("GROUP_RANK", "LOCAL_WORLD_SIZE"), _torchrun),
    (("LOCAL_WORLD_SIZE",), _plain),
    (("OMPI_COMM_WORLD_LOCAL_SIZE",), _mpi),
    (("SLURM_PROCID",), _slurm),
)


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launcher's facts (see the module docstring for which variables are read, in which order)."""
    env = os.environ if environ is None else environ
    for markers, reader in _READERS:
        if all(name in env for name in markers):
            return reader(env)
    return LaunchEnv("none", _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK"), None, None, None)


def ranks_per_node(default: int, environ: Mapping[str, str] | None = None) -> int:
    """Ranks on this node as the launcher says (at least 1); ``default`` when it does not say."""
    local = read_launch_env(environ).local_world_size
    return max(1, local) if local is not None else default
