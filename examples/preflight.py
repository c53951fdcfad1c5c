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
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

EXIT_CONFIG_ERROR = 2


class RunConfigError(ValueError):
    """A problem with the command line or the config that the user must fix."""


@dataclass(frozen=True)
class RunPlan:
    """What preflight found: the DeepSpeed config (a dict), the hybrid section, the world, the run
    directory, and ``notice``: a line for rank 0's console (the default run directory written over)."""

    ds_config: dict
    hybrid: object  # hybridsp.integrations.deepspeed.HybridConfig
    world_size: int
    rank: int
    save_dir: Path
    notice: str | None = None


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
    """Query heads of the model the run will build (its config.json for --model-path, whose model
    type must be one the hybrid attention switch takes)."""
    if not args.model_path:
        return args.heads
    config = Path(args.model_path) / "config.json"
    if not config.is_file():
        raise RunConfigError(f"--model-path {args.model_path} has no config.json")
    try:
        fields = json.loads(config.read_text())
    except json.JSONDecodeError as error:
        raise RunConfigError(
            f"--model-path {args.model_path}: config.json is not valid JSON ({error.msg} at line {error.lineno})"
        ) from None
    check_model_type(args.model_path, fields.get("model_type"))
    heads = fields.get("num_attention_heads", fields.get("text_config", {}).get("num_attention_heads"))
    if not isinstance(heads, int):
        raise RunConfigError(f"--model-path {args.model_path}: config.json has no num_attention_heads")
    return heads


def check_model_type(path: str, model_type) -> None:
    """RunConfigError unless the hybrid attention switch takes the model saved at ``path``: built on the meta
    device (no weights read) and checked by capability (a Mamba or T5 model is refused, with the reason)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridsp.integrations.transformers import VLM_MODEL_TYPES, check_switchable

    if model_type in VLM_MODEL_TYPES:
        return
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        check_switchable(model)
    except ValueError as error:
        reason = str(error).splitlines()[0]  # transformers lists every causal LM class on the next line
        where = "" if reason.endswith("(docs/model-support.md)") else " (docs/model-support.md)"
        raise RunConfigError(
            f"--model-path {path} is a {model_type!r} model hybridsp's attention switch cannot take: {reason}{where}"
        ) from None


def default_save_dir(config_path: str, ulysses: int, ring: int, tensor: int = 1) -> Path:
    """``runs/<config name>-u<U>r<R>`` (``t<T>`` appended when T > 1): each config and mesh gets its own run directory."""
    return Path("runs") / f"{Path(config_path).stem}-u{ulysses}r{ring}{f't{tensor}' if tensor > 1 else ''}"


def preflight(args) -> RunPlan:
    """Validate the run before anything expensive; RunConfigError with every problem found, in one line."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    config = load_ds_config(args.ds_config)  # nothing else can be checked without it
    problems = argument_problems(args)
    hybrid = _hybrid_section(args, config, world, problems)
    try:
        heads = model_heads(args)
    except RunConfigError as error:
        problems.append(str(error))
    else:
        if hybrid is not None and heads % hybrid.ulysses:
            problems.append(
                f"the model's {heads} query heads are not divisible by ulysses={hybrid.ulysses}; pass --ulysses with "
                f"a divisor of {heads} (and a larger --ring)"
            )
        elif hybrid is not None and heads % (hybrid.ulysses * hybrid.tensor):
            problems.append(
                f"the model's {heads} query heads are not divisible by tensor={hybrid.tensor} x ulysses="
                f"{hybrid.ulysses}; pass --tensor and --ulysses whose product divides {heads}"
            )
    save_dir = _save_dir(args, hybrid)
    problems += _resume_problems(args, save_dir) + _overwrite_problems(args, save_dir) + _engine_problems(args, config)
    if problems:
        raise RunConfigError(
            problems[0]
            if len(problems) == 1
            else f"{len(problems)} problems: " + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        )
    return RunPlan(config, hybrid, world, rank, save_dir, _overwrite_notice(args, save_dir))


def announce(plan: RunPlan) -> None:
    """Rank 0 prints the plan's notice, if any (e.g. that the default run directory is written over)."""
    if plan.notice and plan.rank == 0:
        print(plan.notice, flush=True)


