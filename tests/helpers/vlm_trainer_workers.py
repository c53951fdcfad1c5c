"""Distributed workers for tests/integrations/transformers/vision/test_trainer.py: a tiny Qwen2-VL trained
by a Trainer on gloo ranks.

Rank 0 returns the per-step logged loss and grad_norm (other ranks None). The plain reference
is ``transformers.Trainer`` on one process, without DeepSpeed, on the same samples.
"""

from __future__ import annotations

import tempfile

import torch

from tests.helpers.trainer_workers import ds_config
from tests.helpers.vlm_workers import collate, sample, tiny_vlm

STEPS, ACCUMULATION, MICRO_BATCH = 3, 2, 2


def samples(count: int, seed: int) -> list[dict]:
    """Rows of 2-3 images (and sometimes a 2-frame video) between text runs of varied length."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        pieces = []
        for _ in range(int(torch.randint(2, 4, (1,), generator=generator))):
            h, w = (int(2 * torch.randint(2, 6, (1,), generator=generator)) for _ in range(2))
            pieces += [int(torch.randint(1, 8, (1,), generator=generator)), ("image", (1, h, w))]
        if bool(torch.randint(0, 2, (1,), generator=generator)):
            pieces += [3, ("video", (2, 4, 4))]
        rows.append(sample(generator, pieces + [int(torch.randint(2, 9, (1,), generator=generator))]))
    return rows


def _arguments(output_dir: str, deepspeed: dict | None):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS, max_grad_norm=1.0, learning_rate=3e-3, weight_decay=0.01, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0, deepspeed=deepspeed,
        use_cpu=True, dataloader_num_workers=0, remove_unused_columns=False,
    )


def train(rank: int, world_size: int, runs: list) -> list:
    """For each run (None: the plain Trainer; else dict(ulysses, ring, stage)) train STEPS steps."""
    import os

    from transformers import Trainer

    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build
    from hybridsp.integrations.transformers import HybridSPTrainer

    os.environ["OMP_NUM_THREADS"] = "1"
    results = []
    for run in runs:
        data = samples(STEPS * ACCUMULATION * MICRO_BATCH, seed=1)
        with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
            if run is None:
                trainer = Trainer(model=tiny_vlm(), args=_arguments(out, None), train_dataset=data,
                                  data_collator=collate)
            else:
                config = ds_config(run["ulysses"], run["ring"], run["stage"], config_optimizer=False)
                trainer = HybridSPTrainer(model=tiny_vlm(), args=_arguments(out, config), train_dataset=data,
                                          data_collator=collate)
            trainer.train()
        steps = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
        results.append({"loss": [row["loss"] for row in steps], "grad_norm": [row["grad_norm"] for row in steps]})
    return results if rank == 0 else None
