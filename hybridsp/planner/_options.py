"""The ``plan`` command's options: the argparse types that check token counts and numbers, the
option groups (:func:`add_arguments`), and the model, cluster, techniques and search space the
parsed options describe."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

from hybridsp.planner._search import SearchSpace
from hybridsp.planner._specs import GIB, GPUS, INTER_LINKS, INTRA_LINKS, MODELS, ClusterSpec, ModelSpec, preset_cluster
from hybridsp.planner._techniques import KV_MODES, Techniques

_MODEL_FIELDS = {  # option dest -> ModelSpec field
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "layers": "num_layers",
    "vocab": "vocab_size",
    "v_head_dim": "v_head_dim",
    "experts": "num_experts",
    "experts_per_token": "experts_per_token",
    "expert_intermediate": "expert_intermediate_size",
    "shared_expert_intermediate": "shared_expert_intermediate_size",
}
_MODEL_HELP = {
    "heads": "query (attention) heads",
    "kv_heads": "key/value heads (GQA; default: --heads)",
    "head_dim": "size of one head (default: --hidden / --heads)",
    "hidden": "hidden size (model width)",
    "intermediate": "MLP intermediate size",
    "layers": "decoder layers",
    "vocab": "vocabulary size",
    "v_head_dim": "size of one value head when it differs from --head-dim (MLA: 128 with --head-dim 192)",
    "experts": "MoE: experts per layer (parameters and optimizer states count all of them)",
    "experts_per_token": "MoE: experts each token runs through (activations and FLOPs count these)",
    "expert_intermediate": "MoE: one expert's intermediate size (default --intermediate)",
    "shared_expert_intermediate": "MoE: the shared expert's intermediate size (default none)",
}
_SUFFIXES = {"k": 1024, "m": 1024**2}  # 128k = 131,072 and 1M = 1,048,576 tokens, as context lengths are named


def _number(kind: type, lowest: float, inclusive: bool, what: str):
    """An argparse ``type`` that accepts finite ``kind`` values above ``lowest`` (or equal, if
    ``inclusive``); anything else (0, negatives, inf, nan) is a usage error (exit code 2) quoting it."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}") from None
        if not math.isfinite(value) or value < lowest or (value == lowest and not inclusive):
            raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def _tokens(text: str) -> int:
    """A token count: an integer, or one with ``k`` (x 1024) or ``M`` (x 1024^2): ``128k`` = 131072, ``1M`` =
    1048576, ``1.5M`` = 1572864; a usage error (exit code 2) otherwise."""
    what = "a positive token count such as 32768, 128k (= 131072) or 1M (= 1048576)"
    body, scale = text.strip(), 1
    if body[-1:].lower() in _SUFFIXES:
        body, scale = body[:-1], _SUFFIXES[body[-1].lower()]
    try:
        value = float(body) * scale if scale > 1 else int(body)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}")
    return int(value)


_POSITIVE_INT = _number(int, 0, False, "a positive integer")


def _head_chunks(text: str) -> int | str:
    """``auto`` or a positive integer (a usage error otherwise)."""
    return "auto" if text == "auto" else _POSITIVE_INT(text)


