"""Bytes saved for backward (the "Saved for backward" terms of :mod:`hybridsp.planner._memory`): per
local token for a layer's norms, attention and MLP and for what lies outside the layers, and the
checkpointed layers' inputs (device and host)."""

from __future__ import annotations

from hybridsp._formulas import FP32, SPILL_WRITES_IN_FLIGHT
from hybridsp.planner._costs import expanded_kv_heads, local_tokens
from hybridsp.planner._specs import MeshConfig, ModelSpec, Workload

IDS_BYTES_PER_TOKEN = 16  # int64 token ids (embedding) and labels (loss)


def norm_bytes_per_token(model: ModelSpec, dtype_bytes: int, lean: bool = False) -> int:
    """One HF RMSNorm: x in fp32, the normalised x and the weighted output in e, fp32 rstd; a lean
    norm: x as it is and the weighted output in e, fp32 rstd."""
    if lean:
        return 2 * dtype_bytes * model.hidden_size + FP32
    return (FP32 + 2 * dtype_bytes) * model.hidden_size + FP32


def o_proj_input_copied(model: ModelSpec, ulysses: int, ring: int, head_chunks: int = 1) -> bool:
    """Whether the o_proj input is a tensor of its own rather than a view of the call's saved output:
    HF attention's ``reshape(...).contiguous()`` copies an output that is not dense [B, S, H Dv].
    At U = 1 the ring path (R > 1; its accumulator, ``hybridsp.attention._ring_function``) and the head
    groups (G > 1; token-major, Note [token-major out] in ``hybridsp.attention._head_chunks``) return
    the dense tensor they keep, so the o_proj input is a view of it; a single kernel call (U = R = G = 1)
    returns a view of heads-first storage (copied). At U > 1 the call keeps its ring-slot output, not
    the one it returns, so the o_proj input is a tensor of its own either way. An output gate always
    makes its own gated product."""
    return model.attention_output_gate or not (ulysses == 1 and (head_chunks > 1 or ring > 1))


def attention_bytes_per_token(
    model: ModelSpec, ulysses: int, dtype_bytes: int, head_chunks: int = 1, ring: int = 1
) -> int:
    """What one attention layer keeps for backward per local token: the call's q, k, v (the
    caller's RoPE outputs at U = 1; the ring-slot copies after the all-to-all at U > 1, K/V heads
    expanded: the same bytes per local token), its output and fp32 LSE (v, the output and the
    o_proj input at the value head dim; head-chunked, G > 1: the same tensors in G pieces), and the
    o_proj input when it is a copy (:func:`o_proj_input_copied`). An output gate (Qwen3-Next) keeps
    sigmoid(gate) and the gated product (the o_proj input) as well."""
    hd, hdv = model.num_heads * model.head_dim, model.num_heads * model.value_head_dim
    kv_heads = expanded_kv_heads(model, ulysses)
    copied = o_proj_input_copied(model, ulysses, ring, head_chunks)
    o_proj_input = (2 if model.attention_output_gate else 1) * hdv * dtype_bytes if copied else 0
    return (
        dtype_bytes * (hd + hdv + kv_heads * (model.head_dim + model.value_head_dim))
        + o_proj_input
        + FP32 * model.num_heads
    )


LINEAR_CHUNK = 64  # the chunked delta rule's / SSD's chunk (flash-linear-attention, transformers' torch path)


def linear_bytes_per_token(model: ModelSpec, ulysses: int, dtype_bytes: int) -> int:
    """One recurrent layer (Gated DeltaNet / Mamba-2, flash-linear-attention's chunk kernel), per local
    token: the conv's input and output (the kernel's q/k/v or x/B/C), 2 c e; the output gate z, the
    kernel output and the gated norm's output (the out-projection input), 3 Hv dv e; per value
    head the fp32 gates (g, beta or dt: 8 bytes), the norm's fp32 rstd (4) and the chunk's WY/decay
    matrix row (64 e). U > 1 adds the all-to-all's received inputs (features e). The chunk
    states are recomputed in backward (:func:`linear_workspace_bytes_per_token`)."""
    spec = model.linear
    if spec is None:
        return 0
    inner, e = spec.heads * spec.value_dim, dtype_bytes
    received = spec.features * e if ulysses > 1 else 0
    return 2 * spec.conv_channels * e + 3 * inner * e + spec.heads * (8 + 4 + LINEAR_CHUNK * e) + received


