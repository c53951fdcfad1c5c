"""The tiny HF Trainer job of e2e.trainer_grad_scale: one tiny Llama trained by a Trainer on gloo ranks.

Copied from tests/helpers/trainer_workers.py and tests/helpers/tiny_models.py (benchmarks import
nothing from tests): the same model (hidden 64, 2 layers, 4 query / 2 K/V heads, fp32), data
(right-padded rows of 17-40 tokens with unlabelled prefixes), TrainingArguments (micro batch 2 x
accumulation 2, 4 steps, ``max_grad_norm=1.0``) and DeepSpeed config as the Trainer tests, so that the
benchmark measures what those tests check. Each worker runs in a fresh process of
``hybridsp.testing.run_distributed`` and returns rank 0's per-step logs (other ranks return None).
"""

from __future__ import annotations

import os
import tempfile

import torch

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 64, 2, 4, 2
STEPS, ACCUMULATION, MICRO_BATCH = 4, 2, 2


def tiny_llama(seed: int = 0):
    """The same tiny Llama (hidden 64, 2 layers, 4 query / 2 K/V heads) on every call."""
    import transformers

    config = transformers.LlamaConfig(
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
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


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


def ds_config(ulysses: int, ring: int, stage: int) -> dict:
    """fp32 DeepSpeed config with a hybridsp section; "auto" values come from TrainingArguments."""
    return {
        "hybridsp": {"ulysses": ulysses, "ring": ring},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": stage == 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }


def arguments(output_dir: str, deepspeed: dict | None, **overrides):
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


def step_logs(trainer) -> dict:
    steps = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
    return {
        "step": [row["step"] for row in steps],
        "loss": [row["loss"] for row in steps],
        "grad_norm": [row["grad_norm"] for row in steps],
    }


def train_logs(rank: int, world_size: int, hybrid: dict | None) -> dict | None:
    """Train 4 steps with the plain Trainer on one process (``hybrid`` None, no DeepSpeed) or with
    HybridSPTrainer (``hybrid``: ``ulysses``, ``ring`` and a ZeRO ``stage``); rank 0's step logs."""
    from transformers import Trainer

    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    os.environ["OMP_NUM_THREADS"] = "1"  # accelerate would raise the thread count on CPU
    with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
        if hybrid is None:
            trainer = Trainer(
                model=tiny_llama(), args=arguments(out, None), train_dataset=samples(40, seed=1), data_collator=collate
            )
        else:
            from hybridsp.integrations.transformers import HybridSPTrainer

            config = ds_config(hybrid["ulysses"], hybrid["ring"], hybrid["stage"])
            trainer = HybridSPTrainer(
                model=tiny_llama(),
                args=arguments(out, config),
                train_dataset=samples(40, seed=1),
                data_collator=collate,
            )
        trainer.train()
    return step_logs(trainer) if rank == 0 else None
