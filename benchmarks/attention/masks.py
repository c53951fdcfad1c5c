"""Packed documents and sliding windows on the ring, side by side with full causal attention.

Run:  python -m benchmarks run attention.masks [--seq-len 8192] [--ring 4] [--window 256] [--repeats 5] [--out DIR]

For each workload (full causal; packed documents of mixed lengths in the zigzag and the
contiguous layout; a sliding window; window + documents), on ``R`` gloo ranks with one
thread each, fp32, torch kernels, B=1, H=8, D=64, forward + backward:

* kernel work per rank: score cells the block plan has each rank compute (a causal square
  counts its triangle), max / mean over ranks (1.0 = balanced) and the total relative to
  full causal attention;
* bytes each rank sends over the ring (``CommCounter``), max over ranks, against the
  window bound (forward: the ``W - 1`` keys before each of a rank's two zigzag chunks, K and
  V; backward the same again plus the fp32 dK/dV of those rows going home);
* wall time of forward + backward, the max over ranks of each rank's median, workloads
  interleaved repeat by repeat (the machine is shared; ``uptime`` load is recorded).

Prints a markdown table and writes benchmarks/results/masks/masks.json and masks.md (``--out DIR``: there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import harness
from hybridsp import CommCounter, ring_attention
from hybridsp.layout._block_plan import build_plan
from hybridsp.layout._documents import normalize_cu_seqlens
from hybridsp.layout._layouts import take_shard

HEADS, HEAD_DIM = 8, 64


def mixed_documents(seq_len: int, seed: int = 0) -> list[int]:
    """Boundaries of documents with long-tailed lengths (a few long, many short), summing to S."""
    gen = torch.Generator().manual_seed(seed)
    bounds, position = [0], 0
    while position < seq_len:
        length = int(torch.empty(1).exponential_(generator=gen).item() * seq_len / 12) + 1
        position = min(seq_len, position + length)
        bounds.append(position)
    return bounds


def workloads(seq_len: int, window: int) -> dict[str, dict]:
    docs = mixed_documents(seq_len)
    return {
        "full causal": dict(layout="zigzag", cu=None, window=None),
        "packed (zigzag)": dict(layout="zigzag", cu=docs, window=None),
        "packed (contiguous)": dict(layout="contiguous", cu=docs, window=None),
        f"window {window}": dict(layout="zigzag", cu=None, window=window),
        f"window {window} + packed": dict(layout="zigzag", cu=docs, window=window),
    }


def plan_work(seq_len: int, ring: int, spec: dict) -> list[int]:
    """Score cells per rank for one forward (the dense case through the same plan)."""
    docs = normalize_cu_seqlens(spec["cu"], 1, seq_len)
    plan = build_plan(seq_len, ring, spec["layout"], causal=True, docs=docs, window=spec["window"], batch=1)
    return [plan.work(r) for r in range(ring)]


def _rank_run(rank, world, seq_len, specs, repeats):
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq_len, HEADS, HEAD_DIM, generator=gen) for _ in range(4)]
    times = {name: [] for name in specs}
    sent = {}
    for repeat in range(repeats + 1):  # repeat 0 warms up
        for name, spec in specs.items():
            q, k, v, dout = (take_shard(t, rank, 0, world, layout=spec["layout"]).clone() for t in full)
            q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
            counter = CommCounter()
            dist.barrier()
            start = time.perf_counter()
            out = ring_attention(
                q,
                k,
                v,
                dist.group.WORLD,
                causal=True,
                backend="torch",
                layout=spec["layout"],
                cu_seqlens=None if spec["cu"] is None else torch.tensor(spec["cu"]),
                sliding_window=spec["window"],
                counter=counter,
            )
            out.backward(dout)
            elapsed = time.perf_counter() - start
            if repeat:
                times[name].append(elapsed)
            sent[name] = counter.total()
    return {name: (statistics.median(times[name]), sent[name]) for name in specs}


def window_bound_bytes(window: int) -> int:
    """Per rank, forward + backward: 2 chunk edges x (W - 1) rows of K and V (fp32, twice) plus fp32 dK/dV."""
    rows = 2 * (window - 1)
    per_row = HEADS * HEAD_DIM * 4
    return rows * per_row * (2 + 2 + 2)  # K,V forward; K,V backward; dK,dV home


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--ring", type=int, default=4)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out",
        default=harness.results_dir("masks"),
        help="folder for masks.{md,json} (default benchmarks/results/masks)",
    )
    args = parser.parse_args(argv)
    specs = workloads(args.seq_len, args.window)
    load_before = os.getloadavg()
    per_rank = harness.launch(_rank_run, args.ring, args.seq_len, specs, args.repeats, timeout=3600)
    load_after = os.getloadavg()
    dense_total = sum(plan_work(args.seq_len, args.ring, specs["full causal"]))
    rows = []
    for name, spec in specs.items():
        work = plan_work(args.seq_len, args.ring, spec)
        rows.append(
            {
                "workload": name,
                "layout": spec["layout"],
                "window": spec["window"],
                "documents": None if spec["cu"] is None else len(spec["cu"]) - 1,
                "work_max_over_mean": max(work) / statistics.mean(work),
                "work_total_vs_full": sum(work) / dense_total,
                "bytes_sent_max": max(r[name][1] for r in per_rank),
                "seconds_fwd_bwd_max_rank_median": max(r[name][0] for r in per_rank),
            }
        )
    bound = window_bound_bytes(args.window)
    result = {
        "seq_len": args.seq_len,
        "ring": args.ring,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "window": args.window,
        "window_bound_bytes": bound,
        "documents": specs["packed (zigzag)"]["cu"],
        "repeats": args.repeats,
        "load_before": load_before,
        "load_after": load_after,
        "rows": rows,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "masks.json").write_text(json.dumps(result, indent=1) + "\n")
    table = _markdown(result)
    (out / "masks.md").write_text(table)
    print(table)
    print(f"wrote {out}/masks.md and masks.json")
    return 0


def _markdown(result: dict) -> str:
    lines = [
        f"S={result['seq_len']}, ring R={result['ring']} (U=1), B=1, H={result['heads']}, D={result['head_dim']}, "
        f"fp32, torch kernels, forward+backward, {result['repeats']} interleaved repeats, "
        f"load {result['load_before'][0]:.1f} -> {result['load_after'][0]:.1f} ({result['date']}).",
        f"Packed documents: {len(result['documents']) - 1} of lengths "
        f"{[b - a for a, b in zip(result['documents'][:-1], result['documents'][1:])]}.",
        f"Window bound on bytes sent per rank: {result['window_bound_bytes']:,} B.",
        "",
        "| workload | layout | work max/mean | work vs full | bytes sent/rank (max) | fwd+bwd s (max rank median) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['workload']} | {row['layout']} | {row['work_max_over_mean']:.2f} | "
            f"{row['work_total_vs_full']:.3f} | {row['bytes_sent_max']:,} | {row['seconds_fwd_bwd_max_rank_median']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
