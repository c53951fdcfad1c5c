"""Does the planner's memory model of one decoder layer match this machine, term by term (G = 1, and G > 1
once ``hybrid_attn_func`` takes ``head_chunks``)?

    python -m benchmarks.memory.layer_terms [--mesh 2x2] [--seq 4096] [--chunks 1,2] [--quick]

One fp32 Llama-shaped layer (h = 512, H = 8, Hkv = 2, D = 64, I = 1376, B = 1) on this CPU. Per term,
measured with torch's own view of memory (saved-tensor hooks for what is kept for backward, the
profiler's memory events, ``benchmarks.common.harness.Allocations``, for a backward's transients):

- ``norm saved``: an HF ``LlamaRMSNorm``'s saved tensors per token (single process) against
  :func:`hybridsp.planner._activations.norm_bytes_per_token`;
- ``mlp saved`` / ``mlp backward``: an HF ``LlamaMLP``'s saved tensors, and its backward's peak beyond the
  input gradient, against ``mlp_bytes_per_token`` / ``mlp_transient_bytes``;
- ``attention saved`` / ``attention backward``: ``hybrid_attn_func`` on a U x R mesh of gloo ranks (rank 0
  reported): the tensors its call keeps (q/k/v after the all-to-all, out, LSE: ``attention_bytes_per_token``
  without the o_proj input, which lives outside the call), and its backward's peak beyond the q/k/v
  gradients it returns, against ``attention_workspace_bytes``.

G > 1 runs only when ``hybrid_attn_func`` has a ``head_chunks`` parameter; otherwise its rows say "not
measured". Writes ``results/planner/layer_terms.{md,json}``.
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch

from benchmarks.common import harness

H, HKV, D, HIDDEN, INTER, E = 8, 2, 64, 512, 1376, 4


class _Saved:
    """Unique storages packed by saved-tensor hooks (bytes), parameters excluded."""

    def __init__(self, exclude=()):
        self.seen: dict[int, int] = {}
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}

    def pack(self, tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in self.exclude:
            self.seen[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


def _spec(seq):
    from hybridsp.planner import MeshConfig, ModelSpec, Workload

    return ModelSpec(H, HKV, D, HIDDEN, INTER, 1, 32000, name="layer"), Workload(seq, dtype_bytes=E), MeshConfig


def _single(seq: int) -> dict:
    """Norm and MLP terms in this process (T = seq tokens)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    from hybridsp.planner._activations import mlp_bytes_per_token, norm_bytes_per_token

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=H, num_key_value_heads=HKV)
    rows = {}
    for name, module in (("norm", LlamaRMSNorm(HIDDEN)), ("mlp", LlamaMLP(config))):
        x = torch.randn(1, seq, HIDDEN, requires_grad=True)  # [B, S, h]
        saved = _Saved(exclude=[x, *module.parameters()])
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            out = module(x)
        grad = torch.randn_like(out)
        with harness.Allocations() as backward:
            out.backward(grad)
        weight_grads = sum(p.numel() * E for p in module.parameters())  # model states, not the layer's
        rows[name] = {"saved": saved.bytes, "backward_peak": backward.peak - seq * HIDDEN * E - weight_grads}
        del out, x
    model, _, _ = _spec(seq)
    # the norm's own: its input x (fp32: the .to(float32) is x itself) and its output (the next linear keeps
    # it) are not saved by the norm module; the planner counts them in the norm term
    rows["norm"]["planned_saved"] = seq * (norm_bytes_per_token(model, E) - 4 * HIDDEN - E * HIDDEN)
    rows["mlp"]["planned_saved"] = seq * mlp_bytes_per_token(model, E)
    rows["mlp"]["planned_backward"] = seq * 2 * INTER * E
    return rows


