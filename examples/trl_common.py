"""What the TRL examples (trl_sft.py, trl_dpo.py, trl_grpo.py, peft_lora.py) share: flags, a word-level
tokenizer and datasets built in memory, the trainer settings, and the run around ``trainer.train()``.

Nothing is downloaded. The text is CPython's bundled documentation (``text_data.load_corpus``,
or ``--data``), cut into paragraphs. The tokenizer is a word-level one whose vocabulary is the
corpus's most frequent whitespace-separated words (``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2), built
with ``tokenizers`` in memory; ``--tokenizer PATH`` takes a local Hugging Face one instead. The
model is ``train.build_model``'s small Llama (or ``--model-path``). Every rank builds the same
data (all of the text, whatever the world size, U x R or ``--max-steps``: a resumed run sees the same
rows) and model from ``--seed``.

The DeepSpeed config is one of the ``"auto"`` configs in ``ds_configs/trainer/`` (the Trainer fills
the batch, clipping, optimizer and precision values from the ``SFTConfig`` / ``DPOConfig``), or any
config with a ``"hybridsp"`` section whose fixed values then become the trainer's arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import ROOT, add_mesh_arguments, add_model_arguments, add_overwrite_argument, add_step_arguments  # noqa: E402
from console import name_cpu_accelerator, quiet_console  # noqa: E402
from host import close_process_group, share_cpu_cores  # noqa: E402
from preflight import RunConfigError, exit_once, preflight  # noqa: E402

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
DEFAULT_CONFIG = str(ROOT / "ds_configs" / "trainer" / "cp2.json")


def parser_for(script: str, description: str) -> argparse.ArgumentParser:
    """The flags every TRL example takes (``--deepspeed`` defaults to ds_configs/trainer/cp2.json)."""
    parser = argparse.ArgumentParser(
        prog=script, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_mesh_arguments(parser)
    parser.set_defaults(ds_config=DEFAULT_CONFIG)
    add_step_arguments(parser)
    parser.set_defaults(max_steps=20, seq_len=512)
    parser.add_argument(
        "--output-dir",
        default=f"runs/{Path(script).stem}",
        help="where metrics.jsonl, checkpoints and the final model go (default: runs/<script>)",
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        help="rows per rank and micro-step (default: the config's "
        "train_micro_batch_size_per_gpu, or 1 where it is 'auto')",
    )
    parser.add_argument(
        "--save-steps", type=int, default=0, help="also checkpoint every N steps (0: only the final model is saved)"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    add_overwrite_argument(parser)
    add_model_arguments(parser)
    parser.set_defaults(hidden_size=128, layers=2, heads=4, kv_heads=2)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=2048,
        help="words in the built-in word-level tokenizer (ignored with --tokenizer)",
    )
    parser.add_argument("--activation-checkpointing", action="store_true")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """What preflight does not know about: RunConfigError in one line."""
    problems = []
    for name in ("micro_batch", "vocab_size"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1; got {value}")
    if args.tensor not in (None, 1):
        problems.append(f"--tensor {args.tensor}: the TRL examples have no tensor parallelism; use examples/train.py")
    if args.resume and not any(Path(args.output_dir).glob("checkpoint-*")):
        problems.append(f"--resume: no checkpoint-N folder in {args.output_dir} (save some with --save-steps)")
    if problems:
        raise RunConfigError(
            problems[0]
            if len(problems) == 1
            else f"{len(problems)} problems: " + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        )


# ---- data ------------------------------------------------------------------------------------------------------


def paragraphs(args: argparse.Namespace, min_words: int = 4) -> list[str]:
    """The corpus as paragraphs (blank-line separated, whitespace collapsed), in an order shuffled by ``--seed``."""
    from text_data import load_corpus

    try:
        text = load_corpus(args.data)
    except (ValueError, OSError) as error:
        raise RunConfigError(str(error)) from None
    found = [" ".join(block.split()) for block in text.split("\n\n")]
    found = [block for block in found if len(block.split()) >= min_words]
    if not found:
        raise RunConfigError(f"no paragraph of {min_words} or more words in --data {args.data}")
    order = torch.randperm(len(found), generator=torch.Generator().manual_seed(args.seed))
    return [found[int(i)] for i in order]


def word_tokenizer(texts: list[str], vocab_size: int):
    """A word-level tokenizer over ``texts``' most frequent words (ties by first appearance): ``<pad>`` 0,
    ``<eos>`` 1, ``<unk>`` 2, then ``vocab_size - 3`` words."""
    from collections import Counter

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    counts = Counter(word for text in texts for word in text.split())
    words = [word for word, _ in counts.most_common(max(vocab_size - 3, 0))]
    vocab = {PAD: 0, EOS: 1, UNK: 2, **{word: i for i, word in enumerate(words, 3)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def load_tokenizer(args: argparse.Namespace, texts: list[str]):
    """``--tokenizer`` (a local Hugging Face tokenizer, given a pad token if it has none), else the word-level one."""
    if args.tokenizer is None:
        return word_tokenizer(texts, args.vocab_size)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    except (OSError, ValueError) as error:
        raise RunConfigError(f"--tokenizer {args.tokenizer} does not load: {error}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---- trainer settings --------------------------------------------------------------------------------------------


def trainer_settings(args: argparse.Namespace, config: dict) -> dict:
    """Keyword arguments for ``SFTConfig`` / ``DPOConfig`` that agree with the config's fixed values (the
    Trainer insists): ``train_hf_trainer.config_settings`` (``"auto"`` micro batch: ``--micro-batch`` or 1)
    plus what the TRL examples set."""
    from train_hf_trainer import config_settings

    settings = config_settings(args, config, micro_batch=args.micro_batch or 1)
    micro = settings["per_device_train_batch_size"]
    if args.micro_batch is not None and micro != args.micro_batch:
        raise RunConfigError(
            f"--micro-batch {args.micro_batch}: {args.ds_config} fixes train_micro_batch_size_per_gpu "
            f"to {micro} (use an 'auto' config from ds_configs/trainer/)"
        )
    return dict(
        settings,
        disable_tqdm=True,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or args.max_steps,
        activation_checkpointing=args.activation_checkpointing,
        dataloader_num_workers=0,
        dataset_num_proc=None,
    )


def metrics_callback(path: Path):
    """A TrainerCallback that appends every log (``loss``, ``grad_norm``, TRL's metrics) to ``path`` as one JSON
    line, and prints a short line per step, on the main process."""
    from transformers import TrainerCallback

    class MetricsFile(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            with path.open("a") as out:
                out.write(json.dumps(row) + "\n")
            if "loss" in row:
                shown = ", ".join(f"{k} {row[k]:.4g}" for k in ("loss", "grad_norm", *EXTRA_SHOWN) if k in row)
                print(f"step {row['step']}/{state.max_steps}: {shown}", flush=True)

    return MetricsFile()


EXTRA_SHOWN = ("mean_token_accuracy", "rewards/accuracies", "rewards/margins", "reward", "kl")


def finite_losses(path: Path) -> list[float]:
    """The per-step training losses in a metrics.jsonl."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["loss"] for row in rows if "loss" in row and "train_loss" not in row and math.isfinite(row["loss"])]


# ---- the run -----------------------------------------------------------------------------------------------------


def main(parse_args, build_trainer, argv: list[str] | None = None) -> None:
    """Parse, preflight (one line, exit 2), start the process group (a world of one without a launcher),
    build the trainer with ``build_trainer(args, plan, model_builder)``, train, save the final model."""
    args = parse_args(argv)
    try:
        check_args(args)
        plan = preflight(args)  # one line, exit code 2, before the expensive imports
    except RunConfigError as error:  # without a launcher, degrees above 1 get the --ulysses 1 --ring 1 hint
        exit_once(error)
    name_cpu_accelerator()
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(share_cpu_cores())  # accelerate neither overrides nor warns
    with quiet_console(plan.rank):
        try:
            run(args, plan, build_trainer)
        except RunConfigError as error:  # found after start-up (the data), on every rank alike
            exit_once(error)


def run(args: argparse.Namespace, plan, build_trainer) -> None:
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build
    from hybridsp.launch import init_process_group

    output = Path(args.output_dir)
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated")  # TRL / PEFT ask it
    with without_cpu_shm_comm_build():  # on CPU, skip DeepSpeed's shm all-reduce build (gloo never uses it)
        init_process_group()  # `python examples/trl_sft.py`: a world of one; under a launcher its world
        if plan.rank != 0:
            from datasets.utils.logging import disable_progress_bar

            disable_progress_bar()  # TRL's dataset preparation bars, once
        config = json.loads(json.dumps(plan.ds_config))
        if args.lr is not None and "optimizer" in config:
            config["optimizer"].setdefault("params", {})["lr"] = args.lr
        trainer, label = build_trainer(args, plan, config)
        if trainer.is_world_process_zero():
            output.mkdir(parents=True, exist_ok=True)
            metrics = output / "metrics.jsonl"
            if not args.resume:
                metrics.write_text("")
            print(
                f"hybridsp {label}: {trainer.hybrid_mesh!r}, seq_len={args.seq_len}, "
                f"lr={trainer.args.learning_rate}, micro batch {trainer.args.per_device_train_batch_size}",
                flush=True,
            )
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # its dict per step; the metrics callback prints one line instead
        trainer.add_callback(metrics_callback(output / "metrics.jsonl"))
        result = trainer.train(resume_from_checkpoint=True if args.resume else None)
        trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        losses = finite_losses(output / "metrics.jsonl")
        trained = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else f"train_loss={result.training_loss:.4f}"
        print(
            f"done: {result.global_step} steps, {trained}; metrics.jsonl and the final model in {args.output_dir}",
            flush=True,
        )
    close_process_group()


def build_model_for(args: argparse.Namespace, tokenizer, training):
    """The model, with the tokenizer's pad / bos / eos ids in its config: ``train.build_model``'s small Llama
    sized to the tokenizer, or ``--model-path`` loaded in the run's precision. Call it after the
    ``SFTConfig`` / ``DPOConfig`` (``training``) exists: under ZeRO-3 transformers then loads each rank's
    partition only, with the config's ``"auto"`` values filled (train.py's loader would hand DeepSpeed the
    unfilled ones)."""
    if args.model_path:
        from transformers.integrations.deepspeed import set_hf_deepspeed_config

        from hybridsp.integrations.transformers import load_pretrained

        filled = {k: v for k, v in training.hf_deepspeed_config.config.items() if k != "train_batch_size"}
        precision = "bf16" if training.bf16 else "fp16" if training.fp16 else "fp32"
        model = load_pretrained(args.model_path, filled, precision=precision, ulysses=args.ulysses, ring=args.ring)
        set_hf_deepspeed_config(training.hf_deepspeed_config)  # load_pretrained unsets the one the Trainer needs
        if args.activation_checkpointing:
            model.gradient_checkpointing_enable()
    else:
        from train import build_model

        model = build_model(args, len(tokenizer))
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
        config.eos_token_id = tokenizer.eos_token_id
    return model
