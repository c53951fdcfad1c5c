"""The two K/V transports side by side: bytes on the wire, bf16 error, time.

    python -m benchmarks run attention.kv_comm            # W = 8 bytes + errors, W = 4 timing (~10 min, 2 cores)
    python -m benchmarks run attention.kv_comm --quick    # smaller; writes to the temp dir (or --out PREFIX)

1. **Bytes per rank / analytic minimum**, every U x R of W = 8, fp32 and bf16, GQA 8:8 and
   8:1, both modes: bytes are counted by wrapping torch.distributed itself (``batch_isend_irecv``
   isends, ``all_to_all_single`` minus the own slice, ``all_gather_single`` / ``_into_tensor``
   times R - 1: ``harness.ByteCounter``), not by hybridsp's counter, and divided by :func:`hybridsp.attention._volume.hybrid_bytes`.
2. **bf16 error ratios at R = 8** (U1 x R8): max |x - ref| of out/dq/dk/dv against an fp32
   reference on the same bf16 inputs, over the same error of one bf16 kernel call on the whole
   sequence (flash-attn's rule: <= 2).
3. **Time, ring vs all-gather**, interleaved in one process group (A B A B ...), bf16 causal
   fwd+bwd, W = 4, S = 4096, H = 8, D = 64, GQA 8:8 and 8:1, at U1 x R4 and U2 x R2 (one warm-up
   call each, then ``harness.interleave``): medians of the per-iteration maximum over ranks.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common.harness import ByteCounter, combine, interleave, launch, results_path
from hybridsp import hybrid_attn_func, init_mesh, shard_sequence
from hybridsp.attention._volume import hybrid_bytes

HEADS, HEAD_DIM = 8, 64
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(seq, kv_heads, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [
        (1, seq, HEADS, HEAD_DIM),
        (1, seq, kv_heads, HEAD_DIM),
        (1, seq, kv_heads, HEAD_DIM),
        (1, seq, HEADS, HEAD_DIM),
    ]
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def _bytes_rows(rank, world, seq):
    rows = []
    meshes = [(u, world // u) for u in (1, 2, 4, 8) if world % u == 0]
    for (ulysses, ring), mode, dtype_name, kv_heads in (
        (m, mode, d, kv) for m in meshes for mode in ("ring", "allgather") for d in _DTYPES for kv in (HEADS, 1)
    ):
        mesh = init_mesh(ulysses, ring, kv_comm=mode)
        q, k, v, dout = (shard_sequence(t, mesh).requires_grad_() for t in _inputs(seq, kv_heads, _DTYPES[dtype_name]))
        with ByteCounter() as sent:
            hybrid_attn_func(q, k, v, mesh=mesh, backend="torch").backward(dout)
        want = sum(
            hybrid_bytes(
                batch=1,
                seq_len=seq,
                heads=HEADS,
                kv_heads=kv_heads,
                head_dim=HEAD_DIM,
                ulysses=ulysses,
                ring=ring,
                ring_rank=mesh.ring_rank,
                element_size=q.element_size(),
                kv_comm=mode,
            ).values()
        )
        rows.append(
            dict(
                ulysses=ulysses,
                ring=ring,
                kv_comm=mode,
                dtype=dtype_name,
                kv_heads=kv_heads,
                rank=rank,
                sent=sum(sent.bytes.values()),
                minimum=want,
            )
        )
    return rows


def _gather_full(local, mesh):
    from hybridsp import gather_sequence

    return gather_sequence(local.detach().float(), mesh)


def _bf16_errors(rank, world, seq):
    full16 = _inputs(seq, 2, torch.bfloat16, seed=3)
    ref_inputs = [t.float().requires_grad_() for t in full16[:3]]
    from hybridsp.kernels import get_kernel

    kernel = get_kernel("torch")
    ref = torch.nn.functional.scaled_dot_product_attention(
        *[t.transpose(1, 2) for t in ref_inputs], is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    ref.backward(full16[3].float())
    reference = [ref.detach(), *(t.grad for t in ref_inputs)]
    single_in = [t.clone().requires_grad_() for t in full16[:3]]
    out, lse = kernel.forward(*single_in, causal=True, softmax_scale=None)
    single = [out, *kernel.backward(full16[3], *single_in, out, lse, causal=True, softmax_scale=None)]
    rows = []
    for mode in ("ring", "allgather"):
        mesh = init_mesh(1, world, kv_comm=mode)
        q, k, v = (shard_sequence(t, mesh).clone().requires_grad_() for t in full16[:3])
        out = hybrid_attn_func(q, k, v, mesh=mesh, backend="torch")
        out.backward(shard_sequence(full16[3], mesh))
        ours = [_gather_full(t, mesh) for t in (out, q.grad, k.grad, v.grad)]
        ratios = [float((a - r).abs().max() / (s.float() - r).abs().max()) for a, s, r in zip(ours, single, reference)]
        rows.append(dict(kv_comm=mode, ring=world, ratios_out_dq_dk_dv=ratios))
    return rows if rank == 0 else None


def _fwd_bwd(q, k, v, dout, mesh, mode) -> None:
    hybrid_attn_func(q, k, v, mesh=mesh, backend="torch", kv_comm=mode).backward(dout)


def _timing_rows(rank, world, seq, iters, meshes):
    rows = []
    for (ulysses, ring), kv_heads in ((m, kv) for m in meshes for kv in (HEADS, 1)):
        mesh = init_mesh(ulysses, ring)
        q, k, v, dout = (shard_sequence(t, mesh).requires_grad_() for t in _inputs(seq, kv_heads, torch.bfloat16))
        calls = {mode: functools.partial(_fwd_bwd, q, k, v, dout, mesh, mode) for mode in ("ring", "allgather")}
        for call in calls.values():  # warm-up
            call()
        times = interleave(calls, iters)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, times)
        ring_s, gather_s = (combine([r[mode] for r in per_rank])["median_wall"] for mode in ("ring", "allgather"))
        rows.append(
            dict(
                ulysses=ulysses,
                ring=ring,
                kv_heads=kv_heads,
                ring_s=ring_s,
                allgather_s=gather_s,
                allgather_over_ring=gather_s / ring_s,
                iters=iters,
            )
        )
    return rows if rank == 0 else None


def _markdown(result) -> str:
    lines = [
        f"# K/V transports (`attention.kv_comm`), {result['date']}, load {result['load']}",
        "",
        "## Bytes per rank / analytic minimum (max over ranks, W = 8)",
        "",
        "| U x R | mode | dtype | K/V heads | max sent/minimum | min sent/minimum |",
        "|---|---|---|---|---|---|",
    ]
    groups = {}
    for row in result["bytes"]:
        key = (row["ulysses"], row["ring"], row["kv_comm"], row["dtype"], row["kv_heads"])
        groups.setdefault(key, []).append(row["sent"] / row["minimum"] if row["minimum"] else 1.0)
    for (u, r, mode, dtype, kv), ratios in groups.items():
        lines.append(f"| {u}x{r} | {mode} | {dtype} | {kv} | {max(ratios):.4f} | {min(ratios):.4f} |")
    lines += ["", "## bf16 error / single-kernel bf16 error at R = 8 (out, dq, dk, dv)", ""]
    for row in result["errors"]:
        lines.append(f"- {row['kv_comm']}: " + ", ".join(f"{x:.2f}" for x in row["ratios_out_dq_dk_dv"]))
    lines += [
        "",
        f"## Time, bf16 causal fwd+bwd, W = {result['timing_world']}, S = {result['timing_seq']}, interleaved medians",
        "",
        "| U x R | K/V heads | ring s | allgather s | allgather / ring |",
        "|---|---|---|---|---|",
    ]
    for row in result["timing"]:
        lines.append(
            f"| {row['ulysses']}x{row['ring']} | {row['kv_heads']} | {row['ring_s']:.3f} | "
            f"{row['allgather_s']:.3f} | {row['allgather_over_ring']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--out", help="output prefix (default benchmarks/results/kv_comm/kv_comm; quick: the temp dir)")
    args = parser.parse_args(argv)
    bytes_seq, err_seq, time_seq = (256, 1024, 1024) if args.quick else (1024, 4096, 4096)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()[0]}
    result["bytes"] = [row for rows in launch(_bytes_rows, 8, bytes_seq, timeout=1800) for row in rows]
    result["errors"] = launch(_bf16_errors, 8, err_seq, timeout=1800)[0]
    meshes = [(1, 4), (2, 2)]
    result.update(timing_world=4, timing_seq=time_seq)
    result["timing"] = launch(_timing_rows, 4, time_seq, 3 if args.quick else args.iters, meshes, timeout=3600)[0]
    result["load_after"] = os.getloadavg()[0]
    out = (
        Path(args.out)
        if args.out
        else Path(tempfile.gettempdir()) / "results_kv_comm_quick"
        if args.quick
        else Path(results_path("kv_comm", "kv_comm"))
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(_markdown(result))
    print(_markdown(result))
    print(f"wrote {out}.md and {out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
