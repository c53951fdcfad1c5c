"""Distributed workers for tests/test_trainer.py: one tiny Llama trained by a Trainer on gloo ranks.

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
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
        pad_token_id=0, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


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
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True, "steps_per_print": 1000,
    }
    if config_optimizer:  # DeepSpeed's AdamW; hybridsp selects torch's implementation on CPU
        config["optimizer"] = {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}}
    return config


def _arguments(output_dir: str, deepspeed: dict | None):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=MICRO_BATCH, per_device_eval_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, max_grad_norm=1.0, learning_rate=3e-3,
        weight_decay=0.01, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        disable_tqdm=True, seed=0, deepspeed=deepspeed, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        remove_unused_columns=False,
    )


def train_and_evaluate(rank: int, world_size: int, hybrid: dict | None) -> dict | None:
    """Train 4 steps, evaluate, predict. ``hybrid``: None for the plain Trainer, else
    ``{"ulysses", "ring", "stage", "config_optimizer"}`` for HybridSPTrainer under DeepSpeed."""
    from transformers import Trainer

    from hybridsp.integrations.deepspeed import _without_cpu_shm_comm_build

    model = tiny_llama()
    train, evaluation = samples(40, seed=1), samples(5, seed=2)
    with tempfile.TemporaryDirectory() as out, _without_cpu_shm_comm_build():
        if hybrid is None:
            trainer = Trainer(model=model, args=_arguments(out, None), train_dataset=train, eval_dataset=evaluation,
                              data_collator=collate)
        else:
            from hybridsp.integrations.transformers import HybridSPTrainer

            config = ds_config(hybrid["ulysses"], hybrid["ring"], hybrid["stage"], hybrid["config_optimizer"])
            trainer = HybridSPTrainer(model=model, args=_arguments(out, config), train_dataset=train,
                                      eval_dataset=evaluation, data_collator=collate)
        trainer.train()
        metrics = trainer.evaluate()
        predictions = trainer.predict(evaluation)
    steps = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
    if rank != 0:
        return None
    return {
        "loss": [row["loss"] for row in steps], "grad_norm": [row["grad_norm"] for row in steps],
        "eval_loss": metrics["eval_loss"], "predictions": torch.as_tensor(predictions.predictions).tolist(),
        "label_ids": torch.as_tensor(predictions.label_ids).tolist(),
    }
