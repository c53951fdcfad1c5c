"""hybridsp vs DeepSpeed-Ulysses vs yunchang (USP) on CPU, one local kernel, interleaved in one process group.

    python -m benchmarks run attention.peers            # world 4 and 8, fp32 and bf16, + GQA (~15 min on 2 idle cores)
    python -m benchmarks run attention.peers --quick    # world 4, S=2048, 5 iterations (~2 min); the temp dir
    python -m benchmarks run attention.peers --render benchmarks/results/peers/peers.json   # rewrite the .md

One launch of W gloo ranks (one torch thread each) per U x R: it sets up hybridsp at U x R (every
``kv_comm`` mode its ``hybrid_attn_func`` offers) AND the peer of equal degrees -- DeepSpeed-Ulysses
``DistributedAttention`` at U = W, yunchang ``LongContextAttention`` (zigzag ring, ``use_ulysses_low``)
at U x R with R > 1 -- with the *same* local kernel, ``aten._scaled_dot_product_flash_attention_for_cpu``
and its ``_backward`` (hybridsp ``backend="torch"``; DeepSpeed: a small autograd Function over the aten
ops; yunchang: its ``pytorch_attn_forward/backward`` swapped for wrappers over them; the methods are
set up in :mod:`benchmarks.common.peers`). Causal attention, forward + backward.

Every method's first call is its verification (and warm-up): each rank compares its shard of out, dq,
dk, dv with a single-process fp32 reference (the same kernel in fp32 on the same rounded inputs;
harness.passes), and the same call counts the bytes it sends (harness.ByteCounter). Only methods that
pass are timed: a second, untimed call measures the peak RSS it adds (harness.PeakMemory), then
``--iters`` rounds of harness.interleave (A B C, B C A, ...; a barrier before each call). The tables
show medians over iterations of the wall time (max over ranks) and CPU time (sum over ranks) and the
ratio hybridsp / peer of the medians. The full run writes benchmarks/results/peers/peers.{md,json};
``--quick`` writes results_peers_quick.* in the temp dir (``--out PREFIX`` elsewhere) and never the
committed results.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.attention._peers_report import markdown
from benchmarks.common import harness
from benchmarks.common.peers import DTYPES, Case, make_inputs, prebuild_deepspeed_ops, setup_method
from hybridsp._formulas import heads_divisible

MODULE = "benchmarks.attention.peers"
_aten = torch.ops.aten
_TENSORS = ("dk", "dq", "dv", "out")


def kv_modes() -> list[str]:
    """hybridsp's K/V communication modes: ``kv_comm`` values when hybrid_attn_func has that keyword."""
    from hybridsp import hybrid_attn_func

    return ["ring", "allgather"] if "kv_comm" in inspect.signature(hybrid_attn_func).parameters else ["ring"]


def methods_of(block: Case) -> list[str]:
    before = [f"hybridsp@{block.before}"] if block.before else []
    return ["hybridsp" if m == "ring" else f"hybridsp-{m}" for m in kv_modes()] + before + [block.peer]


