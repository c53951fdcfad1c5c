"""Perplexity of a whole long text in ONE sharded forward pass (no grad, no logits, nothing saved).

    torchrun --nproc-per-node 8 examples/score_long.py --model-path DIR --tokenizer DIR --data book.txt
    python examples/score_long.py --max-tokens 16384                  # one process, no launcher
    deepspeed --num_gpus 8 examples/score_long.py --model-path DIR --tokenizer DIR --data book.txt --ring 2

The whole text (or its first ``--max-tokens`` tokens) is one sequence, sharded over all ranks
as one context group (``--ulysses U --ring R``, default U = ranks), scored under
``torch.inference_mode()`` with the hybrid attention (which keeps nothing for backward there)
and ``hybridsp.integrations.transformers.causal_lm_loss`` (fused linear + cross-entropy: the
[S/C, V] logits are never built, only ``--chunk-size`` rows of them at a time). Each rank
holds S/C tokens' activations of one layer at a time plus the weights, so the longest text
grows with the number of ranks. Rank 0 prints (and ``--json-out`` writes) the mean negative
log-likelihood per token, the perplexity, the wall time and the peak memory of every rank;
while the forward runs, it prints a line per finished layer (to standard error). The process
group is :func:`hybridsp.launch.init_process_group`'s (a world of one without a
launcher, the gloo interface chosen for multi-host runs, ``--collective-timeout``).

Defaults need no download: the Python documentation shipped with CPython, UTF-8 bytes, and a
small *untrained* Llama built from a config (its perplexity is ~256, the point is the
mechanics); pass ``--model-path``/``--tokenizer`` for a real model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from preflight import RunConfigError, argument_problems, exit_once  # noqa: E402
from progress import layer_progress  # noqa: E402
from text_data import load_corpus, tokenize  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", help="a local Hugging Face causal LM (default: a small untrained Llama)")
    parser.add_argument("--tokenizer", help="a local Hugging Face tokenizer (default: UTF-8 bytes)")
    parser.add_argument("--data", help="a local .txt file, folder of .txt files, or .jsonl with a 'text' field")
    parser.add_argument("--max-tokens", type=int, help="score only the first N tokens (default: the whole text)")
    parser.add_argument("--ulysses", type=int, help="Ulysses degree (default: all ranks, or ranks / --ring)")
    parser.add_argument("--ring", type=int, default=1, help="ring degree (default 1)")
    parser.add_argument(
        "--tensor",
        type=int,
        default=1,
        help="tensor-parallel degree T: each rank holds 1/T of the "
        "layer weights and H/T heads (default 1; docs/tensor-parallel.md)",
    )
    parser.add_argument("--backend", default="auto", help="attention kernel: auto, torch, flash, reference")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="weights' dtype (default: bf16 on CUDA, else fp32)")
    parser.add_argument("--chunk-size", type=int, help="loss chunk in tokens (default: 64 MiB of fp32 logits)")
    parser.add_argument("--json-out", help="write the result as JSON here (rank 0)")
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=1800.0,
        help="seconds a collective may wait before the rank fails (default 1800: one ring step of a long CPU prefill can take minutes)",
    )
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace, vocab_size: int, dtype: torch.dtype, seq_len: int, mesh=None, device="cpu"):
    """The model to score with (every rank holds all weights unless ``--tensor`` T > 1: then 1/T of the layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from hybridsp.tensor_parallel import load_sharded_safetensors, tensor_parallel

    if args.model_path and mesh is not None and mesh.tensor > 1:  # straight into the shards: never the whole model
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_path, local_files_only=True))
        tensor_parallel(model, mesh)
        return load_sharded_safetensors(model, args.model_path, dtype=dtype, device=device)
    if args.model_path:
        return AutoModelForCausalLM.from_pretrained(args.model_path, local_files_only=True, dtype=dtype)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=max(seq_len, 2048),
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(dtype)
    return model if mesh is None else tensor_parallel(model, mesh)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory allocated, or this process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def score(model, tokens: torch.Tensor, mesh, device: torch.device, chunk_size: int | None) -> float:
    """Mean NLL (nats/token) of ``tokens`` [N] as one sequence: one sharded forward, no grad."""
    from hybridsp import shard_batch
    from hybridsp.integrations.transformers import causal_lm_loss

    full = tokens[None]  # [1, N]
    local = {k: v.to(device) for k, v in shard_batch({"input_ids": full, "labels": full}, mesh).items()}
    with torch.inference_mode(), layer_progress(model, f"score {tokens.numel():,} tokens", enabled=mesh.rank == 0):
        return float(causal_lm_loss(model, local, mesh, chunk_size=chunk_size))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    problems = argument_problems(args)
    if problems:
        exit_once(RunConfigError("; ".join(problems)))
    try:
        return run(args)
    except RunConfigError as error:  # the same on every rank
        exit_once(error)


def run(args: argparse.Namespace) -> dict:
    """Build the mesh and the model, score, report on rank 0."""
    from hybridsp import init_mesh
    from hybridsp.integrations.transformers import apply
    from hybridsp.launch import init_process_group

    device = init_process_group(args.collective_timeout)
    world = dist.get_world_size()
    ulysses = args.ulysses or max(world // (args.ring * args.tensor), 1)
    try:
        mesh = init_mesh(ulysses, args.ring, tensor=args.tensor)
    except ValueError as error:
        raise RunConfigError(
            f"--ulysses {ulysses} --ring {args.ring} --tensor {args.tensor} on {world} ranks: {error}"
        ) from None
    if mesh.dp != 1:
        raise RunConfigError(
            f"score_long.py scores one sequence over all {world} ranks: set --ulysses x --ring x --tensor = {world}"
        )
    tokens, vocab = tokenize(load_corpus(args.data), args.tokenizer)
    tokens = tokens[: args.max_tokens] if args.max_tokens else tokens
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build_model(args, vocab, dtype, tokens.numel(), mesh, device).to(device).eval()
    apply(model, mesh, backend=args.backend)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    nll = score(model, tokens, mesh, device, args.chunk_size)
    seconds = time.perf_counter() - started
    peaks = [None] * world
    dist.all_gather_object(peaks, peak_memory_bytes(device))
    result = {
        "tokens": int(tokens.numel()),
        "nll_per_token": nll,
        "perplexity": float(torch.tensor(nll).exp()),
        "seconds": seconds,
        "tokens_per_s": tokens.numel() / seconds,
        "mesh": repr(mesh),
        "dtype": str(dtype).split(".")[-1],
        "peak_memory_bytes_per_rank": peaks,
        "peak_memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "process peak RSS",
    }
    if dist.get_rank() == 0:
        print(
            f"scored {result['tokens']:,} tokens in one forward over {mesh!r}: {nll:.4f} nats/token, "
            f"perplexity {result['perplexity']:.2f}, {seconds:.1f} s; peak memory per rank "
            f"{max(peaks) / 2**20:,.0f} MiB ({result['peak_memory_kind']})",
            flush=True,
        )
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
