"""Packed batches: the zigzag and the document-balanced layout side by side, in one run.

Run:  python -m benchmarks run packed.layout [--packs 3] [--repeats 3] [--window W] [--out PREFIX]

For mixed packs (lognormal document lengths from ~16 to ~8,000 tokens, S = 16,384; the first seeds
on which zigzag's busiest ring rank does >= 1.4x the mean work at that ring degree, the balanced
layout's target packs), at U1 x R4 and U2 x R2 on 4 gloo ranks, for each layout:

* **plan work max/mean**: score cells each ring rank computes (``BlockPlan.work``), busiest over the mean;
  **total work** over ranks, as a ratio to zigzag's;
* **bytes**: what the busiest rank sends per forward + backward (``comm_volume.hybrid_bytes`` with the
  call's plan, which the byte counter tests equal), as a ratio to zigzag's;
* **measured**: each rank's process CPU time of one forward + backward of ``hybrid_attn_func`` (fp32,
  by default H = 8, Hkv = 2, D = 128: Llama-style GQA 4:1 and head dim, enough work per kernel call
  that the CPU kernel's per-call costs do not hide the imbalance; ``--heads/--kv-heads/--head-dim``;
  the torch CPU kernel), median over repeats, layouts interleaved. The
  busiest rank's time is what a step costs with one device per rank (every ring step waits for
  it); max/mean is the measured balance. CPU time, not wall time: on a shared 2-core machine four
  ranks' wall clocks measure the scheduler, their CPU times measure the work.

``--window W``: a sliding window on every call; three variants then: zigzag, ``balanced`` placed
as if there were no window (what the layout did before it knew the window) and ``balanced W``
(``init_mesh(layout="balanced", sliding_window=W)``), on the first packs where the window-blind
balanced plan is >= 1.1x the mean. Writes benchmarks/results/packed/packed_layout.md and .json
(``--window``: packed_layout_w<W>).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.common.harness import launch, load, machine_info, results_path, revision, write_results

SEQ, HEADS, KV_HEADS, HEAD_DIM = 16384, 8, 2, 128
MESHES = ((1, 4), (2, 2))
LAYOUTS = ("zigzag", "balanced")


def variants(window) -> dict:
    """{name: (layout name, placement window)} compared, with the call's window ``window``."""
    out = {name: (name, None) for name in LAYOUTS}
    if window is not None:
        out[f"balanced W{window}"] = ("balanced", window)
    return out


def lognormal_pack(seed: int, seq: int = SEQ) -> tuple[int, ...]:
    """Document boundaries of one row: lognormal lengths clipped to [16, 8000], the last one cut at ``seq``."""
    rng = random.Random(seed)
    bounds = [0]
    while bounds[-1] < seq:
        length = int(min(8000, max(16, rng.lognormvariate(6.0, 1.3))))
        bounds.append(min(seq, bounds[-1] + length))
    return tuple(bounds)


def skewed_packs(ring: int, count: int, threshold: float = 1.4, window=None) -> list[tuple[int, ...]]:
    """The first ``count`` seeded packs on which zigzag's plan imbalance at ``ring`` is >= ``threshold``
    (with ``window``: the window-blind balanced layout's, >= 1.1)."""
    from hybridsp.layout._block_plan import build_plan

    layout, threshold = ("zigzag", threshold) if window is None else ("balanced", 1.1)
    found, seed = [], 0
    while len(found) < count:
        bounds = lognormal_pack(seed)
        plan = build_plan(SEQ, ring, layout, causal=True, docs=(bounds,), window=window, batch=1)
        work = [plan.work(r) for r in range(ring)]
        if max(work) * ring / sum(work) >= threshold:
            found.append(bounds)
        seed += 1
    return found


