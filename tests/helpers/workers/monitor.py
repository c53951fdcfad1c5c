"""Distributed workers for tests/integrations/transformers/test_trainer_monitor.py: HybridSPTrainer with and
without the section's ``"monitor"`` block (DeepSpeed ZeRO-1, fp32); rank 0 returns the per-step losses and the
hybridsp rows of ``log_history``."""

from __future__ import annotations

import tempfile

import torch

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


SPIKE_STEP, SPIKE_SCALE = 5, 50.0  # the step whose logits are scaled (its loss jumps far past 4x the median)


class _Spike:
    """A forward hook scaling the logits on ``SPIKE_STEP`` (a loss spike through the real path), and the weights'
    sum after every step (``sums[step]``; FSDP2 shards summed over the ranks)."""

    def __init__(self, trainer):
        self.trainer, self.sums = trainer, {}
        trainer.model.register_forward_hook(self._scale)

    def _scale(self, module, args, output):
        if module.training and self.trainer.state.global_step + 1 == SPIKE_STEP:
            output.logits = output.logits * SPIKE_SCALE
        return output

    def record(self, step: int) -> None:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        params = list(self.trainer.model.parameters())
        local = sum(float((p.to_local() if isinstance(p, DTensor) else p).detach().double().sum()) for p in params)
        if any(isinstance(p, DTensor) for p in params):
            total = torch.tensor([local], dtype=torch.float64)
            dist.all_reduce(total)
            local = float(total)
        self.sums[step] = local


def _policy_trainer(out: str, sharding: str, monitor: dict, steps: int, save_steps: int):
    from transformers import TrainerCallback

    from hybridsp.integrations.transformers import HybridSPTrainer

    stage = 1 if sharding == "zero1" else None
    config = ds_config(1, 2, stage or 1, False)
    config["hybridsp"]["monitor"] = monitor
    fields = dict(max_steps=steps, gradient_accumulation_steps=1, save_strategy="steps", save_steps=save_steps)
    if sharding == "fsdp2":
        fields.update(fsdp=True, fsdp_config={"fsdp_version": 2})
    trainer = HybridSPTrainer(
        model=tiny_llama(),
        args=_arguments(out, config if stage else None, **fields),
        train_dataset=samples(40, seed=1),
        data_collator=collate,
        hybridsp=None if stage else config["hybridsp"],
    )
    spike = _Spike(trainer)

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            spike.record(state.global_step)

    trainer.add_callback(Record())
    return trainer, spike


def train_with_policy(
    rank: int, world_size: int, sharding: str, policy: str, out: str, save_steps: int, resume_from: str | None = None
) -> dict | None:
    """7 steps at U1 x R2 (``sharding``: "ddp", "zero1" or "fsdp2") with a loss spike at step 5 and
    ``on_anomaly=policy``, checkpoints every ``save_steps`` into ``out`` (a folder the ranks share);
    ``resume_from``: a checkpoint to continue from. Rank 0 returns the logged losses, the weights' sum after
    every step and the steps logged as dropped."""
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    monitor = {"on_anomaly": policy, "spike_window": 3, "spike_factor": 4.0}
    with without_cpu_shm_comm_build():
        trainer, spike = _policy_trainer(out, sharding, monitor, 7, save_steps)
        trainer.train(resume_from_checkpoint=resume_from)
    if rank != 0:
        return None
    rows = [r for r in trainer.state.log_history if "hybridsp/dropped_step" in r]
    return {**step_logs(trainer), "sums": spike.sums, "dropped": [r["step"] for r in rows]}
