"""Longest context one training step survives on this machine, against the planner's prediction.

    python -m benchmarks run longest.context            # w1, cp2, cp4, cp8, 1 GiB in all (~20-25 min)
    python -m benchmarks run longest.context --quick    # w1 and cp2, 0.5 GiB, coarse (~4 min); temp dir

The attempt and the search are in :mod:`benchmarks.common.longest` (longest.ablation and memory.loss
use them too); the report in :mod:`benchmarks.longest._report`.

One attempt: ``world`` gloo ranks (``hybridsp.testing.run_distributed``, one launch per attempt,
torch threads per rank = cores // world) each build the example model of ``examples/train.py``
on its defaults (``train.build_model(train.parse_args(["--deepspeed", cpN.json, "--seq-len", S]),
256)``: a Llama with h=256, 4 layers, 8 query / 4 K/V heads of 32, I=640, byte vocabulary 256,
tied embeddings, fp32; ``--seq-len`` only sets max_position_embeddings), wrap it with
``hybridsp.integrations.deepspeed.initialize`` on the shipped ``ds_configs/cpN.json`` (ZeRO-3;
"auto" precision is fp32 on CPU; AdamW runs as torch Adam) and run ONE ``train.train_step``
(forward + backward + optimizer step) on a window of S tokens of the example's byte corpus.
The attempt succeeds when every rank finishes the step. Configs: w1 (U=R=1), cp2 (U2 R1),
cp4 (U2 R2), cp8 (U4 R2), all DP=1.

Memory limit (Note [the limit]): each rank, after the imports and the engine build (model,
ZeRO-3 partitions, DeepSpeed buffers; ``--limit-from imports`` moves the start before the
build), sets the soft ``RLIMIT_DATA`` to its current VmData + ``budget / world``. An allocation
past it fails inside torch (``RuntimeError: DefaultCPUAllocator: can't allocate memory``); the
rank writes its error to a report file and re-raises, ``run_distributed`` kills the others, and
the attempt counts as too long. The machine's RAM is never at risk. The start of every run
checks which limits raise that way on this kernel.

Search per config: lengths are multiples of ``lcm(granularity, 2 R U)`` (the zigzag layout's
multiple); doubling from a start length until an attempt fails, then bisection to the step.
A failed or timed-out attempt counts as too long; a failure that is not memory stops the run.

Measured per successful attempt, per rank (the tables show the max over ranks):
- allocated (torch's view, the analogue of ``torch.cuda.max_memory_allocated``): the live tensor
  bytes after the engine build (unique storages of every tensor the garbage collector tracks)
  plus the step's peak of torch's own allocations (profiler memory events, ``profile_memory``).
- RSS (the OS's view): VmHWM - VmRSS after the imports (VmHWM reset through
  /proc/self/clear_refs), minus the growth of file-backed RSS (code pages faulted in).
- saved: unique storages autograd saved for backward (``saved_tensors_hooks``, parameters
  excluded): the activations, allocator-independent.
- VmData growth (what the limit counts) and glibc's free heap when the limit is set.

Planner: ``hybridsp.planner.memory_use`` for the same model (``example_model_spec``), S, mesh,
ZeRO-3, no checkpointing, ``dtype_bytes=4``; and ``longest_context`` on a 1-node "cluster" of
``world`` ranks whose memory is the budget per rank plus the planner's own model states (the
limit starts after the engine build), nothing reserved. Error = (planner - measured) / measured.

Note [the limit]: RLIMIT_RSS is not enforced by Linux (a no-op since 2.6): only the OOM killer
would stop a rank that outgrows RAM, which is not clean and may pick another process on a
shared machine. RLIMIT_AS counts every mapping (shared libraries, PROT_NONE reservations of
glibc's per-thread arenas, 64 MiB each), so a budget would depend on how many threads gloo and
DeepSpeed start. RLIMIT_DATA (Linux >= 4.7) counts private writable mappings only (heap,
anonymous mmaps such as every large tensor, thread stacks); mmap/brk/mprotect fail with ENOMEM
and torch's CPU allocator raises RuntimeError. It counts memory when it is reserved, as a GPU
allocator does. Why the budget starts after the engine build by default: the build reserves
~370-400 MiB of VmData per rank that is mostly never touched (DeepSpeed's ZeRO-3 reduce bucket,
``reduce_bucket_size`` = 5e7 fp32 elements = 191 MiB allocated with ``torch.empty``; 8 MiB stacks
of ~20 threads), so with "budget / world" counted from the imports cp8 could not even build its
engine at any budget whose world-1 search finishes in minutes (attention is quadratic on 2 cores).

Note [malloc]: glibc serves a request from free heap chunks before it considers mmap, and its
default mmap threshold grows up to 32 MiB as large blocks are freed, so freed activations stay in
the heap: with glibc's defaults, one step's RSS was 1.6x torch's allocated peak (541 vs 334 MiB at
S=4096, world 1), and free heap inside VmData lets later tensors escape the limit. Each rank
therefore sets ``mallopt(M_MMAP_THRESHOLD, 256 KiB)`` (fixed; every tensor of 256 KiB or more is
mmapped and unmapped at free) and the limit is set when glibc's free heap is small (it is
recorded). Profiling the engine build would leave ~100 MiB of free heap behind (the profiler's
event records), so only the step is profiled.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.common import ROOT, harness
from benchmarks.common.example import CONFIGS, VOCAB, example_model_spec, planner_memory
from benchmarks.common.harness import machine_info, malloc_trim, memory_status, software_info
from benchmarks.common.longest import GIB, MIB, Attempt, Settings, example_imports, search, warm_forkserver
from benchmarks.longest._report import clusters_section, markdown, relative_error

MODULE = "benchmarks.longest.context"
FIXTURE = ROOT / "tests" / "data" / "planner_memory_cpu.json"  # what tests/planner/test_planner.py reads
BREAKDOWN_LEN = 2048  # sequence length of the saved-tensor breakdowns


# --------------------------------------------------------------------------------------------
# inside a rank


def breakdown_rank(rank: int, world: int, ulysses: int, ring: int, config: str, seq_len: int) -> list:
    """What autograd keeps for backward after one forward of the example (no limit): walk the graph
    from the loss, collect every saved tensor (``_saved_*`` and custom Functions' ``saved_tensors``),
    dedup by storage, group by (node, last dimension, dtype). Returns rows with bytes per local token."""
    train, text_data, initialize = example_imports()
    from hybridsp import shard_batch, sharded_cross_entropy

    tokens, vocab = text_data.tokenize(text_data.load_corpus(None), None)
    windows = text_data.TokenWindows(tokens, seq_len, 0)
    args = train.parse_args(["--deepspeed", str(ROOT / "ds_configs" / config), "--seq-len", str(seq_len)])
    engine, _, mesh, _ = initialize(
        train.build_model(args, vocab), train._config_with_lr(args), ulysses=ulysses, ring=ring
    )
    full = windows.batch(0, 1)
    local = shard_batch({"input_ids": full, "labels": full}, mesh)
    logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
    loss = sharded_cross_entropy(logits, local["shift_labels"], mesh)
    seen, groups, nodes, stack = set(), {}, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        saved = []
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:
                    continue
                saved += list(value) if isinstance(value, (tuple, list)) else [value]
        try:
            saved += list(getattr(node, "saved_tensors", ()))
        except RuntimeError:
            pass
        for tensor in saved:
            if not isinstance(tensor, torch.Tensor) or (tensor.is_leaf and tensor.requires_grad):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            key = (type(node).__name__, int(tensor.shape[-1]) if tensor.dim() else 0, str(tensor.dtype).split(".")[-1])
            groups[key] = groups.get(key, 0) + storage.nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    local_tokens = local["input_ids"].numel()
    return sorted(([*key, value / local_tokens] for key, value in groups.items()), key=lambda row: -row[3])


def bf16_checks() -> dict:
    """Single-process bf16 checks of two terms this machine's example cannot show at scale: the
    loss path's peak per (token x vocabulary entry) and HF's RMSNorm's saved bytes per (token x h)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokens, hidden, vocab = 1024, 256, 32768
    head = torch.nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16)
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    head.weight.grad = torch.zeros_like(head.weight)  # allocated before: only the loss path is counted
    x.grad = torch.zeros_like(x)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = head(x)  # [1, T, V] bf16, held by the caller as in train.train_step
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), labels, reduction="sum")
        loss.backward()
        del logits, loss
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    loss_peak = peak / (tokens * vocab)  # the gradient buffers were allocated before: this is the loss path
    norm = LlamaRMSNorm(hidden).to(torch.bfloat16)
    linear = torch.nn.Linear(hidden, hidden, bias=False).to(torch.bfloat16)
    storages = {}

    def pack(tensor):
        if not (tensor.is_leaf and tensor.requires_grad) and tensor.shape != (hidden, hidden):  # not W^T
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    inputs = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True) * 1.0  # not a leaf
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        linear(norm(inputs))
    torch.set_num_threads(threads)
    return {
        "loss_peak_bytes_per_entry": loss_peak,
        "rmsnorm_saved_bytes_per_hidden": sum(storages.values()) / (tokens * hidden),
        "shapes": {"tokens": tokens, "hidden": hidden, "vocab": vocab},
    }


