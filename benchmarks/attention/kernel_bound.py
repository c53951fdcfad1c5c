"""How far hybrid_attn_func is from the kernel-bound limit at each U x R mesh.

    python -m benchmarks run attention.kernel_bound [--meshes 4x1 2x2 1x4] [--seq-len 4096] [--heads 8]
        [--kv-heads 2] [--head-dim 32] [--repeats 5] [--rounds 3] [--before TREE]
    python -m benchmarks run attention.kernel_bound --collectives [--world 4]

The limit: one single-process call of the same kernel on the whole problem (every head, the whole
sequence, GQA as given), forward + backward, one thread; divided over C ranks it is what a perfect
split would cost each. The ratio is the summed process CPU of one ``hybrid_attn_func`` forward +
backward over the C ranks (gloo, one thread each) divided by that single call's CPU; 1.0 is no
overhead at all. The total splits three ways, each summed over the ranks: the seconds inside the
kernel's forward and backward (thread time), the rest of the calling thread (hybridsp's all-to-all
packing and reordering, ring merges and accumulators, checks, the autograd shell, the caller's side
of each collective), and gloo's own threads (process time minus the calling thread's: the TCP
loopback copies and wake-ups of every collective).

Each round launches the single call and every mesh once per tree in a subprocess under that tree's
hybridsp (:mod:`benchmarks.common.trees`; with ``--before`` the two trees alternate round by round); medians of the repeats inside
a launch, then the median over rounds. Causal, fp32, B=1. Writes
``results/ring_cost/kernel_bound_s<S>.{md,json}``.

``--collectives``: what gloo itself costs, without attention: the process CPU per round of
``all_to_all_single`` at ``--world`` ranks for a few sizes, sent as one call or as six (the Ulysses
call's count), and the same bytes as one batch of point-to-point ops (the local chunk not copied);
the whole process's CPU, calling thread included
(``results/ring_cost/gloo_collectives.{md,json}``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, harness
from benchmarks.common.harness import timed_kernel
from benchmarks.common.trees import run_in_tree, tree_head

MODULE = "benchmarks.attention.kernel_bound"

# --------------------------------------------------------------------------------------------
# the worker (inside a subprocess under the hybridsp of the tree under test)


def _inputs(shape: dict):
    import torch

    gen = torch.Generator().manual_seed(0)
    s, h, hkv, d = shape["seq_len"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    return [torch.randn(1, s, n, d, generator=gen) for n in (h, hkv, hkv, h)]  # q, k, v, dout [B, S, H, D]


PARTS = ("total", "kernel", "thread")  # process CPU, inside the kernel, the calling thread


def _fwd_bwd(attend, q, k, v, dout, kernel) -> tuple[float, float, float]:
    """(process CPU s, kernel thread s, calling thread s) of one forward + backward of ``attend(q, k, v, kernel)``."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    kernel.seconds = 0.0
    start, thread = time.process_time(), time.thread_time()
    attend(q, k, v, kernel).backward(dout)
    return time.process_time() - start, kernel.seconds, time.thread_time() - thread


def _single(rank, world, shape, repeats):
    """The limit: one call on the whole problem (a 1 x 1 mesh is one kernel call, no plan)."""
    from hybridsp import ring_attention

    def attend(q, k, v, kernel):
        return ring_attention(q, k, v, None, causal=True, backend=kernel)

    kernel, full = timed_kernel(), _inputs(shape)
    _fwd_bwd(attend, *full, kernel)
    return [_fwd_bwd(attend, *full, kernel) for _ in range(repeats)]


def _mesh_rank(rank, world, shape, repeats, ulysses, ring):
    import torch.distributed as dist

    from hybridsp import hybrid_attn_func, init_mesh, shard_sequence

    mesh = init_mesh(ulysses=ulysses, ring=ring)

    def attend(q, k, v, kernel):
        return hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend=kernel)

    kernel = timed_kernel()
    local = [shard_sequence(t, mesh) for t in _inputs(shape)]
    _fwd_bwd(attend, *local, kernel)  # warm-up
    costs = []
    for _ in range(repeats):
        dist.barrier()
        costs.append(_fwd_bwd(attend, *local, kernel))
    return costs


