"""Train a causal LM on long sequences with hybrid sequence parallelism and DeepSpeed ZeRO.

    deepspeed [--num_gpus N] examples/train.py --deepspeed ds_configs/cp8.json [options]

Defaults need no download: a small Llama built from a config and the Python documentation
that ships with CPython, tokenised at the byte level (see text_data.py). ``--model-path``,
``--data`` and ``--tokenizer`` point at local files instead. ``--ulysses U --ring R``
override the config's degrees; ``--ulysses 1 --ring 1`` on one process is the same job
without sequence parallelism. The same ``--seed`` gives the same data and initial weights
whatever the degrees. Rank 0 shows a progress bar, writes JSON-lines metrics
(``--metrics-out``) and a loss-curve PNG; checkpoints go through DeepSpeed's own
save/load (``--save-dir``, ``--resume``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from text_data import TokenWindows, load_corpus, tokenize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed", dest="ds_config", default=str(ROOT / "ds_configs" / "cp8.json"),
                        help="DeepSpeed JSON config with a 'hybridsp' section (default: ds_configs/cp8.json)")
    parser.add_argument("--deepspeed_config", dest="ds_config", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--ulysses", type=int, help="Ulysses degree (overrides the config)")
    parser.add_argument("--ring", type=int, help="ring degree (overrides the config)")
    parser.add_argument("--backend", help="attention kernel backend: auto, torch, flash, reference")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate, written into the config's optimizer (default 1e-3 suits the small built-in model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", default="runs/example")
    parser.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    parser.add_argument("--metrics-out", help="JSON-lines metrics file (default: <save-dir>/metrics.jsonl)")
    parser.add_argument("--model-path", help="a local Hugging Face causal LM (default: a small Llama from a config); "
                        "loaded in the config's precision, partitioned while it loads under ZeRO-3")
    parser.add_argument("--export-hf", metavar="DIR", help="after training, write a save_pretrained-loadable model here")
    parser.add_argument("--data", help="a local .txt file, folder of .txt files, or .jsonl with a 'text' field")
    parser.add_argument("--tokenizer", help="a local Hugging Face tokenizer (default: UTF-8 bytes)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--no-plot", action="store_true", help="skip the loss-curve PNG")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace, vocab_size: int) -> torch.nn.Module:
    """The model, initialised identically on every rank from ``--seed``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    if args.model_path:
        return load_model(args)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=int(args.hidden_size * 8 / 3) // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq_len, 2048), rope_theta=500000.0, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def load_model(args: argparse.Namespace) -> torch.nn.Module:
    """``--model-path`` the way DeepSpeed and transformers load big models: under ZeRO-3 each rank
    holds only its partition while loading (hybridsp.integrations.hf_checkpoint.load_pretrained)."""
    from hybridsp.integrations.hf_checkpoint import load_pretrained

    model = load_pretrained(args.model_path, _config_with_lr(args), ulysses=args.ulysses, ring=args.ring)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def export_model(engine, args: argparse.Namespace) -> None:
    """``--export-hf DIR``: the trained weights as a Hugging Face directory (all ranks call it)."""
    from hybridsp.integrations.hf_checkpoint import export_hf

    directory = export_hf(engine, args.export_hf)
    if dist.get_rank() == 0:
        print(f"exported the trained model to {directory} (AutoModelForCausalLM.from_pretrained loads it)", flush=True)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory, or this process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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

    def plot(self, path: Path) -> None:
        if not self.enabled or not self.history:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(6, 4))
        axis.plot([r["step"] for r in self.history], [r["loss"] for r in self.history])
        axis.set(xlabel="step", ylabel="loss (nats/token)", title="hybridsp example: training loss")
        axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)


def train_step(engine, mesh, windows: TokenWindows, step: int, micro_batch: int, accumulation: int) -> float:
    """One optimizer step over ``accumulation`` micro-batches; returns the mean loss."""
    from hybridsp import shard_batch, sharded_cross_entropy

    losses = []
    replicas = mesh.dp
    for micro in range(accumulation):
        first = ((step * accumulation + micro) * replicas + mesh.dp_rank) * micro_batch
        tokens = windows.batch(first, micro_batch)  # [b, S], the same on every context rank
        local = {k: v.to(engine.device) for k, v in shard_batch({"input_ids": tokens, "labels": tokens}, mesh).items()}
        logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        loss = sharded_cross_entropy(logits, local["shift_labels"], mesh)
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from tqdm import tqdm

    from hybridsp.integrations.deepspeed import initialize

    torch.manual_seed(args.seed)
    tokens, vocab_size = tokenize(load_corpus(args.data), args.tokenizer)
    windows = TokenWindows(tokens, args.seq_len, args.seed)
    model = build_model(args, vocab_size)
    engine, _, mesh, _ = initialize(model, _config_with_lr(args), ulysses=args.ulysses, ring=args.ring,
                                    backend=args.backend)
    start_step = _maybe_resume(engine, args)
    rank0 = dist.get_rank() == 0
    save_dir = Path(args.save_dir)
    metrics = Metrics(Path(args.metrics_out or save_dir / "metrics.jsonl"), args.resume, rank0)
    micro_batch, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    if rank0:
        print(f"hybridsp example: {mesh!r}, seq_len={args.seq_len}, micro_batch={micro_batch}, "
              f"accumulation={accumulation}, steps {start_step}..{args.max_steps}", flush=True)
    bar = tqdm(range(start_step, args.max_steps), disable=not rank0, desc="train", dynamic_ncols=True)
    for step in bar:
        started = time.perf_counter()
        loss = _mean_over_replicas(train_step(engine, mesh, windows, step, micro_batch, accumulation), mesh)
        seconds = time.perf_counter() - started
        tokens_per_s = args.seq_len * micro_batch * accumulation * mesh.dp / seconds
        row = {"step": step + 1, "loss": loss, "tokens_per_s": tokens_per_s,
               "peak_mem_bytes": peak_memory_bytes(engine.device), "grad_norm": _grad_norm(engine),
               "step_seconds": seconds}
        metrics.log(row)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}")
        if args.save_every and (step + 1) % args.save_every == 0:
            engine.save_checkpoint(str(save_dir), tag=f"step{step + 1}", client_state={"step": step + 1})
    engine.save_checkpoint(str(save_dir), tag=f"step{args.max_steps}", client_state={"step": args.max_steps})
    if args.export_hf:
        export_model(engine, args)
    if rank0 and not args.no_plot:
        metrics.plot(save_dir / "loss.png")
        print(f"metrics: {metrics.path}, loss curve: {save_dir / 'loss.png'}, checkpoint: {save_dir}", flush=True)


def _config_with_lr(args: argparse.Namespace) -> dict:
    """The DeepSpeed config as a dict, with ``--lr`` written into its optimizer section."""
    config = json.loads(Path(args.ds_config).read_text())
    if args.lr is not None:
        if "optimizer" not in config:
            raise ValueError(f"--lr needs an 'optimizer' section in {args.ds_config}")
        config["optimizer"].setdefault("params", {})["lr"] = args.lr
    return config


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def _maybe_resume(engine, args: argparse.Namespace) -> int:
    """The step to start from: 0, or the one stored with the latest checkpoint."""
    if not args.resume:
        return 0
    path, client_state = engine.load_checkpoint(args.save_dir)
    if path is None:
        raise FileNotFoundError(f"--resume: no checkpoint found in {args.save_dir}")
    return int(client_state["step"])


if __name__ == "__main__":
    main()
