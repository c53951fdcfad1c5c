"""Continue a long text with a K/V cache that stays sharded over the context ranks.

    torchrun --nproc-per-node 4 examples/generate_long.py --ulysses 2 --ring 2 --prompt-len 16384
    python examples/generate_long.py --prompt-len 4096                  # one process, no parallelism

The prompt is a window of ``--prompt-len`` tokens of the built-in corpus (the Python
documentation that ships with CPython, as bytes; ``--data`` / ``--tokenizer`` for local
files). The model is ``examples/train.py``'s small Llama (its ``--seed``, ``--hidden-size``,
``--layers``, ``--heads``, ``--kv-heads``), with the weights of a DeepSpeed checkpoint that
``train.py`` saved (``--checkpoint runs/cp8-u4r2``, the main job's run directory) or random ones, or a local Hugging Face
model (``--model-path``). The prefill runs sequence-parallel through the hybrid attention,
every decode step attends to the sharded cache and merges by log-sum-exp
(``hybridsp.integrations.transformers._generation``). Rank 0 prints the continuation, prefill and
decode tokens/s, and every rank's peak memory and K/V cache size; during the prefill it prints a
line per finished layer. The process group is :func:`hybridsp.launch.init_process_group`'s
(a world of one without a launcher, the gloo interface for multi-host runs, ``--collective-timeout``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import add_model_arguments  # noqa: E402
from console import name_cpu_accelerator, quiet_console  # noqa: E402
from preflight import RunConfigError, argument_problems, exit_once  # noqa: E402
from progress import layer_progress  # noqa: E402
from train import build_model, load_windows, peak_memory_bytes  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ulysses", type=int, default=None, help="Ulysses degree (default: 1)")
    parser.add_argument("--ring", type=int, default=None, help="ring degree (default: world / (ulysses x tensor))")
    parser.add_argument(
        "--tensor",
        type=int,
        default=1,
        help="tensor-parallel degree T: 1/T of the layer weights and "
        "H/T heads of the K/V cache per rank (default 1; docs/tensor-parallel.md)",
    )
    parser.add_argument("--prompt-len", type=int, default=8192, help="prompt tokens (default 8192)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    parser.add_argument("--batch", type=int, default=1, help="prompts continued at once (default 1)")
    parser.add_argument("--sample", action="store_true", help="sample (temperature/top-p) instead of greedy")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--backend", default="auto", help="attention kernel: auto, torch, flash, reference")
    parser.add_argument("--seed", type=int, default=0, help="model init, prompt window and sampling seed")
    parser.add_argument("--checkpoint", help="a DeepSpeed checkpoint folder saved by train.py (--save-dir)")
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=1800.0,
        help="seconds a collective may wait before the rank fails (default 1800: one ring step of a long CPU prefill can take minutes)",
    )
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    args.seq_len, args.activation_checkpointing = args.prompt_len + args.new_tokens, False  # for build_model
    return args


def load_model(args: argparse.Namespace, vocab_size: int, device: torch.device) -> torch.nn.Module:
    model = build_model(args, vocab_size)
    if args.checkpoint:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with quiet_console(dist.get_rank()), _silent_unless(dist.get_rank() == 0):  # DeepSpeed prints per rank
            model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(args.checkpoint))
    return model.to(device=device, dtype=getattr(torch, args.dtype)).eval()


@contextlib.contextmanager
def _silent_unless(speak: bool):
    """Standard output and error (DeepSpeed's prints, tqdm bars) discarded inside the block unless
    ``speak`` (rank 0 reports). An exception still propagates and is reported after the block."""
    if speak:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


class Clock:
    """A streamer (transformers' put/end protocol) that notes when each new token arrives."""

    def __init__(self):
        self.start, self.arrivals = time.perf_counter(), []

    def put(self, ids: torch.Tensor) -> None:
        if ids.dim() == 1:  # a new token (the prompt comes first, as [B, S])
            self.arrivals.append(time.perf_counter())

    def end(self) -> None:
        pass


def kv_cache_bytes(model: torch.nn.Module, batch: int, tokens: int, dtype: torch.dtype) -> int:
    """K and V of ``tokens`` tokens over all layers: 2 x layers x B x Hkv x tokens x D x itemsize."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    item = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * batch * config.num_key_value_heads * tokens * head_dim * item


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    problems = argument_problems(args)
    if problems:
        exit_once(RunConfigError("; ".join(problems)))
    name_cpu_accelerator()  # DeepSpeed's "Setting accelerator to CPU" warning, once per rank, avoided
    try:
        run(args)
    except RunConfigError as error:  # the same data on every rank: every rank stops alike
        exit_once(error)


def run(args: argparse.Namespace) -> None:
    """Prefill and decode; rank 0 reports."""
    from hybridsp.launch import init_process_group

    device = init_process_group(args.collective_timeout)  # a world of one without a launcher
    import hybridsp
    from hybridsp.integrations.transformers import apply, generate, tensor_parallel

    world = dist.get_world_size()
    ulysses = args.ulysses or 1
    try:  # degrees that do not divide the world: a ValueError on every rank, before any collective
        mesh = hybridsp.init_mesh(
            ulysses=ulysses, ring=args.ring or world // (ulysses * args.tensor), tensor=args.tensor
        )
    except ValueError as error:
        raise RunConfigError(
            f"--ulysses {args.ulysses} --ring {args.ring} --tensor {args.tensor} on {world} ranks: {error}"
        ) from None
    _, vocab_size, windows = load_windows(args, args.prompt_len)
    prompt = windows.batch(mesh.dp_rank * args.batch, args.batch).to(device)  # [B, S], one per replica
    model = load_model(args, vocab_size, device)
    try:
        model = tensor_parallel(model, mesh)  # T = 1: unchanged
        apply(model, mesh, backend=args.backend)
    except ValueError as error:  # e.g. heads the Ulysses degree does not divide: the same on every rank
        raise RunConfigError(str(error)) from None
    dist.barrier()
    with layer_progress(model, f"prefill {args.batch} x {args.prompt_len:,} tokens", enabled=mesh.rank == 0):
        clock = Clock()  # the layer lines stop after the prefill's last layer
        ids = generate(
            model,
            prompt,
            mesh=mesh,
            max_new_tokens=args.new_tokens,
            do_sample=args.sample,
            temperature=args.temperature,
            top_p=args.top_p,
            streamer=clock,
            generator=torch.Generator(device=device).manual_seed(args.seed),
        )
    report(args, mesh, model, prompt, ids, clock, device)
    dist.destroy_process_group()


def report(args, mesh, model, prompt, ids, clock: Clock, device) -> None:
    """Rank 0 prints the text and speeds; every rank's peak memory and cache share are gathered."""
    prefill_s = clock.arrivals[0] - clock.start
    decode_s = clock.arrivals[-1] - clock.arrivals[0]
    local_tokens = -(-args.prompt_len // mesh.context) + -(-args.new_tokens // mesh.context)
    mine = dict(
        peak=peak_memory_bytes(device),
        cache=kv_cache_bytes(model, args.batch, local_tokens, getattr(torch, args.dtype)) // mesh.tensor,
        params=sum(p.numel() * p.element_size() for p in model.parameters()),
    )  # K/V heads: 1/T per rank
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return
    batch, new = ids.shape[0], ids.shape[1] - prompt.shape[1]
    whole = kv_cache_bytes(model, batch, ids.shape[1], getattr(torch, args.dtype))
    print(f"mesh: {mesh!r}")
    print(f"prompt: {prompt.shape[1]} tokens x {batch}; new: {new} tokens; {args.dtype}; device {device}")
    print(f"prefill: {prefill_s:.2f} s = {batch * prompt.shape[1] / prefill_s:,.0f} tokens/s (incl. first token)")
    if new > 1:
        print(
            f"decode: {decode_s:.2f} s for {new - 1} steps = {batch * (new - 1) / decode_s:,.1f} tokens/s "
            f"({1000 * decode_s / (new - 1):.1f} ms/step)"
        )
    for rank, row in enumerate(everyone):
        print(
            f"rank {rank}: peak memory {row['peak'] / 2**20:,.0f} MiB, parameters {row['params'] / 2**20:,.1f} MiB, "
            f"K/V cache <= {row['cache'] / 2**20:,.1f} MiB "
            f"(one process holding it all: {whole / 2**20:,.1f} MiB)"
        )
    if args.tokenizer is None:
        text = lambda row: bytes(row.tolist()).decode("utf-8", errors="replace")  # noqa: E731
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        text = tokenizer.decode
    print("----- end of the prompt -----")
    print(text(prompt[0, -300:].cpu()))
    print("----- continuation -----")
    print(text(ids[0, prompt.shape[1] :].cpu()))


if __name__ == "__main__":
    main()