def kernel_fwd_bwd(q, k, v, dout):
    """Single-process fused CPU kernel, causal, [B, S, H, D] in and out: {out, dq, dk, dv}."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731 - [B, S, H, D] <-> [B, H, S, D]
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(t(q), t(k), t(v), 0.0, True)
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        t(dout), t(q), t(k), t(v), out, lse, 0.0, True
    )
    return {n: t(x).contiguous() for n, x in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv))}


def build_reference(case: Case, directory: str) -> tuple[str, dict, dict]:
    """Save the fp32 reference; return (path, max |ref| per tensor, the low-precision kernel's errors)."""
    inputs = make_inputs(case)
    ref = kernel_fwd_bwd(*(inputs[n].float() for n in ("q", "k", "v", "dout")))
    kernel_errors = {}
    if case.dtype != "fp32":
        low = kernel_fwd_bwd(*(inputs[n] for n in ("q", "k", "v", "dout")))
        kernel_errors = {n: float((low[n].float() - ref[n]).abs().max()) for n in ref}
    path = os.path.join(directory, f"ref_{case.dtype}_{case.seq}_{case.heads}_{case.kv_heads}_{case.batch}.pt")
    torch.save(ref, path)
    return path, {n: float(x.abs().max()) for n, x in ref.items()}, kernel_errors


def analytic_bytes(case: Case) -> int:
    """The most bytes a rank must send per forward + backward (max over ring ranks) at the
    byte minimum: Ulysses (U-1)/U of q, k, v, out each way; K/V rows only where the receiver reads them,
    forward and again backward, each visited block's dK/dV home once, in the input dtype
    (:func:`hybridsp.attention._volume.hybrid_bytes` with ``kv_comm="ring"``)."""
    from hybridsp._formulas import hybrid_bytes

    return max(
        sum(
            hybrid_bytes(
                batch=case.batch,
                seq_len=case.seq,
                heads=case.heads,
                kv_heads=case.kv_heads,
                head_dim=case.head_dim,
                ulysses=case.ulysses,
                ring=case.ring,
                ring_rank=r,
                element_size=DTYPES[case.dtype].itemsize,
            ).values()
        )
        for r in range(case.ring)
    )


def _prepare(case: Case, rank: int, inputs: dict, ref: dict, ref_max: dict, kernel_errors: dict):
    """Set one method up and verify it: (call() -> None, report dict); call is None when it failed."""
    attention, shard = setup_method(case, rank)
    q, k, v = (shard(inputs[n]).detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
    dout = shard(inputs["dout"]).detach().clone()

    def call():
        q.grad = k.grad = v.grad = None
        attention(q, k, v).backward(dout)

    dist.barrier()
    with harness.PeakMemory() as first, harness.ByteCounter() as sent:
        out = attention(q, k, v)
        out.backward(dout)
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    errors = harness.max_errors(got, {n: shard(ref[n]) for n in _TENSORS})
    report = {
        "errors": errors,
        "ok": harness.passes(errors, ref_max, case.dtype, kernel_errors),
        "bytes": dict(sent.bytes),
        "first_call_mem_mb": first.peak_mb,
        "peak_mem_mb": None,
    }
    del out, got
    if not report["ok"]:
        return None, report
    with harness.PeakMemory() as steady:  # the second call overall, untimed
        call()
    report["peak_mem_mb"] = steady.peak_mb
    return call, report


def bench_rank(rank: int, world: int, block: dict, ref_path: str, ref_max: dict, kernel_errors: dict) -> dict:
    """Verify every method of the block, then time the verified ones interleaved; this rank's report."""
    inputs = make_inputs(Case(**block))
    ref = torch.load(ref_path, mmap=True)
    calls, reports = {}, {}
    for method in methods_of(Case(**block)):
        try:
            call, reports[method] = _prepare(
                Case(**{**block, "method": method}), rank, inputs, ref, ref_max, kernel_errors
            )
        except Exception as error:  # noqa: BLE001 - a peer that cannot run this case is reported, not timed
            call, reports[method] = None, {"ok": False, "error": f"{type(error).__name__}: {str(error)[:200]}"}
        if call is not None:
            calls[method] = call
    times = harness.interleave(calls, block["iters"])
    return {m: {**r, **times.get(m, {})} for m, r in reports.items()}


def run_block(block: Case, ref: tuple) -> dict:
    """One launch: every method of the block, combined over the ranks."""
    per_iter = {"fp32": 0.5, "bf16": 1.0}[block.dtype] * (block.seq / 4096) ** 2 * block.heads / 8 * block.world / 4
    start, before = time.monotonic(), harness.load()
    ranks = harness.launch(bench_rank, block.world, asdict(block), *ref, timeout=300 + 6 * per_iter * block.iters)
    row = {
        "block": asdict(block),
        "load": [before, harness.load()],
        "launch_s": time.monotonic() - start,
        "analytic_min_bytes": analytic_bytes(block),
        "ref_max": ref[1],
        "kernel_errors": ref[2],
        "methods": {},
    }
    for method, first in ranks[0].items():
        entry = {k: first.get(k) for k in ("ok", "error", "errors", "bytes")}
        if first.get("ok"):
            entry.update(harness.combine([r[method] for r in ranks]))
            entry["bytes_sent_per_rank"] = max(sum(r[method]["bytes"].values()) for r in ranks)
            entry["peak_mem_mb"] = max(r[method]["peak_mem_mb"] for r in ranks)
            entry["first_call_mem_mb"] = max(r[method]["first_call_mem_mb"] for r in ranks)
        row["methods"][method] = entry
    peer = row["methods"].get(block.peer, {})
    for method, entry in row["methods"].items():
        if method.startswith("hybridsp") and entry.get("ok") and peer.get("ok"):
            entry["ratio_wall"] = entry["median_wall"] / peer["median_wall"]
            entry["ratio_cpu"] = entry["median_cpu"] / peer["median_cpu"]
            entry["ratio_wall_paired"] = _paired_median(entry["wall"], peer["wall"])
    return row


def _paired_median(ours: list[float], theirs: list[float]) -> float:
    """Median over rounds of ours[i] / theirs[i] (the calls of one round ran back to back)."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def blocks(worlds, dtypes, seq, heads, kv_heads, iters, extras) -> list[Case]:
    """Every U x R (U | heads) of every world size; U = 1 only with a peer ring of R = W."""
    out = []
    for world in worlds:
        for dtype in dtypes:
            out += [
                Case("hybridsp", world, u, world // u, dtype, seq, heads, kv_heads, iters=iters)
                for u in range(world, 0, -1)
                if world % u == 0 and heads_divisible(heads, u)
            ]
    if extras:  # GQA (2 K/V heads) at world 4, bf16
        out += [Case("hybridsp", 4, u, 4 // u, "bf16", seq, heads, 2, iters=iters) for u in (4, 2)]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="world 4, S=2048, 5 iterations (~2 min)")
    parser.add_argument("--worlds", type=int, nargs="+", help="world sizes (default 4 8; quick: 4)")
    parser.add_argument("--seq", type=int, help="global sequence length (default 4096; quick: 2048)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="default bf16 fp32")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, help="default = heads")
    parser.add_argument("--degrees", nargs="+", help="only these U x R, e.g. 4x1 2x2")
    parser.add_argument("--iters", type=int, help="interleaved rounds (default 15; quick: 5)")
    parser.add_argument("--no-extras", action="store_true", help="skip the GQA block")
    parser.add_argument(
        "--before",
        default="",
        help="git revision: also time hybridsp's ulysses.py and CPU kernel "
        "of that revision, interleaved (before/after)",
    )
    parser.add_argument("--out", help="output prefix (default benchmarks/results/peers/peers; quick: the temp dir)")
    parser.add_argument("--render", metavar="JSON", help="only rewrite the markdown beside a results JSON")
    args = parser.parse_args(argv)
    if args.render:
        data = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(markdown(data["rows"], data["meta"]))
        return 0
    prefix = args.out or (
        os.path.join(tempfile.gettempdir(), "results_peers_quick")
        if args.quick
        else harness.results_path("peers", "peers")
    )
    todo = blocks(
        args.worlds or ([4] if args.quick else [4, 8]),
        args.dtypes or ["bf16", "fp32"],
        args.seq or (2048 if args.quick else 4096),
        args.heads,
        args.kv_heads or args.heads,
        args.iters or (5 if args.quick else 15),
        not (args.quick or args.no_extras),
    )
    if args.degrees:
        todo = [b for b in todo if f"{b.ulysses}x{b.ring}" in args.degrees]
    for block in todo:
        block.before = args.before
    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": harness.command(MODULE, argv),
        "machine": harness.machine_info(),
        "software": harness.software_info("deepspeed", "yunchang"),
        "hybridsp": harness.revision(),
        "kv_modes": kv_modes(),
        "load_start": harness.load(),
    }
    if any(b.peer == "deepspeed" for b in todo):
        print(f"DeepSpeed shm comm op ready ({prebuild_deepspeed_ops():.0f} s)", flush=True)
    rows, start = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as directory:
        refs = {}
        for block in todo:
            key = (block.dtype, block.seq, block.heads, block.kv_heads, block.batch)
            refs[key] = refs.get(key) or build_reference(block, directory)
            rows.append(run_block(block, refs[key]))
            print(f"[{time.monotonic() - start:5.0f} s] {summary(rows[-1])}", flush=True)
    meta["total_wall_s"] = time.monotonic() - start
    harness.write_results(prefix, markdown(rows, meta), {"meta": meta, "rows": rows})
    return 0


def summary(row: dict) -> str:
    b = row["block"]
    parts = [f"W{b['world']} {b['dtype']} S={b['seq']} Hkv={b['kv_heads']} U{b['ulysses']}xR{b['ring']}"]
    for method, e in row["methods"].items():
        parts.append(
            f"{method} {e['median_wall']:.3f} s" + (f" ({e['ratio_wall']:.3f}x)" if "ratio_wall" in e else "")
            if e.get("ok")
            else f"{method} n/a ({e.get('error') or 'wrong'})"
        )
    return "; ".join(parts) + f"; load {row['load'][0]} -> {row['load'][1]}"


if __name__ == "__main__":
    sys.exit(main())
