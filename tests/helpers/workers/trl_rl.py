"""Distributed workers for tests/integrations/trl/test_rl_trainers.py: TRL GRPO / RLOO, plain or hybrid, on gloo ranks.

A case is a dict: ``item`` ("grpo" or "rloo"), ``hybrid`` (None for the plain trainer, else
``ulysses``, ``ring``, ``stage`` and optionally ``generation``, the section's "plain" or "sharded") and options (``loss_type``, ``num_iterations``,
``accumulation``, ``peft``, ``beta``, ``checkpointing``). Every rank returns its per-step logs and the completion ids
it saw (in the order its reward function was called), so a test can check both the numbers
against the plain run and that every context rank saw the same completions. The tiny Llama is
saved to a directory first and passed by path (TRL loads the policy and builds the reference model
from it); a PEFT policy is the loaded model with LoRA adapters.
"""

from __future__ import annotations

import os
import tempfile

import torch

from tests.helpers.workers.trainer import ds_config, tiny_llama
from tests.helpers.workers.trl_sft import WORDS, tokenizer

STEPS, MICRO_BATCH, GENERATIONS, COMPLETION = 3, 4, 2, 10
LOGGED = (
    "loss",
    "grad_norm",
    "kl",
    "reward",
    "reward_std",
    "entropy",
    "clip_ratio/region_mean",
    "completions/mean_length",
    "rewards/low_ids/mean",
    "rewards/near_five/mean",
)


def prompt_rows(count: int, seed: int) -> list[dict]:
    """Prompts of 2-9 words: rows of different length, so generation and scoring see left padding."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(2, 10, (1,), generator=generator))
        rows.append(
            {"prompt": " ".join(f"t{int(i)}" for i in torch.randint(2, 2 + WORDS, (length,), generator=generator))}
        )
    return rows


class Rewards:
    """Two plain-python reward functions that also record the completions they score."""

    def __init__(self):
        self.seen: list[list[int]] = []

    def low_ids(self, completion_ids, **kwargs) -> list[float]:
        self.seen.extend(list(ids) for ids in completion_ids)
        return [sum(1.0 for t in ids if t < 24) / max(len(ids), 1) for ids in completion_ids]

    @staticmethod
    def near_five(completions, **kwargs) -> list[float]:
        return [-abs(len(text.split()) - 5) / 5.0 for text in completions]

    def functions(self) -> list:
        return [self.low_ids, self.near_five]  # TRL names the metrics after the functions


def _fsdp2(case: dict) -> bool:
    return case["hybrid"] is not None and case["hybrid"]["stage"] == "fsdp2"


def _degrees(case: dict) -> dict:
    """The ``hybridsp=`` keyword of an FSDP2 case (no DeepSpeed config carries the section), else nothing."""
    if not _fsdp2(case):
        return {}
    return {"hybridsp": {k: v for k, v in case["hybrid"].items() if k in ("ulysses", "ring", "generation")}}


def _settings(output_dir: str, case: dict) -> dict:
    """The arguments every case shares: DeepSpeed at ``hybrid["stage"]`` (0-3), or FSDP2 (``"fsdp2"``)."""
    hybrid, deepspeed = case["hybrid"], None
    if hybrid is not None and not _fsdp2(case):
        deepspeed = ds_config(hybrid["ulysses"], hybrid["ring"], hybrid["stage"], False)
        if "generation" in hybrid:
            deepspeed["hybridsp"]["generation"] = hybrid["generation"]
    sharding = dict(fsdp=True, fsdp_config={"fsdp_version": 2}) if _fsdp2(case) else {}
    return dict(
        **sharding,
        output_dir=output_dir,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=case.get("accumulation", 1),
        max_steps=STEPS,
        max_grad_norm=1.0,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        deepspeed=deepspeed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        bf16=False,
        gradient_checkpointing=case.get("checkpointing", False),
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION,
        beta=case.get("beta", 0.1),
        num_iterations=case.get("num_iterations", 1),
    )


def _model(path: str, case: dict):
    """The policy: its path (TRL loads it, as users pass it), or for PEFT the loaded model with LoRA adapters."""
    if not case.get("peft"):
        return path
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    torch.manual_seed(1)  # the adapters' initial A matrices: the same in every process
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))


def _trainer(case: dict, output_dir: str, model_path: str, rewards: Rewards):
    from datasets import Dataset

    settings, data = _settings(output_dir, case), Dataset.from_list(prompt_rows(48, seed=4))
    if case["item"] == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        from hybridsp.integrations.trl import HybridGRPOTrainer

        args = GRPOConfig(**settings, loss_type=case.get("loss_type", "dapo"))
        cls = GRPOTrainer if case["hybrid"] is None else HybridGRPOTrainer
    else:
        from trl import RLOOConfig, RLOOTrainer

        from hybridsp.integrations.trl import HybridRLOOTrainer

        args = RLOOConfig(**settings)
        cls = RLOOTrainer if case["hybrid"] is None else HybridRLOOTrainer
    return cls(
        model=_model(model_path, case),
        reward_funcs=rewards.functions(),
        args=args,
        train_dataset=data,
        processing_class=tokenizer(),
        **_degrees(case),
    )


def _logs(trainer) -> dict:
    steps = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
    return {key: [row.get(key) for row in steps] for key in ("step", *LOGGED)}


def _saved_tiny_llama(rank: int, scratch: str) -> str:
    """Rank 0 saves the tiny Llama (transformers writes on global rank 0 only); every rank gets its path."""
    import torch.distributed as dist

    path = [os.path.join(scratch, "tiny")]
    dist.broadcast_object_list(path, src=0)
    if rank == 0:
        tiny_llama().save_pretrained(path[0])
    dist.barrier()
    return path[0]


class CountedCalls:
    """Counts the calls of ``module.name`` (a function) during the block; the original is back on exit."""

    def __init__(self, module, name: str):
        self.module, self.name, self.calls = module, name, 0

    def __enter__(self):
        original = self.original = getattr(self.module, self.name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        setattr(self.module, self.name, counted)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.original)


def run_case(rank: int, case: dict) -> dict:
    """Train one case; this rank's logs, the completions its reward function saw and how many
    times hybridsp's sharded ``generate`` ran (``sharded_generations``)."""
    import time

    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build
    from hybridsp.integrations.trl import _generation as generation

    # a prefix per rank: forked workers share tempfile's name generator
    start = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix=f"rl-rank{rank}-") as out,
        without_cpu_shm_comm_build(),
        CountedCalls(generation, "generate") as sharded,
    ):
        model_path = _saved_tiny_llama(rank, out)
        rewards = Rewards()
        trainer = _trainer(case, os.path.join(out, "run"), model_path, rewards)
        trainer.train()
        import torch.distributed as dist

        dist.barrier()  # rank 0's directory (the reference model's path) outlives every rank's use
        return {
            **_logs(trainer),
            "completions": rewards.seen,
            "sharded_generations": sharded.calls,
            "seconds": time.perf_counter() - start,
            "fully_sharded": _fsdp2(case) and _all_dtensor(trainer.model),
        }


def _all_dtensor(model) -> bool:
    from hybridsp.integrations.fsdp import is_fully_sharded

    return is_fully_sharded(model)


def several(rank: int, world_size: int, cases: list) -> list:
    """``run_case`` for each case in turn, in the same processes."""
    os.environ["OMP_NUM_THREADS"] = "1"  # accelerate would raise the thread count on CPU
    return [run_case(rank, case) for case in cases]
