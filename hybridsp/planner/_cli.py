"""``python -m hybridsp plan``: rank Ulysses x ring x DP x ZeRO plans for a model on a cluster.

Presets (``--model``, ``--gpu``, ``--intra``, ``--inter``) give every number; explicit
options (``--heads``, ``--flops``, ``--memory-gib``, ``--intra-bw`` ...) override them.
Memory techniques (``--fused-loss``, ``--tiled-mlp``, ``--offload-activations``,
``--offload-optimizer``, ``--offload-params``) change the memory model
(:mod:`hybridsp.planner._memory`); ``--longest-context --ablation`` adds them one at a time.
``--clusters`` prints the longest-context table of :mod:`hybridsp.planner._clusters` (Llama-3
8B / 70B on 8 to 512 H100 / H200; ``--out PATH.json`` also writes its rows).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import replace
from typing import Any

from hybridsp.planner import _clusters as clusters
from hybridsp.planner._ablation import ablation, format_ablation
from hybridsp.planner._options import add_arguments as add_arguments
from hybridsp.planner._options import cluster_from_args, model_from_args, space_from_args, techniques_from_args
from hybridsp.planner._packing import attention_work_fraction, packing_summary
from hybridsp.planner._plan_table import FORWARD_ONLY_VS_TENSOR, format_result
from hybridsp.planner._search import PlanResult, SearchSpace, longest_context, plan
from hybridsp.planner._specs import GIB, ClusterSpec, ModelSpec, Workload
from hybridsp.planner._techniques import Techniques
from hybridsp.planner._tensor import inference_options

HELP = "rank Ulysses x ring x DP x ZeRO plans for a model on a cluster"


def run_ablation(
    args: argparse.Namespace,
    model: ModelSpec,
    cluster: ClusterSpec,
    space: SearchSpace,
    techniques: Techniques,
    workload_args: dict,
) -> int:
    """``--longest-context --ablation``: one row per technique added; JSON ``{"ablation": [...]}`` (printed
    with ``--json``, written to ``--out`` beside the table)."""
    rows = ablation(model, cluster, base=techniques, granularity=args.granularity, space=space, **workload_args)
    document = {
        "ablation": [row.to_dict() for row in rows],
        "model": model.name,
        "cluster": cluster.name,
        "granularity": args.granularity,
    }
    if args.out:
        with open(args.out, "w") as sink:
            sink.write(json.dumps(document, indent=1) + "\n")
    print(json.dumps(document) if args.json else format_ablation(rows, model, cluster))
    return 0 if rows[-1].plan is not None else 1


def run_clusters(args: argparse.Namespace) -> int:
    """``--clusters``: the table (or ``--json`` rows); ``--out`` writes ``{"meta", "rows"}``."""
    rows, seconds = clusters.run(args.granularity)
    if args.out:
        meta = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": "python -m hybridsp " + " ".join(sys.argv[1:]),
            "seconds": seconds,
            "assumptions": clusters.__doc__.split("\n\n", 2)[2].strip(),
        }
        with open(args.out, "w") as sink:
            sink.write(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(json.dumps({"clusters": rows}) if args.json else clusters.markdown(rows))
    return 0


def run_tensor_inference(args: argparse.Namespace, model: ModelSpec, cluster: ClusterSpec) -> int:
    """``--tensor-inference``: every T x U x R mesh for one prefill, fitting and fastest first."""
    if args.seq_len is None:
        raise ValueError("--tensor-inference needs --seq-len (the prompt's tokens)")
    options = inference_options(model, cluster, args.seq_len, args.dtype_bytes, sequence_parallel=args.tensor_sp)
    if args.json:
        print(
            json.dumps(
                {"tensor_inference": [{**vars(o), "memory": o.memory, "prefill_s": o.prefill_s} for o in options]}
            )
        )
    else:
        print(
            f"{model.name}, {args.seq_len:,}-token prefill on {cluster.name} ({cluster.world_size} GPUs, "
            f"{cluster.usable_bytes / GIB:.1f} GiB usable each){', SP in the tensor group' if args.tensor_sp else ''}"
        )
        print(f"Note: {FORWARD_ONLY_VS_TENSOR}.")
        print(f"{'T':>3} {'U':>3} {'R':>4} {'GiB/rank':>9} {'weights':>8} {'K/V':>8} {'fits':>5} {'prefill s':>10}")
        for o in options[: args.top or None]:
            print(
                f"{o.tensor:>3} {o.ulysses:>3} {o.ring:>4} {o.memory / GIB:>9.1f} {o.params / GIB:>8.1f} "
                f"{o.kv_cache / GIB:>8.1f} {'yes' if o.fits else 'no':>5} {o.prefill_s:>10.2f}"
            )
        best = options[0] if options and options[0].fits else None
        print(
            f"Recommended: T={best.tensor} x Ulysses={best.ulysses} x ring={best.ring}"
            if best
            else "Nothing fits: more GPUs, --tensor-sp, or a shorter --seq-len."
        )
    return 0 if options and options[0].fits else 1


def _linear(args: argparse.Namespace, result: PlanResult) -> str:
    """``--linear``: the recurrent layers' report at the recommended mesh."""
    from hybridsp.linear_attention._volume import linear_report, parse_linear

    try:
        spec, layers = parse_linear(args.linear)
    except ValueError as error:
        raise SystemExit(f"python -m hybridsp plan: error: {error}") from None
    assert result.recommended is not None  # run() asks for the report only when a plan is recommended
    config, work = result.recommended.config, result.workload
    report = linear_report(spec, layers, work.micro_batch, work.seq_len, config.ulysses, config.ring, args.dtype_bytes)
    return report.replace("models every layer as attention", f"models these {layers} layers as linear")


