"""The ablation: the longest context as memory techniques are added one at a time, in order.

    python -m hybridsp plan --model llama3-8b --gpu h100 --nodes 1 --gpus-per-node 8 \\
        --longest-context --ablation [--json]

Each row switches on one more technique of ``ABLATION_ORDER`` (fused loss, tiled MLP,
activation offload, optimizer offload; the first row has none) and reports the longest
sequence some plan fits, the plan (DP x U x R, ZeRO stage, checkpointing) and every memory
term of it, device and host (:mod:`hybridsp.planner._memory`).

:func:`no_fit_hint` is the same idea at one sequence length, for ``plan --seq-len`` when nothing
fits: every technique that is off in the search is tried alone (and all together), and the hint
names those that lower the memory needed; :func:`tie_note` says why a slower plan was picked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from hybridsp.planner import _search as search
from hybridsp.planner._candidates import CandidatePlan, format_seconds, memory_of
from hybridsp.planner._memory import memory_use
from hybridsp.planner._search import LongestContext, PlanResult, SearchSpace, longest_context
from hybridsp.planner._specs import GIB, ClusterSpec, ModelSpec, Workload
from hybridsp.planner._techniques import ABLATION_ORDER, Techniques


@dataclass(frozen=True)
class AblationRow:
    """The longest context with ``techniques`` switched on (cumulative, in ``ABLATION_ORDER``)."""

    techniques: tuple[str, ...]
    longest: LongestContext
    why: str = ""  # nothing fits: what the previous row's plan would need with this row's techniques

    @property
    def plan(self) -> CandidatePlan | None:
        return self.longest.result.recommended if self.longest.result else None

    def to_dict(self) -> dict:
        """The contract row ``{"techniques", "longest_context", "dp", "ulysses", "ring"}`` plus the
        chosen ZeRO stage, checkpointing and the memory terms of the recommended plan."""
        best = self.plan
        row = {
            "techniques": list(self.techniques),
            "longest_context": self.longest.seq_len,
            "dp": best.config.dp if best else None,
            "ulysses": best.config.ulysses if best else None,
            "ring": best.config.ring if best else None,
        }
        if best is not None:
            memory, timing = memory_of(best), best.timing
            assert timing is not None  # evaluate() sets every cost of a valid plan
            row.update(
                zero_stage=best.config.zero_stage,
                activation_checkpointing=best.config.checkpointing,
                step_s=best.step_s,
                tokens_per_s=best.tokens_per_s,
                peak_phase=memory.peak_phase,
                memory={
                    **{k: v for k, v in asdict(memory).items() if k != "phases"},
                    "phases": dict(memory.phases),
                    "total": memory.total,
                    "host": memory.host,
                },
                usable_bytes=best.usable_bytes,
                host_usable_bytes=best.host_usable_bytes,
                host_traffic_bytes=timing.host_traffic_bytes,
                offload_s=timing.offload_s,
            )
        return row


def ablation(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    base: Techniques | None = None,
    order: tuple[str, ...] = ABLATION_ORDER,
    **longest_options,
) -> list[AblationRow]:
    """Longest context with no technique, then adding each of ``order`` in turn (cumulative).

    ``base`` carries the techniques' settings (chunk and tile sizes, keep_last, K/V mode);
    its on/off switches are replaced row by row. ``longest_options`` go to :func:`longest_context`.
    """
    base = base or Techniques()
    rows: list[AblationRow] = []
    for count in range(len(order) + 1):
        names = tuple(order[:count])
        longest = longest_context(model, cluster, techniques=base.with_only(names), **longest_options)
        fitted = [row for row in rows if row.plan is not None]
        why = _why_nothing(fitted[-1], base.with_only(names), model, cluster) if fitted and not longest.seq_len else ""
        rows.append(AblationRow(names, longest, why))
    return rows


TERMS = ("checkpoints", "activations", "logits", "workspace", "params", "grads", "optimizer", "gathered_params")


def _why_nothing(previous: AblationRow, techniques: Techniques, model: ModelSpec, cluster: ClusterSpec) -> str:
    """Nothing fits: the previous row's plan and length with these techniques, and the term that grew most."""
    best = previous.plan
    if best is None or previous.longest.result is None:
        return ""
    workload = previous.longest.result.workload
    before = memory_of(best)
    after = memory_use(
        model, replace(workload, techniques=replace(techniques, head_chunks=best.head_chunks)), best.config
    )
    grew = max(TERMS, key=lambda term: getattr(after, term) - getattr(before, term))
    return (
        f"at the last fitting row's plan and length ({workload.seq_len:,}) it needs {after.total / GIB:.1f} GiB of "
        f"{cluster.usable_bytes / GIB:.1f} ({after.peak_phase} peak): {grew} {getattr(before, grew) / GIB:.1f} -> "
        f"{getattr(after, grew) / GIB:.1f} GiB"
        + (
            f"; the fused loss keeps a full fp32 LM-head weight gradient (V h 4 = "
            f"{model.embedding_params * 4 / GIB:.1f} GiB) and, in bf16, makes each chunk's V h product and its fp32 "
            f"cast (hybridsp/losses/_fused.py), a fixed cost the [T, V] logits it replaces exceed only at longer T"
            if grew == "logits" and "fused_loss" in techniques.names
            else ""
        )
    )


