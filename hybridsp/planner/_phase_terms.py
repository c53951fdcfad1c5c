"""The S-dependent terms the phases of a step hold (the "Loss" and "Transients" of
:mod:`hybridsp.planner._memory`): the loss's bytes, the attention workspace, the MLP backward's
gradients, ZeRO-3's re-gather temporaries, the end-of-backward reduction copies and the gradients
staged before ZeRO's bucket."""

from __future__ import annotations

from hybridsp._formulas import CHUNK_LOGITS_BYTES, FP32, default_chunk_size
from hybridsp.linear_attention import linear_layer_memory
from hybridsp.planner._activations import linear_workspace_bytes_per_token
from hybridsp.planner._attention_workspace import backward_workspace_bytes
from hybridsp.planner._costs import comm_volume, local_tokens
from hybridsp.planner._head_chunks import resolved_head_chunks
from hybridsp.planner._kv_modes import kv_workspace_bytes, planner_chunks
from hybridsp.planner._specs import MeshConfig, ModelSpec, Workload

FUSED_CHUNK_LOGITS_BYTES = CHUNK_LOGITS_BYTES  # the library's own (hybridsp._formulas)


def fused_loss_chunk(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """Rows per fused-loss chunk: ``loss_chunk``, or the library's default
    (:func:`hybridsp._formulas.default_chunk_size`: ceil(T h / V), at most 64 MiB of fp32 logits); <= T."""
    tokens = local_tokens(workload, config)
    chunk = workload.techniques.loss_chunk
    if chunk is None:
        chunk = default_chunk_size(model.vocab_size, tokens, model.hidden_size)
    return min(chunk, tokens)


def loss_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """The loss's bytes at the loss phase (module docstring, "Loss")."""
    tokens, vocab, e, h = local_tokens(workload, config), model.vocab_size, workload.dtype_bytes, model.hidden_size
    chunk = fused_loss_chunk(model, workload, config)
    low = 0 if e == FP32 else e  # bf16/fp16: the chunk's logits and weight-gradient product in e, then cast
    if workload.forward_only:
        return chunk * vocab * (FP32 + low) if workload.fused_loss else tokens * vocab * (e + FP32)
    if workload.fused_loss:
        return chunk * vocab * (FP32 + low) + vocab * h * (FP32 + (low and low + FP32)) + tokens * h * e
    return tokens * vocab * (e + 3 * FP32)


def attention_workspace_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """Transient buffers of one attention call. Training: its backward's working set as the code
    allocates it (:mod:`hybridsp.planner._attention_workspace`: dout, the fp32 dq/dk/dv
    accumulators, the kernel call's gradients and copies, the K/V blocks and dK/dV in flight, the
    worst ring step of the worst rank; measured term by term by ``benchmarks.memory.layer_terms``).
    Forward-only (not measured): the fp32 out accumulator and LSE, 4 T H (Dv + 1), and the larger
    of the all-to-all's send + receive of q/k/v (U > 1) and the K/V transport's blocks
    (:func:`hybridsp.planner._kv_modes.kv_workspace_bytes`; ``_ulysses`` reshards before and after
    the ring, each side freeing its buffers first); head-chunked, G > 1: one group's accumulators
    and blocks, and at U > 1 its q/k/v after the all-to-all with the next group's in flight, / G."""
    volume = comm_volume(model, workload, config)
    if not workload.forward_only:
        return backward_workspace_bytes(model, workload, config, volume.kv_comm)
    tokens = local_tokens(workload, config)
    chunks = resolved_head_chunks(model, workload, config)
    accumulators = tokens * model.num_heads * (model.value_head_dim + 1) * FP32
    a2a = 2 * volume.qkv_bytes if config.ulysses > 1 else 0
    ring = kv_workspace_bytes(
        volume.kv_comm,
        volume.kv_block_bytes,
        volume.grad_block_bytes,
        workload.dtype_bytes,
        config.ring,
        planner_chunks(workload, config),
        False,
    )
    if chunks == 1:
        return accumulators + max(a2a, ring)  # one after the other, never both
    return -(-(accumulators + ring + 3 * a2a // 2) // chunks)


def linear_workspace_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """Transient buffers of one recurrent layer's call: its recomputed chunk states and their
    gradients (:func:`hybridsp.planner._activations.linear_workspace_bytes_per_token`) and the sharded
    call's buffers (:func:`hybridsp.linear_attention.linear_layer_memory`: the slot's inputs, the
    gathered state pairs and halos, the initial states). 0 for a model without linear layers."""
    if model.linear is None or not model.linear_layers:
        return 0
    tokens, e = local_tokens(workload, config), workload.dtype_bytes
    held = linear_layer_memory(
        model.linear, workload.micro_batch, workload.seq_len, config.ulysses, config.ring, element_bytes=e
    )
    states = tokens * linear_workspace_bytes_per_token(model, e) if not workload.forward_only else 0
    return states + held["total"]


def mlp_transient_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """MLP backward: t x 2 I e gradients untiled (t = T), t x 6 I e tiled (t = mlp_tile, default h);
    MoE: I is the active width, k x I_e + I_shared."""
    tokens, e, tech = local_tokens(workload, config), workload.dtype_bytes, workload.techniques
    width = model.active_intermediate
    if not tech.tiled_mlp:
        return tokens * 2 * width * e
    tile = min(tokens, tech.mlp_tile or model.hidden_size)
    return tile * 6 * width * e


def gather_copy_bytes(model: ModelSpec, workload: Workload, config: MeshConfig, unit: int) -> int:
    """ZeRO-3 re-gathers each module's parameters (``unit`` of them) for its backward; a backend
    that all-gathers through a temporary (``collective_copies``: gloo, measured) holds that many
    more, e each. 0 on NCCL or below ZeRO-3."""
    if config.zero_stage < 3 or config.world_size == 1:
        return 0
    return workload.techniques.collective_copies * unit * workload.dtype_bytes


def reduction_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """The end of the backward under ZeRO-3 (measured, benchmarks/results/longest_context/ablation_cpu.md): the last
    gradient hook flushes DeepSpeed's bucket, whose reduce-scatter copies the bucket's contents
    into one flat rank-ordered buffer (``reduce_scatter_coalesced``), e x min(Psi, reduce_bucket),
    plus ``collective_copies`` more (gloo clones its input), while the first module's full
    gradient, e x embedding, still exists. 0 below ZeRO-3 or on one rank."""
    if config.zero_stage < 3 or config.world_size == 1 or workload.forward_only:
        return 0
    tech, e = workload.techniques, workload.dtype_bytes
    bucket = min(model.total_params, tech.reduce_bucket)
    return (1 + tech.collective_copies) * bucket * e + model.embedding_params * e


def staged_gradient_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """Full-size gradients alive in a layer's backward before ZeRO (>= 2) takes them into its
    bucket (preallocated: ``engine_state``): the LM head's (a tied embedding's waits for the
    embedding's backward) and the running layer's, up to ``reduce_bucket`` elements of e. (The
    whole model's worth that an earlier revision counted here with checkpointing, measured at
    L=16, is the end-of-backward reduce-scatter copy: :func:`reduction_bytes`.)"""
    if config.zero_stage < 2:
        return 0
    elements = model.embedding_params + model.layer_params
    return workload.dtype_bytes * min(elements, workload.techniques.reduce_bucket)
