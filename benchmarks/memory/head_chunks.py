"""Head-chunked attention (``head_chunks=G``): memory per rank of one attention layer and of a training step.

    python -m benchmarks run memory.head_chunks                         # every part (tens of minutes on 2 cores)
    python -m benchmarks run memory.head_chunks --part layer --seq 8192 --chunks 1 2 4 8
    python -m benchmarks run memory.head_chunks --part step --seq-len 16384 --kv-heads 8
    python -m benchmarks run memory.head_chunks --part longest --budget-mib 64 --kv-heads 8

Parts (each writes ``results/head_chunks/<part>.{md,json}``, or under ``--out``):

- ``layer``: one ``hybrid_attn_func`` forward + backward (causal, fp32, torch kernel) on ``--world`` gloo
  ranks at each mesh of ``--meshes`` (U x R) and each G of ``--chunks``, all in one launch per mesh: per
  rank the peak of torch's own allocations inside the call (profiler memory events,
  ``harness.Allocations``: the inputs and dout that exist before are not counted; the analogue of
  ``torch.cuda.max_memory_allocated`` minus the memory before), max over ranks; the wall seconds of
  the call (max over ranks, median of ``--repeats`` rounds with the G order rotated, timed without
  the profiler); every G's out and gradients against G = 1's (max relative error).
- ``step``: the ALST comparison's job (:mod:`benchmarks.common.alst_stacks`, best features: checkpointing,
  fused loss, tiled MLP, lean norms, activation offload) at one S, ALST against hybridsp at ``--mesh``
  with each G of ``--step-chunks`` (the ``"hybridsp"`` config section's ``head_chunks``; ``8+split``: G = 8
  with ``apply_split_checkpointing``): per rank the
  peak RSS (VmHWM), the step's own peak above the built engine, CPU and wall seconds per step (after a
  warm-up step), medians over ``--rounds`` launches with the order rotated.
- ``longest``: the longest S (a multiple of ``--granularity``) one step of that job fits under a
  per-rank cap of ``--budget-mib`` (alst._search's ``longest`` over alst.compare's ``fits``: RLIMIT_DATA from after the engine
  build, tensors >= 256 KiB mmapped, doubling from ``--start`` then bisection, no attempt above
  ``--max-seq-len``), for ALST and hybridsp at each G of ``--step-chunks``; ``--walk-from ALST=36864
  G8=57344`` walks from a known neighbourhood instead (alst._search's ``walk``: ``--granularity`` steps
  up while a step fits, down while it fails).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace

import torch

from benchmarks.alst import _search, compare
from benchmarks.common import alst_stacks, harness

MODULE = "benchmarks.memory.head_chunks"
SUFFIXES = {  # a --step-chunks value is G and any of these, in this order (8+split+rope+disk)
    "split": "split checkpointing (apply_split_checkpointing)",
    "rope": "lean RoPE (apply_lean_rope)",
    "disk": "the activation offload's disk tier (spill_dir: a temporary directory of the launcher's)",
}
MIB = 2**20
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")  # +disk refuses these: the files would stay in memory


# --------------------------------------------------------------------------------------------
# layer


def layer_rank(rank, world, ulysses, ring, seq, heads, kv_heads, head_dim, chunks, repeats):
    """Per G: this rank's allocation peak of one fwd + bwd, its wall seconds per round, errors vs G = 1."""
    import torch.distributed as dist

    from hybridsp import hybrid_attn_func, init_mesh, shard_sequence

    mesh = init_mesh(ulysses=ulysses, ring=ring)
    gen = torch.Generator().manual_seed(0)
    shapes = {"q": heads, "k": kv_heads, "v": kv_heads, "dout": heads}
    full = {name: torch.randn(1, seq, h, head_dim, generator=gen) for name, h in shapes.items()}
    local = {name: shard_sequence(t, mesh).contiguous() for name, t in full.items()}
    del full
    q, k, v = (local[n].requires_grad_() for n in ("q", "k", "v"))

    def call(g):
        q.grad = k.grad = v.grad = None
        out = hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend="torch", head_chunks=g)
        out.backward(local["dout"])
        return out.detach(), q.grad, k.grad, v.grad

    results = {g: call(g) for g in chunks}  # warm-up and the results
    errors = {
        g: max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(results[g], results[chunks[0]]))
        for g in chunks
    }
    del results
    peaks, times = {}, {g: [] for g in chunks}
    for g in chunks:
        dist.barrier()
        with harness.Allocations() as allocations:
            call(g)
        peaks[g] = allocations.peak
        q.grad = k.grad = v.grad = None
    for i in range(repeats):
        for g in chunks[i % len(chunks) :] + chunks[: i % len(chunks)]:
            dist.barrier()
            started = time.perf_counter()
            call(g)
            times[g].append(time.perf_counter() - started)
    q_bytes = local["q"].numel() * local["q"].element_size()
    return {"peaks": peaks, "times": times, "errors": errors, "q_bytes": q_bytes}


