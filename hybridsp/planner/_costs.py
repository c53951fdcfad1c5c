"""The planner's arithmetic: FLOPs and bytes sent of one rank for one step (memory: :mod:`.memory`).

All functions are pure and exact in integers; the formulas are stated in
:mod:`hybridsp.planner` (module docstring). Callers validate the mesh first
(:func:`hybridsp.planner._candidates.mesh_problems`): the sequence must split evenly, U must
divide the query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridsp import _formulas as formulas
from hybridsp._formulas import all_to_all_sent, kv_row_bytes, kv_transport, ring_rows
from hybridsp.planner._specs import MeshConfig, ModelSpec, Workload


def local_tokens(workload: Workload, config: MeshConfig) -> int:
    """Tokens one rank holds outside attention: B * S / C."""
    return workload.micro_batch * workload.seq_len // config.context


def expanded_kv_heads(model: ModelSpec, ulysses: int) -> int:
    """K/V heads after :func:`hybridsp._formulas.kv_repeats_for` expansion (Hkv' ; Hkv' % U == 0)."""
    return formulas.expanded_kv_heads(model.num_heads, model.num_kv_heads, ulysses)


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
    """4 * B * S^2 * H * D * c / C, c = 1/2 when causal (QK^T and PV, 2 FLOPs per MAC), times the
    workload's ``attention_work`` (packed documents)."""
    b, s = workload.micro_batch, workload.seq_len
    full = 4 * b * s * (s // context) * model.num_heads * model.head_dim
    return int((full // 2 if workload.causal else full) * workload.attention_work)


def ring_step_forward_flops(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """One ring step's forward: 4 * B * (S/R)^2 * (H/U) * D * c (zigzag: every step is half a block),
    times the workload's ``attention_work`` (packed documents: on average)."""
    block = workload.seq_len // config.ring
    full = 4 * workload.micro_batch * block * block * (model.num_heads // config.ulysses) * model.head_dim
    return int((full // 2 if workload.causal else full) * workload.attention_work)


LINEAR_CHUNK = 64  # the chunked delta rule's chunk (hybridsp.planner._activations.LINEAR_CHUNK)


def linear_forward_flops_per_token(model: ModelSpec) -> int:
    """One recurrent layer's chunked recurrence per token (projections are in ``matmul_params``):
    per value head, within its chunk of c = 64 tokens q k^T and the scores times v, 2 c (dk + dv),
    and the state's read-out and update, 4 dk dv (2 FLOPs per multiply-add). 0 without linear layers."""
    spec = model.linear
    if spec is None or not model.linear_layers:
        return 0
    return spec.heads * (2 * LINEAR_CHUNK * (spec.key_dim + spec.value_dim) + 4 * spec.key_dim * spec.value_dim)


def flops_per_rank(model: ModelSpec, workload: Workload, config: MeshConfig) -> Flops:
    """Attention (forward, 2.5x backward, +1x forward when recomputed) and dense (2/4/+2 x N x T; N counts
    active experts only; recurrent layers' chunked recurrence joins the dense FLOPs, linear in T)."""
    att_fwd = model.attention_layers * attention_forward_flops_per_layer(model, workload, config.context)
    tokens = local_tokens(workload, config)
    dense_fwd = 2 * model.matmul_params * tokens + model.linear_layers * linear_forward_flops_per_token(model) * tokens
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
    before an all-to-all; ``(U-1)/U`` of each leaves the rank. ``kv_block_bytes``: one whole
    K/V block of a ring slot (input dtype); ``grad_block_bytes``: its dK/dV, sent in the input
    dtype too. ``sent_blocks`` / ``read_blocks``: the K/V a rank sends / reads per pass, in
    blocks, averaged over the ring's ranks (:func:`hybridsp._formulas.ring_rows`; causal
    zigzag: 3/4 (R-1) each) for ``kv_comm="ring"``; ``kv_comm="allgather"`` gathers whole blocks,
    (R-1) per pass, and returns (R-1) dK/dV blocks by reduce-scatter.
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
    kv_comm: str = "ring"
    sent_blocks: float = 0.0
    read_blocks: float = 0.0

    @property
    def all_to_all_per_layer_pass(self) -> int:
        """Bytes leaving the rank in one pass of one layer: the q/k/v op plus the out op
        (forward), or the dout op plus the dq/dk/dv op (backward): the same sizes."""
        return all_to_all_sent(self.qkv_bytes, self.ulysses) + all_to_all_sent(self.out_bytes, self.ulysses)

    @property
    def all_to_all(self) -> int:
        passes = self.forward_passes + (1 if self.backward else 0)
        return self.layers * passes * self.all_to_all_per_layer_pass

    @property
    def ring_forward_per_layer(self) -> int:
        """K/V bytes one rank sends in one forward pass of one layer (mean over the ring)."""
        forward, _, _ = kv_transport(self.kv_comm, self.ring, 1, self.sent_blocks, self.read_blocks)
        return round(forward * self.kv_block_bytes)

    @property
    def ring_backward_per_layer(self) -> int:
        """K/V again plus the dK/dV of what the rank read, home once (ring) / reduce-scattered."""
        if not self.backward or self.ring == 1:
            return 0
        _, kv, grads = kv_transport(self.kv_comm, self.ring, 1, self.sent_blocks, self.read_blocks)
        return round(kv * self.kv_block_bytes + grads * self.grad_block_bytes)

    @property
    def ring_total(self) -> int:
        return self.layers * (self.forward_passes * self.ring_forward_per_layer + self.ring_backward_per_layer)


def comm_volume(model: ModelSpec, workload: Workload, config: MeshConfig) -> CommVolume:
    """Bytes of every all-to-all and ring transfer of one rank for one step."""
    e, d, dv, u = workload.dtype_bytes, model.head_dim, model.value_head_dim, config.ulysses
    tokens, kv_heads = local_tokens(workload, config), expanded_kv_heads(model, u)
    kv_block = (workload.seq_len // config.ring) * kv_row_bytes(workload.micro_batch, kv_heads, u, d, e, dv)
    sent, read = _mean_ring_blocks(config.ring, workload.seq_len // config.ring, workload.causal)
    return CommVolume(
        ulysses=u,
        ring=config.ring,
        layers=model.attention_layers,
        qkv_bytes=tokens * ((model.num_heads + kv_heads) * d + kv_heads * dv) * e,
        out_bytes=tokens * model.num_heads * dv * e,
        kv_block_bytes=kv_block,
        grad_block_bytes=kv_block,
        forward_passes=2 if config.checkpointing and not workload.forward_only else 1,
        backward=not workload.forward_only,
        kv_comm=resolved_kv_mode(workload),
        sent_blocks=sent,
        read_blocks=read,
    )


def resolved_kv_mode(workload: Workload) -> str:
    """The workload's K/V mode; ``"auto"`` counts as ``"ring"`` here (the leaner one) until
    :func:`hybridsp.planner._candidates.evaluate` compares both."""
    mode = workload.techniques.kv_mode
    return "ring" if mode == "auto" else mode


def _mean_ring_blocks(ring: int, slot: int, causal: bool) -> tuple[float, float]:
    """(blocks sent, blocks read) per pass, averaged over ring ranks (zigzag layout)."""
    if ring == 1:
        return 0.0, 0.0
    block = slot - slot % 2  # zigzag's two halves
    rows = [ring_rows(ring, r, block, "zigzag", causal) for r in range(ring)]
    return sum(s for s, _ in rows) / ring / block, sum(r for _, r in rows) / ring / block


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