def argument_problems(args) -> list[str]:
    """Numbers on the command line that cannot work (zero or negative lengths, a non-finite --lr,
    a --data path that does not exist); each problem one phrase naming the option."""
    problems = []
    positive = ("seq_len", "max_steps", "hidden_size", "layers", "heads", "kv_heads", "prompt_len", "batch")
    for name in positive:
        value = getattr(args, name, None)
        if name == "seq_len" and hasattr(args, "prompt_len"):
            continue  # generate_long.py derives it from --prompt-len and --new-tokens
        if value is not None and value < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1; got {value}")
    for name in ("save_every", "save_steps", "new_tokens"):
        value = getattr(args, name, None)
        if value is not None and value < 0:
            problems.append(f"--{name.replace('_', '-')} must be 0 or more; got {value}")
    lr = getattr(args, "lr", None)
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        problems.append(f"--lr must be a positive number; got {lr}")
    timeout = getattr(args, "collective_timeout", None)
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        problems.append(f"--collective-timeout must be a positive number of seconds; got {timeout}")
    heads, kv_heads = getattr(args, "heads", None), getattr(args, "kv_heads", None)
    if not getattr(args, "model_path", None) and heads and kv_heads and heads >= 1 and kv_heads >= 1:
        problems += _head_problems(heads, kv_heads, getattr(args, "hidden_size", None))
    for option in ("data", "checkpoint", "model_path", "tokenizer"):
        path = getattr(args, option, None)
        if path is not None and not Path(path).exists():
            problems.append(f"--{option.replace('_', '-')} {path} does not exist")
    return problems


def _head_problems(heads: int, kv_heads: int, hidden_size: int | None) -> list[str]:
    """The built-in model's head counts: each failing condition alone, with its numbers and a value that works."""
    problems = []
    if heads % kv_heads:
        fits = [k for k in range(kv_heads, 0, -1) if heads % k == 0][0]
        problems.append(
            f"the query heads (--heads {heads}) must be a multiple of the key/value heads (--kv-heads {kv_heads}); "
            f"pass --kv-heads {fits} (or a divisor of {heads})"
        )
    if hidden_size is not None and hidden_size % heads:
        fits = [h for h in range(heads, 0, -1) if hidden_size % h == 0 and h % kv_heads == 0] or [kv_heads]
        problems.append(
            f"the hidden size (--hidden-size {hidden_size}) must be a multiple of the query heads (--heads {heads}) "
            f"to give each head {hidden_size / heads:g} dimensions; pass --heads {fits[0]} or a --hidden-size that "
            f"{heads} divides (e.g. {-(-hidden_size // heads) * heads})"
        )
    return problems


def _hybrid_section(args, config: dict, world: int, problems: list[str]):
    """The validated hybrid section (None if it is unusable); problems with it appended to ``problems``."""
    from hybridsp.integrations.deepspeed import HybridConfig
    from hybridsp.layout import get_layout

    try:
        hybrid = HybridConfig.from_ds_config(
            config,
            ulysses=args.ulysses,
            ring=args.ring,
            backend=args.backend,
            kv_comm=getattr(args, "kv_comm", None),
            layout=getattr(args, "layout", None),
            tensor=getattr(args, "tensor", None),
        )
    except (ValueError, TypeError) as error:
        problems.append(f"{args.ds_config}: {error}")
        return None
    try:
        hybrid.mesh_shape(world)
        if hybrid.tensor > 1:
            from hybridsp.integrations.deepspeed import deepspeed_config

            deepspeed_config(config, hybrid, precision="fp32")  # refusals for tensor parallelism (gradient clipping)
    except ValueError as error:
        alone = (
            "" if "WORLD_SIZE" in os.environ else " (without a launcher this is one process: pass --ulysses 1 --ring 1)"
        )
        problems.append(f"{args.ds_config} on {world} ranks: {error}{alone}")
    seq_len = getattr(args, "seq_len", None)
    if seq_len is not None and seq_len >= 1:
        try:
            chunks = hybrid.kv_chunks if hybrid.kv_comm == "allgather" else None
            get_layout(hybrid.layout).check_sequence_length(seq_len, hybrid.ring, hybrid.ulysses, chunks)
        except ValueError as error:
            problems.append(f"--seq-len {seq_len}: {error}")
    return hybrid


def _save_dir(args, hybrid) -> Path:
    given = getattr(args, "save_dir", None) or getattr(args, "output_dir", None)
    if given:
        return Path(given)
    if hybrid is None:
        return default_save_dir(args.ds_config, args.ulysses or 1, args.ring or 1, getattr(args, "tensor", None) or 1)
    return default_save_dir(args.ds_config, hybrid.ulysses, hybrid.ring, hybrid.tensor)


