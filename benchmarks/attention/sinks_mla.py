"""Sinks, MLA head dims and soft-capping against the plain attention: bytes and CPU time, U2 x R2.

    python -m benchmarks run attention.sinks_mla            # S = 2048, 9 rounds (~3-5 min on 2 busy cores)
    python -m benchmarks run attention.sinks_mla --quick    # S = 512, 3 rounds; the temp dir (or --out PREFIX)

Paths, at the same shapes (B = 1, H = Hkv = 8 as MLA's K/V after ``kv_b_proj``, bf16, causal,
zigzag), each one fwd+bwd of ``hybrid_attn_func`` on 4 gloo ranks:

- ``plain-Dqk``: q, k, v at head dim Dqk (DeepSeek-V3's 192 scaled down to 48);
- ``plain-Dv``: q, k, v at head dim Dv (128 scaled down to 32);
- ``mla``: q, k at Dqk, v at Dv (the CPU kernel pads v to Dqk inside its calls; nothing padded travels);
- ``sinks``: ``plain-Dqk`` with learned sinks [H];
- ``softcap``: ``plain-Dqk`` with ``softcap=30`` (the only CPU kernel that caps is the reference math).

1. **Bytes** (hybridsp's ``CommCounter``, both ``kv_comm`` modes) per rank, summed over the ranks,
   against :func:`hybridsp.attention._volume.hybrid_bytes` (with ``v_head_dim`` for ``mla``), and as
   ratios to ``plain-Dqk`` and ``plain-Dv``.
2. **Time**, ``kv_comm="ring"``: all paths interleaved in one process group (``harness.interleave``,
   one warm-up each), medians of the per-iteration wall (max over ranks) and CPU (sum over ranks)
   seconds, as ratios to ``plain-Dqk``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hybridsp
from benchmarks.common.harness import (
    combine,
    interleave,
    launch,
    load,
    machine_info,
    results_path,
    revision,
    write_results,
)
from hybridsp import hybrid_attn_func, init_mesh, shard_sequence
from hybridsp.attention._volume import hybrid_bytes

HEADS, DQK, DV = 8, 48, 32
SOFTCAP = 30.0
PATHS = {  # name: (q/k head dim, v head dim, sinks, softcap)
    "plain-Dqk": (DQK, DQK, False, None),
    "plain-Dv": (DV, DV, False, None),
    "mla": (DQK, DV, False, None),
    "sinks": (DQK, DQK, True, None),
    "softcap": (DQK, DQK, False, SOFTCAP),
}


def _inputs(mesh, seq, d, dv, seed=0):
    """This rank's q [1, S/C, H, Dqk], k, v [.., Dv], dout [.., Dv] (bf16, leaves)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1, seq, HEADS, d), (1, seq, HEADS, d), (1, seq, HEADS, dv), (1, seq, HEADS, dv)]
    full = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
    return [shard_sequence(t, mesh).clone().requires_grad_() for t in full]


def _step(tensors, sinks, softcap, mesh, kv_comm, counter=None) -> None:
    q, k, v, dout = tensors
    out = hybrid_attn_func(q, k, v, mesh=mesh, sinks=sinks, softcap=softcap, kv_comm=kv_comm, counter=counter)
    out.backward(dout)


def _path_call(mesh, seq, name, kv_comm, counter=None):
    d, dv, has_sinks, softcap = PATHS[name]
    sinks = torch.linspace(-1, 1, HEADS).requires_grad_() if has_sinks else None
    return functools.partial(_step, _inputs(mesh, seq, d, dv), sinks, softcap, mesh, kv_comm, counter)


