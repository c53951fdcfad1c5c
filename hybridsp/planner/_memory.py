"""Memory of one rank at the peak of a step, term by term, and what offload puts in host memory.

Notation as in :mod:`hybridsp.planner` (T = B S / C tokens per rank, e the activation element
size, Psi parameters, N = DP x C ranks ZeRO partitions over). Every term below is per rank.

Persistent (does not depend on S)
    model states: params e Psi, grads e Psi, Adam 12 Psi (fp32 master, m, v), partitioned by
        ZeRO stage over N (stage 3 also holds two gathered units of e x max(layer, embedding)).
        Optimizer offload (ZeRO >= 1): Adam and the gradient partition go to host
        (host: 12 Psi/N + 4 Psi/N fp32 gradients); parameter offload (ZeRO-3): the parameter
        partition goes to host (host: e Psi/N); the gathered units stay on the device.
    engine state: DeepSpeed's contiguous gradient bucket, ``reduce_bucket`` x e (ZeRO >= 1;
        5e7 elements = 191 MiB in fp32, measured in benchmarks/results/longest_context/longest_context.md).

Saved for backward, per token (HF Llama as hybridsp runs it; equal to the measured breakdown
of benchmarks/results/longest_context/longest_context.md, 82,356 B/token at U=1 and 86,452 at U=2, fp32)
    one RMSNorm: (4 + 2e) h + 4 (x in fp32, the normalised x and the weighted output in e,
        which the next linear keeps, fp32 rstd); with lean norms (``hybridsp.apply_lean_norms``)
        2 e h + 4 (x itself, the weighted output, fp32 rstd)
    attention: e (2 H D + 2 Hkv' D) + [U > 1] e H D + 4 H (q, k, v after the all-to-all, the
        kernel output, the o_proj input after the reverse all-to-all (a view of the output at
        U = 1), fp32 LSE)
    MLP: 4 I e (gate, SiLU(gate), up, their product); 0 with a tiled MLP (its input is the
        norm's output, already counted)
    layer A = 2 norms + attention + MLP; MLP region = 1 norm + MLP.
    outside the layers G: final norm + RoPE cos/sin 2 D e + token ids and labels 16.
    recomputed layer (checkpointing): A, less the first norm's x when it is the checkpoint itself
        and that stays on the device (HF's norm: e = 4, ``.to(float32)`` of fp32 returns it; a lean
        norm keeps x as it is, any e).
    checkpoints (activation checkpointing): the layers' inputs, L T h e; with activation
        offload min(L, keep_last + in_flight) T h e stay on the device (the newest
        ``keep_last``, ``offload_in_flight`` = 2 copies in flight on CUDA, one each way) and
        (L - keep_last) T h e live in host memory.

Loss
    logits path: T V (e + 12): the logits (e), the fp32 log-softmax the loss saves, and two
        fp32 gradients at the start of the backward (measured: 16 B/entry fp32, 14 bf16); the LM
        head's weight gradient comes after the log-softmax's backward has freed two of them
        (measured at V = 32000: the peak holds the gathered head weight, not its gradient).
    fused loss (measured, benchmarks/results/memory/memory.md): c V 4 + V h 4 + T h e in fp32, with
        c = ``loss_chunk`` or the library's default ceil(T h / V) (at most 64 MiB of logits):
        one chunk's fp32 logits, turned into their gradient in place; the fp32 LM-head gradient
        accumulator (added into in place); the hidden-state gradient kept for backward. bf16
        adds the chunk's bf16 logits c V e and the chunk's bf16 weight-gradient product with
        its fp32 cast, V h (e + 4) (measured: 188 MiB at T = 8192, V = 32000, h = 512).
    forward-only: T V (e + 4), fused c V (4 + e if not fp32).

Transients
    attention workspace: 4 T H (D + 1) fp32 accumulators + the larger of 2 qkv all-to-all
        buffers (U > 1) and 2 K/V receive blocks + 3 fp32 dK/dV blocks (R > 1) (the K/V mode's
        term: ring only): the all-to-alls run before and after the ring call, each freeing its
        buffers first, so the two never coexist (an earlier revision added them, 4 KB per
        local token too much in the checkpointed CPU ablation rows).
    MLP backward: t x 2 I e gradients (t = T untiled); tiled: t x 6 I e (the tile's recomputed
        intermediate and its gradients), t = mlp_tile (default h tokens).
    gradient flowing between layers: T h e.
    gradients awaiting ZeRO's reduction (ZeRO >= 2, layer backward phases): e x min(V h + one
        layer, reduce_bucket) (the LM head's, held until the tied embedding's backward, and the
        running layer's; the others wait in DeepSpeed's preallocated bucket, ``engine state``).
    ZeRO-3 re-gather: ``collective_copies`` x e x the unit being all-gathered (a layer in the
        layer phases, the head in the head's backward): the backend's temporary (gloo: 1,
        measured; NCCL: 0).
    LM head backward: the loss's gradients (fused: V h 4 + T h e; logits path: T V (e + 4))
        + the head's re-gather, or on the logits path its weight gradient V h e if larger.
    gradient reduction (ZeRO-3, the end of the backward): (1 + ``collective_copies``) x e x
        min(Psi, reduce_bucket) (the flat rank-ordered copy of the bucket DeepSpeed's
        reduce-scatter makes, and gloo's clone of it) + e x embedding (the first module's full
        gradient, still alive).

Peak = persistent + the largest of (checkpoints + phase) (checkpointing keeps nothing inside
the layers until the backward recomputes one; without it all L layers' A stay until their own
backward; the gradient reduction comes after the last layer's backward has freed every
checkpoint, so it holds none):
    loss:               [no checkpointing] L A + G + loss
    head backward:      [no checkpointing] L A + G + the loss's gradients + re-gather / V h e
    MLP backward:       layers + T h e + MLP transient + staged gradients + re-gather
    attention backward: layers - MLP region + T h e + attention workspace + staged gradients + re-gather
    gradient reduction: the reduce-scatter's copies + the first module's gradient (ZeRO-3)
with layers = L A (no checkpointing) or A (one layer recomputed). Forward-only keeps one
layer: T (A + 2 h e) + loss + workspace. The peak's parts are reported as ``activations``
(saved), ``logits`` (the loss, when the loss phase is the peak) and ``workspace``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridsp._formulas import CHUNK_LOGITS_BYTES, FP32, default_chunk_size
from hybridsp.planner._costs import comm_volume, expanded_kv_heads, local_tokens
from hybridsp.planner._kv_modes import kv_workspace_bytes, planner_chunks
from hybridsp.planner._specs import MeshConfig, ModelSpec, Workload

ADAM_BYTES_PER_PARAM = 12  # fp32 master weights + Adam m + Adam v
HOST_GRAD_BYTES_PER_PARAM = 4  # ZeRO-Offload's fp32 gradient partition in host memory
IDS_BYTES_PER_TOKEN = 16  # int64 token ids (embedding) and labels (loss)


@dataclass(frozen=True)
class MemoryUse:
    """Bytes one rank holds at its peak, by kind; ``host_*``: this rank's offloaded bytes.

    ``total = model_states + engine_state + checkpoints + activations + logits + workspace``;
    ``phases``: (name, bytes) of every phase's S-dependent part (checkpoints excluded); the
    largest with the checkpoints it holds (``checkpoints``: those of the peak phase; none at the
    gradient reduction) is ``peak_phase``.
    """

    params: int
    grads: int
    optimizer: int
    gathered_params: int
    activations: int
    logits: int
    workspace: int
    engine_state: int = 0
    checkpoints: int = 0
    peak_phase: str = "loss"
    phases: tuple[tuple[str, int], ...] = ()
    host_activations: int = 0
    host_optimizer: int = 0
    host_params: int = 0

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered_params

    @property
    def persistent(self) -> int:
        return self.model_states + self.engine_state

    @property
    def step(self) -> int:
        """What the step adds over the persistent states (the S-dependent memory)."""
        return self.checkpoints + self.activations + self.logits + self.workspace

    @property
    def total(self) -> int:
        return self.persistent + self.step

    @property
    def host(self) -> int:
        return self.host_activations + self.host_optimizer + self.host_params


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def model_state_bytes(
    model: ModelSpec,
    zero_stage: int,
    shards: int,
    forward_only: bool,
    dtype_bytes: int = 2,
    optimizer_offload: bool = False,
    param_offload: bool = False,
    prefetch_bucket: int | None = None,
) -> tuple[int, ...]:
    """(params, grads, optimizer, gathered) device bytes: e + e + 12 per param, ZeRO-partitioned.

    Stage 1 partitions the optimizer states, 2 adds gradients, 3 adds parameters (and then
    holds gathered parameters: the largest unit of a layer and the embedding, u, plus what is
    prefetched, max(u, prefetch_bucket), at most the whole model; without ``prefetch_bucket``
    two units). Offload moves the optimizer states and gradients (ZeRO >= 1) or the parameter
    partition (ZeRO-3) to host.
    """
    psi, e = model.total_params, dtype_bytes
    params = _ceil_div(e * psi, shards) if zero_stage == 3 else e * psi
    if param_offload and zero_stage == 3:
        params = 0
    unit = max(model.layer_params, model.embedding_params)
    ahead = unit if prefetch_bucket is None else max(unit, prefetch_bucket)
    gathered = (
        e * min(psi if prefetch_bucket is not None else 2 * unit, unit + ahead) if zero_stage == 3 and shards > 1 else 0
    )
    if forward_only:
        return params, 0, 0, gathered
    grads = _ceil_div(e * psi, shards) if zero_stage >= 2 else e * psi
    optimizer = _ceil_div(ADAM_BYTES_PER_PARAM * psi, shards) if zero_stage >= 1 else ADAM_BYTES_PER_PARAM * psi
    if optimizer_offload and zero_stage >= 1:
        grads = optimizer = 0
    return params, grads, optimizer, gathered


def host_state_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> tuple[int, int]:
    """(optimizer, params) bytes this rank keeps in host memory under ZeRO-Offload."""
    tech, psi, shards = workload.techniques, model.total_params, config.world_size
    optimizer = params = 0
    if not workload.forward_only and tech.optimizer_offload and config.zero_stage >= 1:
        optimizer = _ceil_div((ADAM_BYTES_PER_PARAM + HOST_GRAD_BYTES_PER_PARAM) * psi, shards)
    if tech.param_offload and config.zero_stage == 3:
        params = _ceil_div(workload.dtype_bytes * psi, shards)
    return optimizer, params


def engine_state_bytes(workload: Workload, config: MeshConfig) -> int:
    """DeepSpeed's contiguous gradient bucket: ``reduce_bucket`` elements of e (ZeRO >= 1, training)."""
    if workload.forward_only or config.zero_stage == 0:
        return 0
    return workload.techniques.reduce_bucket * workload.dtype_bytes


