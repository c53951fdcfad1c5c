"""The TRL examples (trl_sft.py, trl_dpo.py, trl_grpo.py, peft_lora.py) as a user launches them: 2 CPU ranks under
``deepspeed --num_gpus 2`` or ``torchrun --nproc_per_node 2`` with ds_configs/trainer/cp2.json (U2 x R1,
ZeRO-3, every Trainer value "auto"), a tiny model and 2 steps; the logged losses are finite, the final
model (or adapter) is written, and the first step's loss equals the same script's on one process
without a launcher (U1, the same data) to 1e-4, and so does the second."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.example_runs import example_environment, free_port
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

CP2 = str(ROOT / "ds_configs" / "trainer" / "cp2.json")
TINY = [
    "--max-steps",
    "2",
    "--seq-len",
    "64",
    "--hidden-size",
    "64",
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--vocab-size",
    "512",
]
JOB_SECONDS = 600  # a hang catcher


def _run(tmp_path: Path, script: str, launcher: str | None, out: Path, *extra: str) -> subprocess.CompletedProcess:
    path = str(ROOT / "examples" / script)
    args = [*TINY, "--output-dir", str(out), *extra]
    if launcher == "deepspeed":
        command = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), path, "--deepspeed", CP2, *args]
    elif launcher == "torchrun":
        command = [
            "torchrun",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            path,
            "--deepspeed",
            CP2,
            *args,
        ]
    else:  # one process, no launcher: U1 (cp2.json's U2 needs two ranks)
        command = [sys.executable, path, "--deepspeed", CP2, "--ulysses", "1", *args]
    return subprocess.run(
        command, cwd=tmp_path, env=example_environment(tmp_path), capture_output=True, text=True, timeout=JOB_SECONDS
    )


def _losses(result: subprocess.CompletedProcess, out: Path) -> list[float]:
    """Exit 0, no traceback, one metrics row per step with a finite loss: the losses."""
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2], rows
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) for row in steps), rows
    assert "done: 2 steps" in result.stdout, result.stdout[-2000:]
    return [row["loss"] for row in steps]


def _same_losses(sharded: list[float], alone: list[float]) -> None:
    """Both steps within 1e-4 (measured: < 2e-7 for SFT and LoRA; the second step follows one update)."""
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(sharded, alone)), (sharded, alone)


def test_sft_example_trains_packed_rows_on_2_ranks_and_refuses_a_rerun(tmp_path):
    out = tmp_path / "sft"
    result = _run(tmp_path, "trl_sft.py", "deepspeed", out)
    losses = _losses(result, out)
    assert "HybridMesh(dp=1, ring=1, ulysses=2" in result.stdout and "packing=bfd" in result.stdout
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert losses[0] > 5.0  # an untrained model over a 512-word vocabulary: ~ln 512 = 6.2

    again = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "trl_sft.py"), "--deepspeed", CP2, *TINY, "--output-dir", str(out)],
        cwd=tmp_path,
        env={**example_environment(tmp_path), "WORLD_SIZE": "2", "RANK": "0"},
        capture_output=True,
        text=True,
        timeout=JOB_SECONDS,
    )
    assert again.returncode == 2, again.stderr[-2000:]
    assert again.stderr.strip() == (
        f"trl_sft.py: error: {out} already holds a run (metrics.jsonl); pass --resume to "
        f"continue it, --overwrite to write over it, or --output-dir DIR for a new one"
    )


@pytest.mark.slow
def test_sft_example_first_step_equals_one_process(tmp_path):
    sharded = _losses(_run(tmp_path, "trl_sft.py", "deepspeed", tmp_path / "u2"), tmp_path / "u2")
    alone = _losses(_run(tmp_path, "trl_sft.py", None, tmp_path / "u1"), tmp_path / "u1")
    _same_losses(sharded, alone)


@pytest.mark.slow
def test_dpo_example_under_torchrun_equals_one_process(tmp_path):
    result = _run(tmp_path, "trl_dpo.py", "torchrun", tmp_path / "u2")
    sharded = _losses(result, tmp_path / "u2")
    rows = [json.loads(line) for line in (tmp_path / "u2" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(row["rewards/margins"]) for row in rows if "loss" in row), rows
    assert abs(sharded[0] - math.log(2)) < 1e-5  # the policy starts as the reference: margin 0, loss ln 2
    alone = _losses(_run(tmp_path, "trl_dpo.py", None, tmp_path / "u1"), tmp_path / "u1")
    _same_losses(sharded, alone)


@pytest.mark.slow
def test_lora_example_saves_the_adapter_and_equals_one_process(tmp_path):
    result = _run(tmp_path, "peft_lora.py", "deepspeed", tmp_path / "u2", "--lora-r", "4", "--lora-alpha", "8")
    sharded = _losses(result, tmp_path / "u2")
    assert "r=4, 1,792 of 108,608 parameters train" in result.stdout, result.stdout[-2000:]  # q, v of 2 layers
    assert (tmp_path / "u2" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "u2" / "model.safetensors").exists()
    alone = _losses(
        _run(tmp_path, "peft_lora.py", None, tmp_path / "u1", "--lora-r", "4", "--lora-alpha", "8"), tmp_path / "u1"
    )
    _same_losses(sharded, alone)


def _grpo_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row and "train_loss" not in row]


@pytest.mark.slow  # the SFT example's default test covers the examples' plumbing; GRPO itself: test_rl_trainers.py
def test_grpo_example_trains_on_2_ranks(tmp_path):
    """GRPO under torchrun at U2 x R1, ZeRO-3: finite loss, grad_norm, reward and kl per step; the initial
    policy (TRL's reference is built from its path) and the final model written."""
    out = tmp_path / "grpo"
    result = _run(tmp_path, "trl_grpo.py", "torchrun", out, "--completion-len", "8")
    _losses(result, out)
    assert "TRL GRPO example (4 completions of <= 8 tokens" in result.stdout, result.stdout[-2000:]
    assert "HybridMesh(dp=1, ring=1, ulysses=2" in result.stdout
    rows = _grpo_rows(out)
    assert all(math.isfinite(row["reward"]) and math.isfinite(row["kl"]) for row in rows), rows
    assert (out / "model.safetensors").is_file() and (out / "initial-policy" / "config.json").is_file()


@pytest.mark.slow
def test_grpo_example_equals_one_process(tmp_path):
    """Both steps' grad_norm, reward and kl on 2 ranks (deepspeed launcher; also with ``--generation sharded``)
    equal the one-process run's (1e-4; the loss to 1e-6 absolute: dapo's first loss is ~0)."""
    extra = ("--completion-len", "8")
    _losses(_run(tmp_path, "trl_grpo.py", "deepspeed", tmp_path / "u2", *extra), tmp_path / "u2")
    _losses(
        _run(tmp_path, "trl_grpo.py", "deepspeed", tmp_path / "u2s", *extra, "--generation", "sharded"),
        tmp_path / "u2s",
    )
    _losses(_run(tmp_path, "trl_grpo.py", None, tmp_path / "u1", *extra), tmp_path / "u1")
    alone = _grpo_rows(tmp_path / "u1")
    for sharded in (_grpo_rows(tmp_path / "u2"), _grpo_rows(tmp_path / "u2s")):
        for a, b in zip(sharded, alone, strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-6 + 1e-4 * abs(b["loss"]), (sharded, alone)
            for key in ("grad_norm", "reward", "kl"):
                assert abs(a[key] - b[key]) <= 1e-6 + 1e-4 * abs(b[key]), (key, sharded, alone)
    assert alone[0]["grad_norm"] > 0 or alone[1]["grad_norm"] > 0
