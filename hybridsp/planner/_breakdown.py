"""Where every GiB of one rank goes at the step's peak: the terms of :func:`hybridsp.planner._memory.memory_use`
split one level further (the layer's norms, mixer and MLP, the attention call's transients), summing
to its ``total`` exactly (``python -m hybridsp plan --breakdown``)."""

from __future__ import annotations

from hybridsp.planner._activations import (
    attention_bytes_per_token,
    checkpoint_alias_bytes_per_token,
    linear_bytes_per_token,
    mlp_bytes_per_token,
    norm_bytes_per_token,
)
from hybridsp.planner._costs import local_tokens
from hybridsp.planner._head_chunks import resolved_head_chunks
from hybridsp.planner._memory import memory_use
from hybridsp.planner._phase_terms import (
    attention_workspace_bytes,
    gather_copy_bytes,
    linear_workspace_bytes,
    mlp_transient_bytes,
    staged_gradient_bytes,
)
from hybridsp.planner._specs import GIB, MeshConfig, ModelSpec, Workload


def _layer_rows(model: ModelSpec, workload: Workload, config: MeshConfig, phase: str) -> list[tuple[str, int]]:
    """The running layer's saved tensors and transients in a checkpointed layer-backward phase."""
    tokens, e, tech = local_tokens(workload, config), workload.dtype_bytes, workload.techniques
    chunks = resolved_head_chunks(model, workload, config)
    kind = "linear" if phase == "linear backward" else "attention"
    if phase == "mlp backward":
        sizes = {
            k: (
                linear_bytes_per_token(model, config.ulysses, e)
                if k == "linear"
                else attention_bytes_per_token(model, config.ulysses, e, chunks, config.ring)
            )
            for k in (("attention", "linear") if model.linear_layers else ("attention",))
        }
        kind = max(sizes, key=lambda k: sizes[k])
    mixer = (
        linear_bytes_per_token(model, config.ulysses, e)
        if kind == "linear"
        else attention_bytes_per_token(model, config.ulysses, e, chunks, config.ring)
    )
    norms = 1 if phase != "mlp backward" else 2
    norm = tokens * (
        norms * norm_bytes_per_token(model, e, tech.lean_norms) - checkpoint_alias_bytes_per_token(model, workload)
    )
    rows = [
        (f"layer: {norms} RMSNorm(s) saved (the checkpoint itself excluded)", norm),
        (
            f"layer: {kind} saved (q/k/v/out/LSE, G={chunks})" if kind == "attention" else "layer: linear saved",
            tokens * mixer,
        ),
    ]
    if phase == "mlp backward":
        rows.append(("layer: MLP saved (0 tiled)", tokens * mlp_bytes_per_token(model, e, tech.tiled_mlp)))
        rows.append(
            ("workspace: MLP backward (tile's recompute + gradients)", mlp_transient_bytes(model, workload, config))
        )
    elif kind == "attention":
        rows.append(
            (
                f"workspace: attention call (dout, accumulators, kernel, ring blocks; one of G={chunks} groups)",
                attention_workspace_bytes(model, workload, config),
            )
        )
    else:
        rows.append(
            (
                "workspace: linear call (chunk states + gradients, state pairs)",
                linear_workspace_bytes(model, workload, config),
            )
        )
    rows.append(("gradient flowing between layers, T h e", tokens * model.hidden_size * e))
    rows.append(("workspace: gradients staged for ZeRO", staged_gradient_bytes(model, workload, config)))
    rows.append(("workspace: ZeRO-3 re-gather copies", gather_copy_bytes(model, workload, config, model.layer_params)))
    return rows


def peak_breakdown(model: ModelSpec, workload: Workload, config: MeshConfig) -> list[tuple[str, int]]:
    """(term, bytes) of every part of the peak; the rows sum to ``memory_use(...).total``. A phase
    the split does not cover (no checkpointing, the loss) reports the coarse terms."""
    m = memory_use(model, workload, config)
    rows = [
        ("model states: parameters", m.params),
        ("model states: gradients", m.grads),
        ("model states: optimizer (fp32 master, Adam m, v)", m.optimizer),
        ("model states: ZeRO-3 gathered parameters", m.gathered_params),
        ("DeepSpeed gradient bucket", m.engine_state),
        ("checkpointed layer inputs on the device", m.checkpoints),
    ]
    if config.checkpointing and m.peak_phase in ("mlp backward", "attention backward", "linear backward"):
        rows += _layer_rows(model, workload, config, m.peak_phase)
    else:
        rows += [("activations saved", m.activations), ("loss", m.logits), ("workspace", m.workspace)]
    rest = m.total - sum(size for _, size in rows)
    if rest:
        rows.append(("other", rest))
    return rows


def format_breakdown(model: ModelSpec, workload: Workload, config: MeshConfig, usable: float) -> str:
    """The breakdown as a Markdown table, GiB per GPU, with the peak phase and the usable memory."""
    m = memory_use(model, workload, config)
    lines = [
        f"Memory at the peak ({m.peak_phase}) of {model.name}, S = {workload.seq_len:,}, {config.label()}, "
        f"G = {resolved_head_chunks(model, workload, config)} (GiB per GPU; usable {usable / GIB:.1f})",
        "",
        "| term | GiB |",
        "|---|---|",
    ]
    lines += [f"| {name} | {size / GIB:.2f} |" for name, size in peak_breakdown(model, workload, config)]
    lines.append(f"| **total** | **{m.total / GIB:.2f}** |")
    lines.append(f"| host (offloaded checkpoints, optimizer, parameters) | {m.host / GIB:.2f} |")
    return "\n".join(lines)
