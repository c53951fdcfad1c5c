"""Does the planner's memory model of one decoder layer match this machine, term by term (G = 1 and G > 1)?

    python -m benchmarks.memory.layer_terms --mesh 2x2 --seq 4096 --chunks 1,2        # results/planner/layer_terms.md
    python -m benchmarks.memory.layer_terms --mesh 1x4 --seq 4096 --chunks 1,2,4 \
        --out benchmarks/results/planner/layer_terms_u1r4                               # ... layer_terms_u1r4.md
    python -m benchmarks.memory.layer_terms --quick [--out DIR/layer_terms]              # S 1024, U2 x R1, no fixture

One fp32 Llama-shaped layer (h = 512, H = 8, Hkv = ``--kv-heads``, D = 64, I = 1376, B = 1) on this CPU.
Per term, measured with torch's own view of memory, the way the planner counts it
(:mod:`hybridsp.planner._memory`: a phase holds the saved tensors, all counted alive, plus a transient):

- saved: the unique storages saved-tensor hooks see (parameters excluded);
- backward transient: the most bytes live at once during the backward above what existed when it began,
  the forward and backward profiled together (the profiler's memory events) so that a saved tensor the
  backward frees makes room, as it does in a real step; weight gradients are not asked for
  (``torch.autograd.grad`` of the inputs only: they are the model states' and ZeRO's).

Rows:

- ``norm saved``: an HF ``LlamaRMSNorm``'s saved tensors per token (single process) against
  :func:`hybridsp.planner._activations.norm_bytes_per_token` less its input and output;
- ``mlp saved`` / ``mlp backward``: an HF ``LlamaMLP`` against ``mlp_bytes_per_token`` /
  ``mlp_transient_bytes``;
- ``attention saved`` / ``attention backward``: ``hybrid_attn_func`` as Hugging Face calls it (q/k/v
  views of heads-first tensors, then ``reshape(...).contiguous()`` and o_proj) on a U x R mesh of gloo
  ranks, against ``attention_bytes_per_token`` / ``attention_workspace_bytes`` (``kv_mode="ring"``).
  Each rank measures ``--repeats`` times and keeps its least (gloo's worker thread drops a finished
  collective's buffers after it wakes the caller, so under load a send buffer may outlive its ``del`` into
  the ring's backward: +2 to 4 MiB in some runs, counted in the notes); the table gives the largest rank's.

G must divide the K/V heads a Ulysses rank holds (Hkv / U here). Writes ``results/planner/layer_terms.{md,json}``
(or ``--out``) and, but for ``--quick``, this mesh's measured terms into the planner tests' fixture (``--fixture``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import ROOT, harness

H, D, HIDDEN, INTER, E = 8, 64, 512, 1376, 4
BACKWARD = "layer_terms: backward"  # the profiler range that marks the backward
FIXTURE = (
    ROOT / "tests" / "data" / "planner_layer_terms_cpu.json"
)  # what tests/planner/test_attention_workspace.py reads


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


def measure(forward, backward, exclude=()) -> tuple[int, int]:
    """(saved bytes of ``forward()``, the backward transient of ``backward(forward())``; module docstring).
    Events at the same instant count frees first (a freed block is reused at once)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    saved = _Saved(exclude)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            outputs = forward()
        with record_function(BACKWARD):
            backward(outputs)
    events = list(prof.profiler.kineto_results.events())
    mark = next(e for e in events if e.name() == BACKWARD)
    start, end = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    memory = sorted(
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and start <= e.start_ns() <= end
    )
    live = peak = 0
    for _, nbytes in memory:
        live += nbytes
        peak = max(peak, live)
    return saved.bytes, peak


def _model(kv_heads: int):
    from hybridsp.planner import ModelSpec

    return ModelSpec(H, kv_heads, D, HIDDEN, INTER, 1, 32000, name="layer")


