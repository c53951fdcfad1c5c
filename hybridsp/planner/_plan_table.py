"""The ``plan`` command's text output: the ranked plans as a table with each plan's reason, the
recommendation and the rejected meshes (:func:`format_result`)."""

from __future__ import annotations

from hybridsp.planner._ablation import recommendation_lines
from hybridsp.planner._candidates import CandidatePlan, format_seconds, memory_of
from hybridsp.planner._search import PlanResult, SearchSpace
from hybridsp.planner._specs import GIB

FORWARD_ONLY_VS_TENSOR = (
    "--forward-only plans a training-style mesh (DP x Ulysses x ring, every rank holds the weights or a ZeRO-3 shard) "
    "for one prefill without a K/V cache; --tensor-inference plans T x Ulysses x ring meshes that also split the "
    "weights and the K/V cache's heads T ways (hybridsp.planner._tensor)"
)


def _why(plan: CandidatePlan) -> str:
    """The table's short reason: what keeps this plan from being faster or from fitting."""
    if not plan.fits:
        return f"needs {memory_of(plan).total / GIB:.1f} GiB"
    topology, timing = plan.topology, plan.timing
    assert topology is not None and timing is not None  # a plan that fits is valid: evaluate() set its costs
    parts = []
    if plan.config.ulysses > 1 and topology.ulysses_crosses_nodes:
        parts.append("all-to-all crosses nodes")
    ring = timing.ring
    if ring is not None and not (ring.forward_hidden and ring.backward_hidden):
        parts.append(f"ring exposed {format_seconds(ring.exposed_s)}")
    if timing.zero_exposed_s > 0:
        parts.append(f"ZeRO exposed {format_seconds(timing.zero_exposed_s)}")
    return ", ".join(parts)


def _row(index: int, plan: CandidatePlan, best: CandidatePlan | None) -> str:
    c, t, topology = plan.config, plan.timing, plan.topology
    assert t is not None and topology is not None  # ranked plans are valid: evaluate() set their costs
    mark = "*" if plan is best else " "
    ratio = f"x{plan.seconds_per_sequence / best.seconds_per_sequence:.3f}" if best else "-"
    a2a = "-" if c.ulysses == 1 else ("xnode" if topology.ulysses_crosses_nodes else "node")
    ring = "-" if t.ring is None else ("xnode" if t.ring.link == "inter" else "node")
    ckpt = "on" if c.checkpointing else "off"
    return (
        f"{index:>3}{mark} {c.dp:>3} {c.ulysses:>3} {c.ring:>3} {c.zero_stage:>4} {ckpt:>4} "
        f"{plan.step_s:>9.3f} {ratio:>7} {plan.tokens_per_s:>10.0f} {memory_of(plan).total / GIB:>7.1f} "
        f"{t.all_to_all_s:>7.3f} {t.ring_exposed_s:>7.3f} {a2a:>5} {ring:>5}  {_why(plan)}"
    )


def format_result(result: PlanResult, top: int = 12, space: SearchSpace | None = None) -> str:
    """The ranked table, the recommendation and the rejected meshes, as text."""
    w, cl = result.workload, result.cluster
    header = (
        f"{result.model.name}: {result.model.total_params / 1e9:.2f}B params, seq {w.seq_len:,} x micro-batch "
        f"{w.micro_batch}{' (forward only)' if w.forward_only else ''} on {cl.name} "
        f"({cl.world_size} GPUs, {cl.peak_flops / 1e12:.0f} TFLOP/s x {cl.efficiency:g}, "
        f"{cl.memory_bytes / GIB:.0f} GiB, intra {cl.intra_bw / 1e9:g} GB/s, inter {cl.inter_bw / 1e9:g} GB/s)"
    )
    columns = (
        f"{'#':>4} {'DP':>3} {'U':>3} {'R':>3} {'ZeRO':>4} {'ckpt':>4} {'step s':>9} {'vs *':>7} "
        f"{'tokens/s':>10} {'mem GiB':>7} {'a2a s':>7} {'ring s':>7} {'a2a':>5} {'ring':>5}  why"
    )
    shown = result.ranked if top <= 0 else result.ranked[:top]
    lines = [header, "", columns] + [_row(i + 1, p, result.recommended) for i, p in enumerate(shown)]
    if len(shown) < len(result.ranked):
        lines.append(f"     ... {len(result.ranked) - len(shown)} more (--top 0 shows all)")
    lines += [""] + recommendation_lines(result, space or SearchSpace())
    if w.forward_only:
        lines += ["", f"Note: {FORWARD_ONLY_VS_TENSOR}."]
    if result.rejected:
        lines += ["", f"Rejected meshes ({len(result.rejected)}):"]
        lines += [
            f"  DP={p.config.dp} U={p.config.ulysses} R={p.config.ring}: {'; '.join(p.problems)}"
            for p in result.rejected
        ]
    return "\n".join(lines)
