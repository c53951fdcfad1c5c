"""What is live at the per-rank peak of one training step of the ALST comparison's job, and who allocated it.

    python -m benchmarks.memory.step_peak [--seq-len 8192] [--mesh 1x4] [--chunks 8] [--kv-heads 8] [--stack hybridsp]

One :mod:`benchmarks.common.alst_stacks` run (best features) on U x R gloo ranks, as alst.compare's ranks
run it (tensors >= 256 KiB mmapped, activation offload into ``/dev/shm``). After a warm-up step, rank 0
profiles one step (forward, backward, optimizer) with torch's profiler (``profile_memory``, ``with_stack``)
and replays its CPU allocation events: the peak of torch's live bytes, and every allocation made in the
step and still live at that moment, grouped by where it was made (forward or backward, the innermost
Python frame of the model / hybridsp / DeepSpeed / benchmark code, the aten op). Sizes in units of one
``[S_local, h]`` fp32 tensor ("vectors"). Also VmData / VmRSS at the step's edges (/proc/self/status).

Writes ``results/memory/step_peak.{md,json}`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import asdict, replace

from benchmarks.alst import compare
from benchmarks.common import alst_stacks, harness

MIB = 2**20
FRAMES = ("modeling_llama", "hybridsp/", "deepspeed/", "benchmarks/", "torch/utils/checkpoint")


def _walk(events):
    for event in events:
        yield event
        yield from _walk(event.children)


def _site(event) -> tuple[str, str, str]:
    """(phase, innermost project frame, aten op) of one allocation event."""
    from torch._C._profiler import _EventType

    op, frame, phase, recompute = "", "", "forward", False
    parent = event.parent
    while parent is not None:
        kind, name = parent.typed[0], parent.name
        if kind == _EventType.TorchOp and not op and name.startswith("aten::") and "empty" not in name:
            op = name
        if kind == _EventType.TorchOp and name.startswith("autograd::engine::evaluate_function"):
            phase = "backward"
        if kind == _EventType.PyCall:
            if not frame and any(tag in name for tag in FRAMES) and "checkpoint.py" not in name:
                frame = name.split("site-packages/")[-1].split("/work/wt/audit/")[-1]
            if "checkpoint.py" in name and "unpack" in name:
                recompute = True
        parent = parent.parent
    if recompute:
        phase = "recompute"
    return phase, frame, op or "?"


def _chain(event) -> list[str]:
    """The names of an event's parents, innermost first (Python frames and torch ops)."""
    names, parent = [], event.parent
    while parent is not None:
        names.append(parent.name.split("site-packages/")[-1][:120])
        parent = parent.parent
    return names


