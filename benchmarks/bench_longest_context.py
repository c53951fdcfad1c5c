"""Longest context one training step survives on this machine, against the planner's prediction.

    python benchmarks/bench_longest_context.py            # world 1, cp2, cp4, cp8 (~25 min on 2 cores)
    python benchmarks/bench_longest_context.py --quick    # world 1 and cp2, coarse (~5 min); temp dir

What one attempt is: ``world`` gloo ranks (``hybridsp.testing.run_distributed``, one launch per
attempt, one torch thread per rank) each build the example model of ``examples/train.py`` on its
defaults (``train.build_model(train.parse_args(["--deepspeed", cpN.json, "--seq-len", S]), 256)``:
a Llama with h=256, 4 layers, 8 query / 4 K/V heads of 32, I=640, byte vocabulary 256, tied
embeddings, fp32), wrap it with ``hybridsp.integrations.deepspeed.initialize`` on the shipped
``ds_configs/cpN.json`` (ZeRO-3; its "auto" precision is fp32 on CPU, AdamW runs as torch Adam)
and run ONE ``train.train_step`` (forward + backward + optimizer step) on one window of S tokens
of the example's byte corpus. The attempt succeeds when every rank finishes the step.

Memory limit (Note [the limit]): before building anything, each rank measures its footprint after
the imports (torch, DeepSpeed, transformers, hybridsp, the corpus) and sets the soft
``RLIMIT_DATA`` to that ``VmData`` plus ``budget / world``. An allocation beyond it fails inside
torch with ``RuntimeError: DefaultCPUAllocator: can't allocate memory`` (a clean, catchable error:
``run_distributed`` kills the other ranks and the attempt counts as "too long"); the machine's RAM
is never exhausted. ``--check-limits`` (also run at the start of every search) verifies which
limits behave that way on this kernel.

Search per configuration: lengths are multiples of ``lcm(granularity, the zigzag layout's
multiple)``; doubling from a start length until an attempt fails, then bisection to the
granularity. A failed or timed-out attempt means "too long".

Measured per successful attempt (per rank; tables show the max over ranks):
- ``peak_rss_delta``: VmHWM (reset through /proc/self/clear_refs right after the baseline) minus
  the baseline VmRSS; ``file_delta``: RssFile at the end minus at the baseline (code pages of
  kernels faulted in for the first time); ``peak_anon_delta = peak_rss_delta - file_delta`` is
  the headline number: anonymous memory (tensors, buffers, malloc heap) the step added at its peak.
- ``data_delta_end``: VmData at the end minus the baseline (what the limit counts; untouched
  reservations such as DeepSpeed's fp32 reduce bucket count here, not in RSS).
- ``saved_bytes``: unique storages autograd saved for backward (``saved_tensors_hooks``,
  parameters excluded): the activations, allocator-independent.

Planner prediction for the same model, length, mesh and ZeRO-3 with ``dtype_bytes=4``:
``hybridsp.planner.memory_use`` per rank (and ``longest_context`` for a "cluster" of 1 node of
``world`` ranks with ``memory = budget / world`` and nothing reserved). Error = (predicted -
measured) / measured.

Note [the limit]: RLIMIT_RSS is not enforced by Linux (a no-op since 2.6), so only the OOM
killer would stop a process that outgrows RAM: not clean, and it may pick another process on a
shared machine. RLIMIT_AS counts every mapping (shared libraries, PROT_NONE reservations of
glibc's per-thread arenas, 64 MiB each), so a rank's budget would depend on how many threads
gloo and DeepSpeed start. RLIMIT_DATA (Linux >= 4.7) counts private writable mappings only:
the heap, anonymous mmaps (every large tensor), thread stacks; mmap/brk fail with ENOMEM and
torch's CPU allocator raises RuntimeError. It counts memory when it is *reserved*, as a GPU
allocator does (``torch.empty`` of a buffer that is never touched costs budget), so it is the
closer analogue of device memory; RSS (what the table measures) counts only touched pages.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hybridsp.testing import run_distributed  # noqa: E402

MIB, GIB = 2**20, 2**30
CONFIGS = {  # name -> (world, ulysses, ring, ds config)
    "w1": (1, 1, 1, "cp1.json"),
    "cp2": (2, 2, 1, "cp2.json"),
    "cp4": (4, 2, 2, "cp4.json"),
    "cp8": (8, 4, 2, "cp8.json"),
}
VOCAB = 256  # examples/text_data.py BYTE_VOCAB
OOM_MARKERS = ("can't allocate memory", "MemoryError", "std::bad_alloc", "Cannot allocate memory",
               "out of memory", "ENOMEM")
PRELOAD = ["torch", "torch.distributed", "hybridsp", "hybridsp.integrations.deepspeed", "deepspeed",
           "transformers", "transformers.models.llama.modeling_llama", "train", "text_data"]


# --------------------------------------------------------------------------------------------
# inside a rank


def _status() -> dict[str, int]:
    """Memory fields of /proc/self/status, bytes."""
    fields = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                fields[name] = int(rest.split()[0]) * 1024
    return fields


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


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


def _imports():
    """Everything an attempt needs, imported before the baseline (preloaded in the forkserver)."""
    import deepspeed  # noqa: F401
    import transformers  # noqa: F401

    import text_data
    import train
    from hybridsp.integrations.deepspeed import initialize

    return train, text_data, initialize


class Allocations:
    """torch's own view of CPU memory over a block: the profiler's memory events (``profile_memory``)
    summed in time order. ``peak``: most bytes live at once that were allocated inside the block;
    ``end``: still live at its end. (Frees of tensors allocated before the block are not reported.)"""

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.peak = self.end = 0

    def __enter__(self):
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        self.profiler.__exit__(*exc)
        if exc[0] is None:
            events = [e for e in self.profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
            live = 0
            for event in sorted(events, key=lambda e: e.start_ns()):
                live += event.nbytes()
                self.peak = max(self.peak, live)
            self.end = live
        self.profiler = None  # drop the recorded events before the next measurement
        gc.collect()
        return False


def _tensors_via_mmap(threshold: int) -> None:
    """glibc: serve every allocation >= ``threshold`` by mmap and unmap it at free (Note [malloc])."""
    if threshold > 0:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD; also stops its dynamic growth


def attempt_rank(rank: int, world: int, ulysses: int, ring: int, config: str, seq_len: int,
                 budget: int, limit: str, limit_from: str, mmap_threshold: int, report_dir: str) -> dict:
    """One training step at ``seq_len`` with the soft ``limit`` rlimit set to ``budget`` bytes above
    the footprint after the imports (``limit_from="imports"``) or after the engine is built ("init").

    A rank that fails writes its error to ``report_dir/rank<N>.txt`` first: run_distributed reports
    only the lowest failed rank, often a peer's "Connection closed by peer" rather than the rank
    that ran out of memory."""
    try:
        return _attempt(rank, world, ulysses, ring, config, seq_len, budget, limit, limit_from, mmap_threshold)
    except BaseException as error:
        _lift_limit(limit)
        Path(report_dir, f"rank{rank}.txt").write_text(f"{time.time():.6f}\n{type(error).__name__}: {error}")
        raise


def _attempt(rank: int, world: int, ulysses: int, ring: int, config: str, seq_len: int,
             budget: int, limit: str, limit_from: str, mmap_threshold: int) -> dict:
    _tensors_via_mmap(mmap_threshold)
    train, text_data, initialize = _imports()
    tokens, vocab = text_data.tokenize(text_data.load_corpus(None), None)
    windows = text_data.TokenWindows(tokens, seq_len, 0)
    gc.collect()
    _malloc_trim()
    base = _status()
    reset = _reset_peak()
    started = time.perf_counter()
    args = train.parse_args(["--deepspeed", str(ROOT / "ds_configs" / config), "--seq-len", str(seq_len)])
    with Allocations() as init_alloc:
        if limit_from == "imports":
            _set_limit(limit, base, budget)
        try:
            model = train.build_model(args, vocab)
            engine, _, mesh, _ = initialize(model, train._config_with_lr(args), ulysses=ulysses, ring=ring)
        finally:
            _lift_limit(limit)  # the profiler needs memory to report; the limit comes back below
    gc.collect()
    _malloc_trim()
    init = _status()
    init_s = time.perf_counter() - started
    _reset_peak()
    saved = SavedTensors()
    with Allocations() as step_alloc:
        _set_limit(limit, base if limit_from == "imports" else init, budget)
        step_start = time.perf_counter()
        try:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                loss = train.train_step(engine, mesh, windows, 0, engine.train_micro_batch_size_per_gpu(),
                                        engine.gradient_accumulation_steps())
            step_s = time.perf_counter() - step_start
        finally:
            _lift_limit(limit)  # reporting (an error, or the profile) needs memory
    end = _status()
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
        # torch's allocations: the engine build (persistent part), the step (peak, persistent part)
        "init_alloc_end": init_alloc.end, "init_alloc_peak": init_alloc.peak,
        "step_alloc_peak": step_alloc.peak, "step_alloc_end": step_alloc.end,
        "alloc_peak": max(init_alloc.peak, init_alloc.end + step_alloc.peak),
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


def _set_limit(limit: str, status: dict[str, int], budget: int) -> None:
    """Soft rlimit ``limit`` ("data" or "as") = the current VmData / VmSize + ``budget``."""
    if limit == "none":
        return
    kind = {"data": resource.RLIMIT_DATA, "as": resource.RLIMIT_AS}[limit]
    current = status["VmData" if limit == "data" else "VmSize"]
    resource.setrlimit(kind, (current + budget, resource.getrlimit(kind)[1]))


def _lift_limit(limit: str) -> None:
    """Soft limit back to the hard limit."""
    if limit != "none":
        kind = {"data": resource.RLIMIT_DATA, "as": resource.RLIMIT_AS}[limit]
        resource.setrlimit(kind, (resource.getrlimit(kind)[1], resource.getrlimit(kind)[1]))


def limit_check_rank(rank: int, world: int, limit: str) -> dict:
    """Does an allocation past ``limit`` (data, as, rss) raise inside torch? 256 MiB allowed,
    then a 512 MiB tensor is allocated (and touched, so RSS would grow if nothing stops it)."""
    _imports()
    gc.collect()
    _malloc_trim()
    base = _status()
    kind = {"data": resource.RLIMIT_DATA, "as": resource.RLIMIT_AS, "rss": resource.RLIMIT_RSS}[limit]
    current = {"data": base["VmData"], "as": base["VmSize"], "rss": base["VmRSS"]}[limit]
    resource.setrlimit(kind, (current + 256 * MIB, resource.getrlimit(kind)[1]))
    small = torch.ones(128 * MIB // 4)  # within the limit
    outcome = {"limit": limit, "base_data": base["VmData"], "base_size": base["VmSize"], "base_rss": base["VmRSS"]}
    try:
        big = torch.ones(512 * MIB // 4)
        outcome.update(raised=False, rss_after=_status()["VmRSS"], error="")
        del big
    except BaseException as error:  # noqa: BLE001 - report what was raised
        outcome.update(raised=True, error_type=type(error).__name__, error=str(error).splitlines()[0][:200])
    outcome["small_ok"] = bool(small.sum() > 0)
    return outcome


def _noop() -> None:
    pass


def warm_forkserver() -> float:
    """Start the forkserver with DeepSpeed, transformers and the example preloaded, so each rank
    forks with them imported (run_distributed's own preload list only names torch and hybridsp;
    the server starts once per parent, and later preload lists do not restart it)."""
    started = time.perf_counter()
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    process = context.Process(target=_noop)
    process.start()
    process.join()
    return time.perf_counter() - started


# --------------------------------------------------------------------------------------------
# the planner's view


def example_model_spec():
    """The example model of examples/train.py (defaults, byte vocabulary) as a planner ModelSpec."""
    import train
    from hybridsp.planner import ModelSpec

    args = train.parse_args([])
    intermediate = int(args.hidden_size * 8 / 3) // 64 * 64  # as train.build_model computes it
    return ModelSpec(num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.hidden_size // args.heads,
                     hidden_size=args.hidden_size, intermediate_size=intermediate, num_layers=args.layers,
                     vocab_size=VOCAB, tied_embeddings=True, name="examples/train.py default")


def planner_memory(ulysses: int, ring: int, world: int, seq_len: int) -> dict:
    """The planner's per-rank memory for one fp32 (dtype_bytes=4) ZeRO-3 step, no checkpointing."""
    from hybridsp.planner import MeshConfig, Workload, memory_use

    use = memory_use(example_model_spec(), Workload(seq_len, dtype_bytes=4),
                     MeshConfig(world // (ulysses * ring), ulysses, ring, zero_stage=3, checkpointing=False))
    row = asdict(use)
    row.update(model_states=use.model_states, step=use.activations + use.logits + use.workspace, total=use.total)
    return row


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


def _worst(ranks: list[dict]) -> dict:
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


def _classify(error: BaseException, reports: list[tuple[float, int, str]]) -> tuple[str, str]:
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


def run_attempt(name: str, seq_len: int, settings: Settings, timeout: float, log) -> Attempt:
    world, ulysses, ring, config = CONFIGS[name]
    attempt = Attempt(name, seq_len, False, timeout_s=timeout, load=[os.getloadavg()[0]],
                      planner=planner_memory(ulysses, ring, world, seq_len))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_longest_") as reports:
        try:
            attempt.ranks = run_distributed(
                attempt_rank, world, ulysses, ring, config, seq_len, settings.budget_total // world, settings.limit,
                settings.limit_from, settings.mmap_threshold, reports, timeout=timeout, threads=settings.threads(world))
            attempt.ok, attempt.worst = True, _worst(attempt.ranks)
        except (AssertionError, TimeoutError) as error:
            attempt.reason, attempt.detail = _classify(error, _rank_reports(reports))
    attempt.wall_s = time.perf_counter() - started
    attempt.load.append(os.getloadavg()[0])
    if attempt.ok:
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


def search(name: str, start: int, settings: Settings, log) -> tuple[int, list[Attempt]]:
    """Doubling from ``start`` until a failure, then bisection to the step; returns (longest, attempts)."""
    from hybridsp.layout import check_sequence_length

    world, ulysses, ring, _ = CONFIGS[name]
    step = math.lcm(settings.granularity, 2 * ring * ulysses)
    attempts: list[Attempt] = []

    def fits(seq_len: int) -> bool:
        check_sequence_length(seq_len, ring, ulysses, "zigzag")
        timeout = _timeout_for(seq_len, [a for a in attempts if a.ok], settings.first_timeout)
        attempt = run_attempt(name, seq_len, settings, timeout, log)
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
            "total_vs_allocated": _error(p["total"], w["alloc_peak"]),
            "step_vs_allocated": _error(p["step"], w["step_alloc_peak"]),
            "activations_vs_saved": _error(p["activations"], w["saved_bytes"]),
            "total_vs_rss": _error(p["total"], w["peak_anon_delta"]),
            "step_vs_rss": _error(p["step"], w["step_peak_anon_delta"]),
            "model_states_vs_init_allocated": _error(p["model_states"], w["init_alloc_end"] + w["step_alloc_end"]),
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


def _error(predicted: float, measured: float) -> float | None:
    return None if not measured else (predicted - measured) / measured


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def _slope(fit: dict | None) -> str:
    return "-" if fit is None else f"{fit['slope']:,.0f}"


def markdown(rows: list[dict], meta: dict, checks: list[dict], clusters: str | None) -> str:
    budget = meta["budget_total"]
    limit_base = "the imports" if meta["limit_from"] == "imports" else "the imports and the engine build"
    lines = [
        "# Longest context of one training step on this machine, measured vs the planner",
        "",
        f"- Date: {meta['date']}",
        f"- Command: `{meta['command']}` ({meta['total_s'] / 60:.1f} min in all)",
        f"- Machine: {meta['machine']}",
        f"- Software: {meta['software']}",
        f"- Model: `examples/train.py` defaults ({meta['model']}), fp32, ZeRO-3 from the shipped "
        f"`ds_configs/cpN.json` through `hybridsp.integrations.deepspeed.initialize`; one `train.train_step` "
        f"(forward + backward + AdamW step, micro-batch 1) on a window of the byte corpus. Ranks: gloo, "
        f"`hybridsp.testing.run_distributed`, one launch per attempt, {meta['threads_note']}.",
        f"- Memory limit: each rank sets the soft `RLIMIT_{meta['limit'].upper()}` to its VmData after {limit_base} "
        f"+ {budget / GIB:g} GiB / world size; glibc serves allocations >= {meta['mmap_threshold'] // 1024} KiB "
        f"by mmap (`mallopt(M_MMAP_THRESHOLD)`, so freed tensors go back to the OS). Search: doubling from "
        f"{meta['start_note']}, then bisection to {meta['granularity']} tokens (multiples of lcm(granularity, 2RU) "
        f"for the zigzag layout); a failed or timed-out attempt counts as too long.",
        "- Measured, per rank, max over ranks: **allocated** = torch's own count of live CPU tensor bytes "
        "(profiler memory events; the analogue of `torch.cuda.max_memory_allocated`): persistent after the engine "
        "build + the step's peak; **RSS** = VmHWM - VmRSS after the imports, minus the growth of file-backed RSS "
        "(code pages); **saved** = unique storages autograd saved for backward (parameters excluded). "
        "`step` columns count only the step, over the footprint after the engine build (what the limit counted).",
        "- Planner: `hybridsp.planner.memory_use` for the same model (ModelSpec H=8, Hkv=4, D=32, h=256, I=640, "
        "L=4, V=256, tied embeddings), S, DP=1 x U x R, ZeRO-3, no checkpointing, `dtype_bytes=4`; `step` = "
        "activations + logits + workspace; `planner longest` = `longest_context` on a 1-node cluster of `world` "
        "ranks with memory = budget per rank + the planner's model states, nothing reserved, restricted to the "
        "same mesh (the last column lets the planner choose the mesh, ZeRO stage and checkpointing). "
        "Error = (planner - measured) / measured.",
        "",
        "## Measured longest context and the planner's prediction",
        "",
        "| config | world (U x R) | budget/rank MiB | longest S | step s | allocated MiB (init + step) | planner MiB "
        "(states + step) | error | step allocated MiB | planner step MiB | error | saved MiB | planner act. MiB | "
        "error | RSS MiB (step) | error vs RSS | planner longest S (error) | planner's own pick |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, p, e, pl, free = r.get("measured"), r.get("planner"), r.get("errors", {}), r["planner_longest"], \
            r["planner_longest_free"]
        head = f"| {r['config']} | {r['world']} ({r['ulysses']} x {r['ring']}) | {_mib(r['budget_per_rank'])} | "
        pick = (f"{free['seq_len']:,} ({free.get('dp')}x{free.get('ulysses')}x{free.get('ring')} ZeRO-"
                f"{free.get('zero_stage')}{' ckpt' if free.get('checkpointing') else ''})" if free.get("dp") else "-")
        if m is None:
            lines.append(head + f"{r['longest']:,} |" + " |" * 12 + f" {pl['seq_len']:,} | {pick} |")
            continue
        pl_err = _pct((pl["seq_len"] - r["longest"]) / r["longest"])
        lines.append(
            head + f"{r['longest']:,} | {r['step_s']:.0f} | {_mib(m['alloc_peak'])} ({_mib(m['init_alloc_end'])} + "
            f"{_mib(m['step_alloc_peak'])}) | {_mib(p['total'])} ({_mib(p['model_states'])} + {_mib(p['step'])}) | "
            f"{_pct(e['total_vs_allocated'])} | {_mib(m['step_alloc_peak'])} | {_mib(p['step'])} | "
            f"{_pct(e['step_vs_allocated'])} | {_mib(m['saved_bytes'])} | {_mib(p['activations'])} | "
            f"{_pct(e['activations_vs_saved'])} | {_mib(m['peak_anon_delta'])} ({_mib(m['step_peak_anon_delta'])}) | "
            f"{_pct(e['total_vs_rss'])} | {pl['seq_len']:,} ({pl_err}) | {pick} |")
    lines += [
        "", "### Per local token and fixed costs", "",
        "Slopes of least-squares lines over every successful attempt of a config, bytes per token a rank holds "
        "(S / C); fixed costs per rank at the longest length.", "",
        "| config | step allocated B/token | planner step B/token | error | saved B/token | planner act. B/token | "
        "error | step RSS B/token | engine build: allocated / RSS / VmData MiB | Adam states etc. made in the step MiB "
        "| planner model states MiB | RSS after imports MiB | threads |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, p = r.get("measured"), r.get("planner")
        if m is None:
            continue
        sa, ps, sv, pa = (r["step_alloc_per_token"], r["planner_step_per_token"], r["saved_per_token"],
                          r["planner_activations_per_token"])
        lines.append(
            f"| {r['config']} | {_slope(sa)} | {_slope(ps)} | "
            f"{_pct(_error(ps['slope'], sa['slope'])) if sa and ps else '-'} | {_slope(sv)} | {_slope(pa)} | "
            f"{_pct(_error(pa['slope'], sv['slope'])) if sv and pa else '-'} | {_slope(r['step_rss_per_token'])} | "
            f"{_mib(m['init_alloc_end'])} / {_mib(m['init_anon_delta'])} / {_mib(m['init_data_delta'])} | "
            f"{_mib(m['step_alloc_end'])} | {_mib(p['model_states'])} | {_mib(m['base_rss'])} | {m['threads_end']} |")
    lines += ["", "### Every attempt", "",
              "| config | S | result | wall s | step s (forward) | allocated MiB (step) | RSS MiB (step) | step VmData "
              "MiB | saved MiB | planner total / step MiB | load before/after |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for a in r["attempt_list"]:
            w = a["worst"]
            load = "/".join(f"{x:.0f}" for x in a["load"])
            plan = f"{_mib(a['planner']['total'])} / {_mib(a['planner']['step'])}"
            if a["ok"]:
                fwd = f" ({w['forward_s']:.0f})" if w.get("forward_s") is not None else ""
                lines.append(
                    f"| {a['config']} | {a['seq_len']:,} | ok | {a['wall_s']:.0f} | {w['step_s']:.0f}{fwd} | "
                    f"{_mib(w['alloc_peak'])} ({_mib(w['step_alloc_peak'])}) | {_mib(w['peak_anon_delta'])} "
                    f"({_mib(w['step_peak_anon_delta'])}) | {_mib(w['step_data_delta_end'])} | {_mib(w['saved_bytes'])} "
                    f"| {plan} | {load} |")
            else:
                lines.append(f"| {a['config']} | {a['seq_len']:,} | **{a['reason']}**: {a['detail'][:100]} | "
                             f"{a['wall_s']:.0f} | | | | | | {plan} | {load} |")
    lines += ["", "### Which memory limit raises inside torch (checked at the start of the run)", "",
              "Each check: one fresh rank after the imports sets the limit to its current value + 256 MiB, then "
              "allocates a 128 MiB tensor (must work) and a 512 MiB one (touched).", "",
              "| limit | 512 MiB tensor | what happened |", "|---|---|---|"]
    for c in checks:
        what = f"{c.get('error_type', '')}: {c['error']}" if c.get("raised") else (
            f"allocated and touched; RSS {c.get('rss_after', 0) / MIB:,.0f} MiB" if "rss_after" in c else c.get("error", ""))
        lines.append(f"| RLIMIT_{c['limit'].upper()} | {'raised' if c.get('raised') else 'no error'} | {what} |")
    if clusters:
        lines += ["", clusters]
    return "\n".join(lines) + "\n"


def machine_info() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return f"{cpu}, {os.cpu_count()} cores, {memory:.1f} GiB RAM, no GPU; {platform.platform()}"


def software_info() -> str:
    import deepspeed
    import transformers

    return (f"Python {platform.python_version()}, torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
            f"transformers {transformers.__version__}")


def check_limits(log) -> list[dict]:
    checks = []
    for limit in ("data", "as", "rss"):
        try:
            checks.append(run_distributed(limit_check_rank, 1, limit, timeout=300)[0])
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
    parser.add_argument("--out", help="output prefix (default benchmarks/results_longest_context; quick: temp dir)")
    args = parser.parse_args(argv)

    quick = args.quick
    names = args.configs or (["w1", "cp2"] if quick else ["w1", "cp2", "cp4", "cp8"])
    settings = Settings(
        budget_total=int((args.budget_gib or (0.5 if quick else 1.0)) * GIB),
        granularity=args.granularity or (2048 if quick else 1024), limit=args.limit, limit_from=args.limit_from,
        mmap_threshold=args.mmap_threshold_kib * 1024, first_timeout=args.first_timeout, cores=os.cpu_count() or 1)
    prefix = args.out or (os.path.join(tempfile.gettempdir(), "results_longest_context_quick") if quick
                          else str(ROOT / "benchmarks" / "results_longest_context"))
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
    clusters = cluster_rows = None
    if not args.no_clusters:
        import predict_clusters

        cluster_rows, _ = predict_clusters.run()
        clusters = ("## Planner predictions for real clusters (`python benchmarks/predict_clusters.py`)\n\n"
                    + predict_clusters.__doc__.split("\n\n", 2)[2].strip() + "\n\n"
                    + predict_clusters.markdown(cluster_rows))
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
    text = markdown(rows, meta, checks, clusters)
    Path(prefix + ".md").write_text(text)
    Path(prefix + ".json").write_text(json.dumps({"meta": meta, "limit_checks": checks, "configs": rows,
                                                  "clusters": cluster_rows}, indent=1, default=str) + "\n")
    print(text)
    log(f"wrote {prefix}.md and {prefix}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