def _bytes(rank, world, seq):
    """Per path and mode: (this rank's counted bytes, its analytic bytes)."""
    rows = {}
    for kv_comm in ("ring", "allgather"):
        mesh = init_mesh(ulysses=2, ring=2, kv_comm=kv_comm)
        for name, (d, dv, _, _) in PATHS.items():
            counter = hybridsp.CommCounter()
            _path_call(mesh, seq, name, kv_comm, counter)()
            want = hybrid_bytes(
                batch=1,
                seq_len=seq,
                heads=HEADS,
                kv_heads=HEADS,
                head_dim=d,
                v_head_dim=dv,
                ulysses=2,
                ring=2,
                ring_rank=mesh.ring_rank,
                element_size=2,
                kv_comm=kv_comm,
            )
            rows[(kv_comm, name)] = (sum(counter.bytes_sent.values()), sum(want.values()))
    return rows


def _timing(rank, world, seq, iters):
    mesh = init_mesh(ulysses=2, ring=2)
    calls = {name: _path_call(mesh, seq, name, "ring") for name in PATHS}
    for call in calls.values():  # warm-up
        call()
    times = interleave(calls, iters)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, times)
    return {name: combine([r[name] for r in per_rank]) for name in PATHS} if rank == 0 else None


def _markdown(result) -> str:
    lines = [
        f"# Sinks, MLA head dims, soft-capping vs plain (`attention.sinks_mla`), {result['date']}",
        "",
        f"U2 x R2 on gloo (4 ranks, one thread each), B = 1, S = {result['seq']}, H = Hkv = {HEADS}, bf16, "
        f"causal zigzag; Dqk = {DQK}, Dv = {DV} (DeepSeek-V3's 192/128 scaled by 1/4); load before "
        f"{result['load']}, after {result['load_after']}; {result['machine']}; hybridsp {result['revision']}.",
        "",
        "## Bytes per call (fwd + bwd), summed over the 4 ranks",
        "",
        "| mode | path | bytes | analytic | counted / analytic | / plain-Dqk | / plain-Dv |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in ("ring", "allgather"):
        base, narrow = result["bytes"][mode]["plain-Dqk"][0], result["bytes"][mode]["plain-Dv"][0]
        for name, (sent, want) in result["bytes"][mode].items():
            lines.append(
                f"| {mode} | {name} | {sent:,} | {want:,} | {sent / want:.4f} | {sent / base:.4f} | "
                f"{sent / narrow:.4f} |"
            )
    lines += [
        "",
        f"## Time, kv_comm=ring, {result['iters']} interleaved rounds, medians",
        "",
        "| path | wall s | CPU s | wall / plain-Dqk | CPU / plain-Dqk | CPU / plain-Dv |",
        "|---|---|---|---|---|---|",
    ]
    timing = result["timing"]
    for name, row in timing.items():
        lines.append(
            f"| {name} | {row['median_wall']:.4f} | {row['median_cpu']:.4f} | "
            f"{row['median_wall'] / timing['plain-Dqk']['median_wall']:.3f} | "
            f"{row['median_cpu'] / timing['plain-Dqk']['median_cpu']:.3f} | "
            f"{row['median_cpu'] / timing['plain-Dv']['median_cpu']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument(
        "--out", help="output prefix (default benchmarks/results/sinks_mla/sinks_mla; quick: the temp dir)"
    )
    args = parser.parse_args(argv)
    seq, iters = (512, 3) if args.quick else (args.seq, args.iters)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": load(),
        "seq": seq,
        "iters": iters,
        "machine": machine_info(),
        "revision": revision(),
    }
    per_rank = launch(_bytes, 4, seq, timeout=1800)
    result["bytes"] = {
        mode: {name: [sum(r[(mode, name)][i] for r in per_rank) for i in (0, 1)] for name in PATHS}
        for mode in ("ring", "allgather")
    }
    result["timing"] = launch(_timing, 4, seq, iters, timeout=3600)[0]
    result["load_after"] = load()
    prefix = args.out or (
        str(Path(tempfile.gettempdir()) / "sinks_mla_quick") if args.quick else results_path("sinks_mla", "sinks_mla")
    )
    markdown = _markdown(result)
    write_results(prefix, markdown, result)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