# ----------------------------------------------------------------------------- saved per token


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


# ----------------------------------------------------------------------------- step terms


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


AFTER_LAYERS_BACKWARD = ("gradient reduction",)  # phases after every layer's backward: no checkpoint is left


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
    """Transient buffers of one attention call: the fp32 out (or dq) accumulator and LSE, plus
    the larger of the all-to-all's send+receive of q/k/v and the K/V transport's buffers
    (:func:`hybridsp.planner._kv_modes.kv_workspace_bytes`: ring or all-gather). Not their sum:
    ``hybridsp.attention._ulysses`` reshards before the ring call (forward: q/k/v; backward: dout) and after
    it (forward: out; backward: dq/dk/dv), and each side frees its buffers before the other
    starts (``del send`` / ``received`` in ``_seq_to_heads`` / ``_heads_to_seq``; the ring's
    receive and dK/dV blocks die with ``_ring_backward``)."""
    volume = comm_volume(model, workload, config)
    tokens = local_tokens(workload, config)
    accumulators = tokens * model.num_heads * (model.value_head_dim + 1) * FP32
    a2a = 2 * volume.qkv_bytes if config.ulysses > 1 else 0
    ring = kv_workspace_bytes(
        volume.kv_comm,
        volume.kv_block_bytes,
        volume.grad_block_bytes,
        workload.dtype_bytes,
        config.ring,
        planner_chunks(workload, config),
        not workload.forward_only,
    )
    return accumulators + max(a2a, ring)  # one after the other, never both (docstring)


