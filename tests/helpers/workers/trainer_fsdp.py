"""Distributed workers for HybridSPTrainer under FSDP2 (tests/integrations/fsdp/test_trainer_fsdp2.py).

The model, data and settings are :mod:`tests.helpers.workers.trainer`'s (tiny Llama, micro batch 2,
accumulation 2, clipping at 1.0, 4 steps), with ``fsdp=True, fsdp_config={"fsdp_version": 2, ...}``.
Rank 0 returns the step logs, the evaluation, and what every rank saw of the sharding.
"""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist

from tests.helpers.workers.trainer import evaluate_and_predict, make_trainer, samples, step_logs


def fsdp_arguments(**fsdp_config) -> dict:
    """TrainingArguments fields asking for FSDP2 (``fsdp_config`` keys added to ``fsdp_version: 2``)."""
    return dict(fsdp=True, fsdp_config={"fsdp_version": 2, **fsdp_config})


def sharding(model) -> dict:
    """Whether every parameter is a DTensor, and the elements this rank holds against the whole model's."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    return {
        "all_dtensor": all(isinstance(p, DTensor) for p in params),
        "local": local,
        "total": sum(p.numel() for p in params),
    }


def _gathered(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def train_fsdp_runs(rank: int, world_size: int, runs: list[tuple[dict, dict]]) -> list:
    """:func:`train_fsdp` for each ``(hybrid, overrides)`` of ``runs`` in turn, in the same processes."""
    return [train_fsdp(rank, world_size, hybrid, overrides) for hybrid, overrides in runs]


def train_fsdp(rank: int, world_size: int, hybrid: dict, overrides: dict | None = None) -> dict | None:
    """Train 4 steps with FSDP2 asked of the Trainer, evaluate, predict; rank 0 returns logs and sharding.
    ``overrides``: TrainingArguments fields (``fsdp_config`` replaces the default one)."""
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    os.environ["OMP_NUM_THREADS"] = "1"
    train, evaluation = samples(40, seed=1), samples(5, seed=2)
    with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
        trainer = make_trainer(out, hybrid, train, evaluation, **{**fsdp_arguments(), **(overrides or {})})
        shards = _gathered(sharding(trainer.model))
        trainer.train()
        evaluated = evaluate_and_predict(trainer, evaluation)
    return {**step_logs(trainer), **evaluated, "sharding": shards} if rank == 0 else None


def save_fsdp(rank: int, world_size: int, hybrid: dict | None, out: str) -> dict | None:
    """Train 4 steps saving every 2 into ``out`` (shared by the ranks): FSDP2 when ``hybrid`` is given,
    else the plain Trainer. Rank 0 returns the step logs and the files of checkpoint-2."""
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    os.environ["OMP_NUM_THREADS"] = "1"
    fields = fsdp_arguments() if hybrid is not None else {}
    with without_cpu_shm_comm_build():
        trainer = make_trainer(out, hybrid, samples(40, seed=1), None, save_strategy="steps", save_steps=2, **fields)
        trainer.train()
    if rank != 0:
        return None
    return {**step_logs(trainer), "files": sorted(os.listdir(os.path.join(out, "checkpoint-2")))}


def resume_fsdp(rank: int, world_size: int, hybrid: dict, checkpoint: str, out: str) -> dict | None:
    """A fresh FSDP2 trainer (any mesh) resumes from ``checkpoint`` and trains to step 4; rank 0 returns the logs."""
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    os.environ["OMP_NUM_THREADS"] = "1"
    with without_cpu_shm_comm_build():
        trainer = make_trainer(out, hybrid, samples(40, seed=1), None, **fsdp_arguments())
        trainer.train(resume_from_checkpoint=checkpoint)
    return step_logs(trainer) if rank == 0 else None


def train_plain(rank: int, world_size: int, overrides: dict) -> dict | None:
    """The plain Trainer (no FSDP, no sequence parallelism) with TrainingArguments ``overrides``; rank 0's logs."""
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(out, None, samples(40, seed=1), samples(5, seed=2), **overrides)
        trainer.train()
        metrics = trainer.evaluate()
    return {**step_logs(trainer), "eval_loss": metrics["eval_loss"]} if rank == 0 else None


def fsdp_after_deepspeed(rank: int, world_size: int) -> str:
    """A DeepSpeed HybridSPTrainer, then one asking for FSDP2, in the same process: the second's error text."""
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
        make_trainer(out, dict(ulysses=1, ring=1, stage=1), samples(4, seed=1), None)
        try:
            make_trainer(out, dict(ulysses=1, ring=1, stage=None), samples(4, seed=1), None, **fsdp_arguments())
        except ValueError as error:
            return str(error)
    return "no error"
