"""Command-line options the examples share: the DeepSpeed config and mesh, and the model and data."""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """``--deepspeed`` (and the launcher's ``--deepspeed_config`` / ``--local_rank``), ``--ulysses``,
    ``--ring``, ``--tensor``, ``--backend``, ``--kv-comm``, ``--layout``."""
    parser.add_argument(
        "--deepspeed",
        dest="ds_config",
        default=str(ROOT / "ds_configs" / "cp8.json"),
        help="DeepSpeed JSON config with a 'hybridsp' section (default: ds_configs/cp8.json)",
    )
    parser.add_argument("--deepspeed_config", dest="ds_config", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--ulysses", type=int, help="Ulysses degree (overrides the config)")
    parser.add_argument("--ring", type=int, help="ring degree (overrides the config)")
    parser.add_argument(
        "--tensor",
        type=int,
        help="tensor-parallel degree T (overrides the config's hybridsp.tensor "
        "and tensor_parallel.autotp_size; docs/tensor-parallel.md)",
    )
    parser.add_argument("--backend", help="attention kernel backend: auto, torch, flash, reference")
    parser.add_argument(
        "--kv-comm",
        choices=("ring", "allgather"),
        help="how K/V travel inside the ring group (overrides the config's kv_comm)",
    )
    parser.add_argument(
        "--layout",
        choices=("zigzag", "contiguous", "balanced"),
        help="token layout over the ring (overrides the config's layout); 'balanced' places packed "
        "documents so every ring rank does the same attention work (use with --pack)",
    )


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """``--max-steps``, ``--seq-len``, ``--lr`` and ``--seed``, the same in both training examples."""
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate, written into the config's optimizer (default: the config's own optimizer lr)",
    )
    parser.add_argument("--seed", type=int, default=0)


def add_overwrite_argument(parser: argparse.ArgumentParser) -> None:
    """``--overwrite``: a run directory that already holds metrics or checkpoints is refused without it."""
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write over a run directory that already holds metrics or checkpoints (without it such a "
        "directory is refused; --resume continues it instead)",
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model-path``, ``--data``, ``--tokenizer`` and the built-in model's shape."""
    parser.add_argument(
        "--model-path",
        help="a local Hugging Face causal LM (default: a small Llama from a config); "
        "loaded in the config's precision, partitioned while it loads under ZeRO-3",
    )
    parser.add_argument("--data", help="a local .txt file, folder of .txt files, or .jsonl with a 'text' field")
    parser.add_argument("--tokenizer", help="a local Hugging Face tokenizer (default: UTF-8 bytes)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)


def mesh_overrides(args: argparse.Namespace) -> dict:
    """``--ulysses``, ``--ring``, ``--backend``, ``--kv-comm``, ``--layout`` where given (the trainer's ``hybridsp=``)."""
    chosen = (
        ("ulysses", args.ulysses),
        ("ring", args.ring),
        ("backend", args.backend),
        ("kv_comm", args.kv_comm),
        ("layout", args.layout),
    )
    return {k: v for k, v in chosen if v}
