"""Peak memory of one hybrid attention forward + backward at U = world, against DeepSpeed-Ulysses.

    python -m benchmarks run memory.a2a            # world 4 and 8, S=8192, fp32 (~2 min)

Side by side, interleaved, each (method, shape) in a fresh gloo launch per repeat:
- ``hybridsp``: ``hybrid_attn_func`` at U = world, R = 1, torch kernel (this tree's lean all-to-all);
- ``hybridsp-before``: the same with ``_seq_to_heads`` / ``_heads_to_seq`` of revision
  ``--before`` (default 352cdf7, before the lean all-to-all) swapped in, read with ``git show``;
- ``deepspeed``: DeepSpeed-Ulysses ``DistributedAttention`` (scatter heads, gather sequence)
  around the same aten CPU flash kernel, set up as attention.peers sets it up (:mod:`benchmarks.common.peers`).

Measured per rank: the peak of torch's own allocations inside the call (profiler memory
events, so the inputs q, k, v, dout that exist before are not counted; the analogue of
``torch.cuda.max_memory_allocated`` minus the memory before), max over ranks, median over
repeats. Every method's output is checked against the same single-process reference first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import ROOT, harness
from benchmarks.common.peers import Case, make_inputs, setup_method

MIB = 2**20
METHODS = ("hybridsp", "hybridsp-before", "deepspeed")


def _patch_before(source: str) -> None:
    """Swap the resharding functions of an earlier ulysses.py into this process's hybridsp."""
    import types

    import hybridsp.attention._ulysses as ulysses

    old = types.ModuleType("hybridsp_ulysses_before")
    exec(compile(source, "ulysses_before.py", "exec"), old.__dict__)  # noqa: S102 - our own earlier file
    ulysses._RESHARD[True], ulysses._RESHARD[False] = old._seq_to_heads, old._heads_to_seq


def rank_main(rank, world, method, seq, heads, kv_heads, batch, before_source):
    import torch.distributed as dist

    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    case = Case(
        "deepspeed" if method == "deepspeed" else "hybridsp", world, world, 1, "fp32", seq, heads, kv_heads, batch=batch
    )
    if method == "hybridsp-before":
        _patch_before(before_source)
    with without_cpu_shm_comm_build():
        attention, shard = setup_method(case, rank)
    inputs = make_inputs(case)
    q, k, v = (shard(inputs[n]).detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
    dout = shard(inputs["dout"]).detach().clone()
    reference = _reference(inputs)
    expected = shard(reference)
    del inputs
    attention(q, k, v).backward(dout)  # warm-up (one-off allocations: process groups, kernels)
    q.grad = k.grad = v.grad = None
    dist.barrier()
    with harness.Allocations() as allocations:
        out = attention(q, k, v)
        out.backward(dout)
    error = float((out.detach() - expected).abs().max() / expected.abs().max())
    return {
        "peak": allocations.peak,
        "end": allocations.end,
        "error": error,
        "qkv_bytes": sum(t.numel() * t.element_size() for t in (q, k, v)),
    }


def _reference(inputs):
    """Single-process causal attention out [B, S, H, D] (aten, fp32) with K/V heads repeated."""
    q, k, v = (inputs[n].transpose(1, 2) for n in ("q", "k", "v"))  # [B, H, S, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2)  # [B, S, H, D]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="4,8")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", default="352cdf7")
    parser.add_argument("--out", default=harness.results_path("memory", "a2a_memory.json"))
    args = parser.parse_args(argv)
    before = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{args.before}:hybridsp/attention/_ulysses.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    shapes = [(world, 8, kv, batch) for world in map(int, args.worlds.split(",")) for kv, batch in ((8, 1), (8, 2))]
    rows, started = [], time.perf_counter()
    for world, heads, kv, batch in shapes:
        runs = {m: [] for m in METHODS}
        for _ in range(args.repeats):
            for method in METHODS:  # interleaved
                ranks = harness.launch(
                    rank_main,
                    world,
                    method,
                    args.seq,
                    heads,
                    kv,
                    batch,
                    before,
                    timeout=600,
                    threads=max(1, 2 // world),
                )
                runs[method].append(ranks)
        row = {
            "world": world,
            "seq": args.seq,
            "heads": heads,
            "kv_heads": kv,
            "batch": batch,
            "head_dim": 64,
            "qkv_mib_per_rank": runs["hybridsp"][0][0]["qkv_bytes"] / MIB,
            "load": os.getloadavg()[0],
        }
        for method, launches in runs.items():
            peaks = [max(r["peak"] for r in ranks) for ranks in launches]
            row[method] = {
                "peak_mib": statistics.median(peaks) / MIB,
                "peaks_mib": [p / MIB for p in peaks],
                "max_error": max(r["error"] for ranks in launches for r in ranks),
            }
        row["ratio_vs_deepspeed"] = row["hybridsp"]["peak_mib"] / row["deepspeed"]["peak_mib"]
        row["before_vs_deepspeed"] = row["hybridsp-before"]["peak_mib"] / row["deepspeed"]["peak_mib"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"rows": rows, "seconds": time.perf_counter() - started, "torch": torch.__version__}, indent=1)
    )
    print(markdown(rows))
    return 0


def markdown(rows) -> str:
    lines = [
        "| world (U) | B x S, H/Hkv, D | q+k+v MiB/rank | hybridsp before MiB | hybridsp lean MiB | "
        "DeepSpeed-Ulysses MiB | lean / DeepSpeed | before / DeepSpeed | max rel. error (lean, DS) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['batch']} x {r['seq']}, {r['heads']}/{r['kv_heads']}, {r['head_dim']} | "
            f"{r['qkv_mib_per_rank']:.1f} | {r['hybridsp-before']['peak_mib']:.1f} | {r['hybridsp']['peak_mib']:.1f} | "
            f"{r['deepspeed']['peak_mib']:.1f} | {r['ratio_vs_deepspeed']:.2f} | {r['before_vs_deepspeed']:.2f} | "
            f"{r['hybridsp']['max_error']:.1e}, {r['deepspeed']['max_error']:.1e} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
