"""Per-call overhead of hybrid_attn_func on a 1 x 1 mesh, one revision against another.

    git worktree add --detach /tmp/before <rev>          # once
    python -m benchmarks run attention.call_overhead --before /tmp/before [--rounds 4] [--out DIR]

Each round runs the overhead worker (:mod:`benchmarks.common.overhead`: B=1, S=64, H=2, D=16 and
B=1, S=256, H=8, D=64, fp32 causal forward + backward, harness.interleave of hybrid_attn_func / the
kernel wrapper / torch SDPA / the raw aten CPU kernels) once per tree in a subprocess under that
tree's hybridsp (:mod:`benchmarks.common.trees`), the order alternating round by round. Per call: medians of process CPU time; the overhead is
``hybrid_attn_func - raw aten`` (everything that is not the kernel) and ``bare kernel - raw aten``
(the kernel wrapper's share), each per round, then the median over rounds. Writes
``results/core_shape/call_overhead.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, harness
from benchmarks.common.overhead import overhead_rank
from benchmarks.common.trees import run_in_tree, tree_head

MODULE = "benchmarks.attention.call_overhead"
SHAPES = [[[1, 64, 2, 16], 400], [[1, 256, 8, 64], 40]]
CALLS = ("hybrid_attn_func", "bare kernel", "torch SDPA", "raw aten")


def worker(shapes: list) -> dict:
    """(In the tree's subprocess) {shape: {call: harness.combine of its times}} and the hybridsp it ran."""
    import hybridsp

    times = harness.launch(overhead_rank, 1, shapes)[0]
    return {
        "hybridsp": hybridsp.__file__,
        "overhead": {
            shape: {name: harness.combine([t]) for name, t in calls.items()} for shape, calls in times.items()
        },
    }


def one_round(tree: str) -> dict:
    """{shape: {call: cpu us}} of one worker run in ``tree``."""
    started = time.perf_counter()
    result = run_in_tree(MODULE, tree, "--worker", json.dumps(SHAPES), what="the overhead worker", timeout=900)
    print(f"  {tree}: {time.perf_counter() - started:.0f} s (load {harness.load()})", flush=True)
    return {
        shape: {call: 1e6 * times[call]["median_cpu"] for call in CALLS} for shape, times in result["overhead"].items()
    }


def summary(rounds: list[dict]) -> dict:
    """Per shape: medians over rounds of each call and of the two overheads (us per call)."""
    out = {}
    for shape in rounds[0]:
        rows = [r[shape] for r in rounds]
        out[shape] = {call: statistics.median(r[call] for r in rows) for call in CALLS} | {
            "overhead": statistics.median(r["hybrid_attn_func"] - r["raw aten"] for r in rows),
            "wrapper": statistics.median(r["bare kernel"] - r["raw aten"] for r in rows),
        }
    return out


def markdown(result: dict, meta: dict) -> str:
    lines = [
        f"# Per-call overhead on a 1 x 1 mesh: {meta['revisions']['before']} -> {meta['revisions']['after']}",
        "",
        f"`{meta['command']}`; {meta['rounds']} rounds alternating; {meta['machine']}; {meta['software']}; "
        f"load before {meta['load_before']}, after {meta['load_after']}.",
        "",
        "CPU us per forward + backward call (medians over rounds; overheads per round, then the median).",
        "",
        "| shape B x S x H x D | tree | hybrid_attn_func | kernel wrapper | torch SDPA | raw aten | "
        "overhead (hybrid - raw) | wrapper (kernel - raw) | hybrid / SDPA |",
        "|---|" + "---|" * 8,
    ]
    for shape in result["after"]:
        for tree in ("before", "after"):
            row = result[tree][shape]
            lines.append(
                f"| {shape} | {tree} | {row['hybrid_attn_func']:.0f} | {row['bare kernel']:.0f} | "
                f"{row['torch SDPA']:.0f} | {row['raw aten']:.0f} | {row['overhead']:.0f} | "
                f"{row['wrapper']:.0f} | {row['hybrid_attn_func'] / row['torch SDPA']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="the earlier tree (a worktree); required unless --worker")
    parser.add_argument("--after", default=str(ROOT))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", help="write call_overhead.{md,json} here instead of results/core_shape/")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if not args.before:
        parser.error("--before TREE is required")
    trees = {"before": args.before, "after": args.after}
    meta = {
        "command": harness.command(MODULE, argv),
        "rounds": args.rounds,
        "machine": harness.machine_info(),
        "software": harness.software_info(),
        "revisions": {name: tree_head(tree) for name, tree in trees.items()},
        "load_before": harness.load(),
    }
    raw = {"before": [], "after": []}
    for i in range(args.rounds):
        for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
            raw[name].append(one_round(trees[name]))
    meta["load_after"] = harness.load()
    result = {name: summary(rounds) for name, rounds in raw.items()}
    prefix = str(Path(args.out) / "call_overhead") if args.out else harness.results_path("core_shape", "call_overhead")
    harness.write_results(prefix, markdown(result, meta), {"meta": meta, "result": result, "raw": raw})
    print(markdown(result, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