_COUNT = _number(int, 0, True, "an integer >= 0")
_POSITIVE = _number(float, 0.0, False, "a positive finite number")
_NON_NEGATIVE = _number(float, 0.0, True, "a finite number >= 0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's options."""
    model = parser.add_argument_group("model (a preset, explicit numbers override it)")
    model.add_argument("--model", choices=sorted(MODELS), help="model preset")
    for option in _MODEL_FIELDS:
        model.add_argument(f"--{option.replace('_', '-')}", type=_POSITIVE_INT, help=_MODEL_HELP[option])
    cluster = parser.add_argument_group("cluster (presets, explicit numbers override them)")
    cluster.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    cluster.add_argument("--intra", choices=INTRA_LINKS, default="nvlink", help="intra-node link")
    cluster.add_argument("--inter", choices=sorted(INTER_LINKS), default="ib", help="inter-node link")
    cluster.add_argument("--nodes", type=_POSITIVE_INT, default=1)
    cluster.add_argument("--gpus-per-node", type=_POSITIVE_INT, default=8)
    cluster.add_argument("--flops", type=_POSITIVE, help="peak dense FLOP/s per accelerator")
    cluster.add_argument("--memory-gib", type=_POSITIVE, help="memory per accelerator, GiB")
    cluster.add_argument("--intra-bw", type=_POSITIVE, help="intra-node bytes/s per accelerator per direction")
    cluster.add_argument("--inter-bw", type=_POSITIVE, help="inter-node bytes/s per accelerator per direction")
    cluster.add_argument("--efficiency", type=_POSITIVE, help="achieved fraction of peak FLOP/s (default 0.5)")
    cluster.add_argument(
        "--reserved-gib", type=_NON_NEGATIVE, help="memory kept from the model per accelerator (default 4)"
    )
    cluster.add_argument(
        "--host-memory-gib", type=_POSITIVE, help="host memory per node for offload, GiB (default 2048)"
    )
    cluster.add_argument(
        "--host-bw", type=_POSITIVE, help="host<->accelerator (PCIe) bytes/s per accelerator per direction"
    )
    cluster.add_argument(
        "--host-adam-params-per-s",
        type=_POSITIVE,
        help="parameters per second a node's CPU Adam updates (optimizer offload; default 1e9)",
    )
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--seq-len",
        type=_tokens,
        help="tokens per sequence, e.g. 32768, 128k or 1M (k = 1024: 128k = "
        "131072, 1M = 1048576); required unless --longest-context",
    )
    work.add_argument("--micro-batch", type=_POSITIVE_INT, default=1, help="sequences per replica per step")
    work.add_argument(
        "--forward-only",
        action="store_true",
        help="one forward (a prefill, scoring) on the training meshes: no backward, gradients or "
        "optimizer; every rank holds the weights (or a ZeRO-3 shard), no K/V cache. For serving "
        "meshes that split weights and K/V cache heads T ways, see --tensor-inference",
    )
    work.add_argument("--chunked-loss", action="store_true", help="the loss never materialises all logits")
    work.add_argument("--non-causal", action="store_true", help="bidirectional attention")
    work.add_argument(
        "--dtype-bytes",
        type=int,
        choices=(1, 2, 4),
        default=2,
        help="activation element size (2 = bf16, 4 = fp32, 1 = fp8)",
    )
    work.add_argument(
        "--doc-lengths",
        type=_lengths,
        metavar="N,N,...",
        help="packed documents: the lengths of one row's documents (repeated to fill --seq-len); the "
        "step time counts only attention within documents (with --seq-len), and the output "
        "reports each layout's ring imbalance and what layout='balanced' buys",
    )
    tech = parser.add_argument_group("memory techniques (hybridsp.planner._memory states each term)")
    tech.add_argument("--fused-loss", action="store_true", help="hybridsp.fused_cross_entropy: no [T, V] logits")
    tech.add_argument(
        "--loss-chunk",
        type=_POSITIVE_INT,
        default=Techniques.loss_chunk,
        help="fused-loss chunk, tokens (default: the library's, ceil(T h / V) capped at 64 MiB of logits)",
    )
    tech.add_argument("--tiled-mlp", action="store_true", help="MLP over sequence tiles with recomputation")
    tech.add_argument("--mlp-tile", type=_POSITIVE_INT, help="tiled-MLP tile, tokens (default: the hidden size)")
    tech.add_argument(
        "--lean-norms",
        action="store_true",
        help="hybridsp.apply_lean_norms: RMSNorms keep x and one scale per row for backward",
    )
    tech.add_argument(
        "--offload-activations",
        action="store_true",
        help="checkpointed layers' inputs in host memory (needs activation checkpointing)",
    )
    tech.add_argument(
        "--spill-activations",
        action="store_true",
        help="with --offload-activations: the offloaded inputs in files on a local disk "
        "(offload_activations(spill_dir=...)); host memory holds only the writes in flight",
    )
    tech.add_argument(
        "--keep-last",
        type=_COUNT,
        default=Techniques.keep_last,
        help="newest checkpointed inputs kept on the device (default 1)",
    )
    tech.add_argument("--offload-optimizer", action="store_true", help="DeepSpeed offload_optimizer to CPU (ZeRO >= 1)")
    tech.add_argument("--offload-params", action="store_true", help="DeepSpeed offload_param to CPU (ZeRO-3)")
    tech.add_argument(
        "--kv-mode",
        choices=KV_MODES,
        default="auto",
        help="how K/V travel inside the ring group: ring (point-to-point steps), allgather "
        "(chunked all-gather), auto (default: the faster that fits, per mesh)",
    )
    tech.add_argument(
        "--head-chunks",
        type=_head_chunks,
        default=1,
        help="G: each attention layer runs as G passes over head groups (an integer dividing the K/V heads "
        "per Ulysses rank, or auto: the fastest G that fits, per mesh; default 1)",
    )
    tech.add_argument(
        "--breakdown", action="store_true", help="print where every GiB of the recommended plan goes at its peak"
    )
    tech.add_argument(
        "--reduce-bucket",
        type=_POSITIVE_INT,
        default=Techniques.reduce_bucket,
        help="DeepSpeed reduce_bucket_size, elements (engine state)",
    )
    search = parser.add_argument_group("search")
    search.add_argument("--zero", type=int, nargs="+", choices=(0, 1, 2, 3), help="ZeRO stage(s) (default: all)")
    search.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="on",
        default="auto",
        choices=("on", "off", "auto"),
        help="on, off, or auto (try both; default)",
    )
    search.add_argument("--dp", type=_POSITIVE_INT, help="fix the data-parallel degree")
    search.add_argument("--ulysses", type=_POSITIVE_INT, help="fix the Ulysses degree")
    search.add_argument("--ring", type=_POSITIVE_INT, help="fix the ring degree")
    search.add_argument("--order", choices=("ulysses_inner", "ring_inner"), default="ulysses_inner")
    search.add_argument("--longest-context", action="store_true", help="find the longest sequence that fits")
    search.add_argument("--granularity", type=_tokens, default=1024, help="--longest-context step, tokens (4k = 4096)")
    search.add_argument(
        "--ablation",
        action="store_true",
        help="with --longest-context: add fused_loss, tiled_mlp, activation_offload, "
        "optimizer_offload one at a time (a row each)",
    )
    search.add_argument(
        "--clusters",
        action="store_true",
        help="the longest-context table for Llama-3 8B / 70B on 8-512 H100 / H200 "
        "(hybridsp.planner._clusters; --granularity applies); other options are ignored",
    )
    tensor = parser.add_argument_group("tensor parallelism (long-context inference)")
    tensor.add_argument(
        "--tensor-inference",
        action="store_true",
        help="rank T x Ulysses x ring meshes for a --seq-len prefill of --model on the cluster: weights "
        "1/T per rank, the K/V cache kept and split over sequence and heads (its own memory "
        "model; --forward-only instead plans the same prefill on DP x Ulysses x ring training "
        "meshes with whole weights and no cache)",
    )
    tensor.add_argument(
        "--tensor-sp",
        action="store_true",
        help="with --tensor-inference: Megatron-style sequence parallelism inside the tensor group",
    )
    work.add_argument(
        "--linear",
        metavar="KIND:LAYERS:UNITS:HEADS:KEY_DIM:VALUE_DIM[:CONV]",
        help="a hybrid model's linear layers (delta_rule or mamba2): their bytes and buffers per rank "
        "at the recommended mesh (hybridsp.linear_attention._volume)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--top", type=int, default=12, help="table rows (0: all)")
    out.add_argument(
        "--out", help="with --clusters or --ablation: also write the rows (and how they were made) to this JSON file"
    )


