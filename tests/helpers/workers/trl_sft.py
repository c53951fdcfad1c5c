"""Distributed workers for tests/integrations/trl/test_trainers.py: TRL SFT/DPO and PEFT LoRA, plain or
hybrid, on gloo ranks.

A case is a dict: ``item`` ("sft", "dpo" or "lora"), ``hybrid`` (None for the plain trainer on
its own, else ``ulysses``, ``ring`` and ``stage``) and the item's options (``packing``,
``loss_type``, ``peft``, ``checkpointing``, ``precompute``). Rank 0 returns the per-step logs and what the test
compares; the data and the tiny models are the same on every call.
"""

from __future__ import annotations

import os
import tempfile

import torch

from tests.helpers.workers.trainer import collate, ds_config, samples, tiny_llama

STEPS, ACCUMULATION, MICRO_BATCH = 2, 2, 2
WORDS = 62  # tokens "t2".."t63"; ids 0 and 1 are <pad> and <eos>
EVALUATED = ("eval_loss", "eval_mean_token_accuracy", "eval_entropy", "eval_rewards/chosen")
LOGGED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "mean_token_accuracy", "entropy", "num_tokens")


def tokenizer():
    """A word-level tokenizer built in memory (nothing downloaded): "t7" <-> id 7, <pad> 0, <eos> 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, 2 + WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def _words(generator: torch.Generator, low: int, high: int) -> str:
    length = int(torch.randint(low, high + 1, (1,), generator=generator))
    return " ".join(f"t{int(i)}" for i in torch.randint(2, 2 + WORDS, (length,), generator=generator))


def sft_rows(count: int, seed: int, packing: bool) -> list[dict]:
    """Prompt-completion rows (TRL's completion_only_loss applies) or plain text rows for packing."""
    generator = torch.Generator().manual_seed(seed)
    if packing:
        return [{"text": _words(generator, 8, 30)} for _ in range(count)]
    return [{"prompt": _words(generator, 3, 12), "completion": " " + _words(generator, 4, 20)} for _ in range(count)]


def dpo_rows(count: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "prompt": _words(generator, 3, 10),
            "chosen": " " + _words(generator, 2, 12),
            "rejected": " " + _words(generator, 2, 12),
        }
        for _ in range(count)
    ]


