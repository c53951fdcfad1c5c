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
    attention: e (2 H D + 2 Hkv' D) + [copy] e H D + 4 H (the call's q, k, v: the caller's RoPE
        outputs at U = 1, the ring-slot copies after the all-to-all at U > 1; its output, fp32 LSE;
        the o_proj input when it is a copy: HF's ``reshape(...).contiguous()`` copies every output
        but the ring's dense accumulator at U = 1, G = 1, R > 1,
        :func:`hybridsp.planner._activations.o_proj_input_copied`; measured equal by
        ``benchmarks.memory.layer_terms``)
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
        (L - keep_last) T h e live in host memory; with ``spill_activations`` (the disk tier) only
        min(L - keep_last, ``SPILL_WRITES_IN_FLIGHT`` = 2) of them, the writes in flight (the rest
        is on disk).

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
    attention workspace: the attention backward's working set beyond the saved tensors, as the
        code allocates it (:mod:`hybridsp.planner._attention_workspace`): the o_proj input's
        gradient (less the o_proj input copy its backward frees), at G > 1 the preallocated
        dq/dk/dv, and one head group's fp32 dq/dk/dv accumulators, kernel call (its gradients,
        dout in its layout, the LSE, the CPU kernel's tiles) and K/V blocks and dK/dV in flight
        at the worst ring step of the worst rank (measured equal on CPU by
        ``benchmarks.memory.layer_terms``, U1 x R4 and U2 x R2, G = 1, 2, 4). Forward-only: the
        fp32 out accumulator and LSE 4 T H (Dv + 1) + the larger of the all-to-all's 2 qkv and
        the ring's 2 K/V blocks.
    MLP backward: t x 2 I e (t = T untiled: with the 4 I e the MLP saved counted alive, the
        peak of HF's backward, which frees the product's copy before SiLU's and up's gradients
        appear; measured equal); tiled: t x 6 I e (the tile's recomputed intermediate and its
        gradients), t = mlp_tile (default h tokens).
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

from hybridsp._formulas import FP32
from hybridsp.planner._activations import (
    checkpoint_alias_bytes_per_token,
    checkpoint_bytes,
    layer_activation_bytes_per_token,
    mlp_bytes_per_token,
    norm_bytes_per_token,
    outside_layers_bytes_per_token,
)
from hybridsp.planner._costs import local_tokens
from hybridsp.planner._head_chunks import resolved_head_chunks
from hybridsp.planner._model_states import engine_state_bytes, host_state_bytes, model_state_bytes
from hybridsp.planner._phase_terms import (
    attention_workspace_bytes,
    gather_copy_bytes,
    linear_workspace_bytes,
    loss_bytes,
    mlp_transient_bytes,
    reduction_bytes,
    staged_gradient_bytes,
)
from hybridsp.planner._specs import MeshConfig, ModelSpec, Workload


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


AFTER_LAYERS_BACKWARD = ("gradient reduction",)
AT_LOSS = (
    "loss",
    "head backward",
)  # the end of the forward: activation offload's copies to host may still run  # phases after every layer's backward: no checkpoint is left


def _layer_bytes(model: ModelSpec, workload: Workload, config: MeshConfig, kind: str) -> int:
    """Saved bytes of one ``kind`` layer (``"attention"`` / ``"linear"``) at this mesh, all local tokens."""
    tech = workload.techniques
    per_token = layer_activation_bytes_per_token(
        model,
        config.ulysses,
        workload.dtype_bytes,
        tech.tiled_mlp,
        tech.lean_norms,
        kind,
        resolved_head_chunks(model, workload, config),
        config.ring,
    )
    return local_tokens(workload, config) * per_token


def _phases(model: ModelSpec, workload: Workload, config: MeshConfig) -> list[tuple[str, int, int, int, int]]:
    """(phase, total, saved, loss, transient) of every training phase (checkpoints excluded)."""
    tokens, e, tech = local_tokens(workload, config), workload.dtype_bytes, workload.techniques
    kinds = {"attention": model.attention_layers, "linear": model.linear_layers}
    layer = {kind: _layer_bytes(model, workload, config, kind) for kind, count in kinds.items() if count}
    if config.checkpointing:
        alias = tokens * checkpoint_alias_bytes_per_token(model, workload)
        layer = {kind: size - alias for kind, size in layer.items()}
    mlp_region = tokens * (
        norm_bytes_per_token(model, e, tech.lean_norms) + mlp_bytes_per_token(model, e, tech.tiled_mlp)
    )
    every_layer = sum(kinds[kind] * size for kind, size in layer.items())
    outside = tokens * outside_layers_bytes_per_token(model, e, tech.lean_norms)
    flow = tokens * model.hidden_size * e
    loss = loss_bytes(model, workload, config)
    mlp = mlp_transient_bytes(model, workload, config)
    at_loss = 0 if config.checkpointing else every_layer  # checkpointed layers keep nothing inside until recomputed
    staged = staged_gradient_bytes(model, workload, config)
    regather = gather_copy_bytes(model, workload, config, model.layer_params)

    def layers(kind: str) -> int:  # saved bytes while a ``kind`` layer runs its backward
        return layer[kind] if config.checkpointing else every_layer

    biggest = max(layer, key=lambda kind: layer[kind])
    phases = [
        ("loss", at_loss + outside + loss, at_loss + outside, loss, 0),
        head_backward_phase(model, workload, config, at_loss + outside),
        (
            "mlp backward",
            layers(biggest) + flow + mlp + staged + regather,
            layers(biggest) + flow,
            0,
            mlp + staged + regather,
        ),
    ]
    mixers = {"attention": attention_workspace_bytes, "linear": linear_workspace_bytes}
    for kind in layer:
        work = mixers[kind](model, workload, config) + staged + regather
        saved = layers(kind) - mlp_region + flow
        phases.append((f"{kind} backward", saved + work, saved, 0, work))
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
        kinds = ("attention", "linear") if model.linear_layers else ("attention",)
        saved = max(_layer_bytes(model, workload, config, kind) for kind in kinds) + 2 * tokens * model.hidden_size * e
        workspace = max(
            attention_workspace_bytes(model, workload, config), linear_workspace_bytes(model, workload, config)
        )
        loss = loss_bytes(model, workload, config)
        return MemoryUse(
            activations=saved,
            logits=loss,
            workspace=workspace,
            peak_phase="forward",
            phases=(("forward", saved + loss + workspace),),
            **states,
        )
    device_ckpt, host_ckpt = checkpoint_bytes(model, workload, config)
    in_backward, _ = checkpoint_bytes(model, workload, config, phase="backward")
    phases = _phases(model, workload, config)
    held = {
        phase[0]: 0 if phase[0] in AFTER_LAYERS_BACKWARD else device_ckpt if phase[0] in AT_LOSS else in_backward
        for phase in phases
    }
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
