"""The long-context examples (score_long.py, generate_long.py, long_video.py) on one process without
a launcher, their --collective-timeout, and the per-layer progress of a long forward."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.integration

sys.path.insert(0, str(ROOT / "examples"))


def _alone(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    """``python examples/<script> ...`` as a user types it: no launcher variables."""
    launcher = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )  # a hang catcher


def test_score_long_runs_on_one_process_and_shows_each_layer(tmp_path):
    result = _alone(tmp_path, "score_long.py", "--max-tokens", "256", "--collective-timeout", "60")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    layers = [line for line in result.stderr.splitlines() if line.startswith("score 256 tokens: layer")]
    assert [line.split(",")[0] for line in layers] == [f"score 256 tokens: layer {i}/4" for i in range(1, 5)]
    assert "scored 256 tokens in one forward over HybridMesh(dp=1, ring=1, ulysses=1" in result.stdout


def test_the_timeout_default_in_the_help_is_the_one_docs_memory_states():
    """docs/memory.md said 300 where the three long-context scripts default to 1800."""
    import generate_long
    import long_video
    import score_long

    defaults = {module.__name__: module.parse_args([]).collective_timeout for module in (score_long, generate_long)}
    defaults["long_video"] = long_video.parse_args([]).collective_timeout
    assert set(defaults.values()) == {1800.0}, defaults
    assert "`--collective-timeout SECONDS` (default 1800," in (ROOT / "docs" / "memory.md").read_text()


def test_score_long_bad_timeout_is_one_error_line(tmp_path):
    result = _alone(tmp_path, "score_long.py", "--collective-timeout", "0")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "score_long.py: error: --collective-timeout must be a positive number of seconds; got 0.0"
    )


def test_progress_reports_one_forward_then_stops():
    import io

    import torch
    from progress import layer_progress
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    sink = io.StringIO()
    with torch.no_grad(), layer_progress(model, "prefill", stream=sink):
        model(torch.zeros(1, 4, dtype=torch.long))
        model(torch.zeros(1, 4, dtype=torch.long))  # a decode step: quiet
    assert [line.split(",")[0] for line in sink.getvalue().splitlines()] == [f"prefill: layer {i}/3" for i in (1, 2, 3)]
    with layer_progress(model, "off", enabled=False, stream=sink):
        model(torch.zeros(1, 4, dtype=torch.long))
    assert "off" not in sink.getvalue()


@pytest.mark.slow  # ~30 s: a tiny prefill and 4 decode steps on one process
def test_generate_long_runs_on_one_process(tmp_path):
    result = _alone(
        tmp_path,
        "generate_long.py",
        "--prompt-len",
        "256",
        "--new-tokens",
        "4",
        "--layers",
        "2",
        "--collective-timeout",
        "60",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prefill 1 x 256 tokens: layer 2/2" in result.stderr and "decode:" in result.stdout
