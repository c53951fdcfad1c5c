"""One training step of the example model under a per-rank memory cap, and the search for the longest
context that fits (shared by longest.context, longest.ablation and memory.loss).

The rules (what an attempt runs, the limit, the search, what is measured) and the two Notes, [the limit]
and [malloc], are in :mod:`benchmarks.longest.context`'s docstring.
"""

from __future__ import annotations

import gc
import math
import os
import resource
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import ROOT, harness
from benchmarks.common.example import CONFIGS, example, planner_memory
from benchmarks.common.harness import (
    Allocations,
    heap_free,
    lift_limit,
    live_tensor_bytes,
    malloc_trim,
    memory_status,
    reset_peak,
    set_limit,
    tensors_via_mmap,
)

MIB, GIB = 2**20, 2**30
OOM_MARKERS = (
    "can't allocate memory",
    "MemoryError",
    "std::bad_alloc",
    "Cannot allocate memory",
    "out of memory",
    "ENOMEM",
)
PRELOAD = [
    "torch",
    "torch.distributed",
    "hybridsp",
    "hybridsp.integrations.deepspeed",
    "deepspeed",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "benchmarks.common._example_preload",
]


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
    """Everything an attempt needs, imported before the baseline (preloaded in the forkserver): the
    example's ``train`` and ``text_data`` modules and hybridsp's DeepSpeed ``initialize``."""
    import deepspeed  # noqa: F401
    import transformers  # noqa: F401

    from hybridsp.integrations.deepspeed import initialize

    return example("train"), example("text_data"), initialize


def attempt_rank(
    rank: int,
    world: int,
    ulysses: int,
    ring: int,
    config: str,
    seq_len: int,
    budget: int,
    limit: str,
    limit_from: str,
    mmap_threshold: int,
    report_dir: str,
    variant=None,
) -> dict:
    """One training step at ``seq_len`` with the soft ``limit`` rlimit set to ``budget`` bytes above
    the footprint after the imports (``limit_from="imports"``) or after the engine is built ("init").

    A rank that fails writes its error to ``report_dir/rank<N>.txt`` first: run_distributed reports
    only the lowest failed rank, often a peer's "Connection closed by peer" rather than the rank
    that ran out of memory."""
    try:
        return _attempt(rank, world, ulysses, ring, config, seq_len, budget, limit, limit_from, mmap_threshold, variant)
    except BaseException as error:
        lift_limit(limit)
        Path(report_dir, f"rank{rank}.txt").write_text(f"{time.time():.6f}\n{type(error).__name__}: {error}")
        raise


def _attempt(
    rank: int,
    world: int,
    ulysses: int,
    ring: int,
    config: str,
    seq_len: int,
    budget: int,
    limit: str,
    limit_from: str,
    mmap_threshold: int,
    variant=None,
) -> dict:
    """``variant`` (memory.loss): an object with ``vocab``, ``prepare(model)`` and
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
                loss = step_fn(
                    engine,
                    mesh,
                    windows,
                    0,
                    engine.train_micro_batch_size_per_gpu(),
                    engine.gradient_accumulation_steps(),
                )
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
        "rank": rank,
        "loss": loss,
        "init_s": init_s,
        "step_s": step_s,
        "forward_s": (saved.first_unpack - step_start) if saved.first_unpack else None,
        "hwm_reset": reset,
        "threads_end": len(os.listdir("/proc/self/task")),
        "base_rss": base["VmRSS"],
        "base_data": base["VmData"],
        "base_size": base["VmSize"],
        # torch's view: live tensors after the engine build; the step's allocations (peak, still live at its end)
        "heap_free_at_limit": free_at_limit,
        "init_alloc_end": init_tensors,
        "step_alloc_peak": step_alloc.peak,
        "step_alloc_end": step_alloc.end,
        "alloc_peak": init_tensors + step_alloc.peak,
        # the OS's view: the engine build (model states, DeepSpeed buffers, process groups)
        "init_rss_delta": init_rss,
        "init_anon_delta": init_rss - init_file,
        "init_data_delta": init["VmData"] - base["VmData"],
        "init_peak_rss_delta": init["VmHWM"] - base["VmRSS"],
        # the step alone, over the footprint after the engine build
        "step_peak_rss_delta": step_peak,
        "step_peak_anon_delta": step_peak - step_file,
        "step_data_delta_end": end["VmData"] - init["VmData"],
        # everything over the post-import baseline
        "peak_rss_delta": peak_rss,
        "file_delta": end["RssFile"] - base["RssFile"],
        "peak_anon_delta": peak_rss - (end["RssFile"] - base["RssFile"]),
        "data_delta_end": end["VmData"] - base["VmData"],
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "saved_bytes": saved.bytes,
        "saved_count": len(saved.storages),
    }


def warm_forkserver() -> float:
    """Start the forkserver with DeepSpeed, transformers and the example preloaded (harness.warm_forkserver)."""
    return harness.warm_forkserver(PRELOAD)


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
    return {
        k: max(r[k] for r in ranks if r[k] is not None) if any(r[k] is not None for r in ranks) else None for k in keys
    }


def rank_reports(directory: str) -> list[tuple[float, int, str]]:
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
    attempt = Attempt(
        name,
        seq_len,
        False,
        timeout_s=timeout,
        load=[os.getloadavg()[0]],
        planner=planner_memory(ulysses, ring, world, seq_len) if variant is None else {},
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_longest_") as reports:
        try:
            attempt.ranks = harness.launch(
                attempt_rank,
                world,
                ulysses,
                ring,
                config,
                seq_len,
                settings.budget_total // world,
                settings.limit,
                settings.limit_from,
                settings.mmap_threshold,
                reports,
                variant,
                timeout=timeout,
                threads=settings.threads(world),
            )
            attempt.ok, attempt.worst = True, worst_rank(attempt.ranks)
        except (AssertionError, TimeoutError) as error:
            attempt.reason, attempt.detail = classify_failure(error, rank_reports(reports))
    attempt.wall_s = time.perf_counter() - started
    attempt.load.append(os.getloadavg()[0])
    if attempt.ok and not attempt.planner:
        w = attempt.worst
        log(
            f"  {name} S={seq_len:>6}: ok   {attempt.wall_s:4.0f} s (step {w['step_s']:.0f} s); MiB per rank: "
            f"allocated {w['alloc_peak'] / MIB:.0f} (step {w['step_alloc_peak'] / MIB:.0f}); load {attempt.load[0]:.0f}"
        )
    elif attempt.ok:
        w, p = attempt.worst, attempt.planner
        log(
            f"  {name} S={seq_len:>6}: ok   {attempt.wall_s:4.0f} s (step {w['step_s']:.0f} s); MiB per rank: "
            f"allocated {w['alloc_peak'] / MIB:.0f} (step {w['step_alloc_peak'] / MIB:.0f}), RSS "
            f"{w['peak_anon_delta'] / MIB:.0f} (step {w['step_peak_anon_delta'] / MIB:.0f}), planner "
            f"{p['total'] / MIB:.0f} (step {p['step'] / MIB:.0f}); load {attempt.load[0]:.0f}/{attempt.load[1]:.0f}"
        )
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
    from hybridsp.layout._layouts import check_sequence_length

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