def rank_main(rank, world, ulysses, ring, seq, chunks):
    from hybridsp import hybrid_attn_func, init_mesh, shard_sequence
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    with without_cpu_shm_comm_build():
        mesh = init_mesh(ulysses, ring)
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(1, seq, h, D, generator=gen) for n, h in (("q", H), ("k", HKV), ("v", HKV), ("dout", H))}
    q, k, v = (shard_sequence(full[n], mesh).detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
    dout = shard_sequence(full["dout"], mesh).detach().clone()
    extra = {"head_chunks": chunks} if chunks > 1 else {}
    hybrid_attn_func(q, k, v, mesh=mesh, backend="torch", **extra).backward(dout)  # warm-up
    q.grad = k.grad = v.grad = None
    saved = _Saved(exclude=[q, k, v])
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        out = hybrid_attn_func(q, k, v, mesh=mesh, backend="torch", **extra)
    with harness.Allocations() as backward:
        out.backward(dout)
    grads = sum(t.grad.numel() * E for t in (q, k, v))
    return {"saved": saved.bytes, "backward_peak": backward.peak - grads}


def _planned_attention(seq, ulysses, ring, chunks):
    from dataclasses import replace

    from hybridsp.planner import Techniques
    from hybridsp.planner._activations import attention_bytes_per_token
    from hybridsp.planner._phase_terms import attention_workspace_bytes

    model, work, mesh_config = _spec(seq)
    work = replace(work, techniques=Techniques(kv_mode="ring", head_chunks=chunks))
    config = mesh_config(1, ulysses, ring)
    tokens = seq // (ulysses * ring)
    o_proj = H * D * E if ulysses > 1 and chunks == 1 else 0  # outside the call
    return {
        "planned_saved": tokens * (attention_bytes_per_token(model, ulysses, E, chunks) - o_proj),
        "planned_backward": attention_workspace_bytes(model, work, config),
    }


def _row(term, measured, planned):
    if measured is None:
        return f"| {term} | not measured | {planned / 2**20:.2f} | - |"
    return f"| {term} | {measured / 2**20:.2f} | {planned / 2**20:.2f} | {planned / measured - 1:+.1%} |"


def main(argv=None) -> int:
    from hybridsp.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="2x2", help="U x R")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--chunks", default="1,2")
    parser.add_argument("--quick", action="store_true", help="S = 1024, mesh 2x1")
    parser.add_argument("--out", default=harness.results_path("planner", "layer_terms"))
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.mesh = 1024, "2x1"
    ulysses, ring = map(int, args.mesh.split("x"))
    started, load = time.perf_counter(), harness.load()
    single = _single(args.seq // (ulysses * ring))
    supported = "head_chunks" in inspect.signature(__import__("hybridsp").hybrid_attn_func).parameters
    lines = [
        f"# One layer's memory terms: measured on this CPU against the planner (fp32, U={ulysses} x R={ring}, "
        f"S={args.seq:,}, h={HIDDEN}, H={H}, Hkv={HKV}, D={D}, I={INTER})",
        "",
        f"- `python -m benchmarks.memory.layer_terms --mesh {args.mesh} --seq {args.seq} --chunks {args.chunks}`; "
        f"load {load}; per rank (rank 0), MiB; planned / measured - 1",
        "",
        "| term | measured MiB | planned MiB | planned vs measured |",
        "|---|---|---|---|",
        _row("RMSNorm saved (its input and output excluded)", single["norm"]["saved"], single["norm"]["planned_saved"]),
        _row("MLP saved", single["mlp"]["saved"], single["mlp"]["planned_saved"]),
        _row(
            "MLP backward transient (weight gradients excluded)",
            single["mlp"]["backward_peak"],
            single["mlp"]["planned_backward"],
        ),
    ]
    data = {"single": single, "attention": {}}
    for chunks in map(int, args.chunks.split(",")):
        planned = _planned_attention(args.seq, ulysses, ring, chunks)
        measured = None
        if chunks == 1 or supported:
            measured = run_distributed(rank_main, ulysses * ring, ulysses, ring, args.seq, chunks, timeout=600)[0]
        data["attention"][chunks] = {"measured": measured, **planned}
        lines.append(_row(f"attention saved, G={chunks}", measured and measured["saved"], planned["planned_saved"]))
        lines.append(
            _row(
                f"attention backward transient, G={chunks}",
                measured and measured["backward_peak"],
                planned["planned_backward"],
            )
        )
    if not supported:
        lines += ["", "G > 1: `hybrid_attn_func` has no `head_chunks` parameter in this tree: not measured."]
    lines += ["", f"Wall {time.perf_counter() - started:.0f} s."]
    harness.write_results(args.out, "\n".join(lines), data)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
