"""Under FSDP2, do parameters, gradients and optimizer state shard over all W = DP x U x R ranks, and what
does each rank hold against plain FSDP2 and against hybridsp's ZeRO-3 path?

    python -m benchmarks run memory.fsdp2                   # S = 4,096, W = 4 (U2 x R2): ~3 min on 2 cores
    python -m benchmarks run memory.fsdp2 --quick           # S = 512

A small Llama (``_fsdp2_ranks.SHAPE``: hidden 256, 4 layers, 8 / 4 heads, MLP 640, V = 32,000, untied
embeddings, fp32; 19.1 M parameters) trains two AdamW steps on one row of S tokens, each set-up in a fresh
set of gloo ranks (one thread each):

- one process: the unmodified model (the whole model's bytes, and the loss reference);
- plain FSDP2 on W ranks: ``fully_shard`` per decoder layer and root over a 1-D DeviceMesh, no sequence
  parallelism. The natural plain-FSDP2 split of a global batch is data parallel, but one row cannot be
  split that way: every rank runs the whole S-token row (the same row; the averaged gradient is the one
  process's), which is what a plain FSDP2 user without context parallelism gets;
- hybridsp + FSDP2 at U x R (``init_mesh``, ``hf.apply``, ``fully_shard_model``, ``shard_batch``,
  ``sharded_cross_entropy``, as ``examples/fsdp2_torchrun.py`` does): S / (U R) tokens per rank;
- hybridsp's ZeRO-3 path (``hybridsp.integrations.deepspeed.initialize``, stage 3, torch's AdamW, every
  parameter partitioned: persistence threshold 0; reduce / prefetch buckets of 5 M elements).

Measured per rank (local shards only; max over ranks, and the sum over ranks against the whole):
parameters after set-up, gradients after the first backward, optimizer state after the first step,
every tensor alive between the steps (``harness.live_tensor_bytes``: the three above plus whatever else the
framework keeps, e.g. ZeRO-3's gradient bucket), and the second step's peak of torch allocations made
inside it (``harness.Allocations``: forward, loss, backward, optimizer step; activations, gathered
parameters, FSDP2's new gradient shards, communication buffers). The first step's loss of every set-up is
compared with the one process's (the same model and row), and the second step's too (after one AdamW step).

Writes ``benchmarks/results/fsdp2/fsdp2_memory.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.common import harness
from benchmarks.memory._fsdp2_ranks import BUCKET, KINDS, SHAPE, measure

MIB = 2**20
TITLES = {
    "one": "one process, unsharded",
    "plain": "plain FSDP2, every rank the whole row",
    "fsdp2": "hybridsp + FSDP2",
    "zero3": "hybridsp ZeRO-3 (DeepSpeed)",
}
COLUMNS = ("params", "grads", "states", "masters", "live_before_step_2", "step_peak")


def run_all(seq: int, world: int, ulysses: int, ring: int) -> dict[str, list[dict]]:
    """Each set-up in its own launch (one rank for the one process); the ranks' results per kind."""
    results = {}
    for kind in KINDS:
        ranks = 1 if kind == "one" else world
        started = time.perf_counter()
        results[kind] = harness.launch(measure, ranks, kind, seq, ulysses, ring, timeout=1800)
        print(
            f"  {kind}: {time.perf_counter() - started:.0f} s, max step peak "
            f"{max(r['step_peak'] for r in results[kind]) / MIB:.1f} MiB (load {harness.load()})",
            flush=True,
        )
    return results


def summarise(results: dict[str, list[dict]]) -> dict[str, dict]:
    """Per kind: each byte count's max over ranks and sum over ranks, the losses of rank 0, the sizes."""
    rows = {}
    for kind, ranks in results.items():
        row = {key: max(r[key] for r in ranks) for key in COLUMNS}
        row |= {f"{key}_sum": sum(r[key] for r in ranks) for key in ("params", "grads", "states")}
        row |= {key: ranks[0][key] for key in ("loss_1", "loss_2", "tokens", "shards_over")}
        row |= {"ranks": len(ranks), "seconds": max(r["seconds"] for r in ranks)}
        rows[kind] = row
    return rows


