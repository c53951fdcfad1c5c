"""A simulated two-node launch on one machine: two torchrun invocations, 4 ranks each."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.netns import unavailable_reason
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.integration]  # two torchrun launches of 4 ranks each

LAUNCH_SECONDS = 600  # only catches a hang: generous, so a busy machine does not fail the test


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_node(node_rank: int, port: int, report_dir: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "tests/scripts/two_node_check.py",
        str(report_dir),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.skipif(
    unavailable_reason() is None,
    reason="tests/mesh/test_two_hosts.py runs the same two-node check over real network namespaces here",
)
def test_two_node_launch_keeps_ulysses_inside_nodes_and_stays_exact(tmp_path):
    port = _free_port()
    nodes = [_launch_node(rank, port, tmp_path) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=LAUNCH_SECONDS)[0].decode(errors="replace") for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
        pytest.fail(f"the simulated two-node launch did not finish within {LAUNCH_SECONDS} s")
    assert all(node.returncode == 0 for node in nodes), "\n".join(o[-3000:] for o in outputs)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(8)]
    for report in reports:
        assert (report["ulysses"], report["ring"], report["dp"]) == (4, 2, 1)
        assert set(report["ulysses_nodes"]) == {report["node"]}, "a Ulysses group crosses nodes"
        assert sorted(report["ring_nodes"]) == [0, 1], "the ring should span both nodes"
        assert max(report["errors"]) < 1e-5, report["errors"]