def _with_linear(args: argparse.Namespace, model: ModelSpec) -> ModelSpec:
    """``--linear KIND:LAYERS:...``: that many of the model's layers are recurrent, in memory and time."""
    if not args.linear:
        return model
    from hybridsp.linear_attention._volume import parse_linear

    spec, layers = parse_linear(args.linear)
    return replace(model, linear_layers=layers, linear=spec)


def _breakdown(result: PlanResult) -> str:
    """``--breakdown``: the recommended plan's memory at its peak, term by term."""
    from hybridsp.planner._breakdown import format_breakdown

    best = result.recommended
    assert best is not None
    techniques = replace(result.workload.techniques, head_chunks=best.head_chunks)
    workload = replace(result.workload, techniques=techniques)
    return format_breakdown(result.model, workload, best.config, best.usable_bytes)


def run(args: argparse.Namespace) -> int:
    """Run ``plan``; print a table or JSON. Returns the exit status (1: nothing fits)."""
    if args.clusters:
        return run_clusters(args)
    extra: dict[str, Any]
    try:
        model, cluster, space = (
            _with_linear(args, model_from_args(args)),
            cluster_from_args(args),
            space_from_args(args),
        )
        techniques = techniques_from_args(args)
        workload_args = dict(
            micro_batch=args.micro_batch,
            forward_only=args.forward_only,
            chunked_loss=args.chunked_loss,
            causal=not args.non_causal,
            dtype_bytes=args.dtype_bytes,
        )
        if args.tensor_inference:
            return run_tensor_inference(args, model, cluster)
        if args.ablation:
            if not args.longest_context:
                raise ValueError("--ablation needs --longest-context")
            return run_ablation(args, model, cluster, space, techniques, workload_args)
        if args.longest_context:
            longest = longest_context(
                model, cluster, granularity=args.granularity, space=space, techniques=techniques, **workload_args
            )
            result, extra = (
                longest.result,
                {"longest_context": {"seq_len": longest.seq_len, "granularity": longest.granularity}},
            )
        elif args.seq_len is None:
            raise ValueError("give --seq-len (or --longest-context)")
        else:
            work = (
                attention_work_fraction(args.doc_lengths, args.seq_len, not args.non_causal)
                if args.doc_lengths
                else 1.0
            )
            workload = Workload(args.seq_len, **workload_args, techniques=techniques, attention_work=work)
            result, extra = plan(model, workload, cluster, space), {}
    except ValueError as error:
        raise SystemExit(f"python -m hybridsp plan: error: {error}") from None
    if args.doc_lengths and result is not None and result.recommended is not None:
        ring, seq_len = result.recommended.config.ring, result.workload.seq_len
        work = result.workload.attention_work
        extra["packing"] = {"ring": ring, "attention_work": work, **packing_summary(args.doc_lengths, seq_len, ring)}
        if not args.longest_context:
            extra["packing"]["report"] = (
                f"packed documents do {work:.1%} of an unpacked row's attention work (step "
                f"times above count only that); " + extra["packing"]["report"]
            )
    if args.linear and result is not None and result.recommended is not None:
        extra["linear"] = _linear(args, result)
    if args.json:
        print(json.dumps({**(result.to_dict() if result else {"recommended": None, "ranked": []}), **extra}))
    else:
        if "longest_context" in extra:
            print(
                f"Longest context: {extra['longest_context']['seq_len']:,} tokens "
                f"(multiple of {args.granularity}) under the plans below\n"
            )
        print(format_result(result, args.top, space) if result else "Nothing fits even at the granularity.")
        if "packing" in extra:
            print("\n" + extra["packing"]["report"])
        if "linear" in extra:
            print("\n" + extra["linear"])
        if args.breakdown and result is not None and result.recommended is not None:
            print("\n" + _breakdown(result))
    return 0 if result is not None and result.recommended is not None else 1