def _single(tokens: int) -> dict:
    """Norm and MLP terms in this process (``tokens`` = the local tokens T)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    from hybridsp.planner import MeshConfig, Workload
    from hybridsp.planner._activations import mlp_bytes_per_token, norm_bytes_per_token
    from hybridsp.planner._phase_terms import mlp_transient_bytes

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=H)
    rows = {}
    for name, module in (("norm", LlamaRMSNorm(HIDDEN)), ("mlp", LlamaMLP(config))):
        x = torch.randn(1, tokens, HIDDEN, requires_grad=True)  # [B, T, h]
        grad = torch.randn(1, tokens, HIDDEN)  # [B, T, h]
        saved, peak = measure(
            lambda module=module, x=x: module(x),
            lambda out, x=x, grad=grad: torch.autograd.grad(out, [x], grad),
            exclude=[x, *module.parameters()],
        )
        rows[name] = {"saved": saved, "backward_peak": peak}
    model = _model(2)
    # the norm's own: its input x (fp32: the .to(float32) is x itself) and its output (the next linear keeps
    # it) are not saved by the norm module; the planner counts them in the norm term
    rows["norm"]["planned_saved"] = tokens * (norm_bytes_per_token(model, E) - 4 * HIDDEN - E * HIDDEN)
    rows["mlp"]["planned_saved"] = tokens * mlp_bytes_per_token(model, E)
    rows["mlp"]["planned_backward"] = mlp_transient_bytes(model, Workload(tokens, dtype_bytes=E), MeshConfig(1, 1, 1))
    return rows


def rank_main(rank, world, ulysses, ring, seq, chunks, kv_heads, repeats):
    """This rank's saved bytes, least backward transient and every backward transient of the HF-shaped call."""
    from hybridsp import hybrid_attn_func, init_mesh, shard_sequence
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    with without_cpu_shm_comm_build():
        mesh = init_mesh(ulysses, ring)
    gen = torch.Generator().manual_seed(0)
    tokens = seq // (ulysses * ring)
    full = {n: torch.randn(1, seq, h, D, generator=gen) for n, h in (("q", H), ("k", kv_heads), ("v", kv_heads))}
    # HF hands the call transposed views of its heads-first [B, h, T, D] RoPE outputs and v
    leaves = [shard_sequence(full[n], mesh).transpose(1, 2).contiguous().requires_grad_(True) for n in "qkv"]
    o_proj = torch.randn(HIDDEN, H * D, generator=gen, requires_grad=True)  # [h, H D]
    grad = torch.randn(1, tokens, HIDDEN, generator=gen)  # [B, T, h]
    extra = {"head_chunks": chunks} if chunks > 1 else {}

    def forward():
        q, k, v = (t.transpose(1, 2) for t in leaves)  # [B, T, H(kv), D]
        out = hybrid_attn_func(q, k, v, mesh=mesh, backend="torch", **extra)  # [B, T, H, D]
        return torch.nn.functional.linear(out.reshape(1, tokens, -1).contiguous(), o_proj)  # [B, T, h]

    def backward(y):
        torch.autograd.grad(y, leaves, grad)

    backward(forward())  # warm-up
    runs = [measure(forward, backward, exclude=[o_proj]) for _ in range(repeats)]
    peaks = [peak for _, peak in runs]
    return {"saved": runs[0][0], "backward_peak": min(peaks), "backward_runs": peaks}


def _planned_attention(seq, ulysses, ring, chunks, kv_heads):
    from hybridsp.planner import MeshConfig, Techniques, Workload
    from hybridsp.planner._activations import attention_bytes_per_token
    from hybridsp.planner._phase_terms import attention_workspace_bytes

    model = _model(kv_heads)
    work = Workload(seq, dtype_bytes=E, techniques=Techniques(kv_mode="ring", head_chunks=chunks))
    tokens = seq // (ulysses * ring)
    return {
        "planned_saved": tokens * attention_bytes_per_token(model, ulysses, E, chunks, ring),
        "planned_backward": attention_workspace_bytes(model, work, MeshConfig(1, ulysses, ring)),
    }


def _row(term, measured, planned):
    return f"| {term} | {measured / 2**20:.2f} | {planned / 2**20:.2f} | {planned / measured - 1:+.1%} |"


def _late_frees(data: dict) -> str:
    """A note on the runs whose backward peaked above their rank's least (late frees, module docstring)."""
    extra = [run - rank["backward_peak"] for g in data.values() for rank in g["ranks"] for run in rank["backward_runs"]]
    late = [x for x in extra if x > 2**16]  # more than a small tensor
    if not late:
        return "Every run of every rank peaked at its least."
    return (
        f"{len(late)} of {len(extra)} runs peaked above their rank's least, by {min(late) / 2**20:.2f} to "
        f"{max(late) / 2**20:.2f} MiB (gloo freeing a finished collective's buffer late)."
    )


