"""Train a causal LM on long sequences with hybrid sequence parallelism and DeepSpeed ZeRO.

    deepspeed [--num_gpus N] examples/train.py --deepspeed ds_configs/cp8.json [options]

Defaults need no download: a small Llama built from a config and the Python documentation
that ships with CPython, tokenised at the byte level (see text_data.py). ``--model-path``,
``--data`` and ``--tokenizer`` point at local files instead. ``--ulysses U --ring R``
override the config's degrees; ``--ulysses 1 --ring 1`` on one process is the same job
without sequence parallelism. The same ``--seed`` gives the same data and initial weights
whatever the degrees. Rank 0 shows a progress bar, writes JSON-lines metrics
(``--metrics-out``) and a loss-curve PNG; checkpoints go through DeepSpeed's own
save/load (``--save-dir``, default ``runs/<config>-u<U>r<R>``; ``--resume``; ``--resume-from DIR``
continues another run's checkpoint, also on another world size or U x R: see
``hybridsp.integrations.deepspeed._checkpoint``). Config errors are reported once, before the expensive
imports (``preflight.py``); known-harmless library noise is filtered (``console.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import add_mesh_arguments, add_model_arguments, add_overwrite_argument, add_step_arguments  # noqa: E402
from console import name_cpu_accelerator, quiet_console  # noqa: E402
from host import end_rank_on_error, return_freed_memory_to_os, share_cpu_cores  # noqa: E402
from monitoring import HEALTH_PANELS, draw_health, example_monitor  # noqa: E402
from preflight import RunConfigError, RunPlan, announce, exit_once, load_ds_config, preflight, report_placement  # noqa: E402
from text_data import TokenWindows, load_corpus, tokenize  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mesh_arguments(parser)
    add_step_arguments(parser)
    parser.add_argument("--save-dir", help="run directory (default: runs/<config name>-u<U>r<R>)")
    parser.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    parser.add_argument(
        "--resume-from",
        help="continue from another run directory's latest checkpoint (or one tag "
        "folder, e.g. runs/cp4-u2r2/step2), also one written on another world size or U x R "
        "(converted to DeepSpeed's universal format once)",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=300.0,
        help="seconds a collective may wait before the rank fails (default 300)",
    )
    parser.add_argument("--metrics-out", help="JSON-lines metrics file (default: <save-dir>/metrics.jsonl)")
    parser.add_argument(
        "--export-hf", metavar="DIR", help="after training, write a save_pretrained-loadable model here"
    )
    add_overwrite_argument(parser)
    add_model_arguments(parser)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument(
        "--offload-activations",
        action="store_true",
        help="keep the checkpointed layers' inputs in host memory (needs --activation-checkpointing)",
    )
    parser.add_argument(
        "--offload-dir",
        metavar="DIR",
        help="with --offload-activations: write the offloaded inputs to unlinked files in DIR (a local "
        "NVMe scratch directory) instead of keeping them in host memory",
    )
    parser.add_argument(
        "--lean-memory",
        action="store_true",
        help="the memory frontier's techniques: tiled MLP, lean norms, lean RoPE and, with "
        "--activation-checkpointing, split checkpointing (docs/memory.md)",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the loss-curve PNG")
    parser.add_argument(
        "--pack",
        action="store_true",
        help="packed documents: every blank-line-separated block of a window is its own document "
        "(position ids restart at 0, no attention and no loss across documents)",
    )
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace, vocab_size: int) -> torch.nn.Module:
    """The model, initialised identically on every rank from ``--seed``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    if args.model_path and getattr(args, "ds_config", None) is None:  # e.g. generate_long.py: no DeepSpeed
        return AutoModelForCausalLM.from_pretrained(args.model_path, local_files_only=True, dtype=torch.float32)
    if args.model_path:
        return load_model(args)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=int(args.hidden_size * 8 / 3) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq_len, 2048),
        rope_theta=500000.0,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def load_model(args: argparse.Namespace) -> torch.nn.Module:
    """``--model-path`` the way DeepSpeed and transformers load big models: under ZeRO-3 each rank
    holds only its partition while loading (hybridsp.integrations.transformers.load_pretrained)."""
    from hybridsp.integrations.transformers import load_pretrained

    config = _config_with_lr(args)
    model = load_pretrained(args.model_path, config, ulysses=args.ulysses, ring=args.ring)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def export_model(engine, args: argparse.Namespace) -> None:
    """``--export-hf DIR``: the trained weights as a Hugging Face directory (all ranks call it)."""
    from hybridsp.integrations.transformers import export_hf

    directory = export_hf(engine, args.export_hf)
    if dist.get_rank() == 0:
        print(f"exported the trained model to {directory} (AutoModelForCausalLM.from_pretrained loads it)", flush=True)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory, or this process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


