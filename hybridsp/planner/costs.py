"""The planner's arithmetic: FLOPs, bytes sent and memory of one rank for one step.

All functions are pure and exact in integers; the formulas are stated in
:mod:`hybridsp.planner` (module docstring). Callers validate the mesh first
(:func:`hybridsp.planner.plans.mesh_problems`): the sequence must split evenly, U must
divide the query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridsp.planner.specs import MeshConfig, ModelSpec, Workload
from hybridsp.ulysses import kv_repeats_for

FP32 = 4
ADAM_BYTES_PER_PARAM = 12  # fp32 master weights + Adam m + Adam v


def local_tokens(workload: Workload, config: MeshConfig) -> int:
    """Tokens one rank holds outside attention: B * S / C."""
    return workload.micro_batch * workload.seq_len // config.context


def expanded_kv_heads(model: ModelSpec, ulysses: int) -> int:
    """K/V heads after :func:`hybridsp.ulysses.kv_repeats_for` expansion (Hkv' ; Hkv' % U == 0)."""
    if ulysses == 1:
        return model.num_kv_heads
    return model.num_kv_heads * kv_repeats_for(model.num_heads, model.num_kv_heads, ulysses)


# ----------------------------------------------------------------------------- FLOPs


@dataclass(frozen=True)
class Flops:
    """FLOPs of one rank for one step. ``attention`` and ``dense`` include recomputation;
    ``model`` does not (it is the useful work, for MFU); ``forward`` is one forward pass."""

    attention: int
    dense: int
    model: int
    forward: int

    @property
    def total(self) -> int:
        return self.attention + self.dense


def attention_forward_flops_per_layer(model: ModelSpec, workload: Workload, context: int) -> int:
    """4 * B * S^2 * H * D * c / C, c = 1/2 when causal (QK^T and PV, 2 FLOPs per MAC)."""
    b, s = workload.micro_batch, workload.seq_len
    full = 4 * b * s * (s // context) * model.num_heads * model.head_dim
    return full // 2 if workload.causal else full


def ring_step_forward_flops(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """One ring step's forward: 4 * B * (S/R)^2 * (H/U) * D * c (zigzag: every step is half a block)."""
    block = workload.seq_len // config.ring
    full = 4 * workload.micro_batch * block * block * (model.num_heads // config.ulysses) * model.head_dim
    return full // 2 if workload.causal else full


def flops_per_rank(model: ModelSpec, workload: Workload, config: MeshConfig) -> Flops:
    """Attention (forward, 2.5x backward, +1x forward when recomputed) and dense (2/4/+2 x N x T)."""
    att_fwd = model.num_layers * attention_forward_flops_per_layer(model, workload, config.context)
    dense_fwd = 2 * model.matmul_params * local_tokens(workload, config)
    if workload.forward_only:
        return Flops(att_fwd, dense_fwd, model=att_fwd + dense_fwd, forward=att_fwd + dense_fwd)
    att_bwd, dense_bwd = att_fwd * 5 // 2, 2 * dense_fwd
    passes = 2 if config.checkpointing else 1
    return Flops(
        attention=passes * att_fwd + att_bwd,
        dense=passes * dense_fwd + dense_bwd,
        model=att_fwd + att_bwd + dense_fwd + dense_bwd,
        forward=att_fwd + dense_fwd,
    )


# ----------------------------------------------------------------------------- bytes sent


@dataclass(frozen=True)
class CommVolume:
    """Bytes one rank sends for one step, and the tensors they come from (per layer).

    ``qkv_bytes`` / ``out_bytes``: one rank's packed q,k,v (after GQA expansion) and out
    before an all-to-all; ``(U-1)/U`` of each leaves the rank. ``kv_block_bytes``: one K/V
    block on the ring (input dtype); ``grad_block_bytes``: its fp32 dK/dV accumulators.
    """

    ulysses: int
    ring: int
    layers: int
    qkv_bytes: int
    out_bytes: int
    kv_block_bytes: int
    grad_block_bytes: int
    forward_passes: int  # 1, or 2 when activation checkpointing recomputes the forward
    backward: bool

    @property
    def all_to_all_per_layer_pass(self) -> int:
        """Bytes leaving the rank in one pass of one layer: the q/k/v op plus the out op
        (forward), or the dout op plus the dq/dk/dv op (backward): the same sizes."""
        u = self.ulysses
        return self.qkv_bytes * (u - 1) // u + self.out_bytes * (u - 1) // u

    @property
    def all_to_all(self) -> int:
        passes = self.forward_passes + (1 if self.backward else 0)
        return self.layers * passes * self.all_to_all_per_layer_pass

    @property
    def ring_forward_per_layer(self) -> int:
        return (self.ring - 1) * self.kv_block_bytes

    @property
    def ring_backward_per_layer(self) -> int:
        if not self.backward or self.ring == 1:
            return 0
        return (self.ring - 1) * self.kv_block_bytes + self.ring * self.grad_block_bytes

    @property
    def ring_total(self) -> int:
        return self.layers * (self.forward_passes * self.ring_forward_per_layer + self.ring_backward_per_layer)


def comm_volume(model: ModelSpec, workload: Workload, config: MeshConfig) -> CommVolume:
    """Bytes of every all-to-all and ring transfer of one rank for one step."""
    e, d, u = workload.dtype_bytes, model.head_dim, config.ulysses
    tokens, kv_heads = local_tokens(workload, config), expanded_kv_heads(model, u)
    block_tokens = workload.micro_batch * workload.seq_len // config.ring
    kv_block_elements = block_tokens * (kv_heads // u) * 2 * d
    return CommVolume(
        ulysses=u, ring=config.ring, layers=model.num_layers,
        qkv_bytes=tokens * (model.num_heads + 2 * kv_heads) * d * e,
        out_bytes=tokens * model.num_heads * d * e,
        kv_block_bytes=kv_block_elements * e,
        grad_block_bytes=kv_block_elements * FP32,
        forward_passes=2 if config.checkpointing and not workload.forward_only else 1,
        backward=not workload.forward_only,
    )


def zero_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> tuple[int, int]:
    """(overlapped, after the step) bytes one rank sends for ZeRO over N = DP x C ranks.

    Ring collectives in bf16, X = (N-1)/N x 2 Psi bytes each. Stage 0: gradient all-reduce 2X,
    overlapped with backward. Stages 1-2: gradient reduce-scatter X overlapped with backward,
    then the updated parameters' all-gather X after the optimizer step (exposed). Stage 3:
    parameter all-gathers in forward and backward plus the reduce-scatter, 3X, overlapped with
    the step. Forward-only: X at stage 3 (overlapped with the forward), else nothing.
    """
    shards = config.world_size
    one = (shards - 1) * 2 * model.total_params // shards
    if workload.forward_only:
        return (one if config.zero_stage == 3 else 0), 0
    return {0: (2 * one, 0), 1: (one, one), 2: (one, one), 3: (3 * one, 0)}[config.zero_stage]


# ----------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryUse:
    """Bytes one rank holds at its peak, by kind."""

    params: int
    grads: int
    optimizer: int
    gathered_params: int
    activations: int
    logits: int
    workspace: int

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered_params

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.logits + self.workspace


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def model_state_bytes(model: ModelSpec, zero_stage: int, shards: int, forward_only: bool) -> tuple[int, ...]:
    """(params, grads, optimizer, gathered) bytes: 2 + 2 + 12 per param, ZeRO-partitioned over ``shards``.

    Stage 1 partitions the optimizer states, 2 adds gradients, 3 adds parameters (and then
    holds two gathered units - the largest of a layer and the embedding - in bf16).
    """
    psi = model.total_params
    params = _ceil_div(2 * psi, shards) if zero_stage == 3 else 2 * psi
    gathered = 2 * 2 * max(model.layer_params, model.embedding_params) if zero_stage == 3 and shards > 1 else 0
    if forward_only:
        return params, 0, 0, gathered
    grads = _ceil_div(2 * psi, shards) if zero_stage >= 2 else 2 * psi
    optimizer = _ceil_div(ADAM_BYTES_PER_PARAM * psi, shards) if zero_stage >= 1 else ADAM_BYTES_PER_PARAM * psi
    return params, grads, optimizer, gathered


def layer_activation_bytes_per_token(model: ModelSpec, ulysses: int, dtype_bytes: int) -> int:
    """Saved tensors of one Llama layer per local token: e(4h + 3HD + 2Hkv'D + 4I) + 4H + 8.

    4h: both RMSNorm inputs and outputs; 3HD: q after the all-to-all, ring out, o_proj input;
    2Hkv'D: expanded k, v after the all-to-all; 4I: gate, SiLU(gate), up, SiLU(gate)*up;
    4H: fp32 LSE; 8: two fp32 RMSNorm reciprocal RMS values.
    """
    h, hd = model.hidden_size, model.num_heads * model.head_dim
    kvd = expanded_kv_heads(model, ulysses) * model.head_dim
    return dtype_bytes * (4 * h + 3 * hd + 2 * kvd + 4 * model.intermediate_size) + FP32 * model.num_heads + 8


def activation_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """Activations one rank holds at the peak of the step (logits excluded).

    training, no checkpointing: T (L A + 2he + 4); with checkpointing: T (L h e + A + 2he + 4);
    forward-only: T (A + 2he) (one layer live at a time). A from
    :func:`layer_activation_bytes_per_token`; 2he + 4: the final norm's input/output and rstd.
    """
    e, tokens = workload.dtype_bytes, local_tokens(workload, config)
    layer = layer_activation_bytes_per_token(model, config.ulysses, e)
    final_norm = 2 * model.hidden_size * e + FP32
    if workload.forward_only:
        return tokens * (layer + 2 * model.hidden_size * e)
    if config.checkpointing:
        return tokens * (model.num_layers * model.hidden_size * e + layer + final_norm)
    return tokens * (model.num_layers * layer + final_norm)


def logits_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """T V (e + 4): logits in the input dtype plus the fp32 log-softmax the loss saves
    (T V e forward-only); 0 with a chunked/fused loss."""
    if workload.chunked_loss:
        return 0
    per_entry = workload.dtype_bytes + (0 if workload.forward_only else FP32)
    return local_tokens(workload, config) * model.vocab_size * per_entry


def attention_workspace_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """Transient buffers of one attention call: all-to-all send+receive of q/k/v, the fp32
    out (or dq) accumulator and LSE, two K/V receive buffers and, in backward, three fp32
    dK/dV blocks (local, travelling, received)."""
    volume = comm_volume(model, workload, config)
    tokens = local_tokens(workload, config)
    accumulators = tokens * model.num_heads * (model.head_dim + 1) * FP32
    a2a = 2 * volume.qkv_bytes if config.ulysses > 1 else 0
    ring = 0
    if config.ring > 1:
        ring = 2 * volume.kv_block_bytes + (0 if workload.forward_only else 3 * volume.grad_block_bytes)
    return accumulators + a2a + ring


def memory_use(model: ModelSpec, workload: Workload, config: MeshConfig) -> MemoryUse:
    """Peak bytes of one rank: ZeRO model states + activations + logits + attention workspace."""
    params, grads, optimizer, gathered = model_state_bytes(
        model, config.zero_stage, config.world_size, workload.forward_only
    )
    return MemoryUse(
        params=params, grads=grads, optimizer=optimizer, gathered_params=gathered,
        activations=activation_bytes(model, workload, config),
        logits=logits_bytes(model, workload, config),
        workspace=attention_workspace_bytes(model, workload, config),
    )
