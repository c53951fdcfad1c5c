"""examples/train_hf_trainer.py as a user runs it: one process without a launcher (also with ``--model-path``,
which needed mpi4py before), and on two meshes of DP 1 (U2xR1, U1xR2 under torchrun) training on the same rows
as the one-process run, so their losses agree step by step (to 1e-4; the data used to be sized by the world)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.example_runs import free_port, run_example
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

SCRIPT = str(ROOT / "examples" / "train_hf_trainer.py")
CP2 = str(ROOT / "ds_configs" / "trainer" / "cp2.json")  # ZeRO-3, every Trainer value "auto"
STEPS = 3
TINY = ["--seq-len", "64", "--hidden-size", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2"]
JOB_SECONDS = 600  # a hang catcher


def _train(
    tmp_path: Path, name: str, ranks: int, *extra: str, steps: int = STEPS, launcher: list[str] | None = None
) -> list[float]:
    """Run the example (``ranks`` 1: no launcher; ``launcher``: this command instead of torchrun) for ``steps``
    into tmp_path/name; exit 0; its per-step losses."""
    out = tmp_path / name
    args = [SCRIPT, "--deepspeed", CP2, *TINY, "--max-steps", str(steps), "--output-dir", str(out), *extra]
    if launcher is None:
        launcher = ["torchrun", "--nproc_per_node", str(ranks), "--master_port", str(free_port())] if ranks > 1 else []
    result = run_example([*launcher, *([] if launcher else [sys.executable]), *args], tmp_path, JOB_SECONDS)
    assert f"done: {steps} steps" in result.stdout, result.stdout[-2000:]
    if "--fsdp" in extra or (launcher and "--config_file" in launcher):
        assert "FSDP2: every parameter a DTensor shard: True" in result.stdout, result.stdout[-2000:]
    history = json.loads((out / f"checkpoint-{steps}" / "trainer_state.json").read_text())["log_history"]
    return [row["loss"] for row in history if "loss" in row]


def _write_model(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, num_key_value_heads=2, **config)).save_pretrained(path)


def test_one_process_without_a_launcher_loads_a_saved_model(tmp_path):
    """``python examples/train_hf_trainer.py --ulysses 1 --model-path DIR``: a world of one, ZeRO-3 loading."""
    _write_model(tmp_path / "model")
    losses = _train(tmp_path, "alone", 1, "--ulysses", "1", "--model-path", str(tmp_path / "model"), steps=1)
    assert len(losses) == 1 and losses[0] > 0


@pytest.mark.slow
def test_meshes_of_one_replica_train_on_the_rows_of_one_process(tmp_path):
    """U2xR1 and U1xR2 on 2 ranks against U1xR1 on one process: every step's loss within 1e-4."""
    alone = _train(tmp_path, "alone", 1, "--ulysses", "1", "--ring", "1")
    for ulysses, ring in ((2, 1), (1, 2)):
        sharded = _train(tmp_path, f"u{ulysses}r{ring}", 2, "--ulysses", str(ulysses), "--ring", str(ring))
        assert len(sharded) == len(alone) == STEPS
        assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(sharded, alone)), (ulysses, ring, sharded, alone)


ACCELERATE_CONFIGS = sorted((ROOT / "examples" / "accelerate").glob("*.yaml"))


def test_the_shipped_accelerate_configs_load_and_ask_for_fsdp2():
    """accelerate reads each shipped YAML (it refuses unknown keys) as FSDP version 2."""
    from accelerate.commands.config.config_args import load_config_from_file

    assert len(ACCELERATE_CONFIGS) >= 2
    for path in ACCELERATE_CONFIGS:
        config = load_config_from_file(str(path))
        assert str(config.distributed_type).endswith("FSDP") and int(config.fsdp_config["fsdp_version"]) == 2, path


@pytest.mark.slow
@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=lambda path: path.stem)
def test_accelerate_launch_of_each_config_shards_and_equals_one_process(tmp_path, config):
    """``accelerate launch --config_file examples/accelerate/X.yaml`` (2 ranks here, U1 x R2) against one
    process: every parameter sharded, losses within 1e-4 (fp32) or 1e-2 (the bf16 config)."""
    alone = _train(tmp_path, "alone", 1, "--ulysses", "1", "--ring", "1")
    port = ["--main_process_port", str(free_port())]
    launcher = ["accelerate", "launch", "--config_file", str(config), "--num_processes", "2", *port]
    sharded = _train(tmp_path, config.stem, 2, "--ulysses", "1", "--ring", "2", launcher=launcher)
    tolerance = 1e-2 if "bf16" in config.stem else 1e-4
    assert len(sharded) == len(alone) == STEPS
    assert all(abs(a - b) <= tolerance * abs(b) for a, b in zip(sharded, alone)), (config.stem, sharded, alone)


@pytest.mark.slow  # the Trainer's FSDP2 path runs by default in tests/integrations/fsdp/test_trainer_fsdp2.py
def test_fsdp_flag_under_torchrun_shards_and_equals_one_process(tmp_path):
    """``torchrun ... --fsdp`` (U1 x R2 on 2 ranks) against one process, to 1e-4."""
    alone = _train(tmp_path, "alone", 1, "--ulysses", "1", "--ring", "1", steps=2)
    sharded = _train(tmp_path, "fsdp", 2, "--fsdp", "--ulysses", "1", "--ring", "2", steps=2)
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(sharded, alone)), (sharded, alone)
