"""Cost that follows the work on packed data: many tiny documents against a few long ones (torch backend).

    python -m benchmarks run attention.documents            # S = 8192, 1 and 4 ranks, 7 rounds (~3 min)
    python -m benchmarks run attention.documents --quick    # S = 2048, 3 rounds; the temp dir (or --out DIR)

One fwd+bwd of ``hybrid_attn_func`` (fp32, causal, H = 4, D = 64, B = 1, the aten CPU kernel, which
has no varlen entry) on S tokens packed with documents of one length L (S / L documents), at
U1xR1 (a ring of one: one block) and U1xR4 (zigzag). Paths, interleaved in one process group
(``harness.interleave``, one warm-up round), per document length:

- ``stacked``: today's pieces (:mod:`hybridsp.attention._stacked`: small pieces of one shape in one
  kernel call along the batch axis);
- ``per-piece``: the same with stacking off (``stacked.MAX_ROWS = 0``: one kernel call per piece, the
  code before stacking).

Reported: median CPU seconds (sum over ranks) per path and length, the ratio per-piece / stacked,
and each path's time per visible score cell relative to the longest documents' (1.0: the time
follows the cells the mask keeps, not the document count). Outputs of both paths are compared.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

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

HEADS, HEAD_DIM = 4, 64


def measure(rank: int, world: int, seq: int, lengths: list[int], iters: int) -> dict | None:
    from hybridsp import hybrid_attn_func, init_mesh, shard_sequence
    from hybridsp.attention import _stacked as stacked
    from hybridsp.layout._documents import as_documents

    mesh = init_mesh(ulysses=1, ring=world)
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen) for _ in range(4)]
    calls, outputs = {}, {}
    for length in lengths:
        documents = as_documents(torch.arange(0, seq + 1, length), 1, seq)
        q, k, v, dout = (shard_sequence(t, mesh, cu_seqlens=documents) for t in full)

        def run(path, q=q, k=k, v=v, dout=dout, documents=documents, length=length):
            stacked.MAX_ROWS = 0 if path == "per-piece" else default_rows
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = hybrid_attn_func(*leaves, mesh=mesh, cu_seqlens=documents, backend="torch")
            out.backward(dout)
            outputs[(path, length)] = [out.detach(), *(t.grad for t in leaves)]

        for path in ("stacked", "per-piece"):
            calls[f"{path} L={length}"] = lambda path=path, run=run: run(path)
    default_rows = stacked.MAX_ROWS
    times = interleave(calls, iters + 1)
    stacked.MAX_ROWS = default_rows
    errors = {
        length: max(
            float((a - b).abs().max()) for a, b in zip(outputs[("stacked", length)], outputs[("per-piece", length)])
        )
        for length in lengths
    }
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, times)
    if rank != 0:
        return None
    paths = {name: combine([{k: v[1:] for k, v in r[name].items()} for r in gathered]) for name in calls}
    return {"paths": paths, "errors": errors}


def cells(seq: int, length: int) -> int:
    """Visible score cells of S tokens in documents of ``length`` (causal)."""
    return (seq // length) * length * (length + 1) // 2


def report(results: dict, args) -> str:
    lines = [
        f"# Many tiny documents: stacked pieces against one call per piece (S={args.seq}, fp32, torch backend)",
        "",
        f"{machine_info()}; load {results['load_before']} before, {load()} after; revision {revision()}",
        "",
        "| ranks | documents x length | stacked CPU | per-piece CPU | per-piece / stacked | "
        "stacked per cell (longest = 1) | per-piece per cell | max abs diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, result in results["worlds"].items():
        longest = max(args.lengths)
        base = {
            p: result["paths"][f"{p} L={longest}"]["median_cpu"] / cells(args.seq, longest)
            for p in ("stacked", "per-piece")
        }
        for length in args.lengths:
            s, p = (result["paths"][f"{name} L={length}"]["median_cpu"] for name in ("stacked", "per-piece"))
            per_cell = [t / cells(args.seq, length) / base[name] for t, name in ((s, "stacked"), (p, "per-piece"))]
            lines.append(
                f"| {world} | {args.seq // length} x {length} | {s:.3f} s | {p:.3f} s | {p / s:.2f} | "
                f"{per_cell[0]:.2f} | {per_cell[1]:.2f} | {result['errors'][length]:.1e} |"
            )
    lines += ["", f"Medians of {args.iters} interleaved rounds (after one warm-up), CPU seconds summed over ranks."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2, 8, 64, 1024])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument(
        "--out", help="folder for documents_s<S>.{md,json} (default benchmarks/results/packed; quick: the temp dir)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.iters, args.lengths = 2048, 3, [2, 16, 256]
    results = {"load_before": load(), "worlds": {}}
    for world in args.worlds:
        results["worlds"][world] = launch(measure, world, args.seq, args.lengths, args.iters, timeout=3600)[0]
    markdown = report(results, args)
    print(markdown)
    name = f"documents_s{args.seq}"
    prefix = (
        str(Path(args.out) / name)
        if args.out
        else results_path("packed", name)
        if not args.quick
        else str(Path(tempfile.gettempdir()) / name)
    )
    write_results(prefix, markdown, {**results, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
