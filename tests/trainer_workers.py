"""The Trainer workers under their old import path, for benchmarks/trainer_grad_scale.py, which imports
``tests.trainer_workers``; they live in tests/helpers/trainer_workers.py (import them from there)."""

from tests.helpers.trainer_workers import (  # noqa: F401
    _arguments,
    _step_logs,
    collate,
    ds_config,
    samples,
    several,
    tiny_llama,
)
