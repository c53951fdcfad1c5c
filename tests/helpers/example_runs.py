"""Running an example script as a user does, in a subprocess: an environment without launcher variables and
a free port for the launcher's rendezvous."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from tests.helpers.paths import ROOT

LAUNCHER_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def example_environment(tmp_path: Path) -> dict:
    """No launcher variables; the worktree on the path; no JIT builds (DS_ACCELERATOR named, an empty
    extensions folder); one thread per rank on the shared cores."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(
        PYTHONPATH=str(ROOT),
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"),
        HF_HUB_OFFLINE="1",
    )
    return env


def run_example(command: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    """``command`` run in ``tmp_path`` as a user runs it (:func:`example_environment`); asserts exit 0 and no
    traceback in its output, and returns the finished process (stdout and stderr as text)."""
    result = subprocess.run(
        command, cwd=tmp_path, env=example_environment(tmp_path), capture_output=True, text=True, timeout=timeout
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in output, output[-4000:]
    return result