SMOOTHED_STEPS = 10  # the summary's smoothed loss: the mean over this many last steps


class Metrics:
    """Rank 0's JSON-lines metrics file and the history for the loss curve."""

    def __init__(self, path: Path, resume: bool, enabled: bool):
        self.path, self.enabled, self.history = path, enabled, []
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            if resume and path.exists():
                self.history = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            path.write_text("".join(json.dumps(row) + "\n" for row in self.history))

    def log(self, row: dict) -> None:
        if self.enabled:
            self.history = [r for r in self.history if r["step"] < row["step"]] + [row]
            with self.path.open("a") as sink:
                sink.write(json.dumps(row) + "\n")

    def plot(self, path: Path) -> Path | None:
        """The loss curve as a PNG; None (with one warning) when matplotlib is not installed."""
        if not self.enabled or not self.history:
            return None
        try:
            import matplotlib
        except ImportError:
            warnings.warn(
                "matplotlib is not installed, so no loss curve was drawn (pip install matplotlib)", stacklevel=2
            )
            return None

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        health = any(key in row for row in self.history for key, _, _ in HEALTH_PANELS)  # the "monitor" block
        figure, axes = plt.subplots(1, 4 if health else 1, figsize=(20 if health else 6, 4), squeeze=False)
        axis = axes[0][0]
        if health:
            draw_health(axes[0][1:], self.history, axis)
        axis.plot([r["step"] for r in self.history], [r["loss"] for r in self.history])
        axis.set(xlabel="step", ylabel="loss (nats/token)", title="hybridsp example: training loss")
        axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        return path

    def summary(self, start_step: int, plot: Path | None, save_dir: Path) -> str:
        """One line: losses (the first, the last batch's, and the mean of the last ``SMOOTHED_STEPS`` steps: one
        batch's loss is noisy), steady tokens/s (the run's first step is warm-up and left out), memory, files."""
        rows = [r for r in self.history if r["step"] > start_step]
        if not rows:
            return f"nothing trained; checkpoint: {save_dir}"
        steady = sorted(r["tokens_per_s"] for r in rows if not r.get("warmup")) or [rows[0]["tokens_per_s"]]
        first, last = rows[0], rows[-1]
        rss = max(r.get("rss_bytes_max", 0) for r in rows) / 2**20
        recent = [r["loss"] for r in rows[-SMOOTHED_STEPS:]]
        return (
            f"done: steps {first['step']}..{last['step']}, loss {first['loss']:.3f} -> {last['loss']:.3f} "
            f"(mean of the last {len(recent)} steps {sum(recent) / len(recent):.3f}), "
            f"{steady[len(steady) // 2]:.0f} tokens/s (median; the first step took {first['step_seconds']:.1f} s of "
            f"warm-up and is left out), max RSS per rank {rss:.0f} MiB; metrics: {self.path}"
            + (f", loss curve: {plot}" if plot else "")
            + f", checkpoint: {save_dir}"
        )


def packed_position_ids(tokens: torch.Tensor, separator: torch.Tensor) -> torch.Tensor:
    """[b, S] position ids that restart at 0 after every occurrence of the ``separator`` ids,
    so each separated block of a window is a packed document (``--pack``)."""
    b, seq = tokens.shape
    n = separator.numel()
    ends = torch.zeros(b, seq, dtype=torch.bool)  # [b, S]: the token closes a separator
    if seq >= n:
        windows = tokens.unfold(1, n, 1)  # [b, S - n + 1, n]
        ends[:, n - 1 :] = (windows == separator).all(-1)
    starts = torch.cat([torch.ones(b, 1, dtype=torch.bool), ends[:, :-1]], dim=1)  # [b, S]
    index = torch.arange(seq).expand(b, seq)  # [b, S]
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # [b, S]
    return index - last_start  # [b, S]


