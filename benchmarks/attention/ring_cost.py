"""What ring attention costs in compute, and how evenly it spreads causal work.

Run:  python -m benchmarks run attention.ring_cost [--seq-len 8192] [--ring 4] [--repeats 3] [--out FILE]

Measures, in one run, on gloo ranks with one thread each:
1. Total CPU work of ring attention forward+backward at ring size R (the sum over ranks of
   process CPU time) against one single-process kernel call on the whole sequence, also
   one thread: the ratio is the price of splitting (block overheads, merges, communication
   threads). Causal, zigzag layout.
2. Per-rank kernel compute time (time spent inside the local kernel, forward+backward),
   max / mean over ranks, for causal attention in the zigzag and the contiguous layouts:
   1.0 is perfect balance; the contiguous layout gives the last rank all the work.
Results are printed as a markdown table and appended as JSON lines to
benchmarks/results/ring_cost/ring_cost.jsonl (``--out FILE``: appended there instead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import harness
from benchmarks.common.harness import timed_kernel
from hybridsp import ring_attention
from hybridsp.layout._layouts import take_shard

HEADS, HEAD_DIM = 8, 64


def _inputs(seq_len: int):
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, seq_len, HEADS, HEAD_DIM, generator=gen) for _ in range(4))
    return q, k, v, dout


def _fwd_bwd(q, k, v, dout, group, kernel, layout):
    """One forward+backward; returns (process CPU seconds, kernel seconds)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    kernel.seconds = 0.0
    cpu_start = time.process_time()
    ring_attention(q, k, v, group, causal=True, backend=kernel, layout=layout).backward(dout)
    return time.process_time() - cpu_start, kernel.seconds


def _rank_costs(rank, world, seq_len, repeats, layout):
    full = _inputs(seq_len)
    shard = [take_shard(t, rank, 0, world, layout=layout) for t in full]
    kernel = timed_kernel()
    _fwd_bwd(*shard, dist.group.WORLD, kernel, layout)  # warm-up
    costs = []
    for _ in range(repeats):
        dist.barrier()
        costs.append(_fwd_bwd(*shard, dist.group.WORLD, kernel, layout))
    return costs


def _single_cost(rank, world, seq_len, repeats):
    kernel = timed_kernel()
    full = _inputs(seq_len)
    _fwd_bwd(*full, None, kernel, "zigzag")
    return [_fwd_bwd(*full, None, kernel, "zigzag") for _ in range(repeats)]


def measure(seq_len: int, ring: int, repeats: int) -> dict:
    single = harness.launch(_single_cost, 1, seq_len, repeats, timeout=1800)[0]
    result = {
        "seq_len": seq_len,
        "ring": ring,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "repeats": repeats,
        "single_cpu_s": statistics.median(c for c, _ in single),
    }
    for layout in ("zigzag", "contiguous"):
        per_rank = harness.launch(_rank_costs, ring, seq_len, repeats, layout, timeout=1800)
        totals = [sum(per_rank[r][i][0] for r in range(ring)) for i in range(repeats)]
        imbalance = [
            max(per_rank[r][i][1] for r in range(ring)) / statistics.mean(per_rank[r][i][1] for r in range(ring))
            for i in range(repeats)
        ]
        result[layout] = {
            "total_cpu_s": statistics.median(totals),
            "cpu_ratio_vs_single": statistics.median(totals) / result["single_cpu_s"],
            "kernel_s_per_rank": [statistics.median(c[1] for c in per_rank[r]) for r in range(ring)],
            "kernel_max_over_mean": statistics.median(imbalance),
        }
    return result


def _table(result: dict) -> str:
    rows = [
        f"| layout | total CPU s (sum of {result['ring']} ranks) | ratio vs single kernel "
        f"({result['single_cpu_s']:.2f} s) | kernel s per rank | max/mean |",
        "|---|---|---|---|---|",
    ]
    for layout in ("zigzag", "contiguous"):
        r = result[layout]
        per_rank = ", ".join(f"{s:.2f}" for s in r["kernel_s_per_rank"])
        rows.append(
            f"| {layout} | {r['total_cpu_s']:.2f} | {r['cpu_ratio_vs_single']:.3f} | {per_rank} | "
            f"{r['kernel_max_over_mean']:.3f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--ring", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="the JSON-lines file to append to (default results/ring_cost/ring_cost.jsonl)")
    args = parser.parse_args(argv)
    result = measure(args.seq_len, args.ring, args.repeats)
    result["date"] = time.strftime("%Y-%m-%d")
    print(f"causal fp32 B=1 S={args.seq_len} H={HEADS} D={HEAD_DIM}, ring={args.ring}, 1 thread per rank")
    print(_table(result))
    sink_path = Path(args.out or harness.results_path("ring_cost", "ring_cost.jsonl"))
    sink_path.parent.mkdir(parents=True, exist_ok=True)
    with open(sink_path, "a") as sink:
        sink.write(json.dumps(result) + "\n")
    print(f"appended to {sink_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
