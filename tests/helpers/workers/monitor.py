"""Distributed workers for tests/integrations/transformers/test_trainer_monitor.py: HybridSPTrainer with and
without the section's ``"monitor"`` block (DeepSpeed ZeRO-1, fp32); rank 0 returns the per-step losses and the
hybridsp rows of ``log_history``."""

from __future__ import annotations

import tempfile

from tests.helpers.workers.trainer import _arguments, collate, ds_config, samples, step_logs, tiny_llama


def train_with_monitor(
    rank: int, world_size: int, ulysses: int, ring: int, monitor: dict | None, fsdp2: bool = False
) -> dict | None:
    """4 steps of HybridSPTrainer under ZeRO-1 (or FSDP2: ``fsdp2``) with the section's ``monitor`` block."""
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build
    from hybridsp.integrations.transformers import HybridSPTrainer

    config = ds_config(ulysses, ring, 1, False)
    if monitor is not None:
        config["hybridsp"]["monitor"] = monitor
    sharding = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}} if fsdp2 else {}
    with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
        trainer = HybridSPTrainer(
            model=tiny_llama(),
            args=_arguments(out, None if fsdp2 else config, **sharding),
            train_dataset=samples(40, seed=1),
            data_collator=collate,
            hybridsp=config["hybridsp"] if fsdp2 else None,
        )
        trainer.train()
    if rank != 0:
        return None
    rows = [r for r in trainer.state.log_history if any(k.startswith("hybridsp/") for k in r)]
    return {**step_logs(trainer), "hybridsp": rows}
