"""TRL supervised fine-tuning with packed rows under hybrid sequence parallelism: HybridSFTTrainer.

    deepspeed --num_gpus 2 examples/trl_sft.py --deepspeed ds_configs/trainer/cp2.json [options]
    torchrun --nproc_per_node 2 examples/trl_sft.py --deepspeed ds_configs/trainer/cp2.json [options]
    python examples/trl_sft.py --ulysses 1          # one process, no launcher (the reference)

``SFTConfig(packing=True, max_length=--seq-len)``: TRL packs the paragraphs of CPython's bundled
documentation (or ``--data``) into rows of ``--seq-len`` tokens, several documents per row with
``position_ids`` restarting at 0 for each; hybridsp finds the documents from them across the
shards, so no document attends to its neighbour. The model is a small Llama built from a config,
the tokenizer a word-level one built in memory (examples/trl_common.py): nothing is downloaded.
Writes ``--output-dir``/metrics.jsonl (one JSON line per logged step: loss, grad_norm,
mean_token_accuracy, entropy, num_tokens) and the final model (``save_model``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_common  # noqa: E402
from cli_args import mesh_overrides  # noqa: E402


def parse_args(argv: list[str] | None = None):
    parser = trl_common.parser_for("trl_sft.py", __doc__)
    parser.add_argument(
        "--packing-strategy",
        choices=("bfd", "wrapped"),
        default="bfd",
        help="TRL's packing: 'bfd' fits whole documents into rows (best-fit decreasing), "
        "'wrapped' cuts the stream at row ends (default: bfd)",
    )
    return parser.parse_args(argv)


def build_trainer(args, plan, config):
    from datasets import Dataset
    from trl import SFTConfig

    from hybridsp.integrations.trl import HybridSFTTrainer

    texts = trl_common.paragraphs(args)
    tokenizer = trl_common.load_tokenizer(args, texts)
    settings = trl_common.trainer_settings(args, config)
    sft = SFTConfig(**settings, packing=True, packing_strategy=args.packing_strategy, max_length=args.seq_len)
    model = trl_common.build_model_for(args, tokenizer, sft)
    trainer = HybridSFTTrainer(
        model=model,
        args=sft,
        train_dataset=Dataset.from_list([{"text": t} for t in texts]),
        processing_class=tokenizer,
        hybridsp=mesh_overrides(args),
    )
    return trainer, f"TRL SFT example (packing={args.packing_strategy})"


if __name__ == "__main__":
    trl_common.main(parse_args, build_trainer)