def _settings(output_dir: str, hybrid: dict | None) -> dict:
    """The arguments every case shares: DeepSpeed at ``hybrid["stage"]`` (0-3), or FSDP2 (``"fsdp2"``)."""
    fsdp2 = hybrid is not None and hybrid["stage"] == "fsdp2"
    deepspeed = None
    if hybrid is not None and not fsdp2:
        deepspeed = ds_config(hybrid["ulysses"], hybrid["ring"], hybrid["stage"], False)
    sharding = dict(fsdp=True, fsdp_config={"fsdp_version": 2}) if fsdp2 else {}
    return dict(
        **sharding,
        output_dir=output_dir,
        per_device_train_batch_size=MICRO_BATCH,
        per_device_eval_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        max_grad_norm=1.0,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        deepspeed=deepspeed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # the adapters' initial A matrices: the same in every process
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(model, config)


def _model(case: dict):
    if case.get("model") == "qwen3_5":  # a hybrid linear-attention model (Gated DeltaNet layers)
        from tests.helpers.models.linear import per_document_mixers, tiny_hybrid

        model = tiny_hybrid("qwen3_5")
        if case["hybrid"] is None:
            per_document_mixers(model)  # the plain reference runs each packed document by itself
        return model
    model = tiny_llama()
    return _lora(model) if case.get("peft") else model


def _trainer(case: dict, output_dir: str):
    from datasets import Dataset

    hybrid = case["hybrid"]
    settings, model = _settings(output_dir, hybrid), _model(case)
    # FSDP2 has no DeepSpeed config to carry the "hybridsp" section: the degrees come as the keyword
    degrees = {"hybridsp": {"ulysses": hybrid["ulysses"], "ring": hybrid["ring"]}} if settings.get("fsdp") else {}
    if case["item"] == "sft":
        from trl import SFTConfig, SFTTrainer

        from hybridsp.integrations.trl import HybridSFTTrainer

        args = SFTConfig(
            **settings,
            bf16=False,
            gradient_checkpointing=case.get("checkpointing", False),
            packing=case.get("packing", False),
            max_length=48,
            loss_type=case.get("loss_type", "nll"),
            dataset_num_proc=None,
        )
        cls = SFTTrainer if hybrid is None else HybridSFTTrainer
        packing = case.get("packing", False)
        data, held_out = (Dataset.from_list(sft_rows(n, seed=seed, packing=packing)) for n, seed in ((32, 1), (5, 3)))
        return cls(
            model=model, args=args, train_dataset=data, eval_dataset=held_out, processing_class=tokenizer(), **degrees
        )
    if case["item"] == "dpo":
        from trl import DPOConfig, DPOTrainer

        from hybridsp.integrations.trl import HybridDPOTrainer

        args = DPOConfig(
            **settings,
            bf16=False,
            gradient_checkpointing=False,
            beta=0.5,
            precompute_ref_log_probs=case.get("precompute", False),
        )
        cls = DPOTrainer if hybrid is None else HybridDPOTrainer
        # PEFT: the reference is the policy without adapters; precompute: the policy before training
        ref = None if case.get("peft") or case.get("precompute") else tiny_llama()
        return cls(
            model=model,
            ref_model=ref,
            args=args,
            train_dataset=Dataset.from_list(dpo_rows(24, seed=2)),
            eval_dataset=Dataset.from_list(dpo_rows(5, seed=3)),
            processing_class=tokenizer(),
            **degrees,
        )
    from transformers import Trainer, TrainingArguments

    from hybridsp.integrations.transformers import HybridSPTrainer

    args = TrainingArguments(**settings, remove_unused_columns=False)
    cls = Trainer if hybrid is None else HybridSPTrainer
    return cls(model=model, args=args, train_dataset=samples(24, seed=1), data_collator=collate, **degrees)


def _logs(trainer) -> dict:
    steps = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
    return {key: [row.get(key) for row in steps] for key in ("step", *LOGGED)}


def _frozen_weights(model) -> dict[str, torch.Tensor]:
    """The base weights of a PEFT model (all but the adapters), copied."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" not in name}


def _adapter(trainer, output_dir: str, rank: int) -> dict | None:
    """Save the model (the adapter, for PEFT) and read rank 0's adapter_model file back."""
    from safetensors.torch import load_file

    trainer.save_model(output_dir)
    if rank != 0:
        return None
    saved = load_file(os.path.join(output_dir, "adapter_model.safetensors"))
    return {key: value.tolist() for key, value in saved.items()}


def run_case(rank: int, case: dict) -> dict | None:
    """Train one case; rank 0 returns its logs (+ DPO's eval metrics, + the adapter and frozen-weight check)."""
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
        trainer = _trainer(case, out)
        peft_model = trainer.model if case.get("peft") else None
        before = _frozen_weights(peft_model) if peft_model is not None and case["hybrid"] is None else None
        trainer.train()
        result = {**_logs(trainer)}
        if trainer.args.fsdp:  # FSDP2 asked of the trainer: every parameter a DTensor shard
            from hybridsp.integrations.fsdp import is_fully_sharded

            result["fully_sharded"] = is_fully_sharded(trainer.model)
        if case["item"] in ("sft", "dpo"):
            metrics = trainer.evaluate()
            result["eval"] = {k: v for k, v in metrics.items() if k in EVALUATED}
        if peft_model is not None:
            result["trainable"] = sorted(n for n, p in peft_model.named_parameters() if p.requires_grad)
            if before is not None:  # plain run: the frozen weights did not move (ZeRO-3 shards them in ours)
                after = _frozen_weights(peft_model)
                result["frozen_unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
            result["adapter"] = _adapter(trainer, os.path.join(out, "saved"), rank)
    return result if rank == 0 else None


def several(rank: int, world_size: int, cases: list) -> list:
    """``run_case`` for each case in turn, in the same processes."""
    os.environ["OMP_NUM_THREADS"] = "1"  # accelerate would raise the thread count on CPU
    return [run_case(rank, case) for case in cases]