def activation_offload(args: argparse.Namespace, model: torch.nn.Module):
    """``--offload-activations``: hybridsp's offload hooks on the checkpointed layers (a no-op
    context without the flag); ``--offload-dir``: to files there instead of host memory."""
    from hybridsp import offload_activations

    if args.offload_activations and not args.activation_checkpointing:
        raise RunConfigError(
            "--offload-activations needs --activation-checkpointing (it offloads the checkpointed layers' inputs)"
        )
    if args.offload_dir and not args.offload_activations:
        raise RunConfigError("--offload-dir needs --offload-activations (it is where the offloaded inputs go)")
    try:
        return offload_activations(model, enabled=args.offload_activations, spill_dir=args.offload_dir)
    except ValueError as error:  # a spill directory that is missing or not writable
        raise RunConfigError(f"--offload-dir: {error}") from error


def lean_memory(args: argparse.Namespace, model: torch.nn.Module) -> None:
    """``--lean-memory``: tiled MLP, lean norms, lean RoPE and (with --activation-checkpointing) split
    checkpointing on the engine's model (the longest trainable step: benchmarks/RESULTS.md, Head-chunked
    attention); nothing without the flag. A model none of them fits raises RunConfigError naming it."""
    import hybridsp

    if not args.lean_memory:
        return
    techniques = [hybridsp.apply_tiled_mlp, hybridsp.apply_lean_norms, hybridsp.apply_lean_rope]
    if args.activation_checkpointing:
        techniques.append(hybridsp.apply_split_checkpointing)
    for apply in techniques:
        try:
            apply(model)
        except ValueError as error:
            raise RunConfigError(
                f"--lean-memory: {apply.__name__}: {error}; drop --lean-memory for this model"
            ) from error


def train_step(
    engine,
    mesh,
    windows: TokenWindows,
    step: int,
    micro_batch: int,
    accumulation: int,
    separator: torch.Tensor | None = None,
    *,
    offload=None,
    monitor=None,
) -> float:
    """One optimizer step over ``accumulation`` micro-batches; returns the mean loss.
    ``separator``: pack documents split at these token ids (``--pack``); ``offload``: a context
    around each forward (:func:`activation_offload`); ``monitor``: the "monitor" block's (monitoring.py), which may
    drop a micro-batch before its backward."""
    import contextlib

    from hybridsp import shard_batch, sharded_cross_entropy

    losses = []
    replicas = mesh.dp
    for micro in range(accumulation):
        first = ((step * accumulation + micro) * replicas + mesh.dp_rank) * micro_batch
        tokens = windows.batch(first, micro_batch)  # [b, S], the same on every context rank
        batch = {"input_ids": tokens, "labels": tokens}
        if separator is not None:
            batch["position_ids"] = packed_position_ids(tokens, separator)  # [b, S]
        local = {k: v.to(engine.device) for k, v in shard_batch(batch, mesh).items()}
        with offload if offload is not None else contextlib.nullcontext():
            logits = engine(
                input_ids=local["input_ids"],
                position_ids=local["position_ids"],
                hybridsp_documents=local["documents"],
                use_cache=False,
            ).logits
            loss = sharded_cross_entropy(logits, local["shift_labels"], mesh)
        if monitor is not None and not monitor.admits(step, loss, batch):
            return loss.item()  # dropped by the anomaly policy: no backward, no optimizer step, on every rank
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return sum(losses) / len(losses)


def _mean_over_replicas(value: float, mesh) -> float:
    """The loss averaged over data-parallel replicas (context ranks already agree)."""
    tensor = torch.tensor([value], dtype=torch.float64)
    if mesh.dp > 1:
        dist.all_reduce(tensor, group=mesh.data_group)
    return tensor.item() / mesh.dp


