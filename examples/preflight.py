"""Checks that run before the expensive imports and the engine build, reported once.

A config error on 8 ranks used to be 8 full tracebacks. :func:`preflight` validates what can
be validated from the command line, the environment the launcher set (``WORLD_SIZE``,
``RANK``) and the JSON file alone — the file exists and parses (the message names the file
and the line), the ``"hybridsp"`` section, degrees that divide the world, heads divisible by
the Ulysses degree, a sequence length the layout can split — and :func:`exit_once` prints
one sentence on rank 0 and ends every rank with exit code 2.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

EXIT_CONFIG_ERROR = 2


class RunConfigError(ValueError):
    """A problem with the command line or the config that the user must fix."""


@dataclass(frozen=True)
class RunPlan:
    """What preflight found: the DeepSpeed config (a dict), the hybrid section, the world."""

    ds_config: dict
    hybrid: object  # hybridsp.integrations.deepspeed.HybridConfig
    world_size: int
    rank: int
    save_dir: Path


def load_ds_config(path: str) -> dict:
    """The parsed JSON config; RunConfigError naming the file (and the line) otherwise."""
    file = Path(path)
    if not file.is_file():
        raise RunConfigError(f"DeepSpeed config {path} does not exist (pass --deepspeed PATH to a JSON file)")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise RunConfigError(
            f"DeepSpeed config {path} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
        ) from None
    if not isinstance(config, dict):
        raise RunConfigError(f"DeepSpeed config {path} must hold a JSON object, got {type(config).__name__}")
    return config


def model_heads(args) -> int:
    """Query heads of the model the run will build (its config.json for --model-path)."""
    if not args.model_path:
        return args.heads
    config = Path(args.model_path) / "config.json"
    if not config.is_file():
        raise RunConfigError(f"--model-path {args.model_path} has no config.json")
    return int(json.loads(config.read_text())["num_attention_heads"])


def default_save_dir(config_path: str, ulysses: int, ring: int, tensor: int = 1) -> Path:
    """``runs/<config name>-u<U>r<R>`` (``t<T>`` appended when T > 1): each config and mesh gets its own run directory."""
    return Path("runs") / f"{Path(config_path).stem}-u{ulysses}r{ring}{f't{tensor}' if tensor > 1 else ''}"


def preflight(args) -> RunPlan:
    """Validate the run before anything expensive; RunConfigError with one readable sentence."""
    from hybridsp.integrations.deepspeed import HybridConfig
    from hybridsp.allgather import check_kv_chunks
    from hybridsp.layout import check_sequence_length

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    config = load_ds_config(args.ds_config)
    try:
        hybrid = HybridConfig.from_ds_config(config, ulysses=args.ulysses, ring=args.ring, backend=args.backend,
                                             kv_comm=getattr(args, "kv_comm", None), layout=getattr(args, "layout", None),
                                             tensor=getattr(args, "tensor", None))
        hybrid.mesh_shape(world)
        if hybrid.tensor > 1:
            from hybridsp.integrations.deepspeed import deepspeed_config

            deepspeed_config(config, hybrid, precision="fp32")  # refusals for tensor parallelism (gradient clipping)
        check_sequence_length(args.seq_len, hybrid.ring, hybrid.ulysses, hybrid.layout)
        if hybrid.kv_comm == "allgather":
            check_kv_chunks(hybrid.kv_chunks, args.seq_len // hybrid.ring)
    except ValueError as error:
        raise RunConfigError(f"{args.ds_config} on {world} ranks: {error}") from None
    heads = model_heads(args)
    if heads % hybrid.ulysses != 0:
        raise RunConfigError(
            f"the model's {heads} query heads are not divisible by ulysses={hybrid.ulysses}; pass --ulysses with a "
            f"divisor of {heads} (and a larger --ring)"
        )
    if heads % (hybrid.ulysses * hybrid.tensor) != 0:
        raise RunConfigError(
            f"the model's {heads} query heads are not divisible by tensor={hybrid.tensor} x ulysses={hybrid.ulysses}; "
            f"pass --tensor and --ulysses whose product divides {heads}"
        )
    save_dir = Path(args.save_dir) if args.save_dir else default_save_dir(args.ds_config, hybrid.ulysses, hybrid.ring,
                                                                                 hybrid.tensor)
    if args.resume and not args.resume_from and not (save_dir / "latest").is_file():
        raise RunConfigError(f"--resume: no checkpoint in {save_dir} (give --save-dir or --resume-from DIR)")
    if args.resume_from and not _is_checkpoint(Path(args.resume_from)):
        raise RunConfigError(
            f"--resume-from {args.resume_from}: neither a run directory with a 'latest' file nor a checkpoint tag folder"
        )
    return RunPlan(config, hybrid, world, rank, save_dir)


def _is_checkpoint(path: Path) -> bool:
    return (path / "latest").is_file() or any(path.glob("*model_states.pt"))


def exit_once(error: Exception) -> None:
    """Rank 0 prints ``train.py: error: <message>``; every rank exits with code 2 (no traceback)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG_ERROR)
