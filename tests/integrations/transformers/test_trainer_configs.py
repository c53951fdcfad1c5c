"""ds_configs/trainer/: the "auto" configs the HF Trainer, TRL and PEFT paths use (docs/hf-trainer.md,
docs/trl-peft.md). transformers fills every "auto" from TrainingArguments and refuses a fixed value
that disagrees with them; the fixed ds_configs/cp*.json do disagree with anything but their own values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

TRAINER_CONFIGS = sorted((ROOT / "ds_configs" / "trainer").glob("*.json"))
ARGUMENTS = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, learning_rate=1e-4,
                 max_grad_norm=0.5, adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-6, weight_decay=0.01)


def _processed(config: dict | Path, tmp: Path, **arguments):
    """transformers' own DeepSpeed-config processing for a Trainer (what HybridSPTrainer reads afterwards):
    ``trainer_config_process`` at TrainingArguments time, ``trainer_config_finalize`` once the model is known."""
    from types import SimpleNamespace

    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = TrainingArguments(output_dir=str(tmp), use_cpu=True, report_to=[], **arguments)
    processed = HfTrainerDeepSpeedConfig(json.loads(Path(config).read_text()) if isinstance(config, Path) else config)
    processed.trainer_config_process(args)
    processed.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=64)), 10)
    return processed.config


def filled_by_trainer(path: Path, tmp: Path | None = None) -> dict:
    """``path`` as the Trainer hands it on, with ARGUMENTS (shared with tests/integrations/deepspeed/test_config.py)."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        return _processed(path, Path(tmp or scratch), **ARGUMENTS)


def _autos(node, prefix="") -> list[str]:
    if isinstance(node, dict):
        return [key for k, v in node.items() for key in _autos(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if node == "auto" else []


def test_there_is_an_auto_config_per_context_size():
    assert [p.name for p in TRAINER_CONFIGS] == ["cp2.json", "cp4.json", "cp8.json"]
    for path in TRAINER_CONFIGS:
        fixed = json.loads((ROOT / "ds_configs" / path.name).read_text())
        assert json.loads(path.read_text())["hybridsp"] == fixed["hybridsp"]


@pytest.mark.parametrize("path", TRAINER_CONFIGS, ids=lambda p: p.name)
def test_auto_configs_take_the_training_arguments_without_a_mismatch(path, tmp_path):
    from hybridsp.integrations.deepspeed import HybridConfig, deepspeed_config

    config = filled_by_trainer(path, tmp_path)
    assert _autos(config) == ["hybridsp.backend"]  # hybridsp's own "auto" (the kernel) is all that is left
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (3, 2)
    assert (config["train_batch_size"], config["gradient_clipping"]) == (6, 0.5)
    assert config["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.01}
    assert config["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    hybrid = HybridConfig.from_ds_config(config)  # HybridSPTrainer's own reading of the section
    assert "hybridsp" not in deepspeed_config(config, hybrid, precision="fp32")


def test_the_fixed_configs_fail_with_the_mismatch_error_the_auto_ones_avoid(tmp_path):
    with pytest.raises(ValueError, match="mismatch TrainingArguments"):
        _processed(ROOT / "ds_configs" / "cp4.json", tmp_path, **ARGUMENTS)