def mlp_transient_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """MLP backward: t x 2 I e gradients untiled (t = T), t x 6 I e tiled (t = mlp_tile, default h)."""
    tokens, e, tech = local_tokens(workload, config), workload.dtype_bytes, workload.techniques
    if not tech.tiled_mlp:
        return tokens * 2 * model.intermediate_size * e
    tile = min(tokens, tech.mlp_tile or model.hidden_size)
    return tile * 6 * model.intermediate_size * e


def _phases(model: ModelSpec, workload: Workload, config: MeshConfig) -> list[tuple[str, int, int, int, int]]:
    """(phase, total, saved, loss, transient) of every training phase (checkpoints excluded)."""
    tokens, e, tech = local_tokens(workload, config), workload.dtype_bytes, workload.techniques
    layer = tokens * layer_activation_bytes_per_token(model, config.ulysses, e, tech.tiled_mlp, tech.lean_norms)
    if config.checkpointing:
        layer -= tokens * checkpoint_alias_bytes_per_token(model, workload)
    mlp_region = tokens * (
        norm_bytes_per_token(model, e, tech.lean_norms) + mlp_bytes_per_token(model, e, tech.tiled_mlp)
    )
    layers = layer if config.checkpointing else model.num_layers * layer
    outside = tokens * outside_layers_bytes_per_token(model, e, tech.lean_norms)
    flow = tokens * model.hidden_size * e
    loss = loss_bytes(model, workload, config)
    mlp, attention = mlp_transient_bytes(model, workload, config), attention_workspace_bytes(model, workload, config)
    at_loss = 0 if config.checkpointing else layers  # checkpointed layers keep nothing inside until recomputed
    staged = staged_gradient_bytes(model, workload, config)
    regather = gather_copy_bytes(model, workload, config, model.layer_params)
    phases = [
        ("loss", at_loss + outside + loss, at_loss + outside, loss, 0),
        head_backward_phase(model, workload, config, at_loss + outside),
        ("mlp backward", layers + flow + mlp + staged + regather, layers + flow, 0, mlp + staged + regather),
        (
            "attention backward",
            layers - mlp_region + flow + attention + staged + regather,
            layers - mlp_region + flow,
            0,
            attention + staged + regather,
        ),
    ]
    reduction = reduction_bytes(model, workload, config)
    if reduction:
        phases.append(("gradient reduction", reduction, 0, 0, reduction))
    return phases