def _parts(per_rank: list, repeat: int) -> dict:
    """One repeat's seconds summed over the ranks: total, kernel, hybridsp's thread (calling thread minus
    kernel) and gloo's threads (process minus calling thread)."""
    total, kernel, thread = (sum(rank[repeat][j] for rank in per_rank) for j in range(len(PARTS)))
    return {"total": total, "kernel": kernel, "hybridsp": thread - kernel, "gloo": total - thread}


def worker(args: dict) -> dict:
    """{"single": cpu s, mesh: {"total", "kernel", "hybridsp", "gloo": s summed over the ranks}} (each the
    median over the repeats of that repeat's value), and the ``hybridsp.__file__`` it ran."""
    import hybridsp

    shape, repeats = args["shape"], args["repeats"]
    single = harness.launch(_single, 1, shape, repeats, timeout=1800)[0]
    out = {"hybridsp": hybridsp.__file__, "single": statistics.median(c[0] for c in single)}
    for name in args["meshes"]:
        u, r = (int(x) for x in name.split("x"))
        per_rank = harness.launch(_mesh_rank, u * r, shape, repeats, u, r, timeout=1800)
        repeated = [_parts(per_rank, i) for i in range(repeats)]
        out[name] = {key: statistics.median(parts[key] for parts in repeated) for key in repeated[0]}
    return out


