"""End to end against DeepSpeed's ALST: what a DeepSpeed user picks between, on the same job.

    python -m benchmarks run alst.compare                    # every part at S=4096, 3 rounds (quiet machine)
    python -m benchmarks run alst.compare --part timing --seq-len 1024 --rounds 1 --out /tmp/alst
    python -m benchmarks run alst.compare --part longest --budget-mib 1500
    python -m benchmarks run alst.compare --part defects --seq-len 1024

The job (:mod:`benchmarks.common.alst_stacks`, shared with the parity test; the rank: alst._ranks): the same tiny HF Llama (h=256, 8 query / 2 K/V heads, 4
layers, byte vocabulary 256, tied embeddings, fp32, sdpa; ``--hidden --heads --kv-heads --layers
--vocab``), seed, windows of the byte corpus and DeepSpeed config (ZeRO-``--stage``, default 3;
clipping 1.0; client AdamW), on ``--world`` gloo ranks (DP = 1), trained by DeepSpeed's ALST at
SP = world and by hybridsp at every U x R = world the planner considers (heads permitting: U4xR1,
U2xR2, U1xR4 at 4 ranks), and by one-process DeepSpeed without sequence parallelism (the reference).

Parts:

- ``parity``: every stack's losses, DeepSpeed's gradient norms and the lm_head gradient norms over
  ``--steps`` steps against the reference (relative 1e-4), plain, tiled and best.
- ``timing``: ``--rounds`` rounds; in each, one launch per stack (the order rotated every round),
  each running ``--steps`` steps after one warm-up step; per step the CPU seconds summed over ranks
  and the wall time (max over ranks); medians over every round's steps; the peak RSS per rank (the
  max over ranks of VmHWM, its median over rounds). Features ``plain`` (no tiling) and ``tiled``
  (ALST: TiledMLP + sequence_tiled_compute; hybridsp: fused loss + tiled MLP). Ratios are
  hybridsp / ALST (< 1: hybridsp cheaper); the loss trace of each launch is checked against the
  reference too.
- ``longest``: the longest S (a multiple of ``--granularity``) that one training step reaches under a
  per-rank cap of ``--budget-mib``: each rank sets the soft ``RLIMIT_DATA`` to its VmData after the
  engine build plus the cap (``--limit-from imports``: after the imports, before the model and engine
  are built, so that they count too; the build reserves VmData it never touches, e.g. 8 MiB stacks
  of every gloo group's threads: ~100 MiB more for hybridsp's mesh groups than for ALST's, measured,
  with equal RSS); tensors >= 256 KiB are mmapped and unmapped at free; an allocation past the cap
  fails the attempt. Doubling from ``--start`` until an attempt fails (or passes ``--max-seq-len``), then bisection. Features
  ``plain`` and ``best`` (ALST: checkpointing + TiledMLP + its tiled loss; hybridsp: checkpointing
  + fused loss + tiled MLP + lean norms + activation offload into /dev/shm, outside the cap as host memory is
  outside an accelerator's; ALST's offload skips CPU tensors).
- ``memory``: peak memory per rank at one S (``--seq-len``), each stack with its best features, one
  launch each after a warm-up step: peak RSS (VmHWM, max over ranks) and the step's own peak above
  the built engine (VmHWM - RSS after the build; the tensors >= 256 KiB mmapped, as under the cap).
- ``defects``: ALST's two gradient defects (benchmarks/alst/_defects.py states what is compared).

Results: ``results/alst/<part>.{md,json}`` (``--out DIR`` writes there instead), each with the
machine, the load (``uptime``) before and after, and the revision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.alst import _defects as alst_defects
from benchmarks.alst import _ranks as alst_ranks
from benchmarks.alst import _search
from benchmarks.common import alst_stacks, harness
from hybridsp._formulas import heads_divisible

MODULE = "benchmarks.alst.compare"

PRELOAD = ["torch", "torch.distributed", "hybridsp", "transformers.models.llama.modeling_llama", "deepspeed"]
TOLERANCE = 1e-4
MIB = 2**20
UNCAPPED = 2**40  # memory: a cap never reached, so that the ranks mmap tensors as under a real cap


# --------------------------------------------------------------------------------------------
# the runs


def meshes(world: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """Every U x R = world the planner considers: U divides the query heads (K/V heads repeat as needed;
    ``kv_heads`` is not a constraint)."""
    del kv_heads
    return [(u, world // u) for u in range(world, 0, -1) if world % u == 0 and heads_divisible(heads, u)]


def stack_runs(base: alst_stacks.Run, world: int, features: str, only=()) -> dict[str, alst_stacks.Run]:
    """ALST at SP = world and hybridsp at every mesh, with ``features`` (``--only`` filters by name)."""
    runs = {f"ALST U{world}": replace(base, stack="alst", ulysses=world, ring=1, features=features)}
    for u, r in meshes(world, base.heads, base.kv_heads):
        runs[f"hybridsp U{u}xR{r}"] = replace(base, stack="hybridsp", ulysses=u, ring=r, features=features)
    return {name: run for name, run in runs.items() if not only or any(word in name for word in only)}


def launch(run: alst_stacks.Run, timeout: float = 3600.0) -> list[dict]:
    world = 1 if run.stack == "reference" else run.context
    return harness.launch(alst_ranks.capped_rank, world, run, timeout=timeout)


def relative(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


def parity_row(trace: dict, reference: dict) -> dict:
    errors = {key: relative(trace[key], reference[key]) for key in ("losses", "norms") if trace[key] and reference[key]}
    if trace["head_norms"] and reference["head_norms"]:
        errors["head_norms"] = relative(trace["head_norms"], reference["head_norms"])
    return {
        "errors": errors,
        "ok": all(e <= TOLERANCE for e in errors.values()),
        "losses": trace["losses"],
        "norms": trace["norms"],
    }


# --------------------------------------------------------------------------------------------
# parts


def part_parity(base: alst_stacks.Run, world: int, only=()) -> dict:
    base = replace(base, head_norm=True)
    reference = launch(alst_stacks.reference_of(base))[0]
    rows = {}
    for features in alst_stacks.FEATURES:
        for name, run in stack_runs(base, world, features, only).items():
            rows[f"{name} {features}"] = parity_row(launch(run)[0], reference)
            print(f"  parity {name} {features}: {rows[f'{name} {features}']['errors']}", flush=True)
    return {"reference": {"losses": reference["losses"], "norms": reference["norms"]}, "rows": rows}


def _measure(traces: list[dict], warmup: int = 1) -> dict:
    """Per step after the warm-up: CPU summed over ranks, wall max over ranks; peak RSS max over ranks."""
    steps = range(warmup, len(traces[0]["cpu"]))
    return {
        "cpu": [sum(t["cpu"][k] for t in traces) for k in steps],
        "wall": [max(t["wall"][k] for t in traces) for k in steps],
        "peak_rss": max(t["peak_rss"] for t in traces),
        "peak_above_base": max(t["peak_rss"] - t["base_rss"] for t in traces),
    }


def part_timing(base: alst_stacks.Run, world: int, rounds: int, only=()) -> dict:
    timed = replace(base, steps=base.steps + 1)  # one warm-up step
    reference = launch(alst_stacks.reference_of(timed))[0]
    runs = {
        f"{name} {features}": run
        for features in ("plain", "tiled")
        for name, run in stack_runs(timed, world, features, only).items()
    }
    names = list(runs)
    samples = {name: {"cpu": [], "wall": [], "peak_rss": [], "peak_above_base": []} for name in names}
    parity = {}
    for i in range(rounds):
        print(f"  round {i + 1}/{rounds}, load {harness.load()}", flush=True)
        for name in names[i % len(names) :] + names[: i % len(names)]:
            traces = launch(runs[name])
            measured = _measure(traces)
            for key in ("cpu", "wall"):
                samples[name][key].extend(measured[key])
            for key in ("peak_rss", "peak_above_base"):
                samples[name][key].append(measured[key])
            parity.setdefault(name, parity_row(traces[0], reference))
            print(
                f"    {name}: CPU {statistics.median(measured['cpu']):.3f} s, wall "
                f"{statistics.median(measured['wall']):.3f} s, peak RSS {measured['peak_rss'] / MIB:.0f} MiB",
                flush=True,
            )
    return {"rows": {name: _medians(samples[name]) | {"parity": parity[name]} for name in names}, "samples": samples}


def _medians(sample: dict) -> dict:
    return {f"median_{key}": statistics.median(values) for key, values in sample.items()} | {
        "steps_timed": len(sample["cpu"])
    }


MEMORY_WORDS = ("allocate memory", "MemoryError", "Cannot allocate", "out of memory", "Connection", "closed")


def fits(run: alst_stacks.Run, seq_len: int, budget: int) -> tuple[bool, str]:
    """One step at ``seq_len`` under the cap: (fitted, "" or the failure's last line). run_distributed
    reports the lowest failed rank, often a peer's closed connection rather than the rank that ran out
    of memory; a failure with none of MEMORY_WORDS is marked "other:" (look at it before trusting the row)."""
    attempt = replace(run, seq_len=seq_len, steps=1, budget=budget, head_norm=False)
    try:
        launch(attempt, timeout=3600.0)
        return True, ""
    except (AssertionError, TimeoutError) as error:
        text = str(error).strip()
        last = text.splitlines()[-1][:200] if text else type(error).__name__
        memory = isinstance(error, TimeoutError) or any(word in text for word in MEMORY_WORDS)
        return False, last if memory else "other: " + last


def part_longest(
    base: alst_stacks.Run,
    world: int,
    budget_mib: int,
    start: int,
    granularity: int,
    only=(),
    ceiling: int | None = None,
) -> dict:
    rows = {}
    for features in ("plain", "best"):
        for name, run in stack_runs(base, world, features, only).items():
            rows[f"{name} {features}"] = _search.longest(
                run, budget_mib * MIB, start, granularity, lambda line: print(line, flush=True), fits, ceiling
            )
    return {"budget_mib": budget_mib, "granularity": granularity, "limit_from": base.limit_from, "rows": rows}


def part_memory(base: alst_stacks.Run, world: int, only=()) -> dict:
    rows = {}
    for name, run in stack_runs(replace(base, steps=2, budget=UNCAPPED), world, "best", only).items():
        traces = launch(run)
        row = rows[f"{name} best"] = {
            "peak_rss": max(t["peak_rss"] for t in traces),
            "peak_above_build": max(t["peak_rss"] - t["built_rss"] for t in traces),
            "parity_losses": traces[0]["losses"],
        }
        print(
            f"    {name} best: peak RSS {row['peak_rss'] / MIB:.0f} MiB, above the build "
            f"{row['peak_above_build'] / MIB:.0f} MiB",
            flush=True,
        )
    return {"seq_len": base.seq_len, "rows": rows}


def part_defects(base: alst_stacks.Run, world: int) -> dict:
    return {
        "zero2": alst_defects.zero2_gradient_scale(base, world),
        "fused_logits": alst_defects.fused_logits_head_gradient(base, world),
        "tied": alst_defects.tied_tiled_loss(base, world),
    }


# --------------------------------------------------------------------------------------------
# reports


def _ratio_to_alst(rows: dict, name: str, key: str) -> str:
    features = name.rsplit(" ", 1)[1]
    alst = next(row for other, row in rows.items() if other.startswith("ALST") and other.endswith(features))
    return f"{rows[name][key] / alst[key]:.3f}"


def markdown_timing(result: dict) -> str:
    rows = result["rows"]
    lines = [
        "| stack | features | CPU s/step (sum over ranks) | / ALST | wall s/step | / ALST | peak RSS MiB/rank "
        "| / ALST | above the imports, MiB | / ALST | parity vs one process |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        stack, features = name.rsplit(" ", 1)
        lines.append(
            f"| {stack} | {features} | {row['median_cpu']:.3f} | {_ratio_to_alst(rows, name, 'median_cpu')} | "
            f"{row['median_wall']:.3f} | {_ratio_to_alst(rows, name, 'median_wall')} | "
            f"{row['median_peak_rss'] / MIB:.0f} | {_ratio_to_alst(rows, name, 'median_peak_rss')} | "
            f"{row['median_peak_above_base'] / MIB:.0f} | {_ratio_to_alst(rows, name, 'median_peak_above_base')} | "
            f"{'equal' if row['parity']['ok'] else 'DIFFERS'} ({max(row['parity']['errors'].values()):.1e}) |"
        )
    return "\n".join(lines) + "\n"


def markdown_parity(result: dict) -> str:
    lines = [
        "| stack | features | max rel. error: loss | grad norm | lm_head grad norm | equal |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in result["rows"].items():
        stack, features = name.rsplit(" ", 1)
        errors = row["errors"]
        lines.append(
            f"| {stack} | {features} | {errors['losses']:.1e} | {errors['norms']:.1e} | "
            f"{errors.get('head_norms', float('nan')):.1e} | {row['ok']} |"
        )
    return "\n".join(lines) + "\n"


def markdown_longest(result: dict) -> str:
    rows = result["rows"]
    lines = [
        f"Per-rank cap {result['budget_mib']} MiB (RLIMIT_DATA from after the {result.get('limit_from', 'build')}), S in steps of "
        f"{result['granularity']}.",
        "",
        "| stack | features | longest S | first failing S | / ALST |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        stack, features = name.rsplit(" ", 1)
        failure = "none tried (search capped)" if row["first_failure"] is None else f"{row['first_failure']:,}"
        longest_s = f"{row['longest']:,}" + (" or more" if row["first_failure"] is None else "")
        lines.append(f"| {stack} | {features} | {longest_s} | {failure} | {_ratio_to_alst(rows, name, 'longest')} |")
    return "\n".join(lines) + "\n"


def markdown_memory(result: dict) -> str:
    rows = result["rows"]
    lines = [
        f"S = {result['seq_len']:,}, best features, one warm-up step then one step.",
        "",
        "| stack | features | peak RSS MiB/rank | / ALST | step peak above the build, MiB | / ALST |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        stack, features = name.rsplit(" ", 1)
        lines.append(
            f"| {stack} | {features} | {row['peak_rss'] / MIB:.0f} | {_ratio_to_alst(rows, name, 'peak_rss')} | "
            f"{row['peak_above_build'] / MIB:.0f} | {_ratio_to_alst(rows, name, 'peak_above_build')} |"
        )
    return "\n".join(lines) + "\n"


def markdown_defects(result: dict) -> str:
    return "\n".join(alst_defects.markdown(name, part) for name, part in result.items())


def render(path: str) -> None:
    """Rewrite ``<part>.md`` from its ``<part>.json`` (``--render PATH``)."""
    stored = json.loads(Path(path).read_text())
    part = Path(path).stem
    write(part, stored["result"], stored["meta"], str(Path(path).parent))


RENDER = {
    "parity": markdown_parity,
    "timing": markdown_timing,
    "memory": markdown_memory,
    "longest": markdown_longest,
    "defects": markdown_defects,
}


def write(part: str, result: dict, meta: dict, out: str | None) -> None:
    prefix = os.path.join(out, part) if out else harness.results_path("alst", part)
    header = (
        f"# End to end against DeepSpeed's ALST: {part}\n\n`{meta['command']}`; {meta['job']}\n\n"
        f"Machine: {meta['machine']}; {meta['software']}; hybridsp {meta['revision']}; load (1/5/15 min) "
        f"before {meta['load_before']}, after {meta['load_after']}; {meta['seconds']:.0f} s.\n\n"
    )
    harness.write_results(prefix, header + RENDER[part](result), {"meta": meta, "result": result})


# --------------------------------------------------------------------------------------------
# main


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", *RENDER), default="all")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="steps per launch (timing: after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--budget-mib", type=int, default=1500, help="longest: per-rank cap (MiB)")
    parser.add_argument(
        "--limit-from",
        choices=("build", "imports"),
        default="build",
        help="longest: the cap counts from after the engine build (default) or after the imports",
    )
    parser.add_argument("--start", type=int, default=8192, help="longest: first S tried")
    parser.add_argument("--granularity", type=int, default=1024, help="longest: S step of the bisection")
    parser.add_argument(
        "--max-seq-len",
        type=int,
        help="longest: no attempt beyond this S (the row then reads "
        "'or more'; an attempt near the limit costs minutes of attention on a CPU)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        help="stacks whose name contains one of these "
        "(e.g. ALST U4xR1); ALST is always kept as the ratios' denominator",
    )
    parser.add_argument("--render", metavar="JSON", help="only rewrite the markdown of a stored <part>.json")
    parser.add_argument("--out", help="write <part>.{md,json} here instead of benchmarks/results/alst/")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        render(args.render)
        return 0
    only = [*args.only, "ALST"] if args.only else []
    base = alst_stacks.Run(
        seq_len=args.seq_len,
        steps=args.steps,
        stage=args.stage,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        layers=args.layers,
        vocab=args.vocab,
        limit_from=args.limit_from,
    )
    if args.granularity % (2 * args.world):
        step = 2 * args.world
        raise SystemExit(
            f"--granularity {args.granularity} must be a multiple of 2 x world = {step} (the zigzag layout's chunks); "
            f"pass --granularity {-(-args.granularity // step) * step}"
        )
    os.environ.setdefault("HYBRIDSP_TEST_PRELOAD", ",".join(PRELOAD[3:]))
    harness.warm_forkserver(PRELOAD)
    parts = list(RENDER) if args.part == "all" else [args.part]
    jobs = {
        "parity": lambda: part_parity(base, args.world, only),
        "timing": lambda: part_timing(base, args.world, args.rounds, only),
        "memory": lambda: part_memory(base, args.world, only),
        "longest": lambda: part_longest(
            base, args.world, args.budget_mib, args.start, args.granularity, only, args.max_seq_len
        ),
        "defects": lambda: part_defects(base, args.world),
    }
    failed = False
    for part in parts:
        print(f"{part} (load {harness.load()})", flush=True)
        meta = {
            "command": harness.command(MODULE, argv),
            "job": json.dumps(asdict(base)),
            "world": args.world,
            "machine": harness.machine_info(),
            "software": harness.software_info(),
            "revision": harness.revision(),
            "load_before": harness.load(),
        }
        started = time.perf_counter()
        result = jobs[part]()
        meta.update(load_after=harness.load(), seconds=time.perf_counter() - started)
        write(part, result, meta, args.out)
        failed |= part in ("parity", "timing") and not all(
            (row.get("parity") or row)["ok"] for row in result["rows"].values()
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
