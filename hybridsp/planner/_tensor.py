"""Tensor parallelism (T) in the planner: per-rank memory and time of long-context inference (prefill
of one long prompt, the K/V cache kept for decoding), and Megatron-style SP's activation saving.

For a mesh ``world = C x T`` (``C = U x R`` context ranks, ``T`` innermost, inside a node), one
prompt of ``S`` tokens, dtype bytes ``e``, a Llama-family model (L layers, hidden h, MLP width I,
H query / Hkv K/V heads of D), per rank:

    parameters   = L (attention + MLP projections) / T + norms + embedding + LM head   (x e)
                   (embedding and head stay whole: hybridsp's tensor_parallel does not split them)
    K/V cache    = 2 L (Hkv / T) D (S / C) e                       sharded over heads and sequence
    activations  = (S / C) e (3 h / T' + 3 I / T + 2 (H + 2 Hkv) D / T)  one layer's prefill working set
                   (hidden, norm output, residual; gate/up/act; q/k/v + attention out, twice);
                   T' = T with Megatron-style SP in the prefill (``sequence_parallel=True``), else 1
    compute      = (2 P_matmul S + 2 L H D S^2) / (world x achieved FLOP/s)   (causal attention)
    TP traffic   = L x 2 all-reduces of (S / C) h e bytes; a ring all-reduce sends 2 (T-1)/T of that,
                   on the intra-node link, not overlapped (conservative)
    Ulysses      = L x 4 all-to-alls of (S / C) (H/T) D e x (U-1)/U bytes each, on the intra-node
                   link when T x U fits a node, else on the inter-node link

The ring's K/V passes hide behind attention compute at these lengths (:mod:`hybridsp.planner._kv_modes`
prices them in detail); they are not added here.

Megatron-style sequence parallelism in the tensor group (training) keeps each norm's input and the
residual stream on ``1/T`` of the tokens: :func:`sequence_parallel_saving` is what it saves per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridsp.planner._specs import ClusterSpec, ModelSpec


@dataclass(frozen=True)
class TensorOption:
    """One mesh for inference: degrees, bytes per rank, seconds for the prefill."""

    tensor: int
    ulysses: int
    ring: int
    params: int
    kv_cache: int
    activations: int
    fits: bool
    compute_s: float
    tp_comm_s: float
    ulysses_comm_s: float
    tp_bytes: int
    sequence_parallel: bool = False

    @property
    def memory(self) -> int:
        return self.params + self.kv_cache + self.activations

    @property
    def prefill_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.ulysses_comm_s


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def param_bytes_per_rank(model: ModelSpec, tensor: int, dtype_bytes: int = 2) -> int:
    """Parameters one rank holds with the layers' projections split ``tensor`` ways."""
    split = model.num_layers * (model.attention_params_per_layer + model.mlp_params_per_layer)
    whole = model.total_params - split
    return (split // tensor + whole) * dtype_bytes


def inference_option(
    model: ModelSpec,
    cluster: ClusterSpec,
    tokens: int,
    tensor: int,
    ulysses: int,
    ring: int,
    dtype_bytes: int = 2,
    sequence_parallel: bool = False,
) -> TensorOption:
    """Memory and prefill time per rank of one prompt of ``tokens`` on ``tensor x ulysses x ring`` ranks
    (``sequence_parallel``: the prefill keeps the hidden states on 1/T of the tokens; same TP bytes)."""
    e, h, d, layers = dtype_bytes, model.hidden_size, model.head_dim, model.num_layers
    context = ulysses * ring
    local = -(-tokens // context)
    heads, kv_heads = model.num_heads // tensor, model.num_kv_heads // tensor
    params = param_bytes_per_rank(model, tensor, e)
    kv_cache = 2 * layers * kv_heads * d * local * e
    outside = 3 * h // (tensor if sequence_parallel else 1)
    activations = local * e * (outside + 3 * model.intermediate_size // tensor + 2 * (heads + 2 * kv_heads) * d)
    world = context * tensor
    flops = 2 * model.matmul_params * tokens + 2 * layers * model.num_heads * d * tokens * tokens
    compute_s = flops / (world * cluster.achieved_flops)
    tp_bytes = 0 if tensor == 1 else int(layers * 2 * 2 * (tensor - 1) / tensor * local * h * e)
    tp_comm_s = tp_bytes / cluster.intra_bw
    a2a = layers * 4 * local * heads * d * e * (ulysses - 1) / ulysses
    link = cluster.intra_bw if tensor * ulysses <= cluster.gpus_per_node else cluster.inter_bw
    fits = params + kv_cache + activations <= cluster.usable_bytes
    return TensorOption(
        tensor,
        ulysses,
        ring,
        params,
        kv_cache,
        activations,
        fits,
        compute_s,
        tp_comm_s,
        a2a / link,
        tp_bytes,
        sequence_parallel and tensor > 1,
    )


def inference_options(
    model: ModelSpec,
    cluster: ClusterSpec,
    tokens: int,
    dtype_bytes: int = 2,
    tensor: int | None = None,
    sequence_parallel: bool = False,
) -> list[TensorOption]:
    """Every valid (T, U, R) on the whole cluster (T and U dividing the heads, T inside a node and
    dividing the K/V heads); ``tensor`` fixes T. Sorted: fitting first, then by prefill time."""
    world, options = cluster.world_size, []
    for t in _divisors(cluster.gpus_per_node) if tensor is None else [tensor]:
        if world % t or model.num_kv_heads % t or model.num_heads % t:
            continue
        for u in _divisors(world // t):
            if (model.num_heads // t) % u == 0:
                options.append(
                    inference_option(model, cluster, tokens, t, u, world // (t * u), dtype_bytes, sequence_parallel)
                )
    return sorted(options, key=lambda o: (not o.fits, o.prefill_s))


def recommend_inference(
    model: ModelSpec, cluster: ClusterSpec, tokens: int, dtype_bytes: int = 2, sequence_parallel: bool = False
) -> TensorOption:
    """The fastest fitting mesh (T may be 1); ValueError naming the smallest need when nothing fits."""
    options = inference_options(model, cluster, tokens, dtype_bytes, sequence_parallel=sequence_parallel)
    if not options or not options[0].fits:
        least = min(options, key=lambda o: o.memory) if options else None
        need = f"; the least memory is {least.memory / 2**30:.1f} GiB per rank at T={least.tensor}" if least else ""
        raise ValueError(
            f"{model.name} with {tokens:,} tokens does not fit {cluster.name} "
            f"({cluster.usable_bytes / 2**30:.1f} GiB usable per rank){need}"
        )
    return options[0]


def sequence_parallel_saving(model: ModelSpec, local_tokens: int, tensor: int, dtype_bytes: int = 2) -> int:
    """Bytes per rank Megatron-style SP in the tensor group saves in a training step's saved activations:
    the two norms' inputs per layer plus the final norm's, on ``1/T`` of the ``local_tokens`` instead of all."""
    saved = (2 * model.num_layers + 1) * local_tokens * model.hidden_size * dtype_bytes
    return saved - saved // tensor