def resident_bytes() -> int:
    """This process's resident set size now (``/proc/self/statm``), 0 where it cannot be read."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def resident_bytes_per_rank() -> list[int]:
    """Every rank's current RSS (one small all_gather over the world)."""
    local = torch.tensor([resident_bytes()], dtype=torch.int64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [int(t.item()) for t in gathered]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        plan = preflight(args)
    except RunConfigError as error:
        exit_once(error)
    announce(plan)  # rank 0: e.g. the default run directory holds an earlier run, written over
    name_cpu_accelerator()
    return_freed_memory_to_os()  # Note [flat RSS] in host.py
    share_cpu_cores()  # Note [threads per rank] in host.py
    with quiet_console(plan.rank), end_rank_on_error():  # Note [prompt exit] in host.py
        try:
            run(args, plan)
        except RunConfigError as error:  # found after start-up, on every rank alike
            exit_once(error)


def run(args: argparse.Namespace, plan: RunPlan) -> None:
    """Build, (resume,) train, checkpoint, summarise."""
    import datetime

    from tqdm import tqdm

    from hybridsp.integrations import deepspeed as ckpt
    from hybridsp.integrations.deepspeed import init_distributed, initialize

    _single_process_environment()
    init_distributed(timeout=datetime.timedelta(seconds=args.collective_timeout))
    torch.manual_seed(args.seed)
    tokens, vocab_size, windows = load_windows(args, args.seq_len)  # the same data (and errors) on every rank
    separator = tokenize("\n\n", args.tokenizer)[0] if args.pack else None  # --pack: blank lines end documents
    model = build_model(args, vocab_size)  # under ZeRO-3, --model-path loads partitioned (a collective)
    _check_vocabulary(tokens, model)
    config = _config_with_lr(args, plan.ds_config)
    resume = _plan_resume(args, plan, config)
    if resume is not None and resume.universal:
        ckpt.convert_to_universal(resume)
        config.setdefault("checkpoint", {})["load_universal"] = True
    engine, _, mesh, _ = initialize(
        model,
        config,
        ulysses=args.ulysses,
        ring=args.ring,
        backend=args.backend,
        kv_comm=args.kv_comm,
        layout=args.layout,
        tensor=args.tensor,
    )
    lean_memory(args, engine.module)
    offload = activation_offload(args, engine.module)
    report_placement(mesh, plan.save_dir)  # host, ranks, groups: before the first step
    micro_batch, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    monitor = example_monitor(engine, mesh, config, accumulation, plan.save_dir)  # None without a "monitor" block
    start_step = _load(engine, resume, monitor)
    dist.barrier()  # Note [first step]: every rank has finished building before the first timed step
    rank0 = dist.get_rank() == 0
    save_dir = plan.save_dir
    metrics = Metrics(Path(args.metrics_out or save_dir / "metrics.jsonl"), start_step > 0, rank0)
    if rank0:
        origin = f", resumed from {resume.tag_dir} ({'universal' if resume.universal else 'direct'})" if resume else ""
        lr = config.get("optimizer", {}).get("params", {}).get("lr")
        print(
            f"hybridsp example: {mesh!r}, seq_len={args.seq_len}, micro_batch={micro_batch}, lr={lr}, "
            f"accumulation={accumulation}, steps {start_step}..{args.max_steps}, run dir {save_dir}{origin}",
            flush=True,
        )
    bar = tqdm(range(start_step, args.max_steps), disable=not rank0, desc="train", dynamic_ncols=True)
    for step in bar:
        started = time.perf_counter()

        def one_step(index: int) -> float:
            return train_step(
                engine, mesh, windows, index, micro_batch, accumulation, separator, offload=offload, monitor=monitor
            )

        if monitor is not None:
            monitor.begin_step()
        loss = _mean_over_replicas(one_step(step), mesh)
        if monitor is not None and monitor.rollback_pending:
            monitor.rollback(one_step)  # the last checkpoint, then the steps after it, this one skipped
        seconds = time.perf_counter() - started
        if monitor is None:
            _check_finite(loss, step)
        tokens_per_s = args.seq_len * micro_batch * accumulation * mesh.dp / seconds
        rss = resident_bytes_per_rank()
        row = {
            "step": step + 1,
            "loss": loss,
            "tokens_per_s": tokens_per_s,
            "peak_mem_bytes": peak_memory_bytes(engine.device),
            "grad_norm": _grad_norm(engine),
            "step_seconds": seconds,
            "warmup": step == start_step,
            "rss_bytes_max": max(rss),
            "rss_bytes_per_rank": rss,
        }
        if monitor is not None:
            row.update(monitor.end_step(step, loss))
            row.update(next((e for e in monitor.events if e["step"] == step + 1), {}))
        metrics.log(row)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}")
        if args.save_every and (step + 1) % args.save_every == 0:
            tag = f"step{step + 1}"
            ckpt.save_checkpoint(
                engine, mesh, save_dir, tag, {"step": step + 1, **(monitor.state(tag) if monitor else {})}
            )
    tag = f"step{args.max_steps}"
    ckpt.save_checkpoint(
        engine, mesh, save_dir, tag, {"step": args.max_steps, **(monitor.state(tag) if monitor else {})}
    )
    if args.export_hf:
        export_model(engine, args)
    if rank0:
        plotted = metrics.plot(save_dir / "loss.png") if not args.no_plot else None
        print(metrics.summary(start_step, plotted, save_dir), flush=True)