def head_backward_phase(model: ModelSpec, workload: Workload, config: MeshConfig, saved: int) -> tuple:
    """The LM head's backward (measured at V = 32000, benchmarks/results/longest_context/ablation_cpu.md): ZeRO-3
    gathers the head's weight again (``collective_copies`` temporaries of V h e on gloo) while the
    loss's gradients are alive: the fused loss's fp32 weight gradient V h 4 and hidden gradient
    T h e; on the logits path the logits and their gradient, T V (e + 4), and the weight gradient
    the backward makes, V h e (after the gather's temporary is freed)."""
    tokens, e, h, vocab = local_tokens(workload, config), workload.dtype_bytes, model.hidden_size, model.vocab_size
    regather = gather_copy_bytes(model, workload, config, model.embedding_params)
    if workload.fused_loss:
        held, transient = vocab * h * FP32 + tokens * h * e, regather
    else:
        held, transient = tokens * vocab * (e + FP32), max(regather, vocab * h * e)
    return ("head backward", saved + held + transient, saved, held, transient)


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


def memory_use(model: ModelSpec, workload: Workload, config: MeshConfig) -> MemoryUse:
    """Peak bytes of one rank (module docstring) and its offloaded host bytes."""
    tech = workload.techniques
    params, grads, optimizer, gathered = model_state_bytes(
        model,
        config.zero_stage,
        config.world_size,
        workload.forward_only,
        workload.dtype_bytes,
        tech.optimizer_offload,
        tech.param_offload,
        tech.prefetch_bucket,
    )
    host_optimizer, host_params = host_state_bytes(model, workload, config)
    states = dict(
        params=params,
        grads=grads,
        optimizer=optimizer,
        gathered_params=gathered,
        engine_state=engine_state_bytes(workload, config),
        host_optimizer=host_optimizer,
        host_params=host_params,
    )
    if workload.forward_only:
        tokens, e = local_tokens(workload, config), workload.dtype_bytes
        saved = tokens * (
            layer_activation_bytes_per_token(model, config.ulysses, e, tech.tiled_mlp) + 2 * model.hidden_size * e
        )
        loss, workspace = loss_bytes(model, workload, config), attention_workspace_bytes(model, workload, config)
        return MemoryUse(
            activations=saved,
            logits=loss,
            workspace=workspace,
            peak_phase="forward",
            phases=(("forward", saved + loss + workspace),),
            **states,
        )
    device_ckpt, host_ckpt = checkpoint_bytes(model, workload, config)
    phases = _phases(model, workload, config)
    held = {phase[0]: 0 if phase[0] in AFTER_LAYERS_BACKWARD else device_ckpt for phase in phases}
    name, _, saved, loss, transient = max(phases, key=lambda phase: phase[1] + held[phase[0]])
    return MemoryUse(
        activations=saved,
        logits=loss,
        workspace=transient,
        checkpoints=held[name],
        host_activations=host_ckpt,
        peak_phase=name,
        phases=tuple((phase[0], phase[1]) for phase in phases),
        **states,
    )
