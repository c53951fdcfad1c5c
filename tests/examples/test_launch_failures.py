"""The main job as a launcher runs it: a killed rank ends the job, the checkpoint continues; config errors once.

These start real ``deepspeed`` launches of ``examples/train.py`` (the README's main command, with
a small model) and a process whose command line carries a unique marker (the run directory), so
the test can find every process of the job, kill one rank, and check that none is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.integration

TRAIN = ROOT / "examples" / "train.py"
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
]
# The job must end soon after a rank is killed, not hang: 240 s is generous on a busy machine (on gloo the
# ranks are gone within seconds) and below train.py's default --collective-timeout (300 s), so the ranks
# leave because their peer died, not because a collective timed out.
EXIT_WITHIN_SECONDS = 240
JOB_SECONDS = 600  # a hang catcher for a launch's steps or its resume


def _job_processes(marker: str) -> list[int]:
    """PIDs whose command line mentions ``marker`` (this test's run directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in command and "train.py" in command:
            found.append(int(entry.name))
    return found


def _rank_pid(marker: str, local_rank: int) -> int | None:
    for pid in _job_processes(marker):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        if f"--local_rank={local_rank}" in command:
            return pid
    return None


def _launch(world: int, run_dir: Path, *extra: str) -> subprocess.Popen:
    command = [
        "deepspeed",
        "--num_gpus",
        str(world),
        "--master_port",
        str(_free_port()),
        str(TRAIN),
        "--deepspeed",
        str(ROOT / "ds_configs" / "cp4.json"),
        *SMALL_MODEL,
        "--save-dir",
        str(run_dir),
        *extra,
    ]
    return subprocess.Popen(
        command, cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_steps(run_dir: Path, steps: int, job: subprocess.Popen, limit: float = JOB_SECONDS) -> None:
    deadline = time.monotonic() + limit
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps and (run_dir / "latest").is_file():
            return
        if job.poll() is not None:
            raise AssertionError(f"the job ended early ({job.returncode}):\n{job.stdout.read()[-4000:]}")
        time.sleep(0.5)
    raise AssertionError(f"no {steps} steps within {limit} s")


def _kill_job(job: subprocess.Popen) -> None:
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


@pytest.mark.distributed  # a 4-rank deepspeed launch
@pytest.mark.timeout(2 * JOB_SECONDS + EXIT_WITHIN_SECONDS + 300)  # the steps, the exit, the resume
def test_killed_rank_ends_the_job_and_the_checkpoint_continues(tmp_path):
    run_dir = tmp_path / "killed-run"
    job = _launch(4, run_dir, "--max-steps", "500", "--save-every", "2")
    try:
        _wait_for_steps(run_dir, 3, job)
        victim = _rank_pid(str(run_dir), 2)
        assert victim is not None, "rank 2 not found"
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        job.wait(timeout=EXIT_WITHIN_SECONDS + 60)
        took = time.monotonic() - killed_at
    finally:
        _kill_job(job)
    assert job.returncode != 0
    assert took < EXIT_WITHIN_SECONDS, f"the other ranks needed {took:.0f} s to exit"
    time.sleep(1.0)
    assert _job_processes(str(run_dir)) == [], "processes of the killed job are still alive"

    saved_step = int((run_dir / "latest").read_text().strip().removeprefix("step"))
    resumed = _launch(4, run_dir, "--resume", "--max-steps", str(saved_step + 1))
    try:
        output, _ = resumed.communicate(timeout=JOB_SECONDS)
    finally:
        _kill_job(resumed)
    assert resumed.returncode == 0, output[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == saved_step + 1 and rows[-1]["loss"] == rows[-1]["loss"]


def _direct(tmp_path: Path, world: int, *args: str) -> subprocess.CompletedProcess:
    """Rank 0 of ``world`` as a launcher would start it, failing in the preflight (no peers needed)."""
    env = {**os.environ, "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"}
    return subprocess.run(
        [sys.executable, str(TRAIN), *SMALL_MODEL, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_SECONDS,
    )


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_config_errors_are_one_sentence_before_the_expensive_imports(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "hybridsp": {"ulysses": 2,\n  "ring": 2\n')
    line = _one_error_line(_direct(tmp_path, 4, "--deepspeed", str(broken)))
    assert "broken.json is not valid JSON" in line and "line 4" in line, line


@pytest.mark.slow  # each message is checked in process (tests/examples/test_user_errors.py); here as a launch sees it
def test_more_config_errors_are_one_sentence(tmp_path):
    missing = _one_error_line(_direct(tmp_path, 4, "--deepspeed", str(tmp_path / "nope.json")))
    assert "nope.json does not exist" in missing
    cp4 = str(ROOT / "ds_configs" / "cp4.json")
    assert "do not divide the world size 6" in _one_error_line(_direct(tmp_path, 6, "--deepspeed", cp4))
    heads = _one_error_line(_direct(tmp_path, 4, "--deepspeed", cp4, "--heads", "3", "--kv-heads", "1"))
    assert "3 query heads are not divisible by ulysses=2" in heads


@pytest.mark.distributed  # a 4-rank deepspeed launch
@pytest.mark.slow  # rank 0 alone speaks: also test_user_errors' mamba case (ranks 0 and 1); a deepspeed launch: above
def test_config_error_under_the_launcher_is_reported_once(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"hybridsp": {"ulysses": 2, "ring": 2},, }')
    command = [
        "deepspeed",
        "--num_gpus",
        "4",
        "--master_port",
        str(_free_port()),
        str(TRAIN),
        "--deepspeed",
        str(broken),
        *SMALL_MODEL,
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=JOB_SECONDS)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("broken.json is not valid JSON") == 1, output[-3000:]
    assert "Traceback" not in output