def _mesh(plan: CandidatePlan | None) -> str:
    return "-" if plan is None else f"{plan.config.dp} x {plan.config.ulysses} x {plan.config.ring}"


def format_ablation(rows: list[AblationRow], model: ModelSpec, cluster: ClusterSpec) -> str:
    """The ablation as a Markdown table with every memory term of each row's plan (GiB per GPU)."""
    lines = [
        f"Ablation: longest context of {model.name} on {cluster.name} ({cluster.world_size} GPUs, "
        f"{cluster.memory_bytes / GIB:.0f} GiB, {cluster.reserved_bytes / GIB:g} GiB reserved; host "
        f"{cluster.host_memory_bytes / GIB:,.0f} GiB per node, PCIe {cluster.host_bw / 1e9:g} GB/s)",
        "",
        "| techniques (cumulative) | longest context | gain | DP x U x R | ZeRO | ckpt | peak phase | "
        "GiB: params / grads / optimizer / gathered / engine / checkpoints / activations / loss / workspace = total "
        "| host GiB per GPU | step s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    previous = None
    for row in rows:
        best, length = row.plan, row.longest.seq_len
        gain = f"x{length / previous:.2f}" if previous else "-"
        previous = length or previous
        name = " + ".join(row.techniques) or "none"
        if best is None:
            lines.append(f"| {name} | nothing fits | | | | | | {row.why} | | |")
            continue
        m = memory_of(best)
        terms = " / ".join(
            f"{value / GIB:.1f}"
            for value in (
                m.params,
                m.grads,
                m.optimizer,
                m.gathered_params,
                m.engine_state,
                m.checkpoints,
                m.activations,
                m.logits,
                m.workspace,
            )
        )
        lines.append(
            f"| {name} | {length:,} | {gain} | {_mesh(best)} | {best.config.zero_stage} | "
            f"{'on' if best.config.checkpointing else 'off'} | {m.peak_phase} | {terms} = {m.total / GIB:.1f} | "
            f"{m.host / GIB:.1f} of {best.host_usable_bytes / GIB:.0f} | {best.step_s:.1f} |"
        )
    return "\n".join(lines)


def _describe(plan: CandidatePlan) -> str:
    c = plan.config
    return f"DP={c.dp} x U={c.ulysses} x R={c.ring}, ZeRO-{c.zero_stage}, ckpt {'on' if c.checkpointing else 'off'}"


def tie_note(result: PlanResult, space: SearchSpace) -> list[str]:
    """Where the recommendation is not the fastest fitting plan: the tie rule that picked it."""
    best = result.recommended
    fastest = min((p for p in result.ranked if p.fits), key=lambda p: p.seconds_per_sequence)
    if best is None or fastest.seconds_per_sequence >= best.seconds_per_sequence:
        return []
    slower = best.seconds_per_sequence / fastest.seconds_per_sequence - 1
    return [
        f"  - picked over the fastest plan ({_describe(fastest)}), {slower:.1%} slower: plans within "
        f"{space.tie_tolerance:.0%} of the fastest count as tied, and a tie goes to a Ulysses group inside one "
        f"node, then the larger Ulysses degree, then a plan leaving {space.headroom:.0%} of memory free, then "
        f"the faster"
    ]


def _variants(workload: Workload, space: SearchSpace):
    """(flag, workload, space) for every memory technique that is off in this search and applies."""
    tech, training = workload.techniques, not workload.forward_only
    with_ckpt = replace(space, checkpointing=(True,))
    stages = tuple(sorted(set(space.zero_stages) | {3}))
    if training and True not in space.checkpointing:
        yield "--activation-checkpointing", workload, with_ckpt
    if training and max(space.zero_stages) < 3:
        yield "--zero 3", workload, replace(space, zero_stages=stages)
    if not workload.fused_loss:
        yield "--fused-loss", replace(workload, techniques=replace(tech, fused_loss=True)), space
    if not tech.tiled_mlp:
        yield "--tiled-mlp", replace(workload, techniques=replace(tech, tiled_mlp=True)), space
    if training and not tech.activation_offload:
        flag = "--offload-activations" + ("" if True in space.checkpointing else " --activation-checkpointing")
        yield flag, replace(workload, techniques=replace(tech, activation_offload=True)), with_ckpt
    if training and not tech.optimizer_offload:
        yield (
            "--offload-optimizer",
            replace(workload, techniques=replace(tech, optimizer_offload=True)),
            replace(space, zero_stages=tuple(s for s in stages if s >= 1)),
        )
    if not tech.param_offload:
        yield (
            "--offload-params",
            replace(workload, techniques=replace(tech, param_offload=True)),
            replace(space, zero_stages=(3,)),
        )


def _all_of(variants: list) -> tuple[Workload, SearchSpace]:
    """Every variant's changes at once."""
    workload, space = variants[0][1], variants[0][2]
    techniques = {
        k: any(getattr(v[1].techniques, k) for v in variants)
        for k in ("fused_loss", "tiled_mlp", "activation_offload", "optimizer_offload", "param_offload")
    }
    spaces = [v[2] for v in variants]
    checkpointing = (True,) if any(s.checkpointing == (True,) for s in spaces) else space.checkpointing
    stages = set.intersection(*(set(s.zero_stages) for s in spaces)) or {3}
    return (
        replace(workload, techniques=replace(workload.techniques, **techniques)),
        replace(space, checkpointing=checkpointing, zero_stages=tuple(sorted(stages))),
    )


def _outcome(result: PlanResult, workload: Workload, space: SearchSpace) -> tuple[bool, float]:
    """(fits, the least memory any plan of the search needs, bytes) with this workload and space."""
    tried = search.plan(result.model, workload, result.cluster, space)
    valid = [memory_of(p).total for p in tried.ranked if p.valid]
    return tried.recommended is not None, min(valid) if valid else float("inf")


def no_fit_hint(result: PlanResult, space: SearchSpace) -> list[str]:
    """Nothing fits: what the smallest plan needs, and each technique that is off, tried on the same search."""
    smallest = min(result.ranked, key=lambda p: memory_of(p).total)
    lines = [
        f"No plan fits in memory: the smallest ({_describe(smallest)}) needs "
        f"{memory_of(smallest).total / GIB:.1f} "
        f"GiB, {smallest.usable_bytes / GIB:.1f} GiB usable per GPU."
    ]
    variants = list(_variants(result.workload, space))
    tried = [(flag, *_outcome(result, w, s)) for flag, w, s in variants]
    helping = [(flag, fits, need) for flag, fits, need in tried if need < memory_of(smallest).total * 0.999]
    if helping:
        lines.append(
            "  Off now, each alone: "
            + "; ".join(
                f"{flag}: {'fits,' if fits else 'no fit,'} {need / GIB:.1f} GiB" for flag, fits, need in helping
            )
        )
        if len(helping) > 1 and not any(fits for _, fits, _ in helping):
            fits, need = _outcome(result, *_all_of([v for v in variants if v[0] in {h[0] for h in helping}]))
            lines.append(f"  All of them together: {'fits,' if fits else 'no fit,'} {need / GIB:.1f} GiB")
    elif variants:
        lines.append("  None of the techniques that are off (" + ", ".join(v[0] for v in variants) + ") lowers it.")
    else:
        lines.append("  Every memory technique is on already.")
    more = "more GPUs (--nodes), a shorter --seq-len; --longest-context finds the longest sequence that fits"
    if result.workload.forward_only:
        more += "; --tensor-inference splits the weights and the K/V cache T ways"
    return lines + [f"  Or: {more}."]


def _why_no_mesh(result: PlanResult) -> str:
    """Nothing was evaluated for memory: every mesh was invalid, or the fixed degrees divide nothing."""
    world = result.cluster.world_size
    if result.rejected:
        reasons = sorted({problem for plan in result.rejected for problem in plan.problems})
        return f"No valid mesh (not a memory problem): {'; '.join(reasons)}."
    return (
        f"No DP x Ulysses x ring factorisation of the {world} GPUs matches the fixed degrees (not a memory "
        f"problem): --dp, --ulysses and --ring must each divide {world}, and so must their product."
    )


def recommendation_lines(result: PlanResult, space: SearchSpace) -> list[str]:
    """The recommendation, its step and memory, the tie rule and notes; or why nothing fits."""
    best = result.recommended
    if best is None and not result.ranked:
        return [_why_no_mesh(result)]
    if best is None:
        return no_fit_hint(result, space)
    c, t, m = best.config, best.timing, memory_of(best)
    assert t is not None  # evaluate() sets every cost of a valid plan
    lines = [
        f"Recommended: DP={c.dp} x Ulysses={c.ulysses} x ring={c.ring}, ZeRO-{c.zero_stage}, "
        f"activation checkpointing {'on' if c.checkpointing else 'off'}"
        + (f", head chunks G={best.head_chunks}" if best.head_chunks > 1 else ""),
        f"  step {format_seconds(best.step_s)} = compute {format_seconds(t.compute_s)} + all-to-all "
        f"{format_seconds(t.all_to_all_s)} + ring exposed {format_seconds(t.ring_exposed_s)} + ZeRO exposed "
        f"{format_seconds(t.zero_exposed_s)} + offload exposed {format_seconds(t.offload_s)}; "
        f"{best.tokens_per_s:,.0f} tokens/s; MFU "
        f"{best.mfu(result.cluster.peak_flops):.0%}",
        f"  memory {m.total / GIB:.1f} GiB at the {m.peak_phase} peak: model states {m.model_states / GIB:.1f}, "
        f"engine {m.engine_state / GIB:.1f}, checkpoints {m.checkpoints / GIB:.1f}, activations "
        f"{m.activations / GIB:.1f}, loss {m.logits / GIB:.1f}, workspace {m.workspace / GIB:.1f} "
        f"(usable {best.usable_bytes / GIB:.1f} GiB); host {m.host / GIB:.1f} GiB",
    ]
    return lines + tie_note(result, space) + [f"  - {note}" for note in best.notes]
