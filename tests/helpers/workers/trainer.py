"""Distributed workers for the Trainer tests (tests/integrations/transformers/, and the TRL, vision and
label tests that reuse its model and data): one tiny Llama trained by a Trainer on gloo ranks.

Each worker runs in a fresh process of :func:`hybridsp.testing.run_distributed` and returns
rank 0's per-step logs, evaluation metrics and prediction logits (other ranks return None).
"""

from __future__ import annotations

import tempfile

import torch

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 64, 2, 4, 2
STEPS, ACCUMULATION, MICRO_BATCH = 4, 2, 2


def tiny_llama(seed: int = 0):
    """The same tiny Llama (hidden 64, 2 layers, 4 query / 2 K/V heads) on every call."""
    from tests.helpers.models.tiny import tiny_causal_lm

    return tiny_causal_lm(
        "llama",
        seed=seed,
        dtype=None,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        pad_token_id=0,
        attn_implementation="sdpa",
    )


def samples(count: int, seed: int, min_len: int = 17, max_len: int = 40) -> list[dict]:
    """Token rows of varied length (so micro-batches and replicas hold different token counts)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        ids = torch.randint(1, VOCAB, (length,), generator=generator)
        labels = ids.clone()
        labels[: int(torch.randint(0, 4, (1,), generator=generator))] = -100  # an unlabelled "prompt"
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding: pad id 0, labels -100, attention_mask 0 on the padding."""
    longest = max(len(row["input_ids"]) for row in rows)
    batch = {"input_ids": [], "labels": [], "attention_mask": []}
    for row in rows:
        pad = longest - len(row["input_ids"])
        batch["input_ids"].append(torch.nn.functional.pad(row["input_ids"], (0, pad), value=0))
        batch["labels"].append(torch.nn.functional.pad(row["labels"], (0, pad), value=-100))
        batch["attention_mask"].append(torch.nn.functional.pad(torch.ones_like(row["input_ids"]), (0, pad)))
    return {key: torch.stack(value) for key, value in batch.items()}  # each [B, S]


def ds_config(ulysses: int, ring: int, stage: int, config_optimizer: bool) -> dict:
    """fp32 DeepSpeed config with a hybridsp section; "auto" values come from TrainingArguments."""
    config = {
        "hybridsp": {"ulysses": ulysses, "ring": ring},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": stage == 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    if config_optimizer:  # DeepSpeed's AdamW; hybridsp selects torch's implementation on CPU
        config["optimizer"] = {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}}
    return config


def _arguments(output_dir: str, deepspeed: dict | None, **overrides):
    from transformers import TrainingArguments

    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=MICRO_BATCH,
        per_device_eval_batch_size=MICRO_BATCH,
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
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    return TrainingArguments(**{**settings, **overrides})


def make_trainer(output_dir: str, hybrid: dict | None, train, evaluation, **overrides):
    """The plain Trainer (``hybrid`` None, no DeepSpeed) or HybridSPTrainer: ``hybrid`` holds
    ``ulysses``, ``ring`` and ``stage`` (a ZeRO stage, or None for DDP without DeepSpeed) and
    optionally ``config_optimizer`` and ``evaluate_first`` (see :func:`train_and_evaluate`)."""
    from transformers import Trainer

    model = tiny_llama()
    if hybrid is None:
        return Trainer(
            model=model,
            args=_arguments(output_dir, None, **overrides),
            train_dataset=train,
            eval_dataset=evaluation,
            data_collator=collate,
        )
    from hybridsp.integrations.transformers import HybridSPTrainer

    degrees = {"ulysses": hybrid["ulysses"], "ring": hybrid["ring"]}
    config = None
    if hybrid["stage"] is not None:
        config = ds_config(hybrid["ulysses"], hybrid["ring"], hybrid["stage"], hybrid.get("config_optimizer", False))
    return HybridSPTrainer(
        model=model,
        args=_arguments(output_dir, config, **overrides),
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collate,
        hybridsp=None if config else degrees,
    )


def step_logs(trainer) -> dict:
    steps = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
    return {
        "step": [row["step"] for row in steps],
        "loss": [row["loss"] for row in steps],
        "grad_norm": [row["grad_norm"] for row in steps],
    }


def train_and_evaluate(rank: int, world_size: int, hybrid: dict | None) -> dict | None:
    """Train 4 steps, evaluate, predict; rank 0 returns the per-step logs, eval loss and predictions."""
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    train, evaluation = samples(40, seed=1), samples(5, seed=2)
    with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
        trainer = make_trainer(out, hybrid, train, evaluation)
        if hybrid is not None and hybrid.get("evaluate_first"):  # an inference engine first (ZeRO-3)
            trainer.evaluate()
        trainer.train()
        evaluated = evaluate_and_predict(trainer, evaluation)
    return {**step_logs(trainer), **evaluated} if rank == 0 else None


def evaluate_and_predict(trainer, evaluation) -> dict:
    """``evaluate()``'s loss and ``predict()``'s logits and labels of ``evaluation`` (every rank calls it)."""
    metrics = trainer.evaluate()
    predictions = trainer.predict(evaluation)
    return {
        "eval_loss": metrics["eval_loss"],
        "predictions": torch.as_tensor(predictions.predictions).tolist(),
        "label_ids": torch.as_tensor(predictions.label_ids).tolist(),
    }


def save_and_resume(rank: int, world_size: int, hybrid: dict, out: str) -> dict | None:
    """Train 4 steps saving at step 2 into ``out`` (a directory all ranks share), then a fresh
    trainer resumes from that checkpoint. Rank 0 returns both runs' step logs and the saved config."""
    import json
    import os

    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    train = samples(40, seed=1)
    with without_cpu_shm_comm_build():
        first = make_trainer(out, hybrid, train, None, save_strategy="steps", save_steps=2)
        first.train()
        checkpoint = os.path.join(out, "checkpoint-2")
        second = make_trainer(out, hybrid, train, None)
        second.train(resume_from_checkpoint=checkpoint)
    if rank != 0:
        return None
    with open(os.path.join(checkpoint, "config.json")) as handle:
        saved_config = json.load(handle)
    return {
        "first": step_logs(first),
        "resumed": step_logs(second),
        "config": saved_config,
        "files": sorted(os.listdir(checkpoint)),
    }


def several(rank: int, world_size: int, runs: list) -> list:
    """``train_and_evaluate`` for each entry of ``runs`` in turn, in the same processes."""
    import os

    os.environ["OMP_NUM_THREADS"] = "1"  # accelerate would raise the thread count on CPU
    return [train_and_evaluate(rank, world_size, hybrid) for hybrid in runs]
