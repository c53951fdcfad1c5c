"""TRL group-relative policy optimisation (GRPO, or RLOO) under hybrid sequence parallelism.

    deepspeed --num_gpus 2 examples/trl_grpo.py --deepspeed ds_configs/trainer/cp2.json [options]
    torchrun --nproc_per_node 2 examples/trl_grpo.py --deepspeed ds_configs/trainer/cp2.json [options]
    python examples/trl_grpo.py --ulysses 1          # one process, no launcher (the reference)

The prompts are the starts of the paragraphs of CPython's bundled documentation (or ``--data``);
the policy samples ``--num-generations`` completions of at most ``--completion-len`` tokens per
prompt and is rewarded by two plain-python functions: the share of its words that occur in the
paragraph's true continuation, and a length close to ``--target-words``. HybridGRPOTrainer
(``--algorithm rloo``: HybridRLOOTrainer) generates with the plain model on every context rank
(the same completions there: docs/trl-peft.md; ``--generation sharded``: with hybridsp's sharded
generation, for prompts too long for one rank), scores the policy, the old policy and the
reference on sequence shards (only per-token log-probs cross ranks) and trains with TRL's loss.
TRL builds the reference model from the policy's path, so the built-in small Llama is saved to
``--output-dir``/initial-policy first (``--model-path`` is used as it is). Nothing is downloaded.
Writes ``--output-dir``/metrics.jsonl (loss, grad_norm, reward, kl, entropy, clip ratios,
completion lengths) and the final policy.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_common  # noqa: E402
from cli_args import mesh_overrides  # noqa: E402

LOSS_TYPES = ("grpo", "dr_grpo", "bnpo", "dapo")


def parse_args(argv: list[str] | None = None):
    parser = trl_common.parser_for("trl_grpo.py", __doc__)
    parser.set_defaults(seq_len=256)
    parser.add_argument(
        "--algorithm", choices=("grpo", "rloo"), default="grpo", help="TRL's GRPOTrainer or RLOOTrainer (default grpo)"
    )
    parser.add_argument("--loss-type", choices=LOSS_TYPES, default="dapo", help="GRPO's loss (default dapo)")
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt (default 4)")
    parser.add_argument("--completion-len", type=int, default=32, help="new tokens per completion at most (default 32)")
    parser.add_argument(
        "--num-iterations",
        type=int,
        default=1,
        help="optimisation passes per generation batch (default 1; more reuse the old policy's log-probs)",
    )
    parser.add_argument("--beta", type=float, default=0.04, help="weight of the KL to the reference (default 0.04)")
    parser.add_argument("--target-words", type=int, default=12, help="the length the second reward prefers")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument(
        "--generation",
        choices=("plain", "sharded"),
        default=None,
        help="how completions are made "
        '(default: the config\'s "generation", else plain): the plain model on every context rank, '
        "or hybridsp's sharded generation (prompt and K/V cache sharded; docs/trl-peft.md)",
    )
    return parser.parse_args(argv)


def prompt_rows(texts: list[str], prompt_words: int) -> list[dict]:
    """Rows {prompt, continuation}: each paragraph of 4 or more words cut after half its words (at most
    ``prompt_words``)."""
    rows = []
    for text in texts:
        words = text.split()
        cut = min(len(words) // 2, prompt_words)
        if cut >= 2:
            rows.append({"prompt": " ".join(words[:cut]), "continuation": " ".join(words[cut:])})
    if not rows:
        raise trl_common.RunConfigError("the text gives no prompt of at least 2 words: give a longer --data file")
    return rows


def rewards(target_words: int) -> list:
    """The two reward functions (TRL passes the dataset's columns as keyword arguments)."""

    def continues_the_text(completions, continuation, **kwargs) -> list[float]:
        scores = []
        for text, truth in zip(completions, continuation):
            words, known = text.split(), set(truth.split())
            scores.append(sum(word in known for word in words) / len(words) if words else 0.0)
        return scores

    def near_target_length(completions, **kwargs) -> list[float]:
        return [-abs(len(text.split()) - target_words) / target_words for text in completions]

    return [continues_the_text, near_target_length]


def initial_policy(args, tokenizer) -> str:
    """The policy's path: ``--model-path``, else the built-in small Llama saved (by rank 0) to
    ``--output-dir``/initial-policy, with the tokenizer's ids in its config."""
    if args.model_path:
        return args.model_path
    import torch.distributed as dist

    path = str(Path(args.output_dir) / "initial-policy")
    model = trl_common.build_model_for(args, tokenizer, None)
    model.save_pretrained(path)  # transformers writes on global rank 0 only
    dist.barrier()
    return path


def build_trainer(args, plan, config):
    from datasets import Dataset

    from hybridsp.integrations.trl import HybridGRPOTrainer, HybridRLOOTrainer

    if args.micro_batch is None:
        args.micro_batch = args.num_generations  # a micro batch of whole prompt groups
    texts = trl_common.paragraphs(args)
    tokenizer = trl_common.load_tokenizer(args, texts)
    args.model_path = initial_policy(args, tokenizer)  # before the config: a whole model, not a ZeRO-3 partition
    settings = {k: v for k, v in trl_common.trainer_settings(args, config).items() if k != "dataset_num_proc"}
    settings.update(
        num_generations=args.num_generations,
        max_completion_length=args.completion_len,
        beta=args.beta,
        num_iterations=args.num_iterations,
        temperature=args.temperature,
    )
    if args.algorithm == "grpo":
        from trl import GRPOConfig

        rl, cls = GRPOConfig(**settings, loss_type=args.loss_type), HybridGRPOTrainer
    else:
        from trl import RLOOConfig

        rl, cls = RLOOConfig(**settings), HybridRLOOTrainer
    model = trl_common.build_model_for(args, tokenizer, rl)
    rows = prompt_rows(texts, max(args.seq_len - args.completion_len, 2) // 2)
    trainer = cls(
        model=model,
        reward_funcs=rewards(args.target_words),
        args=rl,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        hybridsp={**mesh_overrides(args), "generation": args.generation},
    )
    loss = f", loss_type={args.loss_type}" if args.algorithm == "grpo" else ""
    return trainer, (
        f"TRL {args.algorithm.upper()} example ({args.num_generations} completions of <= "
        f"{args.completion_len} tokens per prompt, beta={args.beta}{loss})"
    )


if __name__ == "__main__":
    trl_common.main(parse_args, build_trainer)
