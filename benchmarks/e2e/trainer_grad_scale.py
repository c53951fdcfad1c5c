"""Gradient-norm ratio to the plain Trainer: HybridSPTrainer vs DeepSpeed's own SP path (ALST).

    python -m benchmarks run e2e.trainer_grad_scale [--stages 1 2 3] [--out FILE.json]

The tiny Llama and data of the Trainer tests (:mod:`benchmarks.common.trainer`, a copy of
tests/helpers/trainer_workers.py's; micro batch 2, accumulation 2, 4 steps,
``max_grad_norm=1.0``) are trained by the plain ``Trainer`` on one process (the reference), by
``HybridSPTrainer`` on 2 ranks (U2 x R1) and by the plain ``Trainer`` with transformers'
``ParallelismConfig(sp_backend="deepspeed", sp_size=2)`` (DeepSpeed's Ulysses + its loss
recipe) on 2 ranks, at each ZeRO stage. Prints and writes the logged ``grad_norm`` of every
step divided by the reference's (1.00 means exact; the first step is the clean figure, later
steps also carry the effect of a wrongly clipped update).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.common import harness
from benchmarks.common.trainer import arguments, collate, ds_config, samples, step_logs, tiny_llama, train_logs


def _fixed_collate(rows):
    """The tests' right-padding collate, padded to 40 tokens, with position_ids (DeepSpeed's SP adapter
    gathers the SP ranks' batches, so all must have one even length, and needs position_ids)."""
    import torch

    batch = collate(rows)
    extra = 40 - batch["input_ids"].shape[1]
    pads = {"input_ids": 0, "labels": -100, "attention_mask": 0}
    batch = {k: torch.nn.functional.pad(v, (0, extra), value=pads[k]) for k, v in batch.items()}  # [B, 40]
    batch["position_ids"] = torch.arange(40).expand_as(batch["input_ids"])  # [B, 40]
    return batch


def deepspeed_sp(rank: int, world_size: int, stage: int) -> dict | None:
    """The plain Trainer with DeepSpeed's sequence parallelism over all ranks; rank 0's step logs."""
    import tempfile

    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    from transformers import Trainer

    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    os.environ["OMP_NUM_THREADS"] = "1"
    config = ds_config(1, 1, stage)
    config.pop("hybridsp")
    parallelism = ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=world_size,
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
    )
    with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
        import deepspeed

        deepspeed.init_distributed()  # with use_cpu accelerate leaves deepspeed.comm uninitialised; ALST needs it
        trainer = Trainer(
            model=tiny_llama(),
            args=arguments(out, config, parallelism_config=parallelism),
            train_dataset=samples(40, seed=1),
            data_collator=_fixed_collate,
        )
        trainer.train()
    return step_logs(trainer) if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument(
        "--out",
        default=harness.results_path("trainer", "trainer_grad_scale.json"),
        help="the JSON file (default benchmarks/results/trainer/trainer_grad_scale.json)",
    )
    args = parser.parse_args(argv)
    reference = harness.launch(train_logs, 1, None, timeout=600)[0]["grad_norm"]
    results = {"reference_grad_norm": reference, "hybridsp": {}, "deepspeed_sp": {}}
    for stage in args.stages:
        ours = harness.launch(train_logs, 2, dict(ulysses=2, ring=1, stage=stage), timeout=600)[0]["grad_norm"]
        results["hybridsp"][stage] = [round(a / b, 4) for a, b in zip(ours, reference)]
        try:
            theirs = harness.launch(deepspeed_sp, 2, stage, timeout=600)[0]["grad_norm"]
            results["deepspeed_sp"][stage] = [round(a / b, 4) for a, b in zip(theirs, reference)]
        except AssertionError as error:  # report a failing peer instead of hiding it
            results["deepspeed_sp"][stage] = f"failed: {str(error).strip().splitlines()[-1]}"
        print(
            f"ZeRO-{stage}: hybridsp {results['hybridsp'][stage]}  deepspeed SP {results['deepspeed_sp'][stage]}",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
