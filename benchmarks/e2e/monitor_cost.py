"""What does watching a run cost: the health metrics per step and the exactness probe, against no monitoring.

    python -m benchmarks run e2e.monitor_cost [--seq-len 2048] [--iters 7] [--out PREFIX]

A switched Llama (4 layers, hidden 256, 8 heads / 4 KV heads, vocabulary 8,192, fp32) on 4 gloo ranks
(U2 x R2) trains one micro-batch of one row per step (forward, backward, SGD update). Interleaved, in
rotating order, after a barrier: ``off`` (the step alone), ``health`` (the step inside
``RunMonitor.begin_step`` / ``end_step``: hooks, timings, one all_gather of 8 numbers; the hooks put on
and taken off around it, which the figure includes) and ``probe`` (one
``verify_parity`` on the step's batch row, what ``parity_every`` adds once per interval). Medians of the
per-iteration wall time (slowest rank). The cost at an interval N is ``probe / (N x off)``; the
health cost is ``health / off - 1`` on every step.
"""

from __future__ import annotations

import argparse

from benchmarks.common import harness

INTERVALS = (500, 2000)  # the example and hybridsp.monitor.MonitorConfig's default


def _rank(rank: int, world: int, seq_len: int, iters: int) -> dict:
    import torch
    import transformers

    import hybridsp
    from hybridsp.integrations.transformers import apply
    from hybridsp.monitor import MonitorConfig, RunMonitor

    mesh = hybridsp.init_mesh(2, 2)
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=seq_len,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    apply(model, mesh, backend="torch")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    ids = torch.randint(1, 8192, (1, seq_len), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    local = hybridsp.shard_batch(batch, mesh)

    def step() -> None:
        logits = model(
            input_ids=local["input_ids"], position_ids=local["position_ids"], hybridsp_documents=local["documents"]
        ).logits
        hybridsp.sharded_cross_entropy(logits, local["shift_labels"], mesh).backward()
        optimizer.step()
        optimizer.zero_grad()

    def health() -> None:  # the hooks go on and off around the step, so that "off" runs without them
        monitor = RunMonitor(model, mesh, MonitorConfig(parity_every=0))
        monitor.begin_step()
        step()
        monitor.end_step(0, 1.0)
        monitor.close()

    calls = {"off": step, "health": health, "probe": lambda: hybridsp.verify_parity(model, mesh, batch)}
    for call in calls.values():  # warm-up
        call()
    return harness.interleave(calls, iters)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--out", default=harness.results_path("monitor", "monitor_cost"))
    args = parser.parse_args(argv)
    load_before = harness.load()
    per_rank = harness.launch(_rank, 4, args.seq_len, args.iters, timeout=1800)
    found = {name: harness.combine([r[name] for r in per_rank]) for name in per_rank[0]}
    wall = {n: found[n]["median_wall"] for n in found}
    cpu = {n: found[n]["median_cpu"] for n in found}
    rows = {
        kind: {
            "step_off_s": m["off"],
            "step_with_health_s": m["health"],
            "health_overhead": m["health"] / m["off"] - 1.0,
            "probe_s": m["probe"],
            "probe_over_step": m["probe"] / m["off"],
            **{f"cost_at_{n}": m["probe"] / (n * m["off"]) for n in INTERVALS},
        }
        for kind, m in (("wall", wall), ("cpu", cpu))
    }
    lines = [
        f"| {kind} | {r['step_off_s']:.2f} s | {r['step_with_health_s']:.2f} s | {r['health_overhead'] * 100:+.1f}% | "
        f"{r['probe_s']:.1f} s | {r['probe_over_step']:.1f}x | "
        + " | ".join(f"{r[f'cost_at_{n}'] * 100:.2f}%" for n in INTERVALS)
        + " |"
        for kind, r in rows.items()
    ]
    markdown = "\n".join(
        [
            "# Monitoring cost: health every step, the probe per interval",
            "",
            f"Command: `{harness.command('benchmarks.e2e.monitor_cost', argv)}`; revision {harness.revision()}; "
            f"load {load_before} before, {harness.load()} after; {harness.machine_info()}; {harness.software_info()}.",
            "",
            f"Llama 4 layers, hidden 256, fp32, S = {args.seq_len}, U2 x R2 on 4 gloo ranks; {args.iters} interleaved "
            "rounds; medians of the slowest rank's wall time, and of the CPU time summed over the ranks (steadier "
            "on a shared machine).",
            "",
            "| median | step alone | step + health | health overhead | one probe | probe / step | "
            + " | ".join(f"cost at parity_every={n}" for n in INTERVALS)
            + " |",
            "|---|---|---|---|---|---|" + "---|" * len(INTERVALS),
            *lines,
            "",
        ]
    )
    print(markdown)
    harness.write_results(args.out, markdown, {"args": vars(args), "results": rows, "raw": found})
    return 0
