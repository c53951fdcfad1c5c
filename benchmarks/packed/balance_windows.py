"""The balanced layout with sliding windows at the plan level: placing for the window or not (no kernels).

Run:  python -m benchmarks run packed.balance_windows [--seeds 30] [--windows 512,2048] [--out PREFIX]

On packed.balance's lognormal packs (S = 16,384, lengths exp(N(6.4, 1.2)) clipped to [16, 8000], the
packs docs/packed-documents.md quotes), at R = 2, 4 and 8, for each window W (and none), three
layouts: ``zigzag``, ``balanced (blind)`` (placed as if there were no window: what
``layout="balanced"`` did before it knew the window) and ``balanced (W)`` (``Balanced(window=W)``,
Note [placement window] in hybridsp/layout/_layouts.py):

* **plan max/mean**: ``BlockPlan.work`` (the cells the plan's pieces compute, what the torch kernel
  spends) of the busiest ring slot over the mean, worst pack and mean over packs;
* **visible max/mean**: the visible cells alone (``slot_work``, a token at offset p attends
  min(p + 1, W) keys: closer to what a kernel that skips masked blocks spends);
* **build ms**: CPU time of one row's runs (mean over packs).

Writes benchmarks/results/packed/balance_windows.md and .json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.common.harness import load, machine_info, results_path, revision, write_results
from benchmarks.common.packs import lognormal_pack
from hybridsp.layout._balance.work import slot_work
from hybridsp.layout._block_plan import build_plan
from hybridsp.layout._layouts import BALANCED, ZIGZAG, get_layout
from hybridsp.layout._runs_cache import RUNS_CACHE

SEQ = 16384
RINGS = (2, 4, 8)


def layouts(window):
    """{name: layout object} compared at one window."""
    out = {"zigzag": ZIGZAG, "balanced (blind)": BALANCED}
    if window is not None:
        out[f"balanced (W={window})"] = get_layout("balanced", window)
    return out


def measure(packs, ring: int, window) -> dict:
    """{layout: {plan, visible: [ratio per pack], build_ms}} at one ring degree and window."""
    out = {}
    for name, layout in layouts(window).items():
        plan_ratios, visible_ratios, build = [], [], []
        for bounds in packs:
            RUNS_CACHE.clear()
            start = time.process_time()
            runs = layout.slot_runs(SEQ, ring, bounds)
            build.append((time.process_time() - start) * 1000)
            plan = build_plan(SEQ, ring, layout, causal=True, docs=(bounds,), window=window, batch=1)
            work = [plan.work(r) for r in range(ring)]
            visible = slot_work(runs, bounds, window)
            plan_ratios.append(max(work) * ring / sum(work))
            visible_ratios.append(max(visible) * ring / sum(visible))
        out[name] = dict(plan=plan_ratios, visible=visible_ratios, build_ms=statistics.mean(build))
    return out


def markdown(rows: list[dict], info: dict) -> str:
    lines = [
        "# The balanced layout and sliding windows (plan level)",
        "",
        f"{info['machine']}; load {info['load']} -> {info['load_after']}; revision {info['revision']}; "
        f"{info['seeds']} lognormal packs (packed.balance's), S = {SEQ:,}.",
        "",
        "| W | R | layout | plan max/mean worst | plan mean | visible max/mean worst | visible mean | build ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for name, m in row["layouts"].items():
            lines.append(
                f"| {row['window'] or 'none'} | {row['ring']} | {name} | {max(m['plan']):.3f} | "
                f"{statistics.mean(m['plan']):.3f} | {max(m['visible']):.3f} | "
                f"{statistics.mean(m['visible']):.3f} | {m['build_ms']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30, help="packs")
    parser.add_argument("--windows", default="512,2048", help="comma-separated windows (none is always run)")
    parser.add_argument(
        "--out",
        default=results_path("packed", "balance_windows"),
        help="output prefix (default benchmarks/results/packed/balance_windows)",
    )
    args = parser.parse_args(argv)
    info = dict(machine=machine_info(), load=load(), revision=revision(), seeds=args.seeds)
    packs = [lognormal_pack(SEQ, seed) for seed in range(args.seeds)]
    rows = []
    for window in [None, *(int(w) for w in args.windows.split(",") if w)]:
        for ring in RINGS:
            print(f"W={window} R={ring} ...", flush=True)
            rows.append(dict(window=window, ring=ring, layouts=measure(packs, ring, window)))
    info["load_after"] = load()
    text = markdown(rows, info)
    print(text)
    write_results(args.out, text, dict(info=info, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
