"""TRL direct preference optimisation under hybrid sequence parallelism: HybridDPOTrainer.

    deepspeed --num_gpus 2 examples/trl_dpo.py --deepspeed ds_configs/trainer/cp2.json [options]
    torchrun --nproc_per_node 2 examples/trl_dpo.py --deepspeed ds_configs/trainer/cp2.json [options]
    python examples/trl_dpo.py --ulysses 1          # one process, no launcher (the reference)

Preference pairs built from CPython's bundled documentation (or ``--data``): the prompt is the
start of a paragraph, ``chosen`` its true continuation, ``rejected`` words of another paragraph,
so the policy learns to prefer the real text over the reference model (a frozen copy of the
initial model, scored under the same hybrid attention). Every sequence's summed log-probability
is exact under sequence parallelism, so DPO's loss and its ``rewards/*`` metrics are the
unsharded ones (docs/trl-peft.md). Nothing is downloaded (examples/trl_common.py). Writes
``--output-dir``/metrics.jsonl (loss, grad_norm, rewards/chosen, rewards/rejected,
rewards/accuracies, rewards/margins, logps/*) and the final policy.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_common  # noqa: E402
from cli_args import mesh_overrides  # noqa: E402


def parse_args(argv: list[str] | None = None):
    parser = trl_common.parser_for("trl_dpo.py", __doc__)
    parser.add_argument(
        "--beta",
        type=float,
        default=0.1,
        help="DPO's beta: how far the policy may move from the reference (default 0.1)",
    )
    return parser.parse_args(argv)


def preference_pairs(texts: list[str], seq_len: int) -> list[dict]:
    """Rows {prompt, chosen, rejected}, one per paragraph of 4 or more words: its first half (at most
    ``seq_len // 2`` words), its next words, and as many words from the following paragraph; together
    within ``seq_len`` words."""
    pairs = []
    for index, text in enumerate(texts):
        words, other = text.split(), texts[(index + 1) % len(texts)].split()
        prompt = min(len(words) // 2, seq_len // 2)
        completion = min(len(words) - prompt, len(other), (seq_len - prompt) // 2)
        if prompt >= 2 and completion >= 2:
            pairs.append(
                {
                    "prompt": " ".join(words[:prompt]),
                    "chosen": " " + " ".join(words[prompt : prompt + completion]),
                    "rejected": " " + " ".join(other[:completion]),
                }
            )
    if not pairs:
        raise trl_common.RunConfigError(
            "the text gives no preference pair of at least 2 + 2 words: give a longer --data file"
        )
    return pairs


def build_trainer(args, plan, config):
    from datasets import Dataset
    from trl import DPOConfig

    from hybridsp.integrations.trl import HybridDPOTrainer

    texts = trl_common.paragraphs(args)
    tokenizer = trl_common.load_tokenizer(args, texts)
    settings = trl_common.trainer_settings(args, config)
    pairs = preference_pairs(texts, args.seq_len)
    dpo = DPOConfig(**settings, beta=args.beta, max_length=args.seq_len)
    model = trl_common.build_model_for(args, tokenizer, dpo)
    reference = trl_common.build_model_for(args, tokenizer, dpo)  # the same seed: the initial policy
    trainer = HybridDPOTrainer(
        model=model,
        ref_model=reference,
        args=dpo,
        train_dataset=Dataset.from_list(pairs),
        processing_class=tokenizer,
        hybridsp=mesh_overrides(args),
    )
    return trainer, f"TRL DPO example (beta={args.beta})"


if __name__ == "__main__":
    trl_common.main(parse_args, build_trainer)
