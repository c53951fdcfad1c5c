"""hybridsp vs DeepSpeed-Ulysses vs yunchang (USP) on CPU, one local kernel, interleaved in one process group.

    python benchmarks/bench_peers.py            # world 4 and 8, fp32 and bf16, + GQA (~15 min on 2 idle cores)
    python benchmarks/bench_peers.py --quick    # world 4, S=2048, 5 iterations (~2 min); writes to the temp dir

One launch of W gloo ranks (one torch thread each) per U x R: it sets up hybridsp at U x R (every
``kv_comm`` mode its ``hybrid_attn_func`` offers) AND the peer of equal degrees -- DeepSpeed-Ulysses
``DistributedAttention`` at U = W, yunchang ``LongContextAttention`` (zigzag ring, ``use_ulysses_low``)
at U x R with R > 1 -- with the *same* local kernel, ``aten._scaled_dot_product_flash_attention_for_cpu``
and its ``_backward`` (hybridsp ``backend="torch"``; DeepSpeed: a small autograd Function over the aten
ops; yunchang: its ``pytorch_attn_forward/backward`` swapped for wrappers over them, see
/work/shared/notes/peers-on-cpu.md). Causal attention, forward + backward.

Every method's first call is its verification (and warm-up): each rank compares its shard of out, dq,
dk, dv with a single-process fp32 reference (the same kernel in fp32 on the same rounded inputs;
harness.passes), and the same call counts the bytes it sends (harness.ByteCounter). Only methods that
pass are timed: a second, untimed call measures the peak RSS it adds (harness.PeakMemory), then
``--iters`` rounds of harness.interleave (A B C, B C A, ...; a barrier before each call). The tables
show medians over iterations of the wall time (max over ranks) and CPU time (sum over ranks) and the
ratio hybridsp / peer of the medians. The full run writes benchmarks/results/peers/peers.{md,json};
``--quick`` writes results_peers_quick.* in the temp dir and never the committed results.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from hybridsp.formulas import heads_divisible

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from peer_kernels import LocalCpuAttention, patch_yunchang_cpu_kernel, patch_yunchang_fp32_alias, prebuild_deepspeed_ops  # noqa: E402

_aten = torch.ops.aten
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TENSORS = ("dk", "dq", "dv", "out")


@dataclass
class Case:
    """One method at one U x R and shape (bench_a2a_memory builds these too)."""

    method: str  # hybridsp | hybridsp-allgather | hybridsp@REV | deepspeed | yunchang
    world: int
    ulysses: int
    ring: int
    dtype: str
    seq: int
    heads: int
    kv_heads: int
    head_dim: int = 64
    batch: int = 1
    iters: int = 15
    before: str = ""  # a git revision: also time hybridsp's ulysses.py + torch kernel of that revision

    @property
    def peer(self) -> str:
        return "deepspeed" if self.ulysses == self.world else "yunchang"


def kv_modes() -> list[str]:
    """hybridsp's K/V communication modes: ``kv_comm`` values when hybrid_attn_func has that keyword."""
    from hybridsp import hybrid_attn_func

    return ["ring", "allgather"] if "kv_comm" in inspect.signature(hybrid_attn_func).parameters else ["ring"]


def methods_of(block: Case) -> list[str]:
    before = [f"hybridsp@{block.before}"] if block.before else []
    return ["hybridsp" if m == "ring" else f"hybridsp-{m}" for m in kv_modes()] + before + [block.peer]


def _revision_modules(revision: str):
    """(ulysses, torch_fused) modules built from hybridsp's files at a git revision (for before/after)."""
    import subprocess
    import types

    modules = []
    for name in ("ulysses", "kernels/torch_fused"):
        source = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "show",
                                 f"{revision}:hybridsp/{name}.py"], check=True, capture_output=True, text=True).stdout
        module = types.ModuleType(f"hybridsp_{name.replace('/', '_')}_at_{revision}")
        exec(compile(source, f"{revision}:{name}.py", "exec"), module.__dict__)  # noqa: S102 - our own file
        modules.append(module)
    return modules


