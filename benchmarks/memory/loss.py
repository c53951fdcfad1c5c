"""Memory outside attention: the loss with and without logits, and the longest context at cp8, V=32000.

    python -m benchmarks run memory.loss                  # both parts (bounded: ~10-20 min on 2 busy cores)
    python -m benchmarks run memory.loss --part loss      # part 1 only (~1 min... ~10 min on a busy machine)

Writes ``benchmarks/results/memory/memory.{md,json}`` (``--part loss``: ``loss.{md,json}``; ``--part longest``:
``longest.{md,json}``; ``--out PREFIX`` elsewhere).

Part 1, the loss alone: peak memory per rank of one loss forward + backward at S_local = 8192 (``--tokens``)
tokens, V = 32000, h = 512, fp32 and bf16, in a fresh process per measurement (one gloo rank;
the loss's only collective is over the context group), interleaved, the median of the repeats:
- ``logits``: ``hidden @ weight.T`` then ``sharded_cross_entropy`` (the logits held until the
  backward is done, as ``examples/train.py`` holds them);
- ``fused``: ``fused_cross_entropy(hidden, weight, ...)`` at the default chunk (and at 128 tokens).
Measured: torch's allocations inside the block (profiler memory events; the inputs, made
before, are not counted; ``weight.grad`` is) and the OS's view (VmHWM - VmRSS before, with
glibc serving every allocation >= 256 KiB by mmap). Analytic: the logits path keeps ~3 [T, V]
fp32 tensors at its peak; the fused path ``c x V x 4`` for one chunk (``+ c x V x dtype bytes``
below fp32), plus ``V x h x 4`` (the fp32 weight-gradient accumulator, which becomes
``weight.grad`` in fp32; ``+ V x h x dtype`` below fp32) and ``T x h x dtype`` (the hidden gradient).
The default chunk is ``ceil(T h / V)`` rows (``hybridsp._formulas.default_chunk_size``).

Part 2, the longest trainable context at cp8 (U=4 x R=2, ZeRO-3, fp32) of the example model of
``examples/train.py`` with a V = 32000 vocabulary (tied embeddings; the byte corpus's ids are a
subset), through ``benchmarks.common.longest.search`` with longest.context's budget rules (soft ``RLIMIT_DATA``
= VmData after the engine build + budget / world; one training step per attempt; doubling then
bisection) for three steps: today's path (logits + ``sharded_cross_entropy``), the fused loss
(``causal_lm_loss``), and the fused loss + ``apply_tiled_mlp``. The budget defaults to 2 GiB
(256 MiB per rank), not longest.context's 1 GiB: with V = 32000 the V x h matrix is
31 MiB, and its gathers and gradients (lm_head and the embedding's dense gradient) take ~100 MiB
of a 128 MiB rank before any activation.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.common import harness, longest
from benchmarks.common.example import example

MIB, GIB = 2**20, 2**30
VOCAB = 32000


# --------------------------------------------------------------------------------------------
# part 1: the loss alone


def loss_rank(rank, world, mode, dtype_name, tokens, vocab, hidden_size, chunk):
    """One loss forward + backward on one rank; returns torch's and the OS's peak, bytes."""
    from hybridsp import fused_cross_entropy, init_mesh, sharded_cross_entropy

    harness.tensors_via_mmap(256 * 1024)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    mesh = init_mesh(1, 1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, hidden_size, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    gc.collect()
    harness.malloc_trim()
    before = harness.memory_status()
    harness.reset_peak()
    started = time.perf_counter()
    with harness.Allocations() as allocations:
        if mode == "logits":
            logits = hidden @ weight.t()  # [1, T, V], held until the step ends (as train.py does)
            loss = sharded_cross_entropy(logits, labels, mesh)
            loss.backward()
            del logits
        else:
            loss = fused_cross_entropy(hidden, weight, labels, mesh, chunk_size=chunk)
            loss.backward()
    seconds = time.perf_counter() - started
    end = harness.memory_status()
    return {
        "alloc_peak": allocations.peak,
        "rss_peak": end["VmHWM"] - before["VmRSS"],
        "loss": loss.item(),
        "seconds": seconds,
        "grad_norm": float(weight.grad.float().norm()),
    }


def part_loss(repeats: int, log, tokens: int = 8192) -> list[dict]:
    this = importlib.import_module(__spec__.name)  # workers unpickle the function from this module, not __main__

    hidden_size = 512
    modes = [("logits", None), ("fused", None), ("fused", 128)]
    rows = []
    for dtype in ("fp32", "bf16"):
        runs = {m: [] for m in modes}
        for _ in range(repeats):
            for mode, chunk in modes:  # interleaved, a fresh process each
                runs[(mode, chunk)].append(
                    harness.launch(this.loss_rank, 1, mode, dtype, tokens, VOCAB, hidden_size, chunk, timeout=600)[0]
                )
        from hybridsp._formulas import default_chunk_size

        for (mode, chunk), results in runs.items():
            c = default_chunk_size(VOCAB, tokens, hidden_size) if (mode == "fused" and chunk is None) else chunk
            row = {
                "dtype": dtype,
                "mode": mode,
                "chunk": c,
                "tokens": tokens,
                "vocab": VOCAB,
                "hidden": hidden_size,
                "alloc_peak_mib": statistics.median(r["alloc_peak"] for r in results) / MIB,
                "rss_peak_mib": statistics.median(r["rss_peak"] for r in results) / MIB,
                "seconds": statistics.median(r["seconds"] for r in results),
                "loss": results[0]["loss"],
                "grad_norm": results[0]["grad_norm"],
                "repeats": len(results),
                "load": os.getloadavg()[0],
            }
            rows.append(row)
            log(
                f"  loss {dtype} {mode:6s} chunk={c}: allocated {row['alloc_peak_mib']:,.0f} MiB, RSS "
                f"{row['rss_peak_mib']:,.0f} MiB, {row['seconds']:.1f} s, loss {row['loss']:.6f}"
            )
    return rows


# --------------------------------------------------------------------------------------------
# part 2: the longest context at cp8


@dataclass(frozen=True)
class Variant:
    """How common.longest's attempt builds the model and runs the step (its ``variant``)."""

    name: str
    fused: bool = False
    tiled: bool = False
    vocab: int = VOCAB
    chunk_size: int | None = 128

    def prepare(self, model) -> None:
        if self.tiled:
            from hybridsp.memory._tiled_mlp import apply_tiled_mlp

            apply_tiled_mlp(model)

    def train_step(self, engine, mesh, windows, step, micro_batch, accumulation) -> float:
        train = example("train")

        if not self.fused:
            return train.train_step(engine, mesh, windows, step, micro_batch, accumulation)
        from hybridsp import shard_batch
        from hybridsp.integrations.transformers import causal_lm_loss

        losses = []
        for micro in range(accumulation):
            first = ((step * accumulation + micro) * mesh.dp + mesh.dp_rank) * micro_batch
            tokens = windows.batch(first, micro_batch)
            local = {
                k: v.to(engine.device) for k, v in shard_batch({"input_ids": tokens, "labels": tokens}, mesh).items()
            }
            loss = causal_lm_loss(engine, local, mesh, chunk_size=self.chunk_size)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return sum(losses) / len(losses)


