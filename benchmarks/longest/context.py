"""Longest context one training step survives on this machine, against the planner's prediction.

    python benchmarks/bench_longest_context.py            # w1, cp2, cp4, cp8, 1 GiB in all (~20-25 min)
    python benchmarks/bench_longest_context.py --quick    # w1 and cp2, 0.5 GiB, coarse (~4 min); temp dir

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
import math
import os
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import harness  # noqa: E402
import torch  # noqa: E402
from harness import (  # noqa: E402
    Allocations,
    heap_free,
    lift_limit,
    live_tensor_bytes,
    machine_info,
    malloc_trim,
    memory_status,
    reset_peak,
    set_limit,
    software_info,
    tensors_via_mmap,
)
from longest_report import clusters_section, markdown, relative_error  # noqa: E402
from longest_setup import CONFIGS, ROOT, VOCAB, example_model_spec, planner_memory  # noqa: F401  (first: it sets sys.path)

MIB, GIB = 2**20, 2**30
FIXTURE = ROOT / "tests" / "data" / "planner_memory_cpu.json"  # what tests/planner/test_planner.py reads
BREAKDOWN_LEN = 2048  # sequence length of the saved-tensor breakdowns
OOM_MARKERS = ("can't allocate memory", "MemoryError", "std::bad_alloc", "Cannot allocate memory",
               "out of memory", "ENOMEM")
PRELOAD = ["torch", "torch.distributed", "hybridsp", "hybridsp.integrations.deepspeed", "deepspeed",
           "transformers", "transformers.models.llama.modeling_llama", "train", "text_data"]


# --------------------------------------------------------------------------------------------
# inside a rank


class SavedTensors:
    """Unique storages autograd saves for backward (parameters excluded), with the time of the
    first save and of the first unpack (= the backward's start)."""

    def __init__(self):
        self.storages: dict[int, int] = {}
        self.first_unpack: float | None = None

    def pack(self, tensor):
        if not (tensor.is_leaf and tensor.requires_grad):
            storage = tensor.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def unpack(self, tensor):
        if self.first_unpack is None:
            self.first_unpack = time.perf_counter()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def example_imports():
    """Everything an attempt needs, imported before the baseline (preloaded in the forkserver)."""
    import deepspeed  # noqa: F401
    import text_data
    import train
    import transformers  # noqa: F401

    from hybridsp.integrations.deepspeed import initialize

    return train, text_data, initialize


def attempt_rank(rank: int, world: int, ulysses: int, ring: int, config: str, seq_len: int,
                 budget: int, limit: str, limit_from: str, mmap_threshold: int, report_dir: str,
                 variant=None) -> dict:
    """One training step at ``seq_len`` with the soft ``limit`` rlimit set to ``budget`` bytes above
    the footprint after the imports (``limit_from="imports"``) or after the engine is built ("init").

    A rank that fails writes its error to ``report_dir/rank<N>.txt`` first: run_distributed reports
    only the lowest failed rank, often a peer's "Connection closed by peer" rather than the rank
    that ran out of memory."""
    try:
        return _attempt(rank, world, ulysses, ring, config, seq_len, budget, limit, limit_from, mmap_threshold,
                        variant)
    except BaseException as error:
        lift_limit(limit)
        Path(report_dir, f"rank{rank}.txt").write_text(f"{time.time():.6f}\n{type(error).__name__}: {error}")
        raise


def _attempt(rank: int, world: int, ulysses: int, ring: int, config: str, seq_len: int,
             budget: int, limit: str, limit_from: str, mmap_threshold: int, variant=None) -> dict:
    """``variant`` (benchmarks/bench_memory.py): an object with ``vocab``, ``prepare(model)`` and
    ``train_step`` (train.train_step's signature) that changes the model and the step; None: the example."""
    tensors_via_mmap(mmap_threshold)
    train, text_data, initialize = example_imports()
    tokens, vocab = text_data.tokenize(text_data.load_corpus(None), None)
    windows = text_data.TokenWindows(tokens, seq_len, 0)
    gc.collect()
    malloc_trim()
    base = memory_status()
    reset = reset_peak()
    started = time.perf_counter()
    args = train.parse_args(["--deepspeed", str(ROOT / "ds_configs" / config), "--seq-len", str(seq_len)])
    try:
        if limit_from == "imports":
            set_limit(limit, base, budget)
        model = train.build_model(args, vocab if variant is None else variant.vocab)
        if variant is not None:
            variant.prepare(model)
        engine, _, mesh, _ = initialize(model, train._config_with_lr(args), ulysses=ulysses, ring=ring)
    finally:
        lift_limit(limit)  # set again (from the same base) for the step below
    gc.collect()
    malloc_trim()
    init = memory_status()
    free_at_limit = heap_free()
    init_tensors = live_tensor_bytes()
    init_s = time.perf_counter() - started
    reset_peak()
    saved = SavedTensors()
    with Allocations() as step_alloc:
        set_limit(limit, base if limit_from == "imports" else init, budget)
        step_start = time.perf_counter()
        try:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                step_fn = train.train_step if variant is None else variant.train_step
                loss = step_fn(engine, mesh, windows, 0, engine.train_micro_batch_size_per_gpu(),
                               engine.gradient_accumulation_steps())
            step_s = time.perf_counter() - step_start
        finally:
            lift_limit(limit)  # reporting (an error, or the profile) needs memory
    end = memory_status()
    init_rss = init["VmRSS"] - base["VmRSS"]
    init_file = init["RssFile"] - base["RssFile"]
    step_peak = end["VmHWM"] - init["VmRSS"]
    step_file = end["RssFile"] - init["RssFile"]
    peak_rss = max(init["VmHWM"] - base["VmRSS"], init_rss + step_peak)
    return {
        "rank": rank, "loss": loss, "init_s": init_s, "step_s": step_s,
        "forward_s": (saved.first_unpack - step_start) if saved.first_unpack else None,
        "hwm_reset": reset, "threads_end": len(os.listdir("/proc/self/task")),
        "base_rss": base["VmRSS"], "base_data": base["VmData"], "base_size": base["VmSize"],
        # torch's view: live tensors after the engine build; the step's allocations (peak, still live at its end)
        "heap_free_at_limit": free_at_limit, "init_alloc_end": init_tensors, "step_alloc_peak": step_alloc.peak, "step_alloc_end": step_alloc.end,
        "alloc_peak": init_tensors + step_alloc.peak,
        # the OS's view: the engine build (model states, DeepSpeed buffers, process groups)
        "init_rss_delta": init_rss, "init_anon_delta": init_rss - init_file,
        "init_data_delta": init["VmData"] - base["VmData"],
        "init_peak_rss_delta": init["VmHWM"] - base["VmRSS"],
        # the step alone, over the footprint after the engine build
        "step_peak_rss_delta": step_peak, "step_peak_anon_delta": step_peak - step_file,
        "step_data_delta_end": end["VmData"] - init["VmData"],
        # everything over the post-import baseline
        "peak_rss_delta": peak_rss, "file_delta": end["RssFile"] - base["RssFile"],
        "peak_anon_delta": peak_rss - (end["RssFile"] - base["RssFile"]),
        "data_delta_end": end["VmData"] - base["VmData"],
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "saved_bytes": saved.bytes, "saved_count": len(saved.storages),
    }


def breakdown_rank(rank: int, world: int, ulysses: int, ring: int, config: str, seq_len: int) -> list:
    """What autograd keeps for backward after one forward of the example (no limit): walk the graph
    from the loss, collect every saved tensor (``_saved_*`` and custom Functions' ``saved_tensors``),
    dedup by storage, group by (node, last dimension, dtype). Returns rows with bytes per local token."""
    train, text_data, initialize = example_imports()
    from hybridsp import shard_batch, sharded_cross_entropy

    tokens, vocab = text_data.tokenize(text_data.load_corpus(None), None)
    windows = text_data.TokenWindows(tokens, seq_len, 0)
    args = train.parse_args(["--deepspeed", str(ROOT / "ds_configs" / config), "--seq-len", str(seq_len)])
    engine, _, mesh, _ = initialize(train.build_model(args, vocab), train._config_with_lr(args),
                                    ulysses=ulysses, ring=ring)
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
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
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
    return {"loss_peak_bytes_per_entry": loss_peak, "rmsnorm_saved_bytes_per_hidden": sum(storages.values()) / (tokens * hidden),
            "shapes": {"tokens": tokens, "hidden": hidden, "vocab": vocab}}


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


def warm_forkserver() -> float:
    """Start the forkserver with DeepSpeed, transformers and the example preloaded (harness.warm_forkserver)."""
    return harness.warm_forkserver(PRELOAD)


# --------------------------------------------------------------------------------------------
# the planner's view


def planner_longest(ulysses: int, ring: int, world: int, budget_per_rank: int, granularity: int,
                    limit_from: str, free: bool = False) -> dict:
    """The planner's longest context on a "cluster" of 1 node x ``world`` ranks whose memory is
    what the measured ranks had: ``budget_per_rank`` plus, when the limit starts after the engine
    build, the planner's own model states (they do not depend on S), nothing reserved.
    ``free``: let the planner choose U x R, ZeRO stage and checkpointing itself."""
    from hybridsp.planner import SearchSpace, longest_context, preset_cluster

    states = planner_memory(ulysses, ring, world, 2 * ulysses * ring)["model_states"] if limit_from == "init" else 0
    cluster = preset_cluster("h100", 1, world, memory_bytes=float(budget_per_rank + states), reserved_bytes=0.0,
                             name=f"this machine: 1 x {world} ranks")
    space = SearchSpace() if free else SearchSpace(zero_stages=(3,), checkpointing=(False,), dp=1,
                                                   ulysses=ulysses, ring=ring)
    found = longest_context(example_model_spec(), cluster, granularity=granularity, dtype_bytes=4, space=space)
    best = found.result.recommended if found.result else None
    row = {"seq_len": found.seq_len, "memory_bytes": cluster.memory_bytes}
    if best is not None:
        c = best.config
        row.update(dp=c.dp, ulysses=c.ulysses, ring=c.ring, zero_stage=c.zero_stage, checkpointing=c.checkpointing,
                   predicted_bytes=best.memory.total)
    return row


# --------------------------------------------------------------------------------------------
# the search


@dataclass
class Attempt:
    config: str
    seq_len: int
    ok: bool
    reason: str = ""  # "" | oom | timeout | crash | error
    detail: str = ""
    wall_s: float = 0.0
    timeout_s: float = 0.0
    load: list = field(default_factory=list)
    ranks: list = field(default_factory=list)  # per-rank dicts (successes)
    worst: dict = field(default_factory=dict)  # max over ranks of every number
    planner: dict = field(default_factory=dict)


def worst_rank(ranks: list[dict]) -> dict:
    keys = [k for k, v in ranks[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "rank"]
    return {k: max(r[k] for r in ranks if r[k] is not None) if any(r[k] is not None for r in ranks) else None
            for k in keys}


def _rank_reports(directory: str) -> list[tuple[float, int, str]]:
    """(time, rank, error) of every rank that wrote one, earliest first."""
    reports = []
    for path in Path(directory).glob("rank*.txt"):
        stamp, _, text = path.read_text().partition("\n")
        reports.append((float(stamp), int(path.stem[4:]), text))
    return sorted(reports)


def classify_failure(error: BaseException, reports: list[tuple[float, int, str]]) -> tuple[str, str]:
    """("oom" | "timeout" | "crash" | "error", detail): out of memory when any rank ran out of memory."""
    for _, rank, text in reports:
        if any(marker in text for marker in OOM_MARKERS):
            return "oom", f"rank {rank}: {text.splitlines()[0][:220]}"
    text = str(error)
    if isinstance(error, TimeoutError):
        return "timeout", text.splitlines()[0]
    if any(marker in text for marker in OOM_MARKERS):
        last = [line for line in text.splitlines() if line.strip()][-1:] or [text]
        return "oom", last[0][:240]
    if "without reporting" in text:
        return "crash", text.splitlines()[-1][:240]
    first = reports[0] if reports else None
    return "error", (f"rank {first[1]}: {first[2].splitlines()[0][:220]}" if first else text.splitlines()[-1][:240])


@dataclass(frozen=True)
class Settings:
    """How every attempt runs (see the module docstring)."""

    budget_total: int
    granularity: int
    limit: str = "data"
    limit_from: str = "init"
    mmap_threshold: int = 256 * 1024
    max_len: int = 466_000  # the built-in corpus has ~466k bytes; TokenWindows needs more than S
    first_timeout: float = 600.0
    cores: int = 2

    def threads(self, world: int) -> int:
        return max(1, self.cores // world)


def run_attempt(name: str, seq_len: int, settings: Settings, timeout: float, log, variant=None) -> Attempt:
    world, ulysses, ring, config = CONFIGS[name]
    attempt = Attempt(name, seq_len, False, timeout_s=timeout, load=[os.getloadavg()[0]],
                      planner=planner_memory(ulysses, ring, world, seq_len) if variant is None else {})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_longest_") as reports:
        try:
            attempt.ranks = harness.launch(
                attempt_rank, world, ulysses, ring, config, seq_len, settings.budget_total // world, settings.limit,
                settings.limit_from, settings.mmap_threshold, reports, variant, timeout=timeout,
                threads=settings.threads(world))
            attempt.ok, attempt.worst = True, worst_rank(attempt.ranks)
        except (AssertionError, TimeoutError) as error:
            attempt.reason, attempt.detail = classify_failure(error, _rank_reports(reports))
    attempt.wall_s = time.perf_counter() - started
    attempt.load.append(os.getloadavg()[0])
    if attempt.ok and not attempt.planner:
        w = attempt.worst
        log(f"  {name} S={seq_len:>6}: ok   {attempt.wall_s:4.0f} s (step {w['step_s']:.0f} s); MiB per rank: "
            f"allocated {w['alloc_peak'] / MIB:.0f} (step {w['step_alloc_peak'] / MIB:.0f}); load {attempt.load[0]:.0f}")
    elif attempt.ok:
        w, p = attempt.worst, attempt.planner
        log(f"  {name} S={seq_len:>6}: ok   {attempt.wall_s:4.0f} s (step {w['step_s']:.0f} s); MiB per rank: "
            f"allocated {w['alloc_peak'] / MIB:.0f} (step {w['step_alloc_peak'] / MIB:.0f}), RSS "
            f"{w['peak_anon_delta'] / MIB:.0f} (step {w['step_peak_anon_delta'] / MIB:.0f}), planner "
            f"{p['total'] / MIB:.0f} (step {p['step'] / MIB:.0f}); load {attempt.load[0]:.0f}/{attempt.load[1]:.0f}")
    else:
        log(f"  {name} S={seq_len:>6}: FAIL {attempt.wall_s:4.0f} s {attempt.reason}: {attempt.detail[:150]}")
    return attempt


def _timeout_for(seq_len: int, successes: list[Attempt], first: float) -> float:
    """Generous: 3x the step time the last success predicts (attention is quadratic), + start-up."""
    if not successes:
        return first
    last = max(successes, key=lambda a: a.seq_len)
    predicted = last.worst["step_s"] * (seq_len / last.seq_len) ** 2 + last.worst["init_s"]
    return min(1800.0, max(180.0, 3 * predicted + 60))


def search(name: str, start: int, settings: Settings, log, variant=None) -> tuple[int, list[Attempt]]:
    """Doubling from ``start`` until a failure, then bisection to the step; returns (longest, attempts)."""
    from hybridsp.layout.layouts import check_sequence_length

    world, ulysses, ring, _ = CONFIGS[name]
    step = math.lcm(settings.granularity, 2 * ring * ulysses)
    attempts: list[Attempt] = []

    def fits(seq_len: int) -> bool:
        check_sequence_length(seq_len, ring, ulysses, "zigzag")
        timeout = _timeout_for(seq_len, [a for a in attempts if a.ok], settings.first_timeout)
        attempt = run_attempt(name, seq_len, settings, timeout, log, variant)
        attempts.append(attempt)
        if attempt.reason == "error":
            raise RuntimeError(f"{name} S={seq_len} failed for a reason other than memory: {attempt.detail}")
        return attempt.ok

    low, high = 0, None
    length = max(step, start // step * step)
    while high is None:
        if fits(length):
            low = length
            if 2 * length > settings.max_len:
                high = settings.max_len // step * step + step
            length *= 2
        else:
            high = length
            while low == 0 and length > step:  # the start already failed: halve until something fits
                length = max(step, length // 2 // step * step)
                if fits(length):
                    low = length
                else:
                    high = length
    while low and high - low > step:
        middle = (low + high) // 2 // step * step
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, attempts


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
    row = {"config": name, "world": world, "ulysses": ulysses, "ring": ring, "ds_config": config,
           "budget_per_rank": budget, "longest": longest, "threads": settings.threads(world),
           "attempts": len(attempts), "search_s": sum(a.wall_s for a in attempts),
           "failures": {str(a.seq_len): a.reason for a in attempts if not a.ok}}
    best = next((a for a in attempts if a.ok and a.seq_len == longest), None)
    if best is not None:
        w, p = best.worst, best.planner
        row.update(measured=w, planner=p, step_s=w["step_s"], errors={
            "total_vs_allocated": relative_error(p["total"], w["alloc_peak"]),
            "step_vs_allocated": relative_error(p["step"], w["step_alloc_peak"]),
            "activations_vs_saved": relative_error(p["activations"], w["saved_bytes"]),
            "total_vs_rss": relative_error(p["total"], w["peak_anon_delta"]),
            "step_vs_rss": relative_error(p["step"], w["step_peak_anon_delta"]),
            "model_states_vs_init_allocated": relative_error(p["model_states"], w["init_alloc_end"] + w["step_alloc_end"]),
        })
    ok = [a for a in attempts if a.ok]
    for key, source in (("step_alloc", "step_alloc_peak"), ("step_rss", "step_peak_anon_delta"), ("saved", "saved_bytes")):
        fit = _fit([(a.seq_len // world, a.worst[source]) for a in ok])
        row[f"{key}_per_token"] = None if fit is None else {"slope": fit[0], "intercept": fit[1]}
    for key, part in (("planner_step", "step"), ("planner_activations", "activations")):
        fit = _fit([(a.seq_len // world, a.planner[part]) for a in ok])
        row[f"{key}_per_token"] = None if fit is None else {"slope": fit[0], "intercept": fit[1]}
    row["planner_longest"] = planner_longest(ulysses, ring, world, budget, settings.granularity, settings.limit_from)
    row["planner_longest_free"] = planner_longest(ulysses, ring, world, budget, settings.granularity,
                                                  settings.limit_from, free=True)
    return row


def check_limits(log) -> list[dict]:
    checks = []
    for limit in ("data", "as", "rss"):
        try:
            checks.append(harness.launch(limit_check_rank, 1, limit, timeout=300)[0])
        except (AssertionError, TimeoutError) as error:
            checks.append({"limit": limit, "raised": False, "error": f"rank failed: {str(error).splitlines()[-1]}"})
        c = checks[-1]
        log(f"limit check RLIMIT_{limit.upper()}: {'raised ' + c.get('error_type', '') if c.get('raised') else 'no error'}"
            f" {c.get('error', '')[:100]}")
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="world 1 and cp2, 0.5 GiB, granularity 2048 (~5 min)")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), help="default: w1 cp2 cp4 cp8")
    parser.add_argument("--budget-gib", type=float, help="total memory budget, split evenly over the ranks "
                        "(default 1; quick 0.5): sized so one step at the longest length takes about a minute")
    parser.add_argument("--granularity", type=int, help="search step in tokens (default 1024; quick 2048)")
    parser.add_argument("--start", type=int, default=4096, help="first length of the first config (default 4096); "
                        "later configs start at 0.6 x the previous longest")
    parser.add_argument("--limit", choices=("data", "as", "none"), default="data", help="rlimit kind (default data)")
    parser.add_argument("--limit-from", choices=("imports", "init"), default="init",
                        help="the budget starts after the imports or after the engine build (default init)")
    parser.add_argument("--mmap-threshold-kib", type=int, default=256,
                        help="glibc M_MMAP_THRESHOLD in each rank (0: glibc's dynamic default); Note [malloc]")
    parser.add_argument("--first-timeout", type=float, default=600.0, help="timeout of a config's first attempt, s")
    parser.add_argument("--no-clusters", action="store_true", help="skip the cluster prediction table")
    parser.add_argument("--out", help="output prefix (default benchmarks/results/longest_context/longest_context; "
                        "quick: temp dir)")
    parser.add_argument("--fixture", default=str(FIXTURE), help="where to write the successful attempts the "
                        "planner's memory test reads ('' for nowhere; never with --quick)")
    parser.add_argument("--render", metavar="JSON", help="only rewrite the markdown beside a results JSON")
    args = parser.parse_args(argv)
    if args.render:
        data = json.loads(Path(args.render).read_text())
        clusters = None
        if data.get("clusters"):
            from hybridsp.planner import clusters as predict_clusters

            clusters = clusters_section(predict_clusters, data["clusters"])
        Path(args.render).with_suffix(".md").write_text(markdown(data["configs"], data["meta"], data["limit_checks"],
                                                                 clusters))
        return 0

    quick = args.quick
    names = args.configs or (["w1", "cp2"] if quick else ["w1", "cp2", "cp4", "cp8"])
    settings = Settings(
        budget_total=int((args.budget_gib or (0.5 if quick else 1.0)) * GIB),
        granularity=args.granularity or (2048 if quick else 1024), limit=args.limit, limit_from=args.limit_from,
        mmap_threshold=args.mmap_threshold_kib * 1024, first_timeout=args.first_timeout, cores=os.cpu_count() or 1)
    prefix = args.out or (os.path.join(tempfile.gettempdir(), "results_longest_context_quick") if quick
                          else harness.results_path("longest_context", "longest_context"))
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True)

    log(f"forkserver with DeepSpeed/transformers preloaded: {warm_forkserver():.1f} s")
    checks = check_limits(log)
    rows, previous = [], None
    for name in names:
        world = CONFIGS[name][0]
        start = args.start if previous is None else int(0.6 * previous)
        log(f"{name}: world {world}, budget {settings.budget_total / world / MIB:.0f} MiB per rank, "
            f"{settings.threads(world)} thread(s) per rank, start {start}")
        longest, attempts = search(name, start, settings, log)
        row = summarize(name, longest, attempts, settings)
        row["attempt_list"] = [asdict(a) for a in attempts]
        rows.append(row)
        previous = longest or previous
        log(f"{name}: longest {longest:,} tokens ({len(attempts)} attempts, {row['search_s']:.0f} s); planner "
            f"{row['planner_longest']['seq_len']:,}")
    breakdowns = {}
    for name in ("w1", "cp4"):
        world, ulysses, ring, config = CONFIGS[name]
        breakdowns[name] = harness.launch(breakdown_rank, world, ulysses, ring, config, BREAKDOWN_LEN,
                                           timeout=600)[0]
    checks_bf16 = bf16_checks()
    log(f"saved-tensor breakdowns (w1, cp4 at S={BREAKDOWN_LEN}) and bf16 checks: loss peak "
        f"{checks_bf16['loss_peak_bytes_per_entry']:.1f} B/entry, RMSNorm {checks_bf16['rmsnorm_saved_bytes_per_hidden']:.1f} "
        f"B/(token x h)")
    clusters = cluster_rows = None
    if not args.no_clusters:
        from hybridsp.planner import clusters as predict_clusters

        cluster_rows, _ = predict_clusters.run()
        clusters = clusters_section(predict_clusters, cluster_rows)
    model = example_model_spec()
    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python benchmarks/bench_longest_context.py" + "".join(
            f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "machine": machine_info(), "software": software_info(), "total_s": time.perf_counter() - started,
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
    Path(prefix + ".json").write_text(json.dumps({"meta": meta, "limit_checks": checks, "configs": rows,
                                                  "clusters": cluster_rows}, indent=1, default=str) + "\n")
    if args.fixture and not quick:
        Path(args.fixture).write_text(json.dumps(memory_fixture(rows), indent=1) + "\n")
    print(text)
    log(f"wrote {prefix}.md and {prefix}.json")
    return 0


def memory_fixture(rows: list[dict]) -> dict:
    """Every successful attempt's measured peaks: what tests/planner/test_planner.py checks the planner against."""
    return {
        "source": "benchmarks/bench_longest_context.py (results/longest_context/longest_context.json), "
                  "written with its results",
        "attempts": [{"config": row["config"], "ulysses": row["ulysses"], "ring": row["ring"],
                      "seq_len": attempt["seq_len"], "step_alloc_peak": attempt["worst"]["step_alloc_peak"],
                      "alloc_peak": attempt["worst"]["alloc_peak"]}
                     for row in rows for attempt in row["attempt_list"] if attempt["ok"]],
    }


if __name__ == "__main__":
    sys.exit(main())
