"""Soak: a long run of the main job; memory must stay flat and every number finite.

    python -m benchmarks run e2e.soak                       # runs the job (8 CPU ranks, ~10-15 min), then reports
    python -m benchmarks run e2e.soak --metrics FILE        # reports on an existing run's metrics.jsonl

The job is the README's main command at a short sequence:
``deepspeed --num_gpus 8 examples/train.py --deepspeed ds_configs/cp8.json --seq-len 1024 --max-steps 300``.
From its metrics (one row per step; ``rss_bytes_per_rank`` is every rank's resident set size
after the step) it reports, per rank, the RSS growth from step ``--after`` to the end (goal:
< 1%), whether every loss and gradient norm is finite, the loss at the start and the end, and
the median step time. The result is appended to ``benchmarks/results/soak/soak.md`` (``--out FILE``:
there instead). The exit status is 1 when the goal is missed or a number is not finite.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, harness


def run_job(run_dir: Path, steps: int, seq_len: int, world: int) -> Path:
    command = [
        "deepspeed",
        "--num_gpus",
        str(world),
        str(ROOT / "examples" / "train.py"),
        "--deepspeed",
        str(ROOT / "ds_configs" / "cp8.json"),
        "--seq-len",
        str(seq_len),
        "--max-steps",
        str(steps),
        "--save-dir",
        str(run_dir),
        "--no-plot",
    ]
    subprocess.run(command, check=True)
    return run_dir / "metrics.jsonl"


def report(metrics: Path, after: int) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    base = next(r for r in rows if r["step"] == after)
    last = rows[-1]
    growth = [(end - start) / start for start, end in zip(base["rss_bytes_per_rank"], last["rss_bytes_per_rank"])]
    finite = all(math.isfinite(r["loss"]) and (r["grad_norm"] is None or math.isfinite(r["grad_norm"])) for r in rows)
    return {
        "steps": len(rows),
        "after_step": after,
        "last_step": last["step"],
        "rss_mib_at_after": [round(b / 2**20, 1) for b in base["rss_bytes_per_rank"]],
        "rss_mib_at_end": [round(b / 2**20, 1) for b in last["rss_bytes_per_rank"]],
        "rss_growth_per_rank": [round(g, 5) for g in growth],
        "max_rss_growth": max(growth),
        "all_finite": finite,
        "loss_first": rows[0]["loss"],
        "loss_last": last["loss"],
        "median_step_s": statistics.median(r["step_seconds"] for r in rows[1:]),
        "first_step_s": rows[0]["step_seconds"],
    }


def markdown(result: dict, command: str) -> str:
    growth = ", ".join(f"{g:+.2%}" for g in result["rss_growth_per_rank"])
    return (
        f"\n## Soak ({result['steps']} steps)\n\n- Command: `{command}`; load: {harness.load()} (1, 5, 15 min)\n"
        f"- RSS per rank after step {result['after_step']} (MiB): {result['rss_mib_at_after']}\n"
        f"- RSS per rank after step {result['last_step']} (MiB): {result['rss_mib_at_end']}\n"
        f"- Growth per rank: {growth} (max {result['max_rss_growth']:+.2%}; goal < 1%)\n"
        f"- Every loss and gradient norm finite: {result['all_finite']}; loss {result['loss_first']:.3f} -> "
        f"{result['loss_last']:.3f}; median step {result['median_step_s']:.2f} s, first step "
        f"{result['first_step_s']:.1f} s\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metrics", type=Path, help="report on this metrics.jsonl instead of running the job")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--after", type=int, default=50, help="growth is measured from this step on")
    parser.add_argument(
        "--out", type=Path, default=Path(harness.results_path("soak", "soak.md")), help="the markdown file to append to"
    )
    args = parser.parse_args(argv)
    command = (
        f"deepspeed --num_gpus {args.world} examples/train.py --deepspeed ds_configs/cp8.json "
        f"--seq-len {args.seq_len} --max-steps {args.steps}"
    )
    metrics = args.metrics or run_job(Path(tempfile.mkdtemp(prefix="soak-")), args.steps, args.seq_len, args.world)
    result = report(metrics, args.after)
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as sink:
        sink.write(markdown(result, command))
    return 0 if result["all_finite"] and result["max_rss_growth"] < 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