def plan_metrics(bounds, ulysses: int, ring: int, shape=(HEADS, KV_HEADS, HEAD_DIM), window=None) -> dict:
    """Plan-level work and bytes of each variant on one pack (no processes)."""
    from hybridsp.attention._volume import hybrid_bytes
    from hybridsp.layout._block_plan import build_plan
    from hybridsp.layout._layouts import get_layout

    out = {}
    for layout, (name, placed) in variants(window).items():
        plan = build_plan(SEQ, ring, get_layout(name, placed), causal=True, docs=(bounds,), window=window, batch=1)
        work = [plan.work(r) for r in range(ring)]
        sent = [
            sum(
                hybrid_bytes(
                    batch=1,
                    seq_len=SEQ,
                    heads=shape[0],
                    kv_heads=shape[1],
                    head_dim=shape[2],
                    ulysses=ulysses,
                    ring=ring,
                    ring_rank=r,
                    element_size=4,
                    plan=plan,
                ).values()
            )
            for r in range(ring)
        ]
        out[layout] = {
            "work_max_over_mean": max(work) * ring / sum(work),
            "total_work": sum(work),
            "max_bytes": max(sent),
        }
    return out


def _measure(rank, world, ulysses, ring, packs, repeats, shape=(HEADS, KV_HEADS, HEAD_DIM), window=None):
    """Per variant and pack: this rank's CPU seconds of one forward + backward, each repeat.
    ``shape``: (heads, K/V heads, head dim) of the whole model (before the Ulysses split)."""
    from hybridsp import hybrid_attn_func, init_mesh, shard_sequence

    heads, kv_heads, head_dim = shape
    meshes = {
        layout: init_mesh(ulysses=ulysses, ring=ring, layout=name, sliding_window=placed)
        for layout, (name, placed) in variants(window).items()
    }
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, SEQ, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads, heads)]
    names = tuple(meshes)
    times = {layout: [[] for _ in packs] for layout in names}
    for repeat in range(repeats):
        order = names if repeat % 2 == 0 else names[::-1]  # interleaved
        for index, bounds in enumerate(packs):
            for layout in order:
                mesh, cu = meshes[layout], torch.tensor(bounds)
                q, k, v = (shard_sequence(t, mesh, cu_seqlens=cu).clone().requires_grad_() for t in full[:3])
                dout = shard_sequence(full[3], mesh, cu_seqlens=cu)
                torch.distributed.barrier()
                start = time.process_time()
                hybrid_attn_func(q, k, v, mesh=mesh, cu_seqlens=cu, sliding_window=window, backend="torch").backward(
                    dout
                )
                times[layout][index].append(time.process_time() - start)
    return times


def summarise(per_rank: list[dict], packs) -> dict:
    """Medians over repeats; per variant and pack: busiest rank, max/mean, total over ranks."""
    out = {}
    for layout in per_rank[0]:
        rows = []
        for index in range(len(packs)):
            medians = [statistics.median(times[layout][index]) for times in per_rank]
            rows.append(
                {
                    "busiest_s": max(medians),
                    "max_over_mean": max(medians) * len(medians) / sum(medians),
                    "total_s": sum(medians),
                }
            )
        out[layout] = rows
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--packs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument(
        "--out",
        default=results_path("packed", "packed_layout"),
        help="output prefix (default benchmarks/results/packed/packed_layout)",
    )
    parser.add_argument("--window", type=int, default=None, help="sliding window of every call (see the docstring)")
    args = parser.parse_args(argv)
    shape = (args.heads, args.kv_heads, args.head_dim)
    if args.window is not None:
        return windowed(args, shape)
    rows, before = [], load()
    for ulysses, ring in MESHES:
        packs = skewed_packs(ring, args.packs)
        plans = [plan_metrics(bounds, ulysses, ring, shape) for bounds in packs]
        measured = summarise(launch(_measure, 4, ulysses, ring, packs, args.repeats, shape, timeout=3600), packs)
        for index, bounds in enumerate(packs):
            zig, bal = plans[index]["zigzag"], plans[index]["balanced"]
            mz, mb = measured["zigzag"][index], measured["balanced"][index]
            rows.append(
                {
                    "mesh": f"U{ulysses}xR{ring}",
                    "pack": index,
                    "documents": len(bounds) - 1,
                    "work_max_over_mean": {"zigzag": zig["work_max_over_mean"], "balanced": bal["work_max_over_mean"]},
                    "total_work_ratio": bal["total_work"] / zig["total_work"],
                    "bytes_ratio": bal["max_bytes"] / zig["max_bytes"],
                    "measured_max_over_mean": {"zigzag": mz["max_over_mean"], "balanced": mb["max_over_mean"]},
                    "busiest_speedup": mz["busiest_s"] / mb["busiest_s"],
                    "total_time_ratio": mb["total_s"] / mz["total_s"],
                    "busiest_s": {"zigzag": mz["busiest_s"], "balanced": mb["busiest_s"]},
                }
            )
    lines = [
        "# Packed batches: zigzag vs balanced layout",
        "",
        f"{machine_info()}; load {before} -> {load()}; revision {revision()}",
        "",
        f"S = {SEQ}, H = {args.heads}, Hkv = {args.kv_heads}, D = {args.head_dim}, fp32, 4 gloo ranks, lognormal packs "
        f"(16..8,000 tokens), medians of {args.repeats} interleaved repeats of one forward + backward "
        "(each rank's CPU time).",
        "",
        "| mesh | pack | docs | plan work max/mean zigzag -> balanced | total work bal/zig | bytes (busiest) bal/zig "
        "| measured max/mean zigzag -> balanced | busiest rank zigzag/balanced | total CPU bal/zig |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mesh']} | {r['pack']} | {r['documents']} | {r['work_max_over_mean']['zigzag']:.3f} -> "
            f"{r['work_max_over_mean']['balanced']:.3f} | {r['total_work_ratio']:.3f} | {r['bytes_ratio']:.3f} | "
            f"{r['measured_max_over_mean']['zigzag']:.3f} -> {r['measured_max_over_mean']['balanced']:.3f} | "
            f"{r['busiest_speedup']:.2f}x | {r['total_time_ratio']:.3f} |"
        )
    write_results(args.out, "\n".join(lines) + "\n", {"rows": rows, "args": vars(args)})
    print("\n".join(lines))
    return {"rows": rows}