def part_longest(budget_gib: float, granularity: int, starts: dict, log) -> list[dict]:
    this = importlib.import_module(__spec__.name)

    settings = longest.Settings(budget_total=int(budget_gib * GIB), granularity=granularity, first_timeout=900.0)
    longest.warm_forkserver()
    rows = []
    for variant in (
        this.Variant("today (logits)"),
        this.Variant("fused loss", fused=True),
        this.Variant("fused loss + tiled MLP", fused=True, tiled=True),
    ):
        log(f"cp8, {variant.name}:")
        started = time.perf_counter()
        best, attempts = longest.search("cp8", starts[variant.name], settings, log, variant)
        ok = [a for a in attempts if a.ok and a.seq_len == best]
        worst = ok[0].worst if ok else {}
        rows.append(
            {
                "variant": asdict(variant),
                "longest": best,
                "attempts": len(attempts),
                "search_s": time.perf_counter() - started,
                "step_alloc_peak_mib": worst.get("step_alloc_peak", 0) / MIB,
                "step_s": worst.get("step_s"),
                "failures": {str(a.seq_len): a.reason for a in attempts if not a.ok},
                "tried": [[a.seq_len, a.ok, round(a.wall_s)] for a in attempts],
            }
        )
        log(f"  -> longest {best:,} tokens ({len(attempts)} attempts, {rows[-1]['search_s'] / 60:.1f} min)")
    return rows


def markdown(result: dict) -> str:
    tokens = result["loss"][0]["tokens"] if result.get("loss") else 8192
    lines = [
        f"## Loss memory per rank at S_local = {tokens}, V = 32000, h = 512 (one rank, fresh processes)",
        "",
        "| dtype | loss | chunk (tokens) | torch allocated peak MiB | RSS peak MiB | s | loss value |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result.get("loss", []):
        lines.append(
            f"| {r['dtype']} | {r['mode']} | {r['chunk'] or '-'} | {r['alloc_peak_mib']:,.0f} | "
            f"{r['rss_peak_mib']:,.0f} | {r['seconds']:.1f} | {r['loss']:.6f} |"
        )
    if result.get("longest"):
        lines += [
            "",
            f"## Longest trainable context at cp8 (U4 x R2, ZeRO-3, fp32), example model with V = {VOCAB}, "
            f"budget {result['budget_gib']:g} GiB / 8 ranks",
            "",
            "| step | longest S | x today | step allocated MiB/rank | step s | attempts (S, ok, s) |",
            "|---|---|---|---|---|---|",
        ]
        today = result["longest"][0]["longest"] or 1
        for r in result["longest"]:
            lines.append(
                f"| {r['variant']['name']} | {r['longest']:,} | {r['longest'] / today:.1f} | "
                f"{r['step_alloc_peak_mib']:,.0f} | {r['step_s'] or 0:.0f} | {r['tried']} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("loss", "longest", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8192, help="part 1: tokens on the rank (S_local)")
    parser.add_argument("--budget-gib", type=float, default=2.0)
    parser.add_argument("--granularity", type=int, default=2048)
    parser.add_argument("--starts", default="2048,8192,12288", help="first length per variant (today, fused, tiled)")
    parser.add_argument("--out", help="output prefix (default benchmarks/results/memory/<memory|loss|longest>)")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, flush=True)

    names = ("today (logits)", "fused loss", "fused loss + tiled MLP")
    starts = dict(zip(names, map(int, args.starts.split(","))))
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "budget_gib": args.budget_gib,
        "machine": harness.machine_info(),
        "load_start": os.getloadavg()[0],
    }
    started = time.perf_counter()
    if args.part in ("loss", "both"):
        result["loss"] = part_loss(args.repeats, log, args.tokens)
    if args.part in ("longest", "both"):
        result["longest"] = part_longest(args.budget_gib, args.granularity, starts, log)
    result["total_s"], result["load_end"] = time.perf_counter() - started, os.getloadavg()[0]
    out = args.out or harness.results_path("memory", {"both": "memory"}.get(args.part, args.part))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(result, indent=1, default=str))
    Path(out + ".md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