def _hybridsp_at(revision: str, mesh, scale):
    """hybrid_attn_func with the resharding and CPU kernel of ``revision`` swapped in for each call."""
    import hybridsp.attention.ulysses as current
    from hybridsp import hybrid_attn_func

    old_ulysses, old_kernels = _revision_modules(revision)
    kernel, mine = old_kernels.TorchFusedKernel(), dict(current._RESHARD)

    def attention(q, k, v, counter=None):
        current._RESHARD.update({True: old_ulysses._seq_to_heads, False: old_ulysses._heads_to_seq})
        try:
            out = hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend=kernel, counter=counter)
            return _SwapDuringBackward.apply(out, old_ulysses, mine)
        finally:
            current._RESHARD.update(mine)

    return attention


class _SwapDuringBackward(torch.autograd.Function):
    """Identity whose backward swaps the old resharding in for the rest of the backward pass (it is
    the first node backward meets); the current hybridsp method swaps its own back in per call."""

    @staticmethod
    def forward(ctx, out, old, mine):
        ctx.old = old
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        import hybridsp.attention.ulysses as current

        current._RESHARD.update({True: ctx.old._seq_to_heads, False: ctx.old._heads_to_seq})
        return grad, None, None


def make_inputs(case: Case, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Full q, k, v, dout [B, S, H(kv), D] in the case's dtype, identical in every process."""
    gen = torch.Generator().manual_seed(seed)
    heads = {"q": case.heads, "k": case.kv_heads, "v": case.kv_heads, "dout": case.heads}
    return {n: torch.randn(case.batch, case.seq, h, case.head_dim, generator=gen).to(_DTYPES[case.dtype])
            for n, h in heads.items()}


def kernel_fwd_bwd(q, k, v, dout):
    """Single-process fused CPU kernel, causal, [B, S, H, D] in and out: {out, dq, dk, dv}."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731 - [B, S, H, D] <-> [B, H, S, D]
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(t(q), t(k), t(v), 0.0, True)
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(t(dout), t(q), t(k), t(v), out, lse,
                                                                            0.0, True)
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
    (:func:`hybridsp.attention.volume.hybrid_bytes` with ``kv_comm="ring"``)."""
    from hybridsp.formulas import hybrid_bytes

    return max(sum(hybrid_bytes(batch=case.batch, seq_len=case.seq, heads=case.heads, kv_heads=case.kv_heads,
                                head_dim=case.head_dim, ulysses=case.ulysses, ring=case.ring, ring_rank=r,
                                element_size=_DTYPES[case.dtype].itemsize).values())
               for r in range(case.ring))


def _setup_method(case: Case, rank: int):
    """(attention(q, k, v, counter=None) -> out, shard(full [B, S, ...]) -> this rank's tokens)."""
    scale = 1.0 / math.sqrt(case.head_dim)
    if case.method.startswith("hybridsp"):
        from hybridsp import hybrid_attn_func, init_mesh, shard_sequence

        mesh = init_mesh(case.ulysses, case.ring)
        if "@" in case.method:
            return _hybridsp_at(case.method.split("@", 1)[1], mesh, scale), lambda x: shard_sequence(x, mesh)
        mode = {"kv_comm": case.method.split("-", 1)[1]} if "-" in case.method else {}

        import hybridsp.attention.ulysses

        current = dict(hybridsp.attention.ulysses._RESHARD)  # a hybridsp@REV method swaps its own in for its calls

        def attention(q, k, v, counter=None):
            hybridsp.attention.ulysses._RESHARD.update(current)
            return hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend="torch", counter=counter, **mode)

        return attention, lambda x: shard_sequence(x, mesh)
    if case.method == "deepspeed":
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the initialised torch.distributed
        layer = DistributedAttention(LocalCpuAttention(True, scale), dist.new_group(list(range(case.world))),
                                     scatter_idx=2, gather_idx=1)
        repeats = -(-case.world // case.kv_heads)

        def attention(q, k, v, counter=None):
            if repeats > 1:  # ALST-style caller-side K/V replication (DistributedAttention needs Hkv >= world)
                k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
            return layer(q, k, v, 0)  # batch_dim_idx=0: [B, S, H, D]

        return attention, lambda x: x.chunk(case.world, dim=1)[rank].contiguous()
    if case.method == "yunchang":
        import yunchang
        from yunchang import LongContextAttention, set_seq_parallel_pg
        from yunchang.kernels import AttnType

        patch_yunchang_cpu_kernel()
        if case.dtype == "fp32":
            patch_yunchang_fp32_alias()
        set_seq_parallel_pg(case.ulysses, case.ring, rank, case.world, use_ulysses_low=True)
        layer = LongContextAttention(ring_impl_type="zigzag", attn_type=AttnType.TORCH_FLASH)
        extract = yunchang.EXTRACT_FUNC_DICT["zigzag"]
        return (lambda q, k, v, counter=None: layer(q, k, v, softmax_scale=scale, causal=True),
                lambda x: extract(x, rank, case.world, case.ring, case.ulysses))
    raise ValueError(case.method)


def _prepare(case: Case, rank: int, inputs: dict, ref: dict, ref_max: dict, kernel_errors: dict):
    """Set one method up and verify it: (call() -> None, report dict); call is None when it failed."""
    attention, shard = _setup_method(case, rank)
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
    report = {"errors": errors, "ok": harness.passes(errors, ref_max, case.dtype, kernel_errors),
              "bytes": dict(sent.bytes), "first_call_mem_mb": first.peak_mb, "peak_mem_mb": None}
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
            call, reports[method] = _prepare(Case(**{**block, "method": method}), rank, inputs, ref, ref_max,
                                             kernel_errors)
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
    row = {"block": asdict(block), "load": [before, harness.load()], "launch_s": time.monotonic() - start,
           "analytic_min_bytes": analytic_bytes(block), "ref_max": ref[1], "kernel_errors": ref[2], "methods": {}}
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
            out += [Case("hybridsp", world, u, world // u, dtype, seq, heads, kv_heads, iters=iters)
                    for u in range(world, 0, -1) if world % u == 0 and heads_divisible(heads, u)]
    if extras:  # GQA (2 K/V heads) at world 4, bf16
        out += [Case("hybridsp", 4, u, 4 // u, "bf16", seq, heads, 2, iters=iters) for u in (4, 2)]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="world 4, S=2048, 5 iterations (~2 min)")
    parser.add_argument("--worlds", type=int, nargs="+", help="world sizes (default 4 8; quick: 4)")
    parser.add_argument("--seq", type=int, help="global sequence length (default 4096; quick: 2048)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(_DTYPES), help="default bf16 fp32")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, help="default = heads")
    parser.add_argument("--degrees", nargs="+", help="only these U x R, e.g. 4x1 2x2")
    parser.add_argument("--iters", type=int, help="interleaved rounds (default 15; quick: 5)")
    parser.add_argument("--no-extras", action="store_true", help="skip the GQA block")
    parser.add_argument("--before", default="", help="git revision: also time hybridsp's ulysses.py and CPU kernel "
                        "of that revision, interleaved (before/after)")
    parser.add_argument("--out", help="output prefix (default benchmarks/results/peers/peers; quick: the temp dir)")
    args = parser.parse_args(argv)
    prefix = args.out or (os.path.join(tempfile.gettempdir(), "results_peers_quick") if args.quick
                          else harness.results_path("peers", "peers"))
    todo = blocks(args.worlds or ([4] if args.quick else [4, 8]), args.dtypes or ["bf16", "fp32"],
                  args.seq or (2048 if args.quick else 4096), args.heads, args.kv_heads or args.heads,
                  args.iters or (5 if args.quick else 15), not (args.quick or args.no_extras))
    if args.degrees:
        todo = [b for b in todo if f"{b.ulysses}x{b.ring}" in args.degrees]
    for block in todo:
        block.before = args.before
    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": "python benchmarks/bench_peers.py" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
            "machine": harness.machine_info(), "software": harness.software_info("deepspeed", "yunchang"),
            "hybridsp": harness.revision(), "kv_modes": kv_modes(), "load_start": harness.load()}
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
    from peers_report import markdown

    harness.write_results(prefix, markdown(rows, meta), {"meta": meta, "rows": rows})
    return 0


def summary(row: dict) -> str:
    b = row["block"]
    parts = [f"W{b['world']} {b['dtype']} S={b['seq']} Hkv={b['kv_heads']} U{b['ulysses']}xR{b['ring']}"]
    for method, e in row["methods"].items():
        parts.append(f"{method} {e['median_wall']:.3f} s" + (f" ({e['ratio_wall']:.3f}x)" if "ratio_wall" in e else "")
                     if e.get("ok") else f"{method} n/a ({e.get('error') or 'wrong'})")
    return "; ".join(parts) + f"; load {row['load'][0]} -> {row['load'][1]}"


if __name__ == "__main__":
    sys.exit(main())