def _attention(args, ulysses, ring) -> tuple[list[str], dict]:
    """The attention rows of every G in ``--chunks`` (the largest rank's least) and their data."""
    from hybridsp.testing import run_distributed

    lines, data = [], {}
    for chunks in map(int, args.chunks.split(",")):
        ranks = run_distributed(
            rank_main, ulysses * ring, ulysses, ring, args.seq, chunks, args.kv_heads, args.repeats, timeout=900
        )
        planned = _planned_attention(args.seq, ulysses, ring, chunks, args.kv_heads)
        worst = max(ranks, key=lambda r: r["backward_peak"])
        data[chunks] = {"ranks": ranks, **planned}
        lines.append(_row(f"attention saved, G={chunks}", max(r["saved"] for r in ranks), planned["planned_saved"]))
        lines.append(
            _row(f"attention backward transient, G={chunks}", worst["backward_peak"], planned["planned_backward"])
        )
    return lines, data


def write_fixture(path: str, setup: dict, single: dict, attention: dict) -> None:
    """This mesh's measured terms (the largest rank's) into the fixture at ``path``, beside the other meshes'."""
    fixture = Path(path)
    data = json.loads(fixture.read_text()) if fixture.exists() else {}
    data["source"] = "benchmarks/memory/layer_terms.py (results/planner/layer_terms*.json), written by each run"
    data.setdefault("meshes", {})[f"U{setup['ulysses']}xR{setup['ring']}"] = {
        **setup,
        "mlp_saved": single["mlp"]["saved"],
        "mlp_backward": single["mlp"]["backward_peak"],
        "attention": {
            str(g): {
                "saved": max(rank["saved"] for rank in row["ranks"]),
                "backward": max(rank["backward_peak"] for rank in row["ranks"]),
            }
            for g, row in attention.items()
        },
    }
    fixture.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="2x2", help="U x R")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--chunks", default="1,2", help="head groups G, comma-separated")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="measurements per rank (its least counts)")
    parser.add_argument("--quick", action="store_true", help="S = 1024, mesh 2x1")
    parser.add_argument("--out", default=harness.results_path("planner", "layer_terms"))
    parser.add_argument("--fixture", default=str(FIXTURE), help="the planner tests' fixture ('' for none)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.mesh, args.fixture = 1024, "2x1", ""
    ulysses, ring = map(int, args.mesh.split("x"))
    started, load = time.perf_counter(), harness.load()
    single = _single(args.seq // (ulysses * ring))
    attention_lines, attention = _attention(args, ulysses, ring)
    out = "" if args.out == harness.results_path("planner", "layer_terms") else f" --out {args.out}"
    lines = [
        f"# One layer's memory terms: measured on this CPU against the planner (fp32, U={ulysses} x R={ring}, "
        f"S={args.seq:,}, h={HIDDEN}, H={H}, Hkv={args.kv_heads}, D={D}, I={INTER})",
        "",
        f"- `python -m benchmarks.memory.layer_terms --mesh {args.mesh} --seq {args.seq} --chunks {args.chunks} "
        f"--kv-heads {args.kv_heads} --repeats {args.repeats}{out}`; load {load}",
        "- MiB per rank; attention rows: the largest rank's least of its measurements; planned / measured - 1",
        "- saved: what saved-tensor hooks see; backward transient: the backward's peak above its start, frees of "
        "saved tensors counted, weight gradients not computed (the planner counts the saved bytes alive and adds this)",
        "",
        "| term | measured MiB | planned MiB | planned vs measured |",
        "|---|---|---|---|",
        _row("RMSNorm saved (its input and output excluded)", single["norm"]["saved"], single["norm"]["planned_saved"]),
        _row("MLP saved", single["mlp"]["saved"], single["mlp"]["planned_saved"]),
        _row("MLP backward transient", single["mlp"]["backward_peak"], single["mlp"]["planned_backward"]),
        *attention_lines,
        "",
        _late_frees(attention),
        "",
        f"Wall {time.perf_counter() - started:.0f} s.",
    ]
    setup = {"ulysses": ulysses, "ring": ring, "seq": args.seq, "kv_heads": args.kv_heads, "repeats": args.repeats}
    harness.write_results(args.out, "\n".join(lines), {"setup": setup, "single": single, "attention": attention})
    if args.fixture:
        write_fixture(args.fixture, setup, single, attention)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