def _collective_rank(rank, world, mbytes, calls, repeats):
    """Process CPU ms of one round: ``mbytes`` per rank through ``calls`` all-to-alls, then the same
    bytes as one round of batched point-to-point sends (all peers posted at once)."""
    import torch
    import torch.distributed as dist

    numel = int(mbytes * 2**20 / 4) // (calls * world) * world
    sends = [torch.randn(world, numel // world) for _ in range(calls)]
    outs = [torch.empty_like(t) for t in sends]

    def all_to_all():
        for out, send in zip(outs, sends):
            dist.all_to_all_single(out, send)

    def point_to_point():
        ops = [
            dist.P2POp(op, buffer[peer], peer)
            for send, out in zip(sends, outs)
            for peer in range(world)
            if peer != rank
            for op, buffer in ((dist.isend, send), (dist.irecv, out))
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    result = {}
    for name, round_trip in (("all_to_all", all_to_all), ("p2p", point_to_point)):
        round_trip()
        dist.barrier()
        start = time.process_time()
        for _ in range(repeats):
            round_trip()
        result[name] = 1e3 * (time.process_time() - start) / repeats
    return result


def collectives(world: int) -> tuple[str, list]:
    """A markdown table of gloo's CPU per round (medians over the ranks), and its rows with every rank's ms."""
    lines = [
        f"gloo, {world} ranks, process CPU ms per rank and round (median over ranks); load {harness.load()}",
        "",
        "| MB per rank | all-to-all calls | all_to_all_single | the same bytes as one batch of p2p ops |",
        "|---|---|---|---|",
    ]
    rows = []
    for mbytes, calls in ((0.5, 1), (2, 1), (6, 1), (6, 6)):
        per_rank = harness.launch(_collective_rank, world, mbytes, calls, 40, timeout=900)
        cost = {name: statistics.median(r[name] for r in per_rank) for name in ("all_to_all", "p2p")}
        lines.append(f"| {mbytes} | {calls} | {cost['all_to_all']:.2f} | {cost['p2p']:.2f} |")
        rows.append({"mbytes": mbytes, "calls": calls, "median_ms": cost, "per_rank_ms": per_rank})
    return "\n".join(lines), rows


# --------------------------------------------------------------------------------------------
# the driver


def run_tree(tree: str, args: dict) -> dict:
    return run_in_tree(MODULE, tree, "--worker", json.dumps(args), what="the kernel-bound worker", timeout=7200)


def summary(rounds: list[dict], meshes: list[str]) -> dict:
    """Medians over rounds: the single call, and per mesh total, kernel, the ratio and the rest's share."""
    out = {"single": statistics.median(r["single"] for r in rounds)}
    for name in meshes:
        shares = {"ratio": [r[name]["total"] / r["single"] for r in rounds]}
        shares |= {key: [r[name][key] / r["single"] for r in rounds] for key in ("kernel", "hybridsp", "gloo")}
        out[name] = {"total": statistics.median(r[name]["total"] for r in rounds), "ratios": shares["ratio"]}
        out[name] |= {key: statistics.median(values) for key, values in shares.items()}
    return out


def markdown(result: dict, meta: dict) -> str:
    shape = meta["shape"]
    lines = [
        f"# Distance from the kernel-bound limit ({meta['revisions']})",
        "",
        f"`{meta['command']}`; causal fp32 B=1 S={shape['seq_len']} H={shape['heads']} Hkv={shape['kv_heads']} "
        f"D={shape['head_dim']}, fwd+bwd, one thread per rank; {meta['rounds']} rounds; {meta['machine']}; "
        f"load before {meta['load_before']}, after {meta['load_after']}.",
        "",
        "Each share is seconds summed over the ranks / the single call's (medians over rounds).",
        "",
        "| tree | mesh | single call CPU s | summed CPU s | / single (the ratio) | kernel | hybridsp's thread "
        "| gloo's threads | ratio per round |",
        "|---|" + "---|" * 8,
    ]
    for tree, res in result.items():
        for name in meta["meshes"]:
            row = res[name]
            rounds = ", ".join(f"{x:.3f}" for x in row["ratios"])
            lines.append(
                f"| {tree} | U{name.replace('x', 'xR')} | {res['single']:.3f} | {row['total']:.3f} | "
                f"**{row['ratio']:.3f}** | {row['kernel']:.3f} | {row['hybridsp']:.3f} | {row['gloo']:.3f} | "
                f"{rounds} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meshes", nargs="+", default=["4x1", "2x2", "1x4"])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4, help="even: each tree goes first equally often")
    parser.add_argument("--before", help="another tree (a worktree of an earlier revision), alternated with this one")
    parser.add_argument(
        "--out",
        help="write kernel_bound_s<S>.{md,json} (gloo_collectives.{md,json}) here instead of results/ring_cost/",
    )
    parser.add_argument("--collectives", action="store_true", help="gloo's own cost per collective, no attention")
    parser.add_argument("--world", type=int, default=4, help="ranks for --collectives")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.collectives:
        text, rows = collectives(args.world)
        print(text)
        meta = {
            "command": harness.command(MODULE, argv),
            "machine": harness.machine_info(),
            "software": harness.software_info(),
        }
        prefix = (
            str(Path(args.out) / "gloo_collectives")
            if args.out
            else harness.results_path("ring_cost", "gloo_collectives")
        )
        harness.write_results(prefix, text + "\n", {"meta": meta, "rows": rows})
        return 0
    shape = {"seq_len": args.seq_len, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    trees = {"after": str(ROOT)} | ({"before": args.before} if args.before else {})
    job = {"shape": shape, "repeats": args.repeats, "meshes": args.meshes}
    meta = {
        "command": harness.command(MODULE, argv),
        "shape": shape,
        "meshes": args.meshes,
        "rounds": args.rounds,
        "machine": harness.machine_info(),
        "revisions": " -> ".join(f"{name} {tree_head(trees[name])}" for name in ("before", "after") if name in trees),
        "load_before": harness.load(),
    }
    raw = {name: [] for name in trees}
    for i in range(args.rounds):
        for name in sorted(trees) if i % 2 == 0 else sorted(trees, reverse=True):
            raw[name].append(run_tree(trees[name], job))
            print(
                f"round {i + 1} {name}: "
                + ", ".join(f"{m} {raw[name][-1][m]['total'] / raw[name][-1]['single']:.3f}" for m in args.meshes),
                flush=True,
            )
    meta["load_after"] = harness.load()
    result = {name: summary(raw[name], args.meshes) for name in sorted(trees)}
    text = markdown(result, meta)
    print(text)
    name = f"kernel_bound_s{args.seq_len}"
    prefix = str(Path(args.out) / name) if args.out else harness.results_path("ring_cost", name)
    harness.write_results(prefix, text, {"meta": meta, "result": result, "raw": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
