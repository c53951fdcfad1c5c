"""The launcher environment, read the same way by the mesh and the examples (hybridsp.launch._launcher).

The environments below are what each launcher sets, copied from their sources (DeepSpeed
0.19.8 ``launcher/launch.py``, torch ``distributed/run.py``, accelerate ``state.py``, SLURM's
``srun``), checked against the values a person reads off the launch line.
"""

from __future__ import annotations

import warnings

import pytest

from hybridsp.launch._launcher import ranks_per_node, read_launch_env, slurm_tasks_on_node
from hybridsp.testing import run_distributed

# `deepspeed --hostfile H` (2 nodes x 4) on node 1, rank 6
DEEPSPEED = {
    "RANK": "6",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "2",
    "LOCAL_SIZE": "4",
    "CROSS_RANK": "1",
    "CROSS_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
# `torchrun --nnodes 2 --nproc-per-node 4` on node 1, rank 6
TORCHRUN = {
    "RANK": "6",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "2",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_RANK": "6",
    "TORCHELASTIC_RUN_ID": "none",
}
# `srun --nodes 2 --ntasks 7` (4 + 3), the second node's first task
SLURM = {
    "SLURM_PROCID": "4",
    "SLURM_NTASKS": "7",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "4,3",
}


def test_deepspeed_launcher_reads_local_size_and_cross_rank():
    env = read_launch_env(DEEPSPEED)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank, env.nodes) == (
        "deepspeed",
        6,
        8,
        2,
        4,
        1,
        2,
    )


def test_accelerate_inside_the_deepspeed_launcher_does_not_make_one_rank_per_node():
    # accelerate's MULTI_CPU state writes LOCAL_WORLD_SIZE from variables DeepSpeed does not set: 1
    assert ranks_per_node(8, {**DEEPSPEED, "LOCAL_WORLD_SIZE": "1"}) == 4


def test_torchrun_and_other_env_launchers():
    env = read_launch_env(TORCHRUN)
    assert (env.launcher, env.local_world_size, env.node_rank, env.nodes) == ("torchrun", 4, 1, 2)
    plain = read_launch_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (plain.launcher, plain.local_world_size, plain.node_rank) == ("env", 2, None)


def test_srun_torchrun_reads_torchrun_and_plain_srun_reads_slurm():
    assert read_launch_env({**SLURM, **TORCHRUN}).launcher == "torchrun"
    env = read_launch_env(SLURM)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (
        "slurm",
        4,
        7,
        0,
        3,
        1,
    )


def test_open_mpi_and_no_launcher():
    env = read_launch_env(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "3",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        }
    )
    assert (env.launcher, env.rank, env.local_world_size) == ("mpi", 3, 4)
    assert read_launch_env({}).launcher == "none"
    assert ranks_per_node(8, {}) == 8 and ranks_per_node(8, {"LOCAL_WORLD_SIZE": "0"}) == 1


@pytest.mark.parametrize(
    "spec,node,expected",
    [("4(x2)", 0, 4), ("4(x2)", 1, 4), ("4(x2),3", 2, 3), ("8", 0, 8), ("2(x3)", 3, None), ("bad", 0, None)],
)
def test_slurm_tasks_per_node(spec, node, expected):
    assert slurm_tasks_on_node(spec, node) == expected


def _meshes_under(rank, world, environments):
    """(auto U, auto R, ranks-per-node warnings) of meshes built under each launcher environment."""
    import os

    from hybridsp import init_mesh

    found = []
    for environ in environments:
        os.environ.pop("LOCAL_WORLD_SIZE", None)  # hybridsp.testing sets it; the launcher's environment replaces it
        os.environ.pop("LOCAL_SIZE", None)
        os.environ.pop("CROSS_RANK", None)
        os.environ.update(environ)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            auto = init_mesh(ulysses="auto", ring="auto", num_heads=4)
            init_mesh(ulysses=2, ring=2)
        found.append((auto.ulysses, auto.ring, [str(w.message) for w in caught if "ranks per node" in str(w.message)]))
    return found


@pytest.mark.distributed
def test_mesh_under_the_deepspeed_launcher_with_accelerate():
    # 2 ranks per node as DeepSpeed says (LOCAL_SIZE) and LOCAL_WORLD_SIZE=1 as accelerate writes:
    # the planner keeps Ulysses inside the node (U=2, R=2), and U=2 raises no crosses-nodes warning;
    # without DeepSpeed's markers the same LOCAL_WORLD_SIZE=1 is believed: the warning a user saw
    deepspeed_and_accelerate = {"LOCAL_SIZE": "2", "CROSS_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    results = run_distributed(_meshes_under, 4, [deepspeed_and_accelerate, {"LOCAL_WORLD_SIZE": "1"}], timeout=120)
    for under_deepspeed, believed in results:
        assert under_deepspeed == (2, 2, []), under_deepspeed
        assert believed[2] and "does not divide the 1 ranks per node" in believed[2][0], believed
