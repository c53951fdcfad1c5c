"""The example job of examples/train.py, through the Hugging Face Trainer: HybridSPTrainer.

    deepspeed [--num_gpus N] examples/train_hf_trainer.py --deepspeed ds_configs/cp8.json [options]
    torchrun --nproc_per_node N examples/train_hf_trainer.py --deepspeed ds_configs/cp8.json [options]
    accelerate launch --use_deepspeed --num_processes N examples/train_hf_trainer.py --deepspeed ds_configs/cp8.json
    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/train_hf_trainer.py --deepspeed ds_configs/cp4.json
    torchrun --nproc_per_node N examples/train_hf_trainer.py --fsdp --deepspeed ds_configs/cp4.json   # FSDP2, no accelerate config
    python examples/train_hf_trainer.py --ulysses 1 --ring 1       # one process, no launcher (the reference)

The same built-in data and model as examples/train.py (byte-level Python documentation, a
small Llama from ``train.build_model``), presented the way Hugging Face users hold data: a
map-style dataset of ``{"input_ids", "labels"}`` rows and ``default_data_collator``. The
DeepSpeed config's ``"hybridsp"`` section gives U and R (``--ulysses/--ring`` override it);
its batch, clipping and optimizer values become the ``TrainingArguments`` (the Trainer
insists that the two agree; ``"auto"`` values take this script's defaults). Logging, the
learning-rate schedule, checkpoints (``--output-dir``, ``--save-steps``) and resumption
(``--resume``) are the Trainer's own.

The dataset holds ``micro batch x accumulation x DP replicas x steps`` windows: the replicas, not the
ranks, since the context ranks of a replica share its rows. So every mesh of the same DP degree
(U2xR1, U1xR2, U1xR1 on one process) trains on the same rows in the same order, and their losses agree
step by step.

FSDP2 instead of DeepSpeed (``--fsdp``, or an accelerate config with ``distributed_type: FSDP`` and
``fsdp_version: 2``, such as ``examples/accelerate/fsdp2.yaml``): the Trainer gets no DeepSpeed config;
the JSON file is read only for its ``"hybridsp"`` section (passed as ``HybridSPTrainer(hybridsp=...)``: the
degrees are written once, in the same section a DeepSpeed user writes) and its batch, clipping and optimizer
values. ``HybridSPTrainer`` then shards every parameter, gradient and optimizer state over all ranks with
FSDP2 (docs/fsdp2.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import add_mesh_arguments, add_model_arguments, add_overwrite_argument, add_step_arguments, mesh_overrides  # noqa: E402
from console import name_cpu_accelerator, quiet_console  # noqa: E402
from host import close_process_group, share_cpu_cores  # noqa: E402
from preflight import RunConfigError, exit_once, preflight  # noqa: E402
from text_data import TokenWindows  # noqa: E402
from train import build_model, load_windows  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mesh_arguments(parser)
    add_step_arguments(parser)
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    add_overwrite_argument(parser)
    add_model_arguments(parser)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="shard with PyTorch FSDP2 instead of DeepSpeed (an accelerate config with distributed_type FSDP "
        "does the same); only the JSON file's 'hybridsp' section and its batch and optimizer values are read",
    )
    return parser.parse_args(argv)


class WindowDataset(torch.utils.data.Dataset):
    """``len`` windows of the token stream as Hugging Face rows: ``input_ids`` [S], ``labels`` [S]."""

    def __init__(self, windows: TokenWindows, length: int):
        self.windows, self.length = windows, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.windows.sample(index)
        return {"input_ids": tokens, "labels": tokens.clone()}


def load_ds_config(args: argparse.Namespace, config: dict | None = None) -> dict:
    """The DeepSpeed config as a dict (a copy of ``config`` if given), with ``--lr`` (when given)
    written into its optimizer section."""
    config = json.loads(json.dumps(config) if config is not None else Path(args.ds_config).read_text())
    if args.lr is not None and "optimizer" in config:
        config["optimizer"].setdefault("params", {})["lr"] = args.lr
    return config


def _fixed(value, default):
    """``value``, unless the config leaves it to the Trainer (absent or ``"auto"``): then ``default``."""
    return default if value in (None, "auto") else value


def config_settings(args: argparse.Namespace, config: dict, micro_batch: int = 1) -> dict:
    """Trainer keyword arguments that agree with the config's fixed values (the Trainer checks them);
    ``"auto"`` values take these defaults: micro batch ``micro_batch``, accumulation 1, clipping 1.0,
    AdamW's betas and eps, no weight decay, the precision hybridsp picks. Shared with the TRL examples."""
    from hybridsp.integrations.deepspeed import auto_precision

    optimizer = config.get("optimizer", {}).get("params", {})
    betas = _fixed(optimizer.get("betas"), [0.9, 0.999])
    precision = auto_precision()
    return dict(
        output_dir=args.output_dir,
        deepspeed=config,
        max_steps=args.max_steps,
        seed=args.seed,
        per_device_train_batch_size=_fixed(config.get("train_micro_batch_size_per_gpu"), micro_batch),
        gradient_accumulation_steps=_fixed(config.get("gradient_accumulation_steps"), 1),
        max_grad_norm=_fixed(config.get("gradient_clipping"), 1.0),
        learning_rate=learning_rate(args, config),
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_epsilon=_fixed(optimizer.get("eps"), 1e-8),
        weight_decay=_fixed(optimizer.get("weight_decay"), 0.0),
        bf16=_enabled(config, "bf16", precision),
        fp16=_enabled(config, "fp16", precision),
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to=[],
        lr_scheduler_type="constant",
    )