def linear_workspace_bytes_per_token(model: ModelSpec, dtype_bytes: int) -> int:
    """A recurrent layer's backward, per local token: the chunk states and their gradients,
    recomputed (``[T/64, Hv, dk, dv]`` each, input dtype): 2 Hv dk dv e / 64."""
    spec = model.linear
    if spec is None:
        return 0
    return -(-2 * spec.heads * spec.key_dim * spec.value_dim * dtype_bytes // LINEAR_CHUNK)


def mlp_bytes_per_token(model: ModelSpec, dtype_bytes: int, tiled: bool = False) -> int:
    """gate, SiLU(gate), up, their product: 4 I e; MoE: 4 I_active e plus each of the k experts' copy
    of its input (k h e) and the router's fp32 probabilities (4 E); 0 when tiled (recomputed per tile)."""
    if tiled:
        return 0
    e = dtype_bytes
    dispatch = model.experts_per_token * model.hidden_size * e + FP32 * model.num_experts if model.is_moe else 0
    return 4 * model.active_intermediate * e + dispatch


def layer_activation_bytes_per_token(
    model: ModelSpec,
    ulysses: int,
    dtype_bytes: int,
    tiled_mlp: bool = False,
    lean_norms: bool = False,
    kind: str = "attention",
    head_chunks: int = 1,
    ring: int = 1,
) -> int:
    """Saved tensors of one layer per local token: 2 norms + its mixer (``kind``: ``"attention"`` or
    ``"linear"``) + MLP."""
    if kind == "linear":
        mixer = linear_bytes_per_token(model, ulysses, dtype_bytes)
    else:
        mixer = attention_bytes_per_token(model, ulysses, dtype_bytes, head_chunks, ring)
    return (
        2 * norm_bytes_per_token(model, dtype_bytes, lean_norms)
        + mixer
        + mlp_bytes_per_token(model, dtype_bytes, tiled_mlp)
    )


def outside_layers_bytes_per_token(model: ModelSpec, dtype_bytes: int, lean_norms: bool = False) -> int:
    """G: the final norm, RoPE cos/sin (one copy for all layers), token ids and labels."""
    return norm_bytes_per_token(model, dtype_bytes, lean_norms) + 2 * model.head_dim * dtype_bytes + IDS_BYTES_PER_TOKEN


def checkpoint_alias_bytes_per_token(model: ModelSpec, workload: Workload) -> int:
    """Bytes of a recomputed layer that are its checkpoint, already counted by :func:`checkpoint_bytes`:
    the first RMSNorm's fp32 x (its ``.to(float32)`` returns the input itself when e = 4) while the
    checkpoint stays on the device (no activation offload). With lean norms (x kept as it is) h x e
    in any dtype, offloaded or not: the restored copy the recompute runs from is the one
    :func:`checkpoint_bytes` counts for a layer's backward, and the norm keeps that very tensor."""
    if workload.techniques.lean_norms:
        return workload.dtype_bytes * model.hidden_size
    if workload.techniques.activation_offload:
        return 0
    return FP32 * model.hidden_size if workload.dtype_bytes == FP32 else 0


def checkpoint_bytes(model: ModelSpec, workload: Workload, config: MeshConfig, phase: str = "loss") -> tuple[int, int]:
    """(device, host) bytes of the checkpointed layers' inputs, T h e each.

    With activation offload the device holds, at the loss (``phase="loss"``: the end of the forward),
    the newest ``keep_last`` and ``offload_in_flight`` more whose copies to host may still run; in a
    layer's backward (``phase="backward"``), the input the recompute runs from (the newest
    ``keep_last`` at the last layer's backward) and the previous layer's, prefetched when copies are
    asynchronous (``offload_in_flight`` > 0: CUDA; the backward copies one way only). The host holds
    the other L - ``keep_last``, or with ``spill_activations`` (the disk tier) at most
    ``SPILL_WRITES_IN_FLIGHT`` of them: the staging copies of the writes in flight."""
    if not config.checkpointing or workload.forward_only:
        return 0, 0
    one = local_tokens(workload, config) * model.hidden_size * workload.dtype_bytes
    layers, tech = model.num_layers, workload.techniques
    if not tech.activation_offload:
        return layers * one, 0
    kept = min(layers, tech.keep_last)
    host = min(layers - kept, SPILL_WRITES_IN_FLIGHT) if tech.spill_activations else layers - kept
    if phase == "loss":
        device = min(layers, kept + tech.offload_in_flight)
    else:
        device = min(layers, max(kept, 1) + min(1, tech.offload_in_flight))
    return device * one, host * one