def _lengths(text: str) -> list[int]:
    """``--doc-lengths``: comma-separated positive integers."""
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts, e.g. 4000,1200,300; got {text!r}"
        ) from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"document lengths must be positive integers; got {text!r}")
    return lengths


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The preset with explicit numbers applied, or a model from explicit numbers alone."""
    given = {
        field: getattr(args, option) for option, field in _MODEL_FIELDS.items() if getattr(args, option) is not None
    }
    if args.model:
        return replace(MODELS[args.model], **given)
    missing = [
        f"--{o.replace('_', '-')}"
        for o in ("heads", "hidden", "intermediate", "layers", "vocab")
        if _MODEL_FIELDS[o] not in given
    ]
    if missing:
        raise ValueError(f"give --model or the model's shape; missing {' '.join(missing)}")
    given.setdefault("num_kv_heads", given["num_heads"])
    if "head_dim" not in given and given["hidden_size"] % given["num_heads"]:
        raise ValueError(
            f"--hidden {given['hidden_size']} is not a multiple of --heads {given['num_heads']}: give "
            f"--head-dim too (the model's per-head size)"
        )
    given.setdefault("head_dim", given["hidden_size"] // given["num_heads"])
    return ModelSpec(**given)


def cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    overrides = {
        "peak_flops": args.flops,
        "intra_bw": args.intra_bw,
        "inter_bw": args.inter_bw,
        "efficiency": args.efficiency,
        "memory_bytes": args.memory_gib * GIB if args.memory_gib is not None else None,
        "reserved_bytes": args.reserved_gib * GIB if args.reserved_gib is not None else None,
        "host_memory_bytes": args.host_memory_gib * GIB if args.host_memory_gib is not None else None,
        "host_bw": args.host_bw,
        "host_adam_params_per_s": args.host_adam_params_per_s,
    }
    given = {key: value for key, value in overrides.items() if value is not None}
    return preset_cluster(args.gpu, args.nodes, args.gpus_per_node, args.intra, args.inter, **given)


def techniques_from_args(args: argparse.Namespace) -> Techniques:
    if args.spill_activations and not args.offload_activations:
        raise ValueError(
            "--spill-activations needs --offload-activations (the disk tier holds what the offload sends off "
            "the device): add it, or drop --spill-activations"
        )
    return Techniques(
        fused_loss=args.fused_loss,
        loss_chunk=args.loss_chunk,
        tiled_mlp=args.tiled_mlp,
        mlp_tile=args.mlp_tile,
        lean_norms=args.lean_norms,
        activation_offload=args.offload_activations,
        keep_last=args.keep_last,
        spill_activations=args.spill_activations,
        optimizer_offload=args.offload_optimizer,
        param_offload=args.offload_params,
        kv_mode=args.kv_mode,
        head_chunks=args.head_chunks,
        reduce_bucket=args.reduce_bucket,
    )


def space_from_args(args: argparse.Namespace) -> SearchSpace:
    checkpointing = {"on": (True,), "off": (False,), "auto": (False, True)}[args.activation_checkpointing]
    stages = tuple(args.zero) if args.zero else (0, 1, 2, 3)
    return SearchSpace(stages, checkpointing, args.dp, args.ulysses, args.ring, args.order)
