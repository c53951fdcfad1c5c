"""transformers' own processing of a DeepSpeed config for a Trainer, with fixed TrainingArguments values
(tests/integrations/transformers/test_trainer_configs.py, tests/integrations/deepspeed/test_config.py)."""

from __future__ import annotations

import json
from pathlib import Path

ARGUMENTS = dict(
    per_device_train_batch_size=3,
    gradient_accumulation_steps=2,
    learning_rate=1e-4,
    max_grad_norm=0.5,
    adam_beta1=0.8,
    adam_beta2=0.9,
    adam_epsilon=1e-6,
    weight_decay=0.01,
)


def processed(config: dict | Path, tmp: Path, **arguments):
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
        return processed(path, Path(tmp or scratch), **ARGUMENTS)
