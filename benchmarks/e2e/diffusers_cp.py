"""Against diffusers' own context parallelism at the same degrees, what does hybridsp's switch cost per rank?

    python -m benchmarks run e2e.diffusers_cp [--frames 16 --size 32 --text 256] [--repeats 7] [--worlds 2 4]

A random ``WanTransformer3DModel`` (4 heads of 32, 2 layers, fp32; by default 4,096 video tokens from a
16 x 32 x 32 latent and 256 text tokens) on gloo ranks of this machine, one thread each: hybridsp's
switch (``hybridsp.integrations.diffusers.apply``) and diffusers' ``ContextParallelConfig`` at
U2xR1 and U1xR2 (2 ranks) and U2xR2 (4 ranks), with one unsharded process as the baseline, all in
one process group per world, interleaved. Per method and step (``train``: forward + MSE + backward;
``sample``: one forward under no_grad): the peak of torch's allocations per rank (max over ranks, median of
``--memory-repeats``),
the bytes each rank sends (counted by wrapping torch.distributed and the functional collectives), CPU
seconds (summed over ranks) and wall seconds (slowest rank), medians of ``--repeats`` rotating rounds,
and the errors of the output and of the summed gradients against the one-process run.

diffusers' context parallelism does not run on a CPU-only torch as shipped; what is done so that it
runs (its code unchanged, the same CPU flash kernel as hybridsp's), and why: ``_diffusers_cpu``.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import harness

QUESTION = "diffusers_cp"
DEGREES = {2: [(2, 1), (1, 2)], 4: [(2, 2)]}
QUICK = {"frames": 4, "text": 64, "repeats": 3, "memory_repeats": 1}  # 1,024 video tokens


def _combine(launch: list[dict], world: int, load: tuple[str, str]) -> dict:
    """The ranks' results of one world -> per-method rows (peaks and bytes: max over ranks)."""
    first = launch[0]
    rows = {}
    for name in first["methods"]:
        row: dict = {"world": world, "errors": first["errors"].get(name, {"out": 0.0, "grad": 0.0})}
        for step in ("train", "sample"):
            key = f"{name} | {step}"
            ranks = [r["memory"][key] for r in launch if r["memory"][key] is not None]  # rank -> [peak per repeat]
            peaks = [max(per_rank[i] for per_rank in ranks) for i in range(len(ranks[0]))]  # max over ranks
            timed = harness.combine([r["times"][key] for r in launch])
            sent = [r["bytes"].get(key) for r in launch]
            row[step] = {
                "peak_mib": statistics.median(peaks) / 2**20,
                "peak_mib_repeats": [p / 2**20 for p in peaks],
                "peak_mib_by_rank": [[p / 2**20 for p in per_rank] for per_rank in ranks],
                "sent_mib": max(sum(s["bytes"].values()) for s in sent) / 2**20 if sent[0] else 0.0,
                "sent_by_kind_rank0": sent[0]["bytes"] if sent[0] else {},
                "hybridsp_counter_rank0": sent[0]["hybridsp_counter"] if sent[0] else None,
                "cpu_s": timed["median_cpu"],
                "wall_s": timed["median_wall"],
                "cpu_all": timed["cpu"],
                "wall_all": timed["wall"],
            }
        rows[name] = row
    return {"rows": rows, "load_before": load[0], "load_after": load[1]}


def _counter_agrees(rows: dict) -> bool:
    """hybridsp's own CommCounter (attention only) = the wrapped calls' bytes less the output's all-gather."""
    return all(
        sum(cell["hybridsp_counter_rank0"].values())
        == sum(v for k, v in cell["sent_by_kind_rank0"].items() if k != "all_gather")
        for name, row in rows.items()
        if name.startswith("hybridsp ")
        for cell in (row["train"], row["sample"])
    )


def _ratios(rows: dict) -> dict:
    """hybridsp / diffusers at each degree, per step and measure."""
    found = {}
    for name in rows:
        if not name.startswith("hybridsp "):
            continue
        tag = name.split()[1]
        theirs = rows[f"diffusers {tag}"]
        found[tag] = {
            f"{step}_{measure}": rows[name][step][measure] / theirs[step][measure]
            for step in ("train", "sample")
            for measure in ("peak_mib", "sent_mib", "cpu_s", "wall_s")
            if theirs[step][measure]
        }
    return found


def main(argv: list[str] | None = None) -> int:
    from benchmarks.e2e._diffusers_cp_ranks import Shape, rank_main
    from benchmarks.e2e._diffusers_cp_report import render

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=16, help="latent frames")
    parser.add_argument("--size", type=int, default=32, help="latent height and width (video tokens F x size^2 / 4)")
    parser.add_argument("--text", type=int, default=256, help="text tokens")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds (medians)")
    parser.add_argument("--memory-repeats", type=int, default=3, help="peak-memory measurements (median)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], choices=sorted(DEGREES))
    parser.add_argument("--no-native", action="store_true", help="skip diffusers' Ulysses on its native backend")
    parser.add_argument(
        "--quick", action="store_true", help="1,024 video tokens, 64 text tokens, 3 rounds, 1 memory measurement"
    )
    parser.add_argument("--out", default=harness.results_path(QUESTION, QUESTION))
    args = parser.parse_args(argv)
    if args.quick:  # smaller defaults; options given on the command line still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    shape = Shape(args.frames, args.size, args.text, args.heads, args.head_dim, args.layers)
    worlds = {}
    for world in args.worlds:
        before = harness.load()
        print(f"world {world}: {DEGREES[world]}, {shape.video_tokens} video tokens, load {before}", flush=True)
        launch = harness.launch(
            rank_main, world, shape, DEGREES[world], args.repeats, args.memory_repeats, not args.no_native, timeout=3600
        )
        worlds[world] = _combine(launch, world, (before, harness.load()))
    rows = {name: row for found in worlds.values() for name, row in found["rows"].items()}
    data = {
        "command": harness.command("benchmarks.e2e.diffusers_cp", argv),
        "args": vars(args),
        "shape": vars(shape) | {"video_tokens": shape.video_tokens},
        "revision": harness.revision(),
        "machine": harness.machine_info(),
        "software": harness.software_info("diffusers"),
        "loads": {w: (found["load_before"], found["load_after"]) for w, found in worlds.items()},
        "worlds": {w: found["rows"] for w, found in worlds.items()},
        "ratios": _ratios(rows),
        "hybridsp_counter_agrees": _counter_agrees(rows),
    }
    markdown = render(data)
    print(markdown)
    harness.write_results(args.out, markdown, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