# Note [first step]: on 8 CPU ranks the first step took 40-90 s against ~1.5 s later (measured
# 51 s at load 45 in benchmarks/results/soak/soak.md). What it is not: lazy gloo connection set-up
# (groups connect when created), lazy imports (none happen during step 1), nor ranks finishing
# the engine build at different times (the barrier in run() removed that part: 51 s -> 18 s at
# a similar load), nor only the 16 threads that 8 ranks ran on 2 cores (sharing the cores, see
# host.py, took it to 13.8 s against 1.2 s for later steps). A py-spy profile of step 1 on two
# ranks shows it spent inside the same compute kernels as later steps (the attention backward
# 25%, ZeRO-3's linear backward 14-19%): one-time per-process costs inside the kernels (first
# touch of fresh memory, kernel set-up), which tests started from a warm forkserver pay far
# less of (step 1 there is ~1.4x a later step). It is reported as warm-up and kept out of the
# summary's tokens/s.


def load_windows(args: argparse.Namespace, seq_len: int) -> tuple[torch.Tensor, int, TokenWindows]:
    """(token ids, vocabulary size, windows of ``seq_len``); a data problem (a missing, unreadable or too
    short ``--data``, a tokenizer that does not load) is a RunConfigError: the same on every rank."""
    try:
        tokens, vocab_size = tokenize(load_corpus(args.data), args.tokenizer)
        return tokens, vocab_size, TokenWindows(tokens, seq_len, args.seed)
    except (ValueError, OSError) as error:
        raise RunConfigError(str(error)) from None


def _single_process_environment() -> None:
    """``python examples/train.py`` without a launcher: a world of one on a free local port."""
    if "WORLD_SIZE" in os.environ:
        return
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def _check_vocabulary(tokens: torch.Tensor, model) -> None:
    """Token ids must fit the model's embedding (the same check on every rank: same data)."""
    vocab = model.get_input_embeddings().num_embeddings
    largest = int(tokens.max()) if tokens.numel() else -1
    if largest >= vocab or (tokens.numel() and int(tokens.min()) < 0):
        raise RunConfigError(
            f"the data holds token id {largest} but the model's vocabulary has {vocab} entries: use the tokenizer "
            f"the model was trained with (--tokenizer) or a model with vocab_size > {largest}"
        )


def _check_finite(loss: float, step: int) -> None:
    """Stop every rank alike (the loss is the same everywhere) when training diverged."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"step {step + 1}: the loss is {loss}; lower --lr or check the data")


def _config_with_lr(args: argparse.Namespace, config: dict | None = None) -> dict:
    """A copy of the DeepSpeed config (default: the ``--deepspeed`` file) with ``--lr`` in its optimizer."""
    config = json.loads(json.dumps(config if config is not None else load_ds_config(args.ds_config)))
    if args.lr is not None:
        if "optimizer" not in config:
            raise RunConfigError(f"--lr needs an 'optimizer' section in {args.ds_config}")
        config["optimizer"].setdefault("params", {})["lr"] = args.lr
    return config


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def _plan_resume(args: argparse.Namespace, plan: RunPlan, config: dict):
    """None for a fresh run; else how to load (direct or universal); no communication."""
    from hybridsp.integrations.deepspeed import plan_resume

    if not (args.resume or args.resume_from):
        return None
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    source = Path(args.resume_from) if args.resume_from else plan.save_dir
    try:
        return plan_resume(source, plan.hybrid.mesh_shape(plan.world_size), stage)
    except (ValueError, FileNotFoundError) as error:
        raise RunConfigError(str(error)) from None


def _load(engine, resume, monitor=None) -> int:
    """The step to start from: 0, or the one stored with the checkpoint that ``resume`` names (and ``monitor``'s
    state from it)."""
    if resume is None:
        return 0
    path, client_state = engine.load_checkpoint(str(resume.load_dir), tag=resume.load_tag)
    if path is None:
        raise RunConfigError(f"DeepSpeed could not load the checkpoint {resume.load_dir / resume.load_tag}")
    if monitor is not None:
        monitor.load_state(client_state)
    return int(client_state["step"])


if __name__ == "__main__":
    main()
