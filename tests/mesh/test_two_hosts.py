"""Two hosts for real: two Linux network namespaces (tests/helpers/netns.py), one launcher per host.

Each namespace has its own network stack (``lo`` and one veth end, 10.77.0.1 and 10.77.0.2);
the ranks of host B reach host A only over the veth pair, with a master address that is not
127.0.0.1 and gloo choosing its interface (hybridsp.launch._gloo_interface). Where the ranks run is read from
the processes themselves (the inode of ``/proc/<pid>/ns/net`` against the namespaces'), not
from the launcher's or the library's belief. Skipped where namespaces cannot be made (not root).

- default run: ``torchrun --nnodes 2`` of tests/scripts/two_node_check.py (hybrid attention
  against float64; Ulysses groups inside a host, rings across);
- slow: the main job (``examples/train.py``, ``ds_configs/cp8.json``) on 2 hosts x 4 ranks with
  ``deepspeed --hostfile H --no_ssh --node_rank i`` and with ``torchrun --nnodes 2``, against the
  same job on one host; a lost host B (link down, every process killed) and host A resuming alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridsp.testing import run_distributed
from tests.helpers.netns import Hosts, two_hosts
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.integration]  # launchers on two network namespaces

TRAIN = ROOT / "examples" / "train.py"
CP8 = str(ROOT / "ds_configs" / "cp8.json")
SMALL_MODEL = [
    "--seq-len",
    "128",
    "--layers",
    "2",
    "--hidden-size",
    "64",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--no-plot",
    "--lr",
    "1e-3",
]
PORT = 29400  # inside fresh namespaces every port is free
JOB_SECONDS = 420
CHECK_SECONDS = 600  # only catches a hang: generous, so a busy machine does not fail the test


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _netns_inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


def _finish(jobs: list[subprocess.Popen], limit: float) -> list[str]:
    """Every job's output; all are killed (and the test fails) if one runs past ``limit`` seconds."""
    deadline = time.monotonic() + limit
    outputs = []
    try:
        for job in jobs:
            outputs.append(job.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"the two-host job did not finish within {limit:.0f} s")
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()
    return outputs