def limit_check_rank(rank: int, world: int, limit: str) -> dict:
    """Does an allocation past ``limit`` (data, as, rss) raise inside torch? 256 MiB allowed,
    then a 512 MiB tensor is allocated (and touched, so RSS would grow if nothing stops it)."""
    example_imports()
    gc.collect()
    malloc_trim()
    base = memory_status()
    kind = {"data": resource.RLIMIT_DATA, "as": resource.RLIMIT_AS, "rss": resource.RLIMIT_RSS}[limit]
    current = {"data": base["VmData"], "as": base["VmSize"], "rss": base["VmRSS"]}[limit]
    resource.setrlimit(kind, (current + 256 * MIB, resource.getrlimit(kind)[1]))
    small = torch.ones(128 * MIB // 4)  # within the limit
    outcome = {"limit": limit, "base_data": base["VmData"], "base_size": base["VmSize"], "base_rss": base["VmRSS"]}
    try:
        big = torch.ones(512 * MIB // 4)
        outcome.update(raised=False, rss_after=memory_status()["VmRSS"], error="")
        del big
    except BaseException as error:  # noqa: BLE001 - report what was raised
        outcome.update(raised=True, error_type=type(error).__name__, error=str(error).splitlines()[0][:200])
    outcome["small_ok"] = bool(small.sum() > 0)
    return outcome


# --------------------------------------------------------------------------------------------
# the planner's view


def planner_longest(
    ulysses: int, ring: int, world: int, budget_per_rank: int, granularity: int, limit_from: str, free: bool = False
) -> dict:
    """The planner's longest context on a "cluster" of 1 node x ``world`` ranks whose memory is
    what the measured ranks had: ``budget_per_rank`` plus, when the limit starts after the engine
    build, the planner's own model states (they do not depend on S), nothing reserved.
    ``free``: let the planner choose U x R, ZeRO stage and checkpointing itself."""
    from hybridsp.planner import SearchSpace, longest_context, preset_cluster

    states = planner_memory(ulysses, ring, world, 2 * ulysses * ring)["model_states"] if limit_from == "init" else 0
    cluster = preset_cluster(
        "h100",
        1,
        world,
        memory_bytes=float(budget_per_rank + states),
        reserved_bytes=0.0,
        name=f"this machine: 1 x {world} ranks",
    )
    space = (
        SearchSpace()
        if free
        else SearchSpace(zero_stages=(3,), checkpointing=(False,), dp=1, ulysses=ulysses, ring=ring)
    )
    found = longest_context(example_model_spec(), cluster, granularity=granularity, dtype_bytes=4, space=space)
    best = found.result.recommended if found.result else None
    row = {"seq_len": found.seq_len, "memory_bytes": cluster.memory_bytes}
    if best is not None:
        c = best.config
        row.update(
            dp=c.dp,
            ulysses=c.ulysses,
            ring=c.ring,
            zero_stage=c.zero_stage,
            checkpointing=c.checkpointing,
            predicted_bytes=best.memory.total,
        )
    return row


# --------------------------------------------------------------------------------------------
# results


def _fit(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (slope, intercept) of y over x; None with fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return slope, my - slope * mx


def summarize(name: str, longest: int, attempts: list[Attempt], settings: Settings) -> dict:
    world, ulysses, ring, config = CONFIGS[name]
    budget = settings.budget_total // world
    row = {
        "config": name,
        "world": world,
        "ulysses": ulysses,
        "ring": ring,
        "ds_config": config,
        "budget_per_rank": budget,
        "longest": longest,
        "threads": settings.threads(world),
        "attempts": len(attempts),
        "search_s": sum(a.wall_s for a in attempts),
        "failures": {str(a.seq_len): a.reason for a in attempts if not a.ok},
    }
    best = next((a for a in attempts if a.ok and a.seq_len == longest), None)
    if best is not None:
        w, p = best.worst, best.planner
        row.update(
            measured=w,
            planner=p,
            step_s=w["step_s"],
            errors={
                "total_vs_allocated": relative_error(p["total"], w["alloc_peak"]),
                "step_vs_allocated": relative_error(p["step"], w["step_alloc_peak"]),
                "activations_vs_saved": relative_error(p["activations"], w["saved_bytes"]),
                "total_vs_rss": relative_error(p["total"], w["peak_anon_delta"]),
                "step_vs_rss": relative_error(p["step"], w["step_peak_anon_delta"]),
                "model_states_vs_init_allocated": relative_error(
                    p["model_states"], w["init_alloc_end"] + w["step_alloc_end"]
                ),
            },
        )
    ok = [a for a in attempts if a.ok]
    for key, source in (
        ("step_alloc", "step_alloc_peak"),
        ("step_rss", "step_peak_anon_delta"),
        ("saved", "saved_bytes"),
    ):
        fit = _fit([(a.seq_len // world, a.worst[source]) for a in ok])
        row[f"{key}_per_token"] = None if fit is None else {"slope": fit[0], "intercept": fit[1]}
    for key, part in (("planner_step", "step"), ("planner_activations", "activations")):
        fit = _fit([(a.seq_len // world, a.planner[part]) for a in ok])
        row[f"{key}_per_token"] = None if fit is None else {"slope": fit[0], "intercept": fit[1]}
    row["planner_longest"] = planner_longest(ulysses, ring, world, budget, settings.granularity, settings.limit_from)
    row["planner_longest_free"] = planner_longest(
        ulysses, ring, world, budget, settings.granularity, settings.limit_from, free=True
    )
    return row


def check_limits(log) -> list[dict]:
    checks = []
    for limit in ("data", "as", "rss"):
        try:
            checks.append(harness.launch(limit_check_rank, 1, limit, timeout=300)[0])
        except (AssertionError, TimeoutError) as error:
            checks.append({"limit": limit, "raised": False, "error": f"rank failed: {str(error).splitlines()[-1]}"})
        c = checks[-1]
        log(
            f"limit check RLIMIT_{limit.upper()}: {'raised ' + c.get('error_type', '') if c.get('raised') else 'no error'}"
            f" {c.get('error', '')[:100]}"
        )
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="world 1 and cp2, 0.5 GiB, granularity 2048 (~5 min)")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), help="default: w1 cp2 cp4 cp8")
    parser.add_argument(
        "--budget-gib",
        type=float,
        help="total memory budget, split evenly over the ranks "
        "(default 1; quick 0.5): sized so one step at the longest length takes about a minute",
    )
    parser.add_argument("--granularity", type=int, help="search step in tokens (default 1024; quick 2048)")
    parser.add_argument(
        "--start",
        type=int,
        default=4096,
        help="first length of the first config (default 4096); later configs start at 0.6 x the previous longest",
    )
    parser.add_argument("--limit", choices=("data", "as", "none"), default="data", help="rlimit kind (default data)")
    parser.add_argument(
        "--limit-from",
        choices=("imports", "init"),
        default="init",
        help="the budget starts after the imports or after the engine build (default init)",
    )
    parser.add_argument(
        "--mmap-threshold-kib",
        type=int,
        default=256,
        help="glibc M_MMAP_THRESHOLD in each rank (0: glibc's dynamic default); Note [malloc]",
    )
    parser.add_argument("--first-timeout", type=float, default=600.0, help="timeout of a config's first attempt, s")
    parser.add_argument("--no-clusters", action="store_true", help="skip the cluster prediction table")
    parser.add_argument(
        "--out", help="output prefix (default benchmarks/results/longest_context/longest_context; quick: temp dir)"
    )
    parser.add_argument(
        "--fixture",
        default=str(FIXTURE),
        help="where to write the successful attempts the "
        "planner's memory test reads ('' for nowhere; never with --quick)",
    )
    parser.add_argument("--render", metavar="JSON", help="only rewrite the markdown beside a results JSON")
    args = parser.parse_args(argv)
    if args.render:
        data = json.loads(Path(args.render).read_text())
        clusters = None
        if data.get("clusters"):
            from hybridsp.planner import _clusters as predict_clusters

            clusters = clusters_section(predict_clusters, data["clusters"])
        Path(args.render).with_suffix(".md").write_text(
            markdown(data["configs"], data["meta"], data["limit_checks"], clusters)
        )
        return 0

    quick = args.quick
    names = args.configs or (["w1", "cp2"] if quick else ["w1", "cp2", "cp4", "cp8"])
    settings = Settings(
        budget_total=int((args.budget_gib or (0.5 if quick else 1.0)) * GIB),
        granularity=args.granularity or (2048 if quick else 1024),
        limit=args.limit,
        limit_from=args.limit_from,
        mmap_threshold=args.mmap_threshold_kib * 1024,
        first_timeout=args.first_timeout,
        cores=os.cpu_count() or 1,
    )
    prefix = args.out or (
        os.path.join(tempfile.gettempdir(), "results_longest_context_quick")
        if quick
        else harness.results_path("longest_context", "longest_context")
    )
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True)

    log(f"forkserver with DeepSpeed/transformers preloaded: {warm_forkserver():.1f} s")
    checks = check_limits(log)
    rows, previous = [], None
    for name in names:
        world = CONFIGS[name][0]
        start = args.start if previous is None else int(0.6 * previous)
        log(
            f"{name}: world {world}, budget {settings.budget_total / world / MIB:.0f} MiB per rank, "
            f"{settings.threads(world)} thread(s) per rank, start {start}"
        )
        longest, attempts = search(name, start, settings, log)
        row = summarize(name, longest, attempts, settings)
        row["attempt_list"] = [asdict(a) for a in attempts]
        rows.append(row)
        previous = longest or previous
        log(
            f"{name}: longest {longest:,} tokens ({len(attempts)} attempts, {row['search_s']:.0f} s); planner "
            f"{row['planner_longest']['seq_len']:,}"
        )
    breakdowns = {}
    for name in ("w1", "cp4"):
        world, ulysses, ring, config = CONFIGS[name]
        breakdowns[name] = harness.launch(breakdown_rank, world, ulysses, ring, config, BREAKDOWN_LEN, timeout=600)[0]
    checks_bf16 = bf16_checks()
    log(
        f"saved-tensor breakdowns (w1, cp4 at S={BREAKDOWN_LEN}) and bf16 checks: loss peak "
        f"{checks_bf16['loss_peak_bytes_per_entry']:.1f} B/entry, RMSNorm {checks_bf16['rmsnorm_saved_bytes_per_hidden']:.1f} "
        f"B/(token x h)"
    )
    clusters = cluster_rows = None
    if not args.no_clusters:
        from hybridsp.planner import _clusters as predict_clusters

        cluster_rows, _ = predict_clusters.run()
        clusters = clusters_section(predict_clusters, cluster_rows)
    model = example_model_spec()
    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": harness.command(MODULE, argv),
        "machine": machine_info(),
        "software": software_info(),
        "total_s": time.perf_counter() - started,
        **asdict(settings),
        "model": f"{model.total_params / 1e6:.2f}M params, h={model.hidden_size}, L={model.num_layers}, "
        f"H={model.num_heads}, Hkv={model.num_kv_heads}, D={model.head_dim}, I={model.intermediate_size}, "
        f"V={VOCAB}",
        "threads_note": f"torch threads per rank = max(1, {settings.cores} cores // world)",
        "start_note": f"{args.start} tokens (later configs: 0.6 x the previous config's longest)",
    }
    meta.update(breakdowns=breakdowns, bf16_checks=checks_bf16, breakdown_len=BREAKDOWN_LEN)
    text = markdown(rows, meta, checks, clusters)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    Path(prefix + ".md").write_text(text)
    Path(prefix + ".json").write_text(
        json.dumps(
            {"meta": meta, "limit_checks": checks, "configs": rows, "clusters": cluster_rows}, indent=1, default=str
        )
        + "\n"
    )
    if args.fixture and not quick:
        Path(args.fixture).write_text(json.dumps(memory_fixture(rows), indent=1) + "\n")
    print(text)
    log(f"wrote {prefix}.md and {prefix}.json")
    return 0


def memory_fixture(rows: list[dict]) -> dict:
    """Every successful attempt's measured peaks: what tests/planner/test_planner.py checks the planner against."""
    return {
        "source": "benchmarks/longest/context.py (results/longest_context/longest_context.json), "
        "written with its results",
        "attempts": [
            {
                "config": row["config"],
                "ulysses": row["ulysses"],
                "ring": row["ring"],
                "seq_len": attempt["seq_len"],
                "step_alloc_peak": attempt["worst"]["step_alloc_peak"],
                "alloc_peak": attempt["worst"]["alloc_peak"],
            }
            for row in rows
            for attempt in row["attempt_list"]
            if attempt["ok"]
        ],
    }


if __name__ == "__main__":
    sys.exit(main())