def _engine_problems(args, config: dict) -> list[str]:
    """train.py hands the config to DeepSpeed as it is: its batch sizes must be numbers (DeepSpeed drops
    an ``"auto"``, which only the HF Trainer fills) and it needs an optimizer section."""
    if not hasattr(args, "save_dir"):  # the HF Trainer example fills "auto" and builds the optimizer itself
        return []
    problems = [
        f"{args.ds_config}: {key} must be a positive integer for train.py; got {config[key]!r} ('auto' is only "
        f"filled by the HF Trainer: examples/train_hf_trainer.py)"
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
        if key in config and (not isinstance(config[key], int) or isinstance(config[key], bool) or config[key] < 1)
    ]
    if not isinstance(config.get("optimizer"), dict):
        problems.append(
            f"{args.ds_config} has no 'optimizer' section; train.py trains with the config's optimizer "
            f'(e.g. {{"type": "AdamW", "params": {{"lr": 0.0002}}}}, as ds_configs/cp8.json)'
        )
    return problems


def _resume_problems(args, save_dir: Path) -> list[str]:
    resume_from = getattr(args, "resume_from", None)
    if not hasattr(args, "resume_from"):  # the HF Trainer example resumes through the Trainer
        return []
    if args.resume and not resume_from and not (save_dir / "latest").is_file():
        return [f"--resume: no checkpoint in {save_dir} (give --save-dir or --resume-from DIR)"]
    if resume_from and not _is_checkpoint(Path(resume_from)):
        return [
            f"--resume-from {resume_from}: neither a run directory with a 'latest' file nor a checkpoint tag folder"
        ]
    return []


def previous_run(directory: Path) -> list[str]:
    """What an earlier run left in ``directory`` that a new one would write over: metrics, the
    DeepSpeed ``latest`` pointer and tag folders (train.py), ``checkpoint-N`` folders and
    ``trainer_state.json`` (the HF Trainer). Empty for a fresh or missing directory."""
    if not directory.is_dir():
        return []
    found = [name for name in ("metrics.jsonl", "latest", "trainer_state.json") if (directory / name).is_file()]
    tags = sorted(
        p.name for p in directory.iterdir() if p.is_dir() and (_is_checkpoint(p) or p.name.startswith("checkpoint-"))
    )
    return found + tags


def _written_over(args, save_dir: Path) -> list[str]:
    """What an earlier run left in ``save_dir`` that this run would write over (none when it resumes,
    continues its own checkpoint, or passed ``--overwrite``)."""
    if not hasattr(args, "overwrite") or args.overwrite or args.resume:
        return []
    resume_from = getattr(args, "resume_from", None)
    if resume_from and save_dir.resolve() in (Path(resume_from).resolve(), *Path(resume_from).resolve().parents):
        return []  # continuing this directory's own checkpoint (the run directory or one of its tag folders)
    return previous_run(save_dir)


def _default_run_directory(args) -> bool:
    """train.py without ``--save-dir``: the run directory is ``runs/<config>-u<U>r<R>``, named for the user."""
    return hasattr(args, "save_dir") and not args.save_dir


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _overwrite_problems(args, save_dir: Path) -> list[str]:
    """A new run into a directory the user named that already holds one needs ``--overwrite`` (``--resume``
    continues it); the default run directory is written over (:func:`_overwrite_notice`)."""
    left = _written_over(args, save_dir)
    if not left or _default_run_directory(args):
        return []
    option = "--save-dir" if hasattr(args, "save_dir") else "--output-dir"
    return [
        f"{save_dir} already holds a run ({_listed(left)}); pass --resume to continue it, --overwrite to write "
        f"over it, or {option} DIR for a new one"
    ]


def _overwrite_notice(args, save_dir: Path) -> str | None:
    """The console line for a rerun into the default run directory: the README's command run twice works,
    writing over the first run (the same choice on every rank, on every host: no directory is invented)."""
    left = _written_over(args, save_dir) if _default_run_directory(args) else []
    if not left:
        return None
    return (
        f"{save_dir} holds an earlier run ({_listed(left)}): this run writes over it (--resume continues it "
        f"instead, --save-dir DIR keeps it)"
    )


def _is_checkpoint(path: Path) -> bool:
    return (path / "latest").is_file() or any(path.glob("*model_states.pt"))


def exit_once(error: Exception) -> None:
    """Rank 0 prints ``train.py: error: <message>``; every rank exits with code 2 (no traceback)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG_ERROR)


def report_placement(mesh, save_dir: Path) -> None:
    """Where the ranks run (a collective): rank 0 prints one line (hosts, ranks, groups) and writes
    ``<save_dir>/placement.json``; see :mod:`hybridsp.mesh._placement`. Runs before the first step, so a
    Ulysses group that crosses hosts shows before a long run, not after it."""
    from hybridsp.mesh import gather_placement

    placement = gather_placement(mesh)
    if mesh.rank == 0:
        print(placement.describe(), flush=True)
        save_dir.mkdir(parents=True, exist_ok=True)
        (save_dir / "placement.json").write_text(json.dumps(placement.to_json()) + "\n")