def training_arguments(args: argparse.Namespace, config: dict):
    """TrainingArguments that agree with the config's fixed values (the Trainer checks it); under FSDP2
    (:func:`uses_fsdp`) no DeepSpeed config, and ``--fsdp`` asks for FSDP2 in the arguments."""
    from transformers import TrainingArguments

    settings = config_settings(args, config)
    if uses_fsdp(args):
        settings.pop("deepspeed")
    if args.fsdp:
        settings.update(fsdp=True, fsdp_config={"fsdp_version": 2})
    return TrainingArguments(
        **settings, remove_unused_columns=False, save_strategy="steps", save_steps=args.save_steps or args.max_steps
    )


def uses_fsdp(args: argparse.Namespace) -> bool:
    """FSDP2 asked for: ``--fsdp``, or accelerate's launcher with ``distributed_type: FSDP``."""
    return bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def hybrid_keywords(args: argparse.Namespace, config: dict) -> dict:
    """``HybridSPTrainer(hybridsp=...)``: the command line's choices; under FSDP2 over the JSON file's
    ``"hybridsp"`` section (no DeepSpeed config carries it to the Trainer)."""
    overrides = mesh_overrides(args)
    return {**config.get("hybridsp", {}), **overrides} if uses_fsdp(args) else overrides


def learning_rate(args: argparse.Namespace, config: dict) -> float:
    """``--lr``, else the config's optimizer lr, else 1e-3 (an ``"auto"`` lr, or no optimizer section)."""
    if args.lr is not None:
        return args.lr
    lr = config.get("optimizer", {}).get("params", {}).get("lr")
    return 1e-3 if lr in (None, "auto") else float(lr)


def _enabled(config: dict, name: str, precision: str) -> bool:
    """A precision section's ``enabled``; ``"auto"`` means the one hybridsp would choose here."""
    enabled = config.get(name, {}).get("enabled", False)
    return precision == name if enabled == "auto" else bool(enabled)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        plan = preflight(args)  # one line, exit code 2, before the expensive imports
        refuse_tensor(args, plan.hybrid)
    except RunConfigError as error:
        exit_once(error)
    name_cpu_accelerator()
    pin_cpu_threads()
    with quiet_console(plan.rank):
        try:
            run(args, plan)
        except RunConfigError as error:  # found after start-up (the data), on every rank alike
            exit_once(error)


def refuse_tensor(args: argparse.Namespace, hybrid) -> None:
    """RunConfigError for a tensor degree (``--tensor`` or the config's): HybridSPTrainer has no tensor parallelism."""
    tensor = getattr(hybrid, "tensor", None) or args.tensor or 1
    if tensor > 1:
        raise RunConfigError(
            f"tensor={tensor} ({'--tensor' if args.tensor else args.ds_config}): the HF Trainer example has no tensor "
            f"parallelism (HybridSPTrainer would train the unsplit weights); use examples/train.py --tensor {tensor} "
            f"(hybridsp.integrations.deepspeed.initialize, docs/tensor-parallel.md)"
        )


def pin_cpu_threads() -> None:
    """CPU runs: share the cores between the node's ranks (host.py) and say so in ``OMP_NUM_THREADS``,
    so accelerate neither overrides the count nor warns about it on every rank."""
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(share_cpu_cores())


def dataset_rows(plan, micro_batch: int, accumulation: int) -> int:
    """Rows one optimizer step takes: micro batch x accumulation x DP replicas (not x the world size: the
    context ranks of a replica share its rows), so meshes of one DP degree train on the same rows."""
    return micro_batch * accumulation * plan.hybrid.mesh_shape(plan.world_size).dp


def run(args: argparse.Namespace, plan) -> None:
    """Build the data, model and HybridSPTrainer; train; print one summary on rank 0."""
    from transformers import default_data_collator

    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build
    from hybridsp.integrations.transformers import HybridSPTrainer
    from hybridsp.launch import init_process_group

    config = load_ds_config(args, plan.ds_config)
    overrides = hybrid_keywords(args, config)
    with without_cpu_shm_comm_build():  # on CPU, skip DeepSpeed's shm all-reduce build (gloo never uses it)
        init_process_group()  # `python examples/train_hf_trainer.py`: a world of one (no MPI discovery)
        _, vocab_size, windows = load_windows(args, args.seq_len)
        model = build_model(args, vocab_size)  # under ZeRO-3, --model-path loads partitioned (a collective)
        training = training_arguments(args, config)
        rows = dataset_rows(plan, training.per_device_train_batch_size, training.gradient_accumulation_steps)
        dataset = WindowDataset(windows, rows * args.max_steps)
        trainer = HybridSPTrainer(
            model=model, args=training, train_dataset=dataset, data_collator=default_data_collator, hybridsp=overrides
        )
        if trainer.is_world_process_zero():
            print(
                f"hybridsp HF Trainer example: {trainer.hybrid_mesh!r}, seq_len={args.seq_len}, "
                f"lr={training.learning_rate}{sharding_note(trainer.model) if uses_fsdp(args) else ''}",
                flush=True,
            )
        result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.is_world_process_zero():
        print(
            f"done: {result.global_step} steps, train_loss={result.training_loss:.4f}, "
            f"checkpoints and trainer_state.json in {args.output_dir}",
            flush=True,
        )
    close_process_group()


def sharding_note(model) -> str:
    """ ", FSDP2: every parameter a DTensor shard (N of M elements on this rank)" as the console says it."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    every = all(isinstance(p, DTensor) for p in params)
    return f", FSDP2: every parameter a DTensor shard: {every} ({local:,} of {sum(p.numel() for p in params):,} elements here)"


if __name__ == "__main__":
    main()