def _table(rows: dict[str, dict], mesh: str) -> list[str]:
    whole = rows["one"]
    mib = lambda b: f"{b / MIB:,.2f}"  # noqa: E731
    against = {key: key for key in COLUMNS} | {"masters": "params"}  # a master copy against the whole parameters
    lines = [
        "| set-up | ranks | tokens per rank | sharded over | parameters MiB (/ whole) | gradients MiB (/ whole) "
        "| AdamW state MiB (/ whole) | fp32 master copy MiB (/ whole parameters) "
        "| all tensors held MiB (/ one process) | step peak MiB (/ one process) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, row in rows.items():
        title = TITLES[kind] + (f" ({mesh})" if kind in ("fsdp2", "zero3") else "")
        cells = [f"{mib(row[key])} ({row[key] / whole[against[key]]:.3f})" for key in COLUMNS]
        lines.append(f"| {title} | {row['ranks']} | {row['tokens']:,} | {row['shards_over']} | {' | '.join(cells)} |")
    return lines


def _shards_and_losses(rows: dict[str, dict]) -> list[str]:
    whole = rows["one"]
    lines = [
        "| set-up | sum over ranks / whole: parameters | gradients | AdamW state | loss, step 1 | "
        "minus one process's | loss, step 2 | minus one process's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, row in rows.items():
        ratios = " | ".join(f"{row[f'{key}_sum'] / whole[key]:.4f}" for key in ("params", "grads", "states"))
        lines.append(
            f"| {TITLES[kind]} | {ratios} | {row['loss_1']:.6f} | {row['loss_1'] - whole['loss_1']:+.1e} | "
            f"{row['loss_2']:.6f} | {row['loss_2'] - whole['loss_2']:+.1e} |"
        )
    return lines


def report(rows: dict[str, dict], args, loads: tuple[str, str], wall: float) -> str:
    mesh = f"U{args.ulysses} x R{args.ring}, DP {args.world // (args.ulysses * args.ring)}"
    lines = [
        f"Per-rank memory under FSDP2, plain FSDP2 and ZeRO-3 (`memory.fsdp2`): Llama {SHAPE['hidden_size']}h x "
        f"{SHAPE['num_hidden_layers']} layers, {SHAPE['num_attention_heads']} / {SHAPE['num_key_value_heads']} "
        f"heads, MLP {SHAPE['intermediate_size']}, V = {SHAPE['vocab_size']:,}, fp32, AdamW; one row of "
        f"S = {args.seq_len:,} tokens; W = {args.world} gloo ranks. Bytes per rank, max over ranks; ratios to "
        "the one process's (its parameters, gradients and AdamW state are the whole model's).",
        "",
        *_table(rows, mesh),
        "",
        "Every shard together (sum over ranks / the whole model's) and the losses against the one process "
        "(rank 0's value; step 2 follows one AdamW step, lr 1e-3):",
        "",
        *_shards_and_losses(rows),
        "",
        "Parameters, gradients and AdamW state (exp_avg, exp_avg_sq, step): local shards (`DTensor.to_local()`; "
        "ZeRO-3's `ds_tensor`, `safe_get_local_grad`, its inner optimizer's state). fp32 master copy: ZeRO-3's "
        "fp32 partitions where they are a copy of the parameter partitions (`_fsdp2_ranks.master_copy_bytes`). "
        "All tensors held: every live CPU tensor between the two steps, each storage once (ZeRO-3's also "
        f"include its gradient partition, kept between steps, and its reduce bucket of {BUCKET:,} elements). "
        "Step peak: the most bytes allocated inside the second step (forward, loss, backward, optimizer step) "
        "live at once (torch's allocation events).",
        "",
        f"{harness.command('benchmarks.memory.fsdp2', args.argv)}; {wall:.0f} s; load {loads[0]} at the start, "
        f"{loads[1]} at the end.",
        f"{harness.machine_info()}; {harness.software_info()}; hybridsp {harness.revision()}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens of the one row (S)")
    parser.add_argument("--world", type=int, default=4, help="ranks W of the sharded set-ups")
    parser.add_argument("--ulysses", type=int, default=2)
    parser.add_argument("--ring", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="S = 512")
    parser.add_argument("--out", default=harness.results_path("fsdp2", "fsdp2_memory"), help="output prefix")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.quick:
        args.seq_len = 512
    start_load, started = harness.load(), time.perf_counter()
    rows = summarise(run_all(args.seq_len, args.world, args.ulysses, args.ring))
    markdown = report(rows, args, (start_load, harness.load()), time.perf_counter() - started)
    print(markdown)
    data = {"rows": rows, "seq_len": args.seq_len, "world": args.world, "ulysses": args.ulysses, "ring": args.ring}
    harness.write_results(args.out, markdown, data | {"shape": SHAPE, "report": markdown})
    return 0


if __name__ == "__main__":
    sys.exit(main())