@pytest.mark.timeout(2 * CHECK_SECONDS + 300)  # two launches, each under CHECK_SECONDS
def test_torchrun_two_hosts_keep_ulysses_inside_a_host_and_stay_exact(tmp_path):
    with two_hosts() as hosts:
        jobs = [
            hosts.popen(
                node,
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "4",
                    "--node-rank",
                    str(node),
                    "--master-addr",
                    hosts.addresses[0],
                    "--master-port",
                    str(PORT),
                    "tests/scripts/two_node_check.py",
                    str(tmp_path),
                ],
                cwd=ROOT,
                env={**_env(), "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for node in (0, 1)
        ]
        outputs = _finish(jobs, CHECK_SECONDS)
        namespaces = [_netns_inode(name) for name in hosts.names]
        assert all(job.returncode == 0 for job in jobs), "\n".join(o[-3000:] for o in outputs)
        checks = [
            hosts.popen(
                node,
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "4",
                    "--node-rank",
                    str(node),
                    "--master-addr",
                    hosts.addresses[0],
                    "--master-port",
                    str(PORT + 1),
                    "-m",
                    "hybridsp",
                    "check-mesh",
                    "--ulysses",
                    "4",
                    "--ring",
                    "2",
                ],
                cwd=ROOT,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for node in (0, 1)
        ]
        check_outputs = _finish(checks, CHECK_SECONDS)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not any(name in left for name in hosts.names), f"namespaces left behind: {left}"
    assert all(job.returncode == 0 for job in checks), "\n".join(o[-3000:] for o in check_outputs)
    a, b = hosts.addresses
    assert f"/{a} ranks 0-3; " in check_outputs[0] and f"/{b} ranks 4-7; " in check_outputs[0], check_outputs[0]
    assert "2 Ulysses groups each inside one host; ring groups span 2 host(s)" in check_outputs[0]
    assert "launcher: torchrun, 8 ranks, 4 per node" in check_outputs[0]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(8)]
    for report in reports:
        assert report["netns"] == namespaces[report["rank"] // 4], "rank in an unexpected host"
        assert report["gloo_interface"] == hosts.interfaces[report["rank"] // 4]
        assert (report["ulysses"], report["ring"], report["dp"]) == (4, 2, 1)
        assert len(set(report["ulysses_netns"])) == 1, "a Ulysses group crosses hosts"
        assert sorted(report["ring_netns"]) == sorted(namespaces), "the ring should span both hosts"
        assert max(report["errors"]) < 1e-5, report["errors"]


# ---- the main job (slow: 8 ranks of examples/train.py on 2 cores) ----


def _hostfile(tmp: Path) -> Path:
    path = tmp / "hostfile"
    path.write_text("hosta slots=4\nhostb slots=4\n")
    return path


def _disk(tmp: Path, node: int) -> Path:
    """Host ``node``'s own disk: each host runs in its own directory and saves to the relative
    ``--save-dir run``, the same path that lands on a different disk on every host."""
    path = tmp / f"disk{node}"
    path.mkdir(exist_ok=True)
    return path


def _deepspeed_host(hosts: Hosts, node: int, tmp: Path, *extra: str) -> subprocess.Popen:
    """``deepspeed --hostfile H --no_ssh --node_rank node`` inside host ``node``, on its own disk."""
    command = [
        "deepspeed",
        "--hostfile",
        str(_hostfile(tmp)),
        "--no_ssh",
        "--node_rank",
        str(node),
        "--master_addr",
        hosts.addresses[0],
        "--master_port",
        str(PORT),
        str(TRAIN),
        "--deepspeed",
        CP8,
        *SMALL_MODEL,
        "--save-dir",
        "run",
        *extra,
    ]
    return hosts.popen(
        node, command, cwd=_disk(tmp, node), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _torchrun_host(hosts: Hosts, node: int, tmp: Path, *extra: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--node-rank",
        str(node),
        "--master-addr",
        hosts.addresses[0],
        "--master-port",
        str(PORT),
        str(TRAIN),
        "--deepspeed",
        CP8,
        *SMALL_MODEL,
        "--save-dir",
        "run",
        *extra,
    ]
    return hosts.popen(
        node, command, cwd=_disk(tmp, node), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _train(rank, world, argv):
    sys.path.insert(0, str(ROOT / "examples"))
    import train

    train.main(argv)


def _one_host(run_dir: Path, world: int, *extra: str) -> dict[int, float]:
    """The same job on one host: ``world`` gloo ranks on this machine's loopback."""
    run_distributed(
        _train, world, ["--deepspeed", CP8, *SMALL_MODEL, "--save-dir", str(run_dir), *extra], timeout=JOB_SECONDS
    )
    return _losses(run_dir)


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def _rank_hosts(hosts: Hosts) -> dict[int, int]:
    """{global rank: host index} of the running train.py processes, read from /proc (their RANK, their netns)."""
    found = {}
    for host in (0, 1):
        for pid in hosts.pids(host):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            ranks = [item[5:] for item in environ if item.startswith(b"RANK=")]
            if (
                b"train.py" in command
                and ranks
                and b"deepspeed.launcher" not in command
                and b"torch.distributed.run" not in command
            ):
                found[int(ranks[0])] = host
    return found


def _watch_ranks(hosts: Hosts, jobs: list[subprocess.Popen], limit: float = 300) -> dict[int, int]:
    """Poll /proc until all 8 ranks are seen (their host as the OS says)."""
    deadline, seen = time.monotonic() + limit, {}
    while time.monotonic() < deadline and len(seen) < 8 and all(job.poll() is None for job in jobs):
        seen.update(_rank_hosts(hosts))
        time.sleep(0.5)
    return seen


def _check_placement(run_dir: Path, rank_hosts: dict[int, int], addresses: tuple[str, str]) -> None:
    """Every Ulysses group inside one host, every ring across both: the OS's view and the job's agree."""
    assert sorted(rank_hosts) == list(range(8)), rank_hosts
    placement = json.loads((run_dir / "placement.json").read_text())
    for group in placement["ulysses"]:
        assert len({rank_hosts[r] for r in group}) == 1, f"Ulysses group {group} crosses hosts: {rank_hosts}"
    for group in placement["ring"]:
        assert {rank_hosts[r] for r in group} == {0, 1}, f"ring group {group} stays on one host: {rank_hosts}"
    seen = [host.split("/")[-1] for host in placement["hosts"]]  # the address each process reaches A from
    assert seen == [addresses[rank_hosts[r]] for r in range(8)], seen


def _partitions(tag: Path) -> list[int]:
    """Ranks whose ZeRO-3 partition (optimizer and parameter files) is in ``tag``."""
    return [
        rank
        for rank in range(8)
        if (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").is_file()
        and (tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").is_file()
    ]


def _check_run_complete(tmp: Path, steps: int) -> None:
    """Rank 0's disk: metrics of every step and a complete checkpoint; host B's disk: its own part."""
    run_a, run_b = _disk(tmp, 0) / "run", _disk(tmp, 1) / "run"
    assert sorted(_losses(run_a)) == list(range(1, steps + 1))
    for run_dir, ranks in ((run_a, list(range(8))), (run_b, [4, 5, 6, 7])):
        tag = run_dir / (run_dir / "latest").read_text().strip()
        assert tag.name == f"step{steps}"
        assert json.loads((tag / "hybridsp_mesh.json").read_text())["world_size"] == 8
        assert _partitions(tag) == ranks, (run_dir, sorted(p.name for p in tag.iterdir()))
    assert not (run_b / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_main_job_on_two_hosts_equals_one_host(tmp_path, launcher):
    steps = 3
    start = _deepspeed_host if launcher == "deepspeed" else _torchrun_host
    run_dir = _disk(tmp_path, 0) / "run"
    with two_hosts() as hosts:
        jobs = [start(hosts, node, tmp_path, "--max-steps", str(steps)) for node in (0, 1)]
        rank_hosts = _watch_ranks(hosts, jobs)
        outputs = _finish(jobs, JOB_SECONDS)
    assert all(job.returncode == 0 for job in jobs), "\n".join(o[-4000:] for o in outputs)
    _check_placement(run_dir, rank_hosts, hosts.addresses)
    assert "2 Ulysses groups each inside one host; ring groups span 2 host(s)" in outputs[0]
    _check_run_complete(tmp_path, steps)
    reference = _one_host(tmp_path / "one-host", 8, "--max-steps", str(steps))
    two = _losses(run_dir)
    for step in range(1, steps + 1):
        assert abs(two[step] - reference[step]) <= 1e-6 * abs(reference[step]), (step, two, reference)


def _wait_for_checkpoint(run_dir: Path, step: int, jobs: list[subprocess.Popen], limit: float = 400) -> None:
    """Until ``latest`` names a checkpoint of at least ``step`` (the job must still be running)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        latest = run_dir / "latest"
        if latest.is_file() and int(latest.read_text().strip().removeprefix("step")) >= step:
            return
        if any(job.poll() is not None for job in jobs):
            raise AssertionError("a host's job ended early:\n" + "\n".join(j.stdout.read()[-3000:] for j in jobs))
        time.sleep(0.5)
    raise AssertionError(f"no checkpoint of step {step} within {limit} s")


# Host A must exit within a few collective timeouts of losing host B (without the fix it waited torch's
# 30-minute group default): 5 x 30 s bounds that, with room for a busy machine.
COLLECTIVE_TIMEOUT, EXIT_MARGIN = 30, 120


@pytest.mark.slow
def test_lost_host_ends_host_a_within_the_timeout_and_host_a_resumes_alone(tmp_path):
    run_dir, alone = _disk(tmp_path, 0) / "run", tmp_path / "host-a-alone"
    with two_hosts() as hosts:
        jobs = [
            _deepspeed_host(
                hosts,
                node,
                tmp_path,
                "--max-steps",
                "200",
                "--save-every",
                "1",
                "--collective-timeout",
                str(COLLECTIVE_TIMEOUT),
            )
            for node in (0, 1)
        ]
        try:
            _wait_for_checkpoint(run_dir, 2, jobs)
            hosts.unplug(1)  # host B vanishes from the network: A hears nothing, not even a reset
            hosts.kill_all(1)
            lost = time.monotonic()
            try:
                jobs[0].wait(timeout=COLLECTIVE_TIMEOUT + EXIT_MARGIN + 120)
            except subprocess.TimeoutExpired:
                pass
            took = time.monotonic() - lost
            time.sleep(1.0)
            lingering = [pid for pid in hosts.pids(0)]
        finally:
            for job in jobs:
                if job.poll() is None:
                    job.kill()
        output_a = jobs[0].stdout.read()
        assert jobs[0].returncode not in (None, 0), output_a[-3000:]
        assert took <= COLLECTIVE_TIMEOUT + EXIT_MARGIN, f"host A needed {took:.0f} s to exit:\n{output_a[-3000:]}"
        print(f"host A's job exited {took:.0f} s after host B was lost (--collective-timeout {COLLECTIVE_TIMEOUT})")
        assert lingering == [], f"processes of host A still alive: {lingering}"

        saved = int((run_dir / "latest").read_text().strip().removeprefix("step"))
        assert _partitions(run_dir / f"step{saved}") == list(range(8))  # host B's parts survive on A's disk
        resumed = hosts.popen(
            0,
            [
                "deepspeed",
                "--num_gpus",
                "4",
                "--master_port",
                str(PORT),
                str(TRAIN),
                "--deepspeed",
                CP8,
                *SMALL_MODEL,
                "--ulysses",
                "4",
                "--ring",
                "1",
                "--resume-from",
                str(run_dir),
                "--max-steps",
                str(saved + 2),
                "--save-dir",
                str(alone),
            ],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        output = _finish([resumed], JOB_SECONDS)[0]
    assert resumed.returncode == 0, output[-4000:]
    assert f"resumed from {run_dir / f'step{saved}'} (universal)" in output
    uninterrupted = _one_host(tmp_path / "uninterrupted", 8, "--max-steps", str(saved + 2))
    losses = _losses(alone)
    assert sorted(losses) == [saved + 1, saved + 2], losses
    for step in (saved + 1, saved + 2):
        assert abs(losses[step] - uninterrupted[step]) <= 1e-5 * abs(uninterrupted[step]), (step, losses, uninterrupted)
