"""The planner's longest context for Llama-3 8B / 70B on H100 / H200 clusters (pure arithmetic).

    python -m hybridsp plan --clusters                    # prints a markdown table
    python -m hybridsp plan --clusters --out PATH.json    # and writes the rows

For each model, GPU and cluster size (8 GPUs per node, NVLink inside a node, InfiniBand between
nodes: ``hybridsp.planner.preset_cluster(gpu, nodes, 8, "nvlink", "ib")``), bf16 activations,
micro-batch 1, ZeRO-3, activation checkpointing on or off as the planner chooses:
``hybridsp.planner.longest_context`` finds the longest sequence (a multiple of ``--granularity``)
that some DP x U x R plan fits, and the table shows the plan the planner recommends at that
length with its predicted step time, tokens/s and MFU. The planner's defaults are kept: 50% of
peak FLOP/s achieved, 4 GiB reserved per GPU, mixed-precision Adam (16 bytes/param), full
logits materialised (the ``chunked loss`` column repeats the search with ``chunked_loss=True``).
The ``loss at 14 B`` column is a what-if, not the planner: the same search with the loss term
set to 14 bytes per token x vocabulary entry instead of the planner's ``e + 4 = 6``, the peak
measured for this loss path in bf16 (bf16 logits kept by the training step, the fp32 copy's
saved log-softmax and two fp32 gradients at the start of the backward; see
``bench_longest_context.bf16_checks``).
"""

from __future__ import annotations

import dataclasses
import time

from hybridsp.planner._candidates import memory_of
from hybridsp.planner._costs import local_tokens
from hybridsp.planner._memory import memory_use
from hybridsp.planner._search import SearchSpace, longest_context
from hybridsp.planner._specs import GIB, MODELS, preset_cluster

MEASURED_LOSS_BYTES = 14  # bf16 loss path's peak per token x vocabulary entry (bench_longest_context.bf16_checks)
MODEL_NAMES = ("llama3-8b", "llama3-70b")
GPUS = ("h100", "h200")
SIZES = (8, 16, 32, 64, 128, 256, 512)
PER_NODE = 8


def loss_at(bytes_per_entry: int):
    """What-if memory model: :func:`~hybridsp.planner._memory.memory_use` with the (unfused) training
    loss counted at ``bytes_per_entry`` bytes per token x vocabulary entry (for ``longest_context``'s
    ``memory_of``; the plans it ranks keep the planner's own)."""

    def memory_of(model, workload, config):
        use = memory_use(model, workload, config)
        if workload.chunked_loss or workload.forward_only:
            return use
        return dataclasses.replace(use, logits=local_tokens(workload, config) * model.vocab_size * bytes_per_entry)

    return memory_of


def predict(model_name: str, gpu: str, world: int, granularity: int) -> dict:
    """The longest context on ``world`` GPUs and the recommended plan there (ZeRO-3, checkpointing free)."""
    model = MODELS[model_name]
    cluster = preset_cluster(gpu, world // PER_NODE, PER_NODE, "nvlink", "ib")
    space = SearchSpace(zero_stages=(3,), checkpointing=(False, True))
    found = longest_context(model, cluster, granularity=granularity, dtype_bytes=2, space=space)
    chunked = longest_context(model, cluster, granularity=granularity, dtype_bytes=2, space=space, chunked_loss=True)
    what_if = longest_context(
        model, cluster, granularity=granularity, dtype_bytes=2, space=space, memory_of=loss_at(MEASURED_LOSS_BYTES)
    ).seq_len
    row = {
        "model": model_name,
        "gpu": gpu,
        "gpus": world,
        "nodes": world // PER_NODE,
        "seq_len": found.seq_len,
        "seq_len_chunked_loss": chunked.seq_len,
        "seq_len_loss_14b": what_if,
        "granularity": granularity,
    }
    best = found.result.recommended if found.result else None
    if best is None:
        return row
    c, t, m, topology = best.config, best.timing, memory_of(best), best.topology
    assert t is not None and topology is not None  # evaluate() sets every cost of a valid plan
    row.update(
        dp=c.dp,
        ulysses=c.ulysses,
        ring=c.ring,
        zero_stage=c.zero_stage,
        checkpointing=c.checkpointing,
        step_s=best.step_s,
        tokens_per_s=best.tokens_per_s,
        mfu=best.mfu(cluster.peak_flops),
        compute_s=t.compute_s,
        all_to_all_s=t.all_to_all_s,
        ring_exposed_s=t.ring_exposed_s,
        zero_exposed_s=t.zero_exposed_s,
        all_to_all_crosses_nodes=topology.ulysses_crosses_nodes,
        ring_crosses_nodes=topology.ring_crosses_nodes,
        memory_gib={
            "total": m.total / GIB,
            "model_states": m.model_states / GIB,
            "activations": m.activations / GIB,
            "logits": m.logits / GIB,
            "workspace": m.workspace / GIB,
            "usable": best.usable_bytes / GIB,
        },
    )
    if chunked.result and chunked.result.recommended:
        cc = chunked.result.recommended.config
        row["chunked_plan"] = f"{cc.dp}x{cc.ulysses}x{cc.ring}{' ckpt' if cc.checkpointing else ''}"
    return row


def _tokens(n: int) -> str:
    return f"{n / 2**20:.2f}M" if n >= 2**20 else f"{n // 1024}K"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | GPU | GPUs (nodes) | longest context | DP x U x R | ckpt | step s | tokens/s | MFU "
        "| memory GiB: states / act / logits / work | exposed a2a / ring / ZeRO s | chunked loss: longest (plan) "
        "| what-if: loss at 14 B |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "dp" not in r:
            lines.append(
                f"| {r['model']} | {r['gpu']} | {r['gpus']} ({r['nodes']}) | nothing fits | | | | | | | | "
                f"{r['seq_len_chunked_loss']:,} | {r['seq_len_loss_14b']:,} |"
            )
            continue
        m = r["memory_gib"]
        where = " (a2a crosses nodes)" if r["all_to_all_crosses_nodes"] else ""
        lines.append(
            f"| {r['model']} | {r['gpu']} | {r['gpus']} ({r['nodes']}) | {r['seq_len']:,} ({_tokens(r['seq_len'])}) | "
            f"{r['dp']} x {r['ulysses']} x {r['ring']}{where} | {'on' if r['checkpointing'] else 'off'} | "
            f"{r['step_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.0%} | "
            f"{m['total']:.1f} = {m['model_states']:.1f} / {m['activations']:.1f} / {m['logits']:.1f} / "
            f"{m['workspace']:.1f} | {r['all_to_all_s']:.2f} / {r['ring_exposed_s']:.2f} / {r['zero_exposed_s']:.2f} | "
            f"{r['seq_len_chunked_loss']:,} ({r.get('chunked_plan', '-')}) | {r['seq_len_loss_14b']:,} "
            f"({(r['seq_len_loss_14b'] - r['seq_len']) / r['seq_len']:+.0%}) |"
        )
    return "\n".join(lines)


def run(granularity: int = 1024) -> tuple[list[dict], float]:
    """Every model x GPU x size of the module's lists: (rows, seconds)."""
    started = time.perf_counter()
    rows = [predict(model, gpu, world, granularity) for model in MODEL_NAMES for gpu in GPUS for world in SIZES]
    return rows, time.perf_counter() - started
