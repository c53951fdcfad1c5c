"""Bytes saved for backward (the "Saved for backward" terms of :mod:`hybridsp.planner._memory`): per
local token for a layer's norms, attention and MLP and for what lies outside the layers, and the
checkpointed layers' inputs (device and host)."""

from __future__ import annotations

from hybridsp._formulas import FP32
from hybridsp.planner._costs import expanded_kv_heads, local_tokens
from hybridsp.planner._specs import MeshConfig, ModelSpec, Workload

IDS_BYTES_PER_TOKEN = 16  # int64 token ids (embedding) and labels (loss)


def norm_bytes_per_token(model: ModelSpec, dtype_bytes: int, lean: bool = False) -> int:
    """One HF RMSNorm: x in fp32, the normalised x and the weighted output in e, fp32 rstd; a lean
    norm: x as it is and the weighted output in e, fp32 rstd."""
    if lean:
        return 2 * dtype_bytes * model.hidden_size + FP32
    return (FP32 + 2 * dtype_bytes) * model.hidden_size + FP32


def attention_bytes_per_token(model: ModelSpec, ulysses: int, dtype_bytes: int) -> int:
    """q, k, v after the all-to-all, the kernel output, the o_proj input (U > 1), fp32 LSE
    (v, the output and the o_proj input at the value head dim)."""
    hd, hdv = model.num_heads * model.head_dim, model.num_heads * model.value_head_dim
    kv_heads = expanded_kv_heads(model, ulysses)
    o_proj_input = hdv * dtype_bytes if ulysses > 1 else 0
    return (
        dtype_bytes * (hd + hdv + kv_heads * (model.head_dim + model.value_head_dim))
        + o_proj_input
        + FP32 * model.num_heads
    )


def mlp_bytes_per_token(model: ModelSpec, dtype_bytes: int, tiled: bool = False) -> int:
    """gate, SiLU(gate), up, their product: 4 I e; 0 when tiled (recomputed per tile)."""
    return 0 if tiled else 4 * model.intermediate_size * dtype_bytes


def layer_activation_bytes_per_token(
    model: ModelSpec, ulysses: int, dtype_bytes: int, tiled_mlp: bool = False, lean_norms: bool = False
) -> int:
    """Saved tensors of one Llama layer per local token: 2 norms + attention + MLP."""
    return (
        2 * norm_bytes_per_token(model, dtype_bytes, lean_norms)
        + attention_bytes_per_token(model, ulysses, dtype_bytes)
        + mlp_bytes_per_token(model, dtype_bytes, tiled_mlp)
    )


def outside_layers_bytes_per_token(model: ModelSpec, dtype_bytes: int, lean_norms: bool = False) -> int:
    """G: the final norm, RoPE cos/sin (one copy for all layers), token ids and labels."""
    return norm_bytes_per_token(model, dtype_bytes, lean_norms) + 2 * model.head_dim * dtype_bytes + IDS_BYTES_PER_TOKEN


def checkpoint_alias_bytes_per_token(model: ModelSpec, workload: Workload) -> int:
    """Bytes of a recomputed layer that are its checkpoint, already counted by :func:`checkpoint_bytes`:
    the first RMSNorm's fp32 x (its ``.to(float32)`` returns the input itself when e = 4) while
    the checkpoint stays on the device (no activation offload; offload brings a new device copy
    back for the recompute, which the norm's x term counts). h x 4 in fp32, else 0; with lean norms
    (x kept as it is) h x e in any dtype."""
    if workload.techniques.activation_offload:
        return 0
    if workload.techniques.lean_norms:
        return workload.dtype_bytes * model.hidden_size
    return FP32 * model.hidden_size if workload.dtype_bytes == FP32 else 0


def checkpoint_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> tuple[int, int]:
    """(device, host) bytes of the checkpointed layers' inputs, T h e each."""
    if not config.checkpointing or workload.forward_only:
        return 0, 0
    one = local_tokens(workload, config) * model.hidden_size * workload.dtype_bytes
    layers, tech = model.num_layers, workload.techniques
    if not tech.activation_offload:
        return layers * one, 0
    kept = min(layers, tech.keep_last)
    return min(layers, kept + tech.offload_in_flight) * one, (layers - kept) * one
