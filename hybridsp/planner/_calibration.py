"""The measured CPU ablation's setup as planner queries (``benchmarks/bench_ablation.py``).

The benchmark trains the example model of ``examples/train.py`` (``base``: its ModelSpec, with
``layers`` and ``vocab`` varied) at cp8 = U4 x R2 on 8 gloo ranks, ZeRO-3, fp32, under a
per-rank memory budget that starts after the engine build; these functions ask the planner the
same questions, so the benchmark prints and the calibration test asserts the same predictions.
Techniques are named as the benchmark's rows name them (``fused_loss``, ``tiled_mlp``,
``checkpointing``, ``activation_offload``).
"""

from __future__ import annotations

from dataclasses import replace

from hybridsp.planner._memory import MemoryUse, memory_use
from hybridsp.planner._search import SearchSpace, longest_context
from hybridsp.planner._specs import MeshConfig, ModelSpec, Workload, preset_cluster
from hybridsp.planner._techniques import Techniques

WORLD, ULYSSES, RING, ZERO_STAGE = 8, 4, 2, 3
DTYPE_BYTES = 4  # fp32


def model_spec(base: ModelSpec, vocab: int, layers: int) -> ModelSpec:
    """``base`` with ``layers`` layers and a vocabulary of ``vocab`` (tied embeddings)."""
    return replace(
        base,
        num_layers=layers,
        vocab_size=vocab,
        tied_embeddings=True,
        name=f"examples/train.py, L={layers}, V={vocab}",
    )


def techniques(names) -> Techniques:
    """The planner's Techniques for a row's technique names (copies synchronous on CPU, so no
    offload in flight; gloo keeps one temporary per all-gather / reduce-scatter)."""
    return Techniques(
        fused_loss="fused_loss" in names,
        tiled_mlp="tiled_mlp" in names,
        activation_offload="activation_offload" in names,
        offload_in_flight=0,
        collective_copies=1,
    )


def memory(base: ModelSpec, vocab: int, layers: int, names, seq_len: int) -> MemoryUse:
    """The planner's per-rank memory of one measured step at ``seq_len`` tokens."""
    return memory_use(
        model_spec(base, vocab, layers),
        Workload(seq_len, dtype_bytes=DTYPE_BYTES, techniques=techniques(names)),
        MeshConfig(WORLD // (ULYSSES * RING), ULYSSES, RING, ZERO_STAGE, "checkpointing" in names),
    )


def longest(base: ModelSpec, vocab: int, layers: int, names, budget: int, granularity: int) -> int:
    """Longest context in the planner's model when each rank has ``budget`` bytes after the engine
    build: a 1 x 8 "cluster" whose memory is the budget plus the parameter, gradient and optimizer
    partitions and the engine's state, nothing reserved, the measured mesh, ZeRO-3 and checkpointing."""
    m = memory(base, vocab, layers, names, 2 * ULYSSES * RING)
    after_build = m.params + m.grads + m.optimizer + m.engine_state
    cluster = preset_cluster(
        "h100",
        1,
        WORLD,
        memory_bytes=float(budget + after_build),
        reserved_bytes=0.0,
        name=f"this machine: 1 x {WORLD} ranks",
    )
    space = SearchSpace(
        zero_stages=(ZERO_STAGE,), checkpointing=("checkpointing" in names,), dp=1, ulysses=ULYSSES, ring=RING
    )
    return longest_context(
        model_spec(base, vocab, layers),
        cluster,
        granularity=granularity,
        dtype_bytes=DTYPE_BYTES,
        space=space,
        techniques=techniques(names),
    ).seq_len


def attempt(base: ModelSpec, vocab: int, layers: int, names, seq_len: int) -> dict:
    """The planner's numbers for one attempt; ``step`` includes the gathered ZeRO-3 parameters,
    which the measured step allocates (the limit starts after the engine build)."""
    m = memory(base, vocab, layers, names, seq_len)
    return {"total": m.total, "step": m.step + m.gathered_params, "host": m.host, "peak_phase": m.peak_phase}
