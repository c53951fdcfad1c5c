"""Distributed workers for tests/integrations/transformers/vision/test_trainer.py: a tiny Qwen2-VL trained
by a Trainer on gloo ranks.

Rank 0 returns the per-step logged loss and grad_norm (other ranks None). The plain reference
is ``transformers.Trainer`` on one process, without DeepSpeed, on the same samples.
"""

from __future__ import annotations

import tempfile

import torch

from tests.helpers.workers.trainer import ds_config
from tests.helpers.workers.vlm import collate, sample, tiny_vlm

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


def text_only_mix(count: int, seed: int, replicas: int = 2) -> list[dict]:
    """Rows for ``replicas`` x MICRO_BATCH rows per micro-step (sequential): in every micro-step the rows of
    one replica have images (as :func:`samples`) and those of the others are text only."""
    images, generator = samples(count, seed), torch.Generator().manual_seed(seed + 100)
    rows = []
    for index in range(count):
        step, replica = divmod(index // MICRO_BATCH, replicas)
        text_only = replica != step % replicas
        rows.append(
            sample(generator, [int(torch.randint(12, 40, (1,), generator=generator))]) if text_only else images[index]
        )
    return rows


def _arguments(output_dir: str, deepspeed: dict | None, micro: int = MICRO_BATCH, **overrides):
    from transformers import TrainingArguments

    return TrainingArguments(
        **{
            **dict(
                output_dir=output_dir,
                per_device_train_batch_size=micro,
                gradient_accumulation_steps=ACCUMULATION,
                max_steps=STEPS,
                max_grad_norm=1.0,
                learning_rate=3e-3,
                weight_decay=0.01,
                lr_scheduler_type="constant",
                logging_steps=1,
                save_strategy="no",
                report_to=[],
                disable_tqdm=True,
                seed=0,
                deepspeed=deepspeed,
                use_cpu=True,
                dataloader_num_workers=0,
                remove_unused_columns=False,
            ),
            **overrides,
        }
    )


def train(rank: int, world_size: int, runs: list, data: str = "images") -> list:
    """For each run (None: the plain Trainer; else dict(ulysses, ring, stage) and optionally ``micro``, the
    plain Trainer's micro batch) train STEPS steps on :func:`samples` (``data="images"``) or, sampled in
    order, :func:`text_only_mix` (``data="text_only_mix"``: DP = 2 replicas, one of them text only)."""
    import os

    from transformers import Trainer

    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build
    from hybridsp.integrations.transformers import HybridSPTrainer

    os.environ["OMP_NUM_THREADS"] = "1"
    mixed = data == "text_only_mix"
    order = dict(train_sampling_strategy="sequential") if mixed else {}
    results = []
    for run in runs:
        rows = (text_only_mix if mixed else samples)(STEPS * ACCUMULATION * MICRO_BATCH * (2 if mixed else 1), seed=1)
        with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
            if run is None or "stage" not in run:
                args = _arguments(out, None, (run or {}).get("micro", MICRO_BATCH), **order)
                trainer = Trainer(model=tiny_vlm(), args=args, train_dataset=rows, data_collator=collate)
            else:
                config = ds_config(run["ulysses"], run["ring"], run["stage"], config_optimizer=False)
                trainer = HybridSPTrainer(
                    model=tiny_vlm(), args=_arguments(out, config, **order), train_dataset=rows, data_collator=collate
                )
            trainer.train()
        steps = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
        results.append({"loss": [row["loss"] for row in steps], "grad_norm": [row["grad_norm"] for row in steps]})
    return results if rank == 0 else None