def analyse(profiler, vector: int) -> dict:
    """The peaks of torch's CPU bytes in the profiled block and what is live then, grouped by site: the
    peak of every byte, and the peak of the bytes the per-rank cap counts (host copies made by
    ``shared_host_tensor`` in ``/dev/shm`` are outside ``RLIMIT_DATA``)."""
    from torch._C._profiler import _EventType

    tree = profiler.profiler.kineto_results.experimental_event_tree()
    allocs = sorted(
        (e for e in _walk(tree) if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu"),
        key=lambda e: e.start_time_ns,
    )
    start = allocs[0].typed[1].total_allocated - allocs[0].typed[1].alloc_size
    capped = _capped_totals(allocs)
    peak_at = max(range(len(allocs)), key=lambda i: allocs[i].typed[1].total_allocated)
    capped_at = max(range(len(allocs)), key=lambda i: capped[i])
    peak = allocs[peak_at].typed[1].total_allocated
    return {
        "start": start,
        "peak": peak,
        "above": peak - start,
        "at_peak": _site(allocs[peak_at]),
        "rows": _live_rows(allocs[: peak_at + 1], vector),
        "capped_above": capped[capped_at] - start,
        "at_capped_peak": _site(allocs[capped_at]),
        "capped_rows": _live_rows(allocs[: capped_at + 1], vector),
    }


def _capped_totals(allocs) -> list[int]:
    """torch's live CPU bytes after each event, less the live host copies (``aten::from_file``)."""
    host: dict[int, int] = {}
    host_bytes, totals = 0, []
    for event in allocs:
        fields = event.typed[1]
        if fields.alloc_size > 0 and _site(event)[2] == "aten::from_file":
            host[fields.ptr] = fields.alloc_size
            host_bytes += fields.alloc_size
        elif fields.alloc_size < 0:
            host_bytes -= host.pop(fields.ptr, 0)
        totals.append(fields.total_allocated - host_bytes)
    return totals


def _live_rows(allocs, vector: int) -> list[dict]:
    """The allocations among ``allocs`` not freed by its end, grouped by site, largest first."""
    live: dict[int, object] = {}
    for event in allocs:
        fields = event.typed[1]
        if fields.alloc_size > 0:
            live[fields.ptr] = event
        else:
            live.pop(fields.ptr, None)
    groups: dict[tuple, list] = defaultdict(lambda: [0, 0, [], []])
    for event in live.values():
        size = event.typed[1].alloc_size  # type: ignore[attr-defined]
        if size < 4096:
            continue
        group = groups[_site(event)]
        group[0] += size
        group[1] += 1
        group[2].append(size)
        if not group[3]:
            group[3] = _chain(event)
    rows = sorted(
        (
            {"phase": k[0], "frame": k[1], "op": k[2], "bytes": b, "count": n, "sizes": z, "chain": c}
            for k, (b, n, z, c) in groups.items()
        ),
        key=lambda r: -r["bytes"],
    )
    for row in rows:
        row["vectors"] = row["bytes"] / vector
    return rows


def rank_main(rank: int, world: int, run: alst_stacks.Run, out_rank: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    harness.tensors_via_mmap(256 * 1024)
    run.check(world)
    engine, step = alst_stacks.BUILDERS[run.stack](run, harness.shared_host_tensor)
    built = harness.memory_status()
    loss = step(0)
    engine.step()
    del loss
    before = harness.memory_status()
    harness.reset_peak()
    vector = run.seq_len // run.context * run.hidden * 4
    if rank == out_rank:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as profiler:
            loss = step(1)
            engine.step()
        result = analyse(profiler, vector)
        del profiler
    else:
        loss = step(1)
        engine.step()
        result = {}
    end = harness.memory_status()
    result.update(
        vector=vector,
        loss=float(loss.detach()),
        built=built,
        before=before,
        hwm_above_before=end["VmHWM"] - before["VmRSS"],
        data_growth_since_build=end["VmData"] - built["VmData"],
        torch_version=torch.__version__,
    )
    return result


def markdown(result: dict, run: alst_stacks.Run) -> str:
    vector = result["vector"]
    lines = [
        f"{run.name}, S = {run.seq_len:,}, kv_heads {run.kv_heads}, {run.layers} layers; rank 0; one vector = "
        f"[S_local, h] fp32 = {vector / MIB:.2f} MiB.",
        "",
        f"- torch CPU bytes at the step's start {result['start'] / MIB:.1f} MiB, peak {result['peak'] / MIB:.1f} MiB: "
        f"**{result['above'] / MIB:.1f} MiB = {result['above'] / vector:.2f} vectors above the step's start**",
        f"- without the host copies in /dev/shm (what the per-rank cap counts): **{result['capped_above'] / MIB:.1f} "
        f"MiB = {result['capped_above'] / vector:.2f} vectors**, at {result['at_capped_peak']}",
        f"- VmHWM during the step minus VmRSS before it: {result['hwm_above_before'] / MIB:.1f} MiB "
        f"({result['hwm_above_before'] / vector:.2f} vectors)",
        f"- at the peak: {result['at_peak']}",
        "",
        *_table(result["rows"]),
        "",
        "What is live at the capped peak:",
        "",
        *_table(result["capped_rows"]),
    ]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict]) -> list[str]:
    lines = ["| phase | made by (innermost frame) | op | count | MiB | vectors |", "|---|---|---|---|---|---|"]
    for row in rows:
        if row["vectors"] >= 0.05:
            lines.append(
                f"| {row['phase']} | {row['frame']} | {row['op']} | {row['count']} | {row['bytes'] / MIB:.1f} | "
                f"{row['vectors']:.2f} |"
            )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--mesh", default="1x4")
    parser.add_argument("--chunks", default="8")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--stack", default="hybridsp", choices=("hybridsp", "alst"))
    parser.add_argument("--split", action="store_true", help="hybridsp: split checkpointing (attention, MLP halves)")
    parser.add_argument("--rope", action="store_true", help="hybridsp: lean RoPE (apply_lean_rope)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    u, r = map(int, args.mesh.split("x"))
    if args.stack == "alst":
        u, r = u * r, 1
    chunks = args.chunks if args.chunks == "auto" else int(args.chunks)
    run = replace(
        alst_stacks.Run(seq_len=args.seq_len, kv_heads=args.kv_heads),
        stack=args.stack,
        ulysses=u,
        ring=r,
        features="best",
        head_chunks=chunks,
        split=args.split,
        rope=args.rope,
        steps=2,
    )
    harness.warm_forkserver(compare.PRELOAD)
    ranks = harness.launch(rank_main, u * r, run, 0, timeout=3600)
    result = {**ranks[0], "run": asdict(run), "other_ranks": [{"hwm": t["hwm_above_before"]} for t in ranks[1:]]}
    text = f"# Step peak: what is live\n\n`{harness.command('benchmarks.memory.step_peak', argv)}`\n\n"
    text += markdown(ranks[0], run)
    harness.write_results(args.out or harness.results_path("memory", "step_peak"), text, result)
    print(text)
    print(json.dumps({"losses": [t["loss"] for t in ranks]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
