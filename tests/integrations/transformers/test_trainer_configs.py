"""ds_configs/trainer/: the "auto" configs the HF Trainer, TRL and PEFT paths use (docs/hf-trainer.md,
docs/trl-peft.md). transformers fills every "auto" from TrainingArguments and refuses a fixed value
that disagrees with them; the fixed ds_configs/cp*.json do disagree with anything but their own values."""

from __future__ import annotations

import json

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.trainer_configs import ARGUMENTS, filled_by_trainer, processed

pytestmark = pytest.mark.integration

TRAINER_CONFIGS = sorted((ROOT / "ds_configs" / "trainer").glob("*.json"))


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
        processed(ROOT / "ds_configs" / "cp4.json", tmp_path, **ARGUMENTS)
