"""Every benchmark: its name (the module under ``benchmarks/``), the question it answers, its results folder
and the options of its small run (``python -m benchmarks run NAME --quick``).

Standard library only: ``python -m benchmarks list`` reads this table without importing any benchmark.
In ``quick``, ``{tmp}`` is the run's temporary folder and ``{root}`` this checkout (the tree a before /
after benchmark then compares with itself).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str  # group.module under benchmarks/; the module has main(argv) -> exit status
    question: str
    results: str  # its folder, relative to benchmarks/
    quick: tuple[str, ...]  # the script's own small-run options, writing under {tmp}

    @property
    def module(self) -> str:
        return f"benchmarks.{self.name}"


BENCHMARKS = (
    # planner
    Benchmark(
        "memory.layer_terms",
        "Does the planner's memory model of one decoder layer match this machine, term by term (any G)?",
        "results/planner",
        ("--quick", "--chunks", "1", "--out", "{tmp}/layer_terms"),
    ),
    # attention
    Benchmark(
        "attention.peers",
        "Is hybridsp faster than the peers (DeepSpeed-Ulysses, yunchang USP)?",
        "results/peers",
        ("--quick", "--out", "{tmp}/peers"),
    ),
    Benchmark(
        "attention.kv_comm",
        "How many bytes go on the wire (K/V communication), and at what bf16 error?",
        "results/kv_comm",
        ("--quick", "--out", "{tmp}/kv_comm"),
    ),
    Benchmark(
        "attention.ring_cost",
        "What does the ring cost in compute, and is causal work balanced?",
        "results/ring_cost",
        ("--seq-len", "1024", "--repeats", "1", "--out", "{tmp}/ring_cost.jsonl"),
    ),
    Benchmark(
        "attention.kernel_bound",
        "How far is one sharded attention call from the kernel-bound limit, and where does the rest go?",
        "results/ring_cost",
        ("--seq-len", "1024", "--repeats", "1", "--rounds", "1", "--out", "{tmp}"),
    ),
    Benchmark(
        "attention.core_shape",
        "What do plan building and the wrapper cost (before -> after a change)?",
        "results/core_shape",
        ("--before", "{root}", "--rounds", "1", "--prefix", "{tmp}/core_shape"),
    ),
    Benchmark(
        "attention.call_overhead",
        "What does one attention call cost beyond its kernels, before -> after?",
        "results/core_shape",
        ("--before", "{root}", "--rounds", "1", "--out", "{tmp}"),
    ),
    Benchmark(
        "attention.sinks_mla",
        "Sinks, MLA head dims, soft-capping: bytes and time against the plain path?",
        "results/sinks_mla",
        ("--quick", "--out", "{tmp}/sinks_mla"),
    ),
    Benchmark(
        "attention.masks",
        "Packed documents and sliding windows on the ring: work balance and bytes?",
        "results/masks",
        ("--seq-len", "1024", "--repeats", "1", "--out", "{tmp}"),
    ),
    Benchmark(
        "attention.documents",
        "Many tiny documents: does the time follow the cells or the document count?",
        "results/packed",
        ("--quick", "--out", "{tmp}"),
    ),
    Benchmark(
        "attention.linear",
        "Linear-attention layers: what does exact state passing cost per layer and rank?",
        "results/linear",
        ("--seq-len", "512", "--iters", "1", "--out", "{tmp}/linear"),
    ),
    # memory
    Benchmark(
        "memory.loss",
        "Memory: the loss with and without logits (fused cross-entropy)?",
        "results/memory",
        ("--part", "loss", "--tokens", "1024", "--repeats", "1", "--out", "{tmp}/loss"),
    ),
    Benchmark(
        "memory.a2a",
        "Memory: the Ulysses all-to-all against DeepSpeed-Ulysses?",
        "results/memory",
        ("--worlds", "4", "--seq", "2048", "--repeats", "1", "--out", "{tmp}/a2a_memory.json"),
    ),
    Benchmark(
        "memory.head_chunks",
        "Head-chunked attention: memory per rank of one layer and of a step, by head groups G?",
        "results/head_chunks",
        ("--quick", "--part", "layer", "--out", "{tmp}"),
    ),
    Benchmark(
        "memory.step_peak",
        "What is live at the per-rank peak of one ALST-comparison step (best features), by who made it?",
        "results/memory",
        ("--seq-len", "2048", "--out", "{tmp}/step_peak"),
    ),
    Benchmark(
        "memory.tensor_parallel",
        "Tensor parallelism x hybrid SP: parameters and activations per rank?",
        "results/tensor_parallel",
        ("--seq", "256", "--out", "{tmp}/tensor_memory"),
    ),
    Benchmark(
        "memory.vlm",
        "Vision-language: a long video as one sequence, memory per rank?",
        "results/vlm",
        ("--frames", "16", "--size", "112", "--iters", "1", "--out", "{tmp}/vlm_memory"),
    ),
    Benchmark(
        "memory.fsdp2",
        "Under FSDP2, do parameters, gradients and optimizer state shard over all W = DP x U x R ranks, and what"
        " does each rank hold against plain FSDP2 and hybridsp's ZeRO-3 path?",
        "results/fsdp2",
        ("--quick", "--out", "{tmp}/fsdp2_memory"),
    ),
    Benchmark(
        "memory.rl_scoring",
        "GRPO / RLOO scoring at a long completion: memory per rank?",
        "results/rl",
        ("--completion", "512", "--prompt", "128", "--repeats", "1", "--out", "{tmp}/rl_scoring"),
    ),
    # longest context
    Benchmark(
        "longest.context",
        "The longest context a training step survives, measured against the planner?",
        "results/longest_context",
        ("--quick", "--out", "{tmp}/longest_context"),
    ),
    Benchmark(
        "longest.ablation",
        "The longest context as memory techniques are added (fused loss, tiled MLP, checkpointing, offload)?",
        "results/longest_context",
        ("--rows", "none", "--vocab", "256", "--at", "1024", "--out", "{tmp}", "--fixture", ""),
    ),
    Benchmark(
        "longest.planner_ablation",
        "What does the planner answer for Llama-3-8B on 8 / 32 / 64 H100, technique by technique, and where do the GiB go?",
        "results/planner",
        ("--nodes", "1", "--out", "{tmp}/ablation_planner"),
    ),
    # packed documents
    Benchmark(
        "packed.layout",
        "Packed documents: does the balanced layout balance end to end, and what does it ship?",
        "results/packed",
        ("--packs", "1", "--repeats", "1", "--out", "{tmp}/packed_layout"),
    ),
    Benchmark(
        "packed.balance",
        "Packed documents: balance and K/V rows of the layouts at the plan level?",
        "results/packed",
        ("--seeds", "1", "--repeats", "1", "--out", "{tmp}/balance"),
    ),
    Benchmark(
        "packed.balance_windows",
        "Packed documents with sliding windows: does placing for the window balance?",
        "results/packed",
        ("--seeds", "2", "--out", "{tmp}/balance_windows"),
    ),
    # end to end against ALST
    Benchmark(
        "alst.compare",
        "End to end against DeepSpeed's ALST: parity, time, memory, longest S, ALST's gradient defects?",
        "results/alst",
        ("--part", "parity", "--world", "2", "--seq-len", "256", "--layers", "2", "--steps", "1", "--out", "{tmp}"),
    ),
    # whole jobs
    Benchmark(
        "e2e.compile",
        "torch.compile of the main job's model: graph breaks, compile time, compiled / eager?",
        "results/compile",
        ("--quick", "--out", "{tmp}"),
    ),
    Benchmark(
        "e2e.generate",
        "Decoding against a sharded K/V cache: cache per rank and latency?",
        "results/generate",
        (
            "--contexts",
            "1024",
            "--meshes",
            "w1",
            "u2r2",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--out",
            "{tmp}/generate.json",
        ),
    ),
    Benchmark(
        "e2e.trainer_grad_scale",
        "HF Trainer: is the gradient scale right against the plain Trainer?",
        "results/trainer",
        ("--stages", "1", "--out", "{tmp}/trainer_grad_scale.json"),
    ),
    Benchmark(
        "e2e.monitor_cost",
        "What do run health (every step) and the exactness probe (per interval) cost against no monitoring?",
        "results/monitor",
        ("--seq-len", "256", "--iters", "1", "--out", "{tmp}/monitor_cost"),
    ),
    Benchmark(
        "e2e.diffusers_cp",
        "Against diffusers' own context parallelism at the same degrees, what does hybridsp's switch cost per rank?",
        "results/diffusers_cp",
        ("--quick", "--out", "{tmp}/diffusers_cp"),
    ),
    Benchmark(
        "e2e.soak",
        "Soak: does memory stay flat over a long run of the main job?",
        "results/soak",
        ("--steps", "60", "--seq-len", "512", "--after", "50", "--out", "{tmp}/soak.md"),
    ),
    # accelerator
    Benchmark(
        "gpu.check",
        "Accelerator check: flash / CUDA correctness, ring blocking, offload, lean norms (GPU)?",
        "results/gpu_check",
        ("--quick", "--out", "{tmp}"),
    ),
)


def find(name: str) -> Benchmark:
    """The benchmark called ``name``, or whose last part is ``name`` when only one is (``peers``)."""
    matches = [b for b in BENCHMARKS if b.name == name] or [b for b in BENCHMARKS if b.name.split(".")[-1] == name]
    if len(matches) != 1:
        known = ", ".join(b.name for b in BENCHMARKS)
        raise KeyError(f"no benchmark {name!r}" + (" (ambiguous)" if matches else "") + f"; known: {known}")
    return matches[0]
