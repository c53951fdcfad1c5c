"""The ablation: the longest context as memory techniques are added one at a time, in order.

    python -m hybridsp plan --model llama3-8b --gpu h100 --nodes 1 --gpus-per-node 8 \\
        --longest-context --ablation [--json]

Each row switches on one more technique of ``ABLATION_ORDER`` (fused loss, tiled MLP,
activation offload, optimizer offload; the first row has none) and reports the longest
sequence some plan fits, the plan (DP x U x R, ZeRO stage, checkpointing) and every memory
term of it, device and host (:mod:`hybridsp.planner.memory`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hybridsp.planner.plans import Plan
from hybridsp.planner.search import LongestContext, longest_context
from hybridsp.planner.specs import GIB, ClusterSpec, ModelSpec
from hybridsp.planner.techniques import ABLATION_ORDER, Techniques


@dataclass(frozen=True)
class AblationRow:
    """The longest context with ``techniques`` switched on (cumulative, in ``ABLATION_ORDER``)."""

    techniques: tuple[str, ...]
    longest: LongestContext

    @property
    def plan(self) -> Plan | None:
        return self.longest.result.recommended if self.longest.result else None

    def to_dict(self) -> dict:
        """The contract row ``{"techniques", "longest_context", "dp", "ulysses", "ring"}`` plus the
        chosen ZeRO stage, checkpointing and the memory terms of the recommended plan."""
        best = self.plan
        row = {"techniques": list(self.techniques), "longest_context": self.longest.seq_len,
               "dp": best.config.dp if best else None, "ulysses": best.config.ulysses if best else None,
               "ring": best.config.ring if best else None}
        if best is not None:
            memory = best.memory
            row.update(zero_stage=best.config.zero_stage, activation_checkpointing=best.config.checkpointing,
                       step_s=best.step_s, tokens_per_s=best.tokens_per_s, peak_phase=memory.peak_phase,
                       memory={**{k: v for k, v in asdict(memory).items() if k != "phases"},
                               "phases": dict(memory.phases), "total": memory.total, "host": memory.host},
                       usable_bytes=best.usable_bytes, host_usable_bytes=best.host_usable_bytes,
                       host_traffic_bytes=best.timing.host_traffic_bytes, offload_s=best.timing.offload_s)
        return row


def ablation(
    model: ModelSpec, cluster: ClusterSpec, *, base: Techniques | None = None,
    order: tuple[str, ...] = ABLATION_ORDER, **longest_options,
) -> list[AblationRow]:
    """Longest context with no technique, then adding each of ``order`` in turn (cumulative).

    ``base`` carries the techniques' settings (chunk and tile sizes, keep_last, K/V mode);
    its on/off switches are replaced row by row. ``longest_options`` go to :func:`longest_context`.
    """
    base = base or Techniques()
    rows = []
    for count in range(len(order) + 1):
        names = tuple(order[:count])
        rows.append(AblationRow(names, longest_context(model, cluster, techniques=base.with_only(names),
                                                       **longest_options)))
    return rows


def _mesh(plan: Plan | None) -> str:
    return "-" if plan is None else f"{plan.config.dp} x {plan.config.ulysses} x {plan.config.ring}"


def format_ablation(rows: list[AblationRow], model: ModelSpec, cluster: ClusterSpec) -> str:
    """The ablation as a Markdown table with every memory term of each row's plan (GiB per GPU)."""
    lines = [
        f"Ablation: longest context of {model.name} on {cluster.name} ({cluster.world_size} GPUs, "
        f"{cluster.memory_bytes / GIB:.0f} GiB, {cluster.reserved_bytes / GIB:g} GiB reserved; host "
        f"{cluster.host_memory_bytes / GIB:,.0f} GiB per node, PCIe {cluster.host_bw / 1e9:g} GB/s)", "",
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
            lines.append(f"| {name} | nothing fits | | | | | | | | |")
            continue
        m = best.memory
        terms = " / ".join(f"{value / GIB:.1f}" for value in (
            m.params, m.grads, m.optimizer, m.gathered_params, m.engine_state, m.checkpoints, m.activations,
            m.logits, m.workspace))
        lines.append(
            f"| {name} | {length:,} | {gain} | {_mesh(best)} | {best.config.zero_stage} | "
            f"{'on' if best.config.checkpointing else 'off'} | {m.peak_phase} | {terms} = {m.total / GIB:.1f} | "
            f"{m.host / GIB:.1f} of {best.host_usable_bytes / GIB:.0f} | {best.step_s:.1f} |")
    return "\n".join(lines)