def part_layer(args) -> dict:
    rows = []
    for mesh in args.meshes:
        u, r = map(int, mesh.split("x"))
        chunks = [g for g in args.chunks if (args.kv_heads // u) % g == 0]
        ranks = harness.launch(
            layer_rank,
            u * r,
            u,
            r,
            args.seq,
            args.heads,
            args.kv_heads,
            args.head_dim,
            chunks,
            args.repeats,
            timeout=3600,
        )
        for g in chunks:
            peak = max(rank["peaks"][g] for rank in ranks)
            wall = statistics.median(max(rank["times"][g][i] for rank in ranks) for i in range(args.repeats))
            rows.append(
                {
                    "mesh": mesh,
                    "chunks": g,
                    "peak": peak,
                    "wall": wall,
                    "error": max(rank["errors"][g] for rank in ranks),
                    "q_mib": ranks[0]["q_bytes"] / MIB,
                }
            )
        print(json.dumps(rows[-len(chunks) :]), flush=True)
    return {"rows": rows, "seq": args.seq, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}


def markdown_layer(result: dict) -> str:
    lines = [
        f"S = {result['seq']:,}, H = {result['heads']}, Hkv = {result['kv_heads']}, D = {result['head_dim']}, B = 1, "
        "fp32, causal, torch kernel; one forward + backward.",
        "",
        "| mesh | G | q MiB/rank | peak MiB/rank | / G=1 | wall s | / G=1 | max rel. diff vs G=1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {}
    for row in result["rows"]:
        base.setdefault(row["mesh"], row)
        first = base[row["mesh"]]
        lines.append(
            f"| U{row['mesh'].replace('x', 'xR')} | {row['chunks']} | {row['q_mib']:.1f} | {row['peak'] / MIB:.1f} | "
            f"{row['peak'] / first['peak']:.3f} | {row['wall']:.2f} | {row['wall'] / first['wall']:.3f} | "
            f"{row['error']:.1e} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# a training step


def step_runs(args, base: alst_stacks.Run, spill_dir: str | None = None) -> dict[str, alst_stacks.Run]:
    """ALST and hybridsp at each --step-chunks setting; ``spill_dir``: where ``+disk`` writes."""
    u, r = map(int, args.mesh.split("x"))
    runs = {"ALST": replace(base, stack="alst", ulysses=u * r, ring=1, features="best")}
    for setting in args.step_chunks:
        g, *suffixes = setting.split("+")
        unknown = [s for s in suffixes if s not in SUFFIXES]
        if unknown:
            raise ValueError(f"--step-chunks {setting!r}: unknown suffix {unknown}; choose from {list(SUFFIXES)}")
        if "disk" in suffixes and harness.filesystem_of(spill_dir or "/") in MEMORY_FILESYSTEMS:
            raise ValueError(
                f"+disk: {spill_dir} is on {harness.filesystem_of(spill_dir or '/')}, which keeps the files in memory; "
                "set TMPDIR to a directory on a disk"
            )
        runs[f"hybridsp G{setting}"] = replace(
            base,
            stack="hybridsp",
            ulysses=u,
            ring=r,
            features="best",
            head_chunks=g if g == "auto" else int(g),
            split="split" in suffixes,
            rope="rope" in suffixes,
            spill_dir=spill_dir if "disk" in suffixes else None,
        )
    return runs


def part_step(args, base: alst_stacks.Run) -> dict:
    with tempfile.TemporaryDirectory(prefix="hybridsp_spill_") as spill_dir:
        return _step_rows(args, base, spill_dir)


def _step_rows(args, base: alst_stacks.Run, spill_dir: str) -> dict:
    runs = step_runs(args, replace(base, steps=base.steps + 1, budget=compare.UNCAPPED), spill_dir)
    names = list(runs)
    samples = {name: {"cpu": [], "wall": [], "peak_rss": [], "peak_above_build": []} for name in names}
    losses = {}
    for i in range(args.rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            traces = compare.launch(runs[name])
            measured = compare._measure(traces)
            samples[name]["cpu"].extend(measured["cpu"])
            samples[name]["wall"].extend(measured["wall"])
            samples[name]["peak_rss"].append(measured["peak_rss"])
            samples[name]["peak_above_build"].append(max(t["peak_rss"] - t["built_rss"] for t in traces))
            losses[name] = traces[0]["losses"]
            print(f"    {name}: {json.dumps({k: v[-1] for k, v in samples[name].items()})}", flush=True)
    rows = {name: {key: statistics.median(values) for key, values in samples[name].items()} for name in names}
    spill_fs = f"{os.path.dirname(spill_dir)} ({harness.filesystem_of(spill_dir)})"
    return {
        "rows": rows,
        "samples": samples,
        "losses": losses,
        "seq_len": base.seq_len,
        "mesh": args.mesh,
        "spill_fs": spill_fs,
    }


def markdown_step(result: dict) -> str:
    rows = result["rows"]
    alst, g1 = rows["ALST"], rows.get("hybridsp G1")
    lines = [
        f"S = {result['seq_len']:,}, best features, hybridsp at U{result['mesh'].replace('x', 'xR')}; medians.",
        "",
        "| stack | peak RSS MiB/rank | / ALST | step peak above the build, MiB | / ALST | CPU s/step | wall s/step | "
        "wall / G=1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        ratio = f"{row['wall'] / g1['wall']:.3f}" if g1 and name != "ALST" else "-"
        lines.append(
            f"| {name} | {row['peak_rss'] / MIB:.0f} | {row['peak_rss'] / alst['peak_rss']:.3f} | "
            f"{row['peak_above_build'] / MIB:.0f} | {row['peak_above_build'] / alst['peak_above_build']:.3f} | "
            f"{row['cpu']:.2f} | {row['wall']:.2f} | {ratio} |"
        )
    if any("+disk" in name for name in rows):
        lines += ["", f"+disk: the offloaded inputs in unlinked files under {result['spill_fs']}."]
    names = list(result["losses"])
    same = all(result["losses"][n] == result["losses"][names[1]] for n in names[1:]) if len(names) > 1 else True
    lines += ["", f"hybridsp losses identical across G: {same}."]
    return "\n".join(lines) + "\n"


def part_longest(args, base: alst_stacks.Run) -> dict:
    with tempfile.TemporaryDirectory(prefix="hybridsp_spill_") as spill_dir:
        return _longest_rows(args, base, spill_dir)


def _longest_rows(args, base: alst_stacks.Run, spill_dir: str) -> dict:
    rows = {}
    guesses = dict(pair.split("=") for pair in args.walk_from)

    def log(line: str) -> None:
        print(line, flush=True)

    for name, run in step_runs(args, base, spill_dir).items():
        key = name.removeprefix("hybridsp ")
        if key in guesses:  # a step-wise walk from a known neighbourhood
            rows[name] = _search.walk(
                run, args.budget_mib * MIB, int(guesses[key]), args.granularity, log, compare.fits
            )
        else:
            rows[name] = _search.longest(
                run, args.budget_mib * MIB, args.start, args.granularity, log, compare.fits, args.max_seq_len
            )
    return {"rows": rows, "budget_mib": args.budget_mib, "granularity": args.granularity, "mesh": args.mesh}


def markdown_longest(result: dict) -> str:
    rows = result["rows"]
    alst, g1 = rows["ALST"]["longest"], rows.get("hybridsp G1", {}).get("longest")
    lines = [
        f"Per-rank cap {result['budget_mib']} MiB (RLIMIT_DATA from after the engine build), S in steps of "
        f"{result['granularity']:,}; hybridsp at U{result['mesh'].replace('x', 'xR')}, best features on both.",
        "",
        "| stack | longest S | first failing S | / ALST | / G=1 |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        failure = "none tried (search capped)" if row["first_failure"] is None else f"{row['first_failure']:,}"
        more = " or more" if row["first_failure"] is None else ""
        ratio = f"{row['longest'] / g1:.3f}" if g1 and name != "ALST" else "-"
        lines.append(f"| {name} | {row['longest']:,}{more} | {failure} | {row['longest'] / alst:.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# main


PARTS = {"layer": markdown_layer, "step": markdown_step, "longest": markdown_longest}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", *PARTS), default="all")
    parser.add_argument("--quick", action="store_true", help="small sizes: layer at S = 2,048, step at S = 2,048")
    parser.add_argument("--meshes", nargs="+", default=["2x2", "1x4"], help="layer: U x R meshes")
    parser.add_argument("--seq", type=int, default=8192, help="layer: S")
    parser.add_argument("--heads", type=int, default=16, help="layer: query heads")
    parser.add_argument("--layer-kv-heads", dest="layer_kv_heads", type=int, default=16, help="layer: K/V heads")
    parser.add_argument("--head-dim", type=int, default=64, help="layer: head dim")
    parser.add_argument("--chunks", nargs="+", type=int, default=[1, 2, 4, 8], help="layer: G values")
    parser.add_argument("--repeats", type=int, default=3, help="layer: timed rounds")
    parser.add_argument("--mesh", default="1x4", help="step / longest: hybridsp's U x R")
    parser.add_argument(
        "--step-chunks",
        nargs="+",
        default=["1", "2", "4", "8"],
        help="step / longest: G values (G+split: with split checkpointing; G+split+rope: and lean RoPE; "
        "G+split+rope+disk: and the offload's disk tier)",
    )
    parser.add_argument("--seq-len", type=int, default=16384, help="step: S")
    parser.add_argument("--kv-heads", type=int, default=8, help="step / longest: the job's K/V heads")
    parser.add_argument("--layers", type=int, default=4, help="step / longest: the job's layers")
    parser.add_argument("--rounds", type=int, default=1, help="step: launches per stack")
    parser.add_argument("--budget-mib", type=int, default=200, help="longest: per-rank cap")
    parser.add_argument("--start", type=int, default=16384, help="longest: first S tried")
    parser.add_argument("--granularity", type=int, default=4096, help="longest: S step of the bisection")
    parser.add_argument(
        "--walk-from",
        nargs="*",
        default=[],
        metavar="STACK=S",
        help="longest: walk in --granularity steps from S for these stacks (ALST, G1, G8, ...) instead of "
        "doubling and bisecting from --start",
    )
    parser.add_argument("--max-seq-len", type=int, default=None, help="longest: no attempt beyond this S")
    parser.add_argument("--out", help="write <part>.{md,json} here instead of benchmarks/results/head_chunks/")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.seq_len, args.repeats, args.meshes = 2048, 2048, 1, ["2x2"]
        args.step_chunks = ["1", "4"]
    return args


def write(part: str, result: dict, meta: dict, out: str | None) -> None:
    prefix = f"{out}/{part}" if out else harness.results_path("head_chunks", part)
    header = (
        f"# Head-chunked attention: {part}\n\n`{meta['command']}`\n\nMachine: {meta['machine']}; {meta['software']}; "
        f"hybridsp {meta['revision']}; load (1/5/15 min) before {meta['load_before']}, after {meta['load_after']}; "
        f"{meta['seconds']:.0f} s.\n\n"
    )
    harness.write_results(prefix, header + PARTS[part](result), {"meta": meta, "result": result})


def main(argv=None) -> int:
    args = parse_args(argv)
    base = alst_stacks.Run(seq_len=args.seq_len, steps=1, kv_heads=args.kv_heads, layers=args.layers)
    harness.warm_forkserver(compare.PRELOAD)
    jobs = {
        "layer": lambda: part_layer(replace_kv(args)),
        "step": lambda: part_step(args, base),
        "longest": lambda: part_longest(args, base),
    }
    for part in list(PARTS) if args.part == "all" else [args.part]:
        meta = {
            "command": harness.command(MODULE, argv),
            "job": json.dumps(asdict(base)),
            "machine": harness.machine_info(),
            "software": harness.software_info(),
            "revision": harness.revision(),
            "load_before": harness.load(),
        }
        started = time.perf_counter()
        result = jobs[part]()
        meta.update(load_after=harness.load(), seconds=time.perf_counter() - started)
        write(part, result, meta, args.out)
    return 0


def replace_kv(args) -> argparse.Namespace:
    """The layer part's namespace: its own K/V heads."""
    return argparse.Namespace(**{**vars(args), "kv_heads": args.layer_kv_heads})


if __name__ == "__main__":
    sys.exit(main())
