"""torch.compile of the main job's model against eager: step time, compile time, graph breaks.

    python -m benchmarks run e2e.compile                 # U2xR2 on 4 ranks, S = 4096, 7 rounds (~5 min)
    python -m benchmarks run e2e.compile --quick         # S = 1024, 3 rounds; the temp dir (or --out DIR)
    python -m benchmarks run e2e.compile --explain-only  # only the graph-break count

For "before" on an old revision: ``PYTHONPATH=<old checkout>:<this checkout> python -m benchmarks.e2e.compile
--explain-only``, started outside both checkouts (so that hybridsp comes from the old one).

The model is ``examples/train.py``'s on its defaults (Llama, hidden 256, 4 layers, 8 query / 4 K/V
heads, intermediate 640, byte vocabulary 256, tied embeddings), fp32 on the CPU, switched with
``hybridsp.integrations.transformers.apply``. Each rank builds two copies from one seed: ``eager``
and ``compiled`` (``torch.compile(model)``, inductor). One step is forward + ``sharded_cross_entropy``
+ backward on a packed batch (B = 1, four documents whose boundaries change every step, so a graph
that guarded on them would recompile). Reported:

1. **Compile time**: the first compiled step (wall, max over ranks; CPU, sum over ranks), minus the
   median compiled step after it.
2. **Step time**: both paths interleaved (``harness.interleave``, one warm-up each), medians of the
   per-step wall and CPU seconds; the ratio compiled / eager. Losses of both paths are compared.
3. **Graphs**: unique graphs and recompilations over every compiled step; ``torch._dynamo.explain``
   of one step of the switched model against the unswitched model's step on the full batch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

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
from benchmarks.common.packs import packed_lm_batch

MODEL = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=640,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)


def build(seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL, max_position_embeddings=max(seq, 2048)))


def packed_batch(step: int, seq: int) -> dict:
    """input_ids/labels [1, seq] of four documents over the byte vocabulary; the cuts move every step."""
    return packed_lm_batch(step, seq, rows=1, vocab=256, low=0)


def step_of(model, mesh, local: dict) -> float:
    """One forward + loss + backward; the loss value."""
    from hybridsp import sharded_cross_entropy

    out = model(
        input_ids=local["input_ids"],
        position_ids=local["position_ids"],
        hybridsp_documents=local["documents"],
        use_cache=False,
    )
    loss = sharded_cross_entropy(out.logits, local["shift_labels"], mesh)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


def explained_breaks(mesh, seq: int) -> dict:
    """Graph breaks (and graphs) of one step of the switched model and of the unswitched one."""
    from hybridsp import shard_batch, sharded_cross_entropy
    from hybridsp.integrations import transformers as hf

    plain, switched = build(seq), build(seq)
    hf.apply(switched, mesh)
    full = packed_batch(0, seq)
    local = shard_batch(full, mesh)

    def step(local):
        out = switched(
            input_ids=local["input_ids"],
            position_ids=local["position_ids"],
            hybridsp_documents=local["documents"],
            use_cache=False,
        )
        return sharded_cross_entropy(out.logits, local["shift_labels"], mesh)

    torch._dynamo.reset()
    ours = torch._dynamo.explain(step)(local)
    torch._dynamo.reset()
    theirs = torch._dynamo.explain(lambda batch: plain(**batch, use_cache=False).loss)(full)
    return {
        "switched_breaks": ours.graph_break_count,
        "switched_graphs": ours.graph_count,
        "unswitched_breaks": theirs.graph_break_count,
        "unswitched_graphs": theirs.graph_count,
        "reasons": sorted({str(reason.reason).split("\n")[0][:120] for reason in ours.break_reasons}),
    }


def measure(rank: int, world: int, ulysses: int, ring: int, seq: int, iters: int, explain_only: bool):
    from hybridsp import init_mesh, shard_batch
    from hybridsp.integrations import transformers as hf

    mesh = init_mesh(ulysses=ulysses, ring=ring)
    breaks = explained_breaks(mesh, seq)
    if explain_only:
        return breaks if rank == 0 else None
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    eager, model = build(seq), build(seq)
    hf.apply(eager, mesh)
    hf.apply(model, mesh)
    compiled = torch.compile(model)
    batches = [shard_batch(packed_batch(step, seq), mesh) for step in range(2 * iters + 3)]
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    first_loss = step_of(compiled, mesh, batches[0])
    first = {"wall": [time.perf_counter() - start], "cpu": [time.process_time() - cpu_start]}
    eager_loss = step_of(eager, mesh, batches[0])
    feed = iter(batches[1:])
    losses = {"eager": [], "compiled": []}

    def timed(name, runner):
        return lambda: losses[name].append(step_of(runner, mesh, next(feed)))

    times = interleave({"eager": timed("eager", eager), "compiled": timed("compiled", compiled)}, iters + 1)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"first": first, "times": times})
    if rank != 0:
        return None
    stats = {"graphs": counters["stats"]["unique_graphs"], "recompiles": sum(counters["recompiles"].values())}
    first_step = combine([r["first"] for r in per_rank])
    paths = {
        name: combine([{k: v[1:] for k, v in r["times"][name].items()} for r in per_rank])
        for name in ("eager", "compiled")
    }  # the first interleaved round is the warm-up
    return {"first": first_step, "paths": paths, "losses": {"first": [first_loss, eager_loss]}, **stats, **breaks}


def report(result: dict, args) -> str:
    eager, compiled = result["paths"]["eager"], result["paths"]["compiled"]
    compile_wall = result["first"]["median_wall"] - compiled["median_wall"]
    compile_cpu = result["first"]["median_cpu"] - compiled["median_cpu"]
    lines = [
        f"# torch.compile of the main job's model (U{args.ulysses}xR{args.ring}, S={args.seq}, fp32, inductor)",
        "",
        f"{machine_info()}; load {result['load_before']} before, {load()} after; revision {revision()}",
        "",
        "| | eager | compiled | compiled / eager |",
        "|---|---|---|---|",
        f"| step wall (median, max over ranks) | {eager['median_wall']:.3f} s | {compiled['median_wall']:.3f} s | "
        f"{compiled['median_wall'] / eager['median_wall']:.3f} |",
        f"| step CPU (median, sum over ranks) | {eager['median_cpu']:.3f} s | {compiled['median_cpu']:.3f} s | "
        f"{compiled['median_cpu'] / eager['median_cpu']:.3f} |",
        "",
        f"Compile time (first compiled step minus a compiled step): {compile_wall:.1f} s wall, {compile_cpu:.1f} s "
        f"CPU summed over {args.ulysses * args.ring} ranks.",
        "",
        f"Graphs over {2 * args.iters + 3} compiled steps on batches with new documents: {result['graphs']} unique, "
        f"{result['recompiles']} recompilations. `torch._dynamo.explain` of one step: switched "
        f"{result['switched_breaks']} breaks / {result['switched_graphs']} graphs, unswitched "
        f"{result['unswitched_breaks']} / {result['unswitched_graphs']}.",
        "",
        f"First-step losses compiled / eager: {result['losses']['first'][0]:.6f} / {result['losses']['first'][1]:.6f}.",
        "",
        f"{args.iters} interleaved rounds after one warm-up; per-round CPU seconds: eager "
        f"{[round(x, 3) for x in eager['cpu']]}, compiled {[round(x, 3) for x in compiled['cpu']]}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--explain-only", action="store_true")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--ulysses", type=int, default=2)
    parser.add_argument("--ring", type=int, default=2)
    parser.add_argument(
        "--out", help="folder for compile_s<S>.{md,json} (default benchmarks/results/compile; quick: the temp dir)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.iters = 1024, 3
    before = load()
    result = launch(
        measure,
        args.ulysses * args.ring,
        args.ulysses,
        args.ring,
        args.seq,
        args.iters,
        args.explain_only,
        timeout=3600,
    )[0]
    if args.explain_only:
        print(result)
        return 0
    result["load_before"] = before
    markdown = report(result, args)
    print(markdown)
    name = f"compile_s{args.seq}"
    prefix = (
        str(Path(args.out) / name)
        if args.out
        else results_path("compile", name)
        if not args.quick
        else str(Path(tempfile.gettempdir()) / name)
    )
    write_results(prefix, markdown, {**result, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