def windowed(args, shape) -> dict:
    """``--window``: plan and measured busiest-rank ratios of every variant (:func:`variants`)."""
    window, rows, before = args.window, [], load()
    for ulysses, ring in MESHES:
        packs = skewed_packs(ring, args.packs, window=window)
        plans = [plan_metrics(bounds, ulysses, ring, shape, window) for bounds in packs]
        measured = summarise(
            launch(_measure, 4, ulysses, ring, packs, args.repeats, shape, window, timeout=3600), packs
        )
        for index, bounds in enumerate(packs):
            rows.append(
                {
                    "mesh": f"U{ulysses}xR{ring}",
                    "pack": index,
                    "documents": len(bounds) - 1,
                    "plan": {v: plans[index][v]["work_max_over_mean"] for v in measured},
                    "measured": {v: measured[v][index]["max_over_mean"] for v in measured},
                    "busiest_s": {v: measured[v][index]["busiest_s"] for v in measured},
                }
            )
    names = list(variants(window))
    lines = [
        f"# Packed batches with sliding_window={window}: zigzag, window-blind balanced, balanced for the window",
        "",
        f"{machine_info()}; load {before} -> {load()}; revision {revision()}",
        "",
        f"S = {SEQ}, W = {window}, H = {args.heads}, Hkv = {args.kv_heads}, D = {args.head_dim}, fp32, 4 gloo "
        f"ranks, the first lognormal packs on which the window-blind balanced plan is >= 1.1x the mean, medians "
        f"of {args.repeats} interleaved repeats of one forward + backward (each rank's CPU time).",
        "",
        "| mesh | pack | docs | "
        + " | ".join(f"plan max/mean {n}" for n in names)
        + " | "
        + " | ".join(f"measured max/mean {n}" for n in names)
        + " | busiest s "
        + " / ".join(names)
        + " |",
        "|---|---|---|" + "---|" * (2 * len(names) + 1),
    ]
    for r in rows:
        lines.append(
            f"| {r['mesh']} | {r['pack']} | {r['documents']} | "
            + " | ".join(f"{r['plan'][n]:.3f}" for n in names)
            + " | "
            + " | ".join(f"{r['measured'][n]:.3f}" for n in names)
            + " | "
            + " / ".join(f"{r['busiest_s'][n]:.2f}" for n in names)
            + " |"
        )
    out = (
        args.out
        if args.out != results_path("packed", "packed_layout")
        else results_path("packed", f"packed_layout_w{window}")
    )
    write_results(out, "\n".join(lines) + "\n", {"rows": rows, "args": vars(args)})
    print("\n".join(lines))
    return {"rows": rows}


if __name__ == "__main__":
    main()
