"""LoRA fine-tuning with PEFT under hybrid sequence parallelism: HybridSFTTrainer with ``peft_config``.

    deepspeed --num_gpus 2 examples/peft_lora.py --deepspeed ds_configs/trainer/cp2.json [options]
    torchrun --nproc_per_node 2 examples/peft_lora.py --deepspeed ds_configs/trainer/cp2.json [options]
    python examples/peft_lora.py --ulysses 1        # one process, no launcher (the reference)

The SFT example's packed rows (examples/trl_sft.py) trained through LoRA adapters: TRL wraps
the model with ``peft.get_peft_model(model, LoraConfig(...))`` and the hybridsp mixin switches
the transformers model inside the wrapper; only the adapters train (at any ZeRO stage). Nothing
is downloaded (examples/trl_common.py). Writes ``--output-dir``/metrics.jsonl and the adapter
(``adapter_model.safetensors``, ``adapter_config.json``; ``PeftModel.from_pretrained`` loads it
onto the same base model).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_common  # noqa: E402
from cli_args import mesh_overrides  # noqa: E402


def parse_args(argv: list[str] | None = None):
    parser = trl_common.parser_for("peft_lora.py", __doc__)
    parser.add_argument("--lora-r", type=int, default=16, help="adapter rank (default 16)")
    parser.add_argument("--lora-alpha", type=int, default=32, help="adapter scale numerator (default 32)")
    parser.add_argument(
        "--lora-targets",
        default="q_proj,v_proj",
        help="comma-separated module names that get adapters (default: q_proj,v_proj)",
    )
    args = parser.parse_args(argv)
    if args.lora_r < 1 or args.lora_alpha < 1 or not args.lora_targets.strip(","):
        parser.error(
            f"--lora-r and --lora-alpha must be at least 1 and --lora-targets name a module; got "
            f"{args.lora_r}, {args.lora_alpha}, {args.lora_targets!r}"
        )
    return args


def build_trainer(args, plan, config):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig

    from hybridsp.integrations.trl import HybridSFTTrainer

    texts = trl_common.paragraphs(args)
    tokenizer = trl_common.load_tokenizer(args, texts)
    settings = trl_common.trainer_settings(args, config)
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        target_modules=[name for name in args.lora_targets.split(",") if name],
    )
    sft = SFTConfig(**settings, packing=True, max_length=args.seq_len)
    model = trl_common.build_model_for(args, tokenizer, sft)
    trainer = HybridSFTTrainer(
        model=model,
        args=sft,
        train_dataset=Dataset.from_list([{"text": t} for t in texts]),
        processing_class=tokenizer,
        peft_config=lora,
        hybridsp=mesh_overrides(args),
    )
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in trainer.model.parameters()]  # ZeRO-3: full
    trainable, total = sum(n for n, grad in sizes if grad), sum(n for n, _ in sizes)
    return trainer, f"PEFT LoRA example (r={args.lora_r}, {trainable:,} of {total:,} parameters train)"


if __name__ == "__main__":
    trl_common.main(parse_args, build_trainer)
