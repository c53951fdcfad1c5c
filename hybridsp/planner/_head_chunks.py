"""Head-chunked attention for the planner: which head-group counts G a mesh admits, and what G changes.

Each attention layer runs as G passes over groups of heads (grouped along K/V heads, so no K/V
head is sent twice): the all-to-all of one group's q/k/v, the ring over R for that group, the
reverse all-to-all of its output; the backward likewise one group at a time. What G changes:

Memory (per rank, :mod:`hybridsp.planner._attention_workspace` and
:func:`hybridsp.planner._activations.attention_bytes_per_token`)
    divides by G: one head group's share of the backward's working set, full-sequence for its
        H/(U G) heads: the fp32 dq/dk/dv accumulators, the kernel call's gradients and copies,
        the ring's K/V blocks and dK/dV in flight, the slot dout (U > 1).
    adds: the dq/dk/dv of every head, preallocated, T (H D + Hkv' (D + Dv)) e; the o_proj input's
        gradient stays alive through the call at U > 1 too.
    stays: what a layer saves for its backward, q/k/v/out of all heads and the fp32 LSE (the same
        bytes per local token before or after the all-to-all), and the o_proj input: the groups
        write a heads-first output that HF's reshape copies (at U = 1 too, where G = 1 on a ring
        hands o_proj a view of its dense output). The layer's other terms (norms, MLP,
        checkpoints, the loss, model states) do not see G.

Time (per layer and pass, :func:`hybridsp.planner._timing.all_to_all_seconds` and ``ring_timing``)
    all-to-all: A of one pass (q/k/v in and out back, or dout in and dq/dk/dv back) splits into G
        parts; the first group's waits, each later one overlaps the previous group's ring compute
        C / G: exposed = A / G + (G - 1) max(0, A / G - C / G) (G = 1: A).
    ring: G rings of blocks kv / G, each step's compute f / G: G x the ring formula at that size, so
        the per-step latency and launch overhead are paid G times.

Choices: G divides the K/V heads a Ulysses rank holds after the all-to-all, Hkv' / U
(:func:`head_chunk_choices`); ``head_chunks="auto"`` evaluates each and keeps the fastest plan
that fits (:func:`hybridsp.planner._candidates.evaluate`), and its memory is the largest G's.
"""

from __future__ import annotations

from hybridsp.planner._costs import expanded_kv_heads
from hybridsp.planner._specs import MeshConfig, ModelSpec, Workload


def head_chunk_choices(model: ModelSpec, ulysses: int) -> tuple[int, ...]:
    """Every G that splits a Ulysses rank's K/V heads evenly: the divisors of Hkv' / U."""
    heads = max(1, expanded_kv_heads(model, ulysses) // ulysses)
    return tuple(g for g in range(1, heads + 1) if heads % g == 0)


def resolved_head_chunks(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """The workload's G for this mesh; ``"auto"`` counts as the largest choice (the least memory of
    G > 1; the plan search evaluates every G, :func:`hybridsp.planner._candidates.evaluate`)."""
    chunks = workload.techniques.head_chunks
    if chunks == "auto":
        return head_chunk_choices(model, config.ulysses)[-1]
    assert isinstance(chunks, int)
    return chunks


def head_chunk_problem(model: ModelSpec, workload: Workload, config: MeshConfig) -> str | None:
    """Why a fixed G does not fit this mesh (None when it does, or for ``"auto"``)."""
    chunks = workload.techniques.head_chunks
    choices = head_chunk_choices(model, config.ulysses)
    if chunks == "auto" or chunks in choices:
        return None
    heads = choices[-1]
    return (
        f"head_chunks={chunks} does not divide the {heads} K/V heads a Ulysses rank holds at U={config.ulysses} "
        f"(choose one of {', '.join(map(str, choices))}, or 'auto')"
    )


def chunked_exposed(transfer_s: float, compute_s: float, chunks: int) -> float:
    """Exposed all-to-all seconds of one pass split into ``chunks`` groups, each overlapping the
    previous group's compute: A / G + (G - 1) max(0, (A - C) / G) (module docstring)."""
    if chunks == 1:
        return transfer_s
    return transfer_s / chunks + (chunks - 1) * max(0.0, (transfer_s - compute_s) / chunks)
