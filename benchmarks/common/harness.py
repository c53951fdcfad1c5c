"""What every CPU benchmark here shares: launch, interleaved timing, verification, memory, results.

- Launch: :func:`launch` runs ``fn(rank, world, *args)`` on ``world`` gloo ranks of this machine
  (``hybridsp.testing.run_distributed``), relaunching when another job took the free port first.
- Timing (inside the ranks): :func:`interleave` times several callables of ONE process group in a
  rotating order (A B C, B C A, C A B, ...), each call after a barrier, so that the machine's load
  drifts over all of them alike; :func:`combine` turns the ranks' lists into per-iteration wall
  times (max over ranks), CPU times (sum over ranks) and medians.
- Verification: :func:`max_errors` (max |x - ref| over the ranks' shards) and :func:`passes`
  (fp32: relative tolerance; bf16/fp16: flash-attn's rule, <= 2x the single-process low-precision
  kernel's own error against the fp32 reference).
- Memory: peak RSS added by a block (:class:`PeakMemory`), torch's allocations over a block
  (:class:`Allocations`), live tensor bytes, glibc knobs and soft rlimits.
- Bytes: :class:`ByteCounter` wraps torch.distributed's sending calls and counts what leaves a rank.
- Machine: :func:`machine_info`, :func:`software_info`, :func:`load`, :func:`revision`.
- Kernel time: :func:`timed_kernel` (hybridsp's torch kernel summing the thread seconds of its calls).
- Host memory outside a cap: :func:`shared_host_tensor` (``/dev/shm``, not counted by ``RLIMIT_DATA``).
- Results: :func:`results_path` names ``benchmarks/results/<question>/<name>`` (one folder per
  question, the index in ``benchmarks/README.md``; under ``$BENCHMARKS_RESULTS`` instead when it is
  set, as ``python -m benchmarks run NAME --quick`` sets it); :func:`write_results` writes
  ``<prefix>.md`` and ``<prefix>.json``, creating the folder.

Runs under another checkout's hybridsp (before / after) are in :mod:`benchmarks.common.trees`.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

GIB = 2**30
FP32_REL_TOL = 5e-5  # fp32: max |x - ref| <= 5e-5 x max |ref|
LOW_PRECISION_FACTOR = 2.0  # bf16/fp16: max |x - ref| <= 2 x the single-process kernel's error


# --------------------------------------------------------------------------------------------
# launch and timing


def launch(fn: Callable, world: int, *args, timeout: float = 600.0, threads: int = 1) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; the ranks' return values in rank order.

    run_distributed picks a free port and releases it before the ranks bind it; on a shared
    machine another job can take it in between, so EADDRINUSE relaunches (three tries).
    """
    from hybridsp.testing import run_distributed

    for attempt in range(3):
        try:
            return run_distributed(fn, world, *args, timeout=timeout, threads=threads)
        except AssertionError as error:
            if "EADDRINUSE" not in str(error) or attempt == 2:
                raise
            print("  port taken by another process before the ranks bound it; relaunching", flush=True)
    raise AssertionError("unreachable")


def interleave(calls: dict[str, Callable[[], None]], iters: int, group=None) -> dict[str, dict[str, list]]:
    """Time every callable ``iters`` times in a rotating order, each call after a barrier (in a rank).

    Returns ``{name: {"wall": [s, ...], "cpu": [s, ...]}}`` for this rank; the lists are in
    iteration order (the same on every rank), ready for :func:`combine`.
    """
    names = list(calls)
    times = {name: {"wall": [], "cpu": []} for name in names}
    for i in range(iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            dist.barrier(group=group)
            start, cpu_start = time.perf_counter(), time.process_time()
            calls[name]()
            times[name]["wall"].append(time.perf_counter() - start)
            times[name]["cpu"].append(time.process_time() - cpu_start)
    dist.barrier(group=group)
    return times


def combine(per_rank: list[dict[str, list]]) -> dict:
    """The ranks' ``{"wall": [...], "cpu": [...]}`` of one callable -> per-iteration wall (max over
    ranks), CPU (sum over ranks) and their medians."""
    iters = len(per_rank[0]["wall"])
    wall = [max(r["wall"][i] for r in per_rank) for i in range(iters)]
    cpu = [sum(r["cpu"][i] for r in per_rank) for i in range(iters)]
    return {"wall": wall, "cpu": cpu, "median_wall": statistics.median(wall), "median_cpu": statistics.median(cpu)}


def timed_kernel():
    """hybridsp's torch kernel, summing in ``.seconds`` the thread seconds of every kernel call (plain and
    band pieces); set ``.seconds = 0.0`` before the block to time."""
    from hybridsp.kernels import TorchFusedKernel

    def timed(method):
        def call(self, *args, **kwargs):
            start = time.thread_time()
            result = method(self, *args, **kwargs)
            self.seconds += time.thread_time() - start
            return result

        return call

    calls = ("forward", "backward", "forward_band", "backward_band")
    kernel = type(
        "TimedKernel",
        (TorchFusedKernel,),
        {"seconds": 0.0} | {name: timed(getattr(TorchFusedKernel, name)) for name in calls},
    )
    return kernel()


# --------------------------------------------------------------------------------------------
# verification


def max_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], group=None) -> dict[str, float]:
    """max |got - ref| per name, maximised over the ranks of ``group`` (a collective)."""
    names = sorted(got)
    errors = torch.tensor([float((got[n].float() - ref[n].float()).abs().max()) for n in names], dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(names, errors.tolist()))


def passes(errors: dict[str, float], ref_max: dict[str, float], dtype: str, kernel_errors: dict | None = None) -> bool:
    """fp32: every error <= FP32_REL_TOL x max|ref|; low precision: <= 2 x the kernel's own error."""
    if not all(math.isfinite(e) for e in errors.values()):
        return False
    if dtype == "fp32":
        return all(errors[n] <= FP32_REL_TOL * ref_max[n] for n in errors)
    return all(errors[n] <= LOW_PRECISION_FACTOR * kernel_errors[n] + 1e-6 * ref_max[n] for n in errors)


# --------------------------------------------------------------------------------------------
# memory (inside a rank)


def memory_status() -> dict[str, int]:
    """Memory fields of /proc/self/status, bytes."""
    fields = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                fields[name] = int(rest.split()[0]) * 1024
    return fields


def malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak resident memory added during a block, MB: VmHWM (reset first) - VmRSS before.

    glibc's free memory is trimmed first so that memory freed before the block is not silently
    reused by it. Falls back to ru_maxrss (a lower bound) where clear_refs cannot be written.
    """

    def __enter__(self):
        malloc_trim()
        self.before = memory_status()["VmRSS"]
        reset = reset_peak()
        self.measure = (
            "VmHWM (reset via /proc/self/clear_refs) - VmRSS before"
            if reset
            else "ru_maxrss - VmRSS before (lower bound)"
        )
        return self

    def __exit__(self, *exc):
        if self.measure.startswith("VmHWM"):
            peak = memory_status()["VmHWM"]
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak_mb = max(0, peak - self.before) / 2**20
        return False


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


def live_tensor_bytes() -> int:
    """Bytes of the unique CPU storages of every tensor the garbage collector tracks (parameters,
    ZeRO partitions and buffers, optimizer states; a DTensor's local shard). (Not profiled: the profiler's own event
    records would leave ~100 MiB of free glibc heap behind, which later tensors reuse.)"""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:  # a wrapper subclass (DTensor) has no valid storage: its local tensor is counted on its own
                storage = obj.untyped_storage()
                if storage.nbytes():
                    storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
    return sum(storages.values())


def heap_free() -> int:
    """Free bytes inside glibc's arenas (mallinfo2().fordblks): VmData that allocations can reuse."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        return int(libc.mallinfo2().fordblks)
    except (OSError, AttributeError):
        return -1


def tensors_via_mmap(threshold: int) -> None:
    """glibc: serve every allocation >= ``threshold`` by mmap and unmap it at free."""
    if threshold > 0:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD; also stops its dynamic growth


def set_limit(limit: str, status: dict[str, int], budget: int) -> None:
    """Soft rlimit ``limit`` ("data" or "as") = the current VmData / VmSize + ``budget``."""
    if limit == "none":
        return
    kind = {"data": resource.RLIMIT_DATA, "as": resource.RLIMIT_AS}[limit]
    current = status["VmData" if limit == "data" else "VmSize"]
    resource.setrlimit(kind, (current + budget, resource.getrlimit(kind)[1]))


def lift_limit(limit: str) -> None:
    """Soft limit back to the hard limit."""
    if limit != "none":
        kind = {"data": resource.RLIMIT_DATA, "as": resource.RLIMIT_AS}[limit]
        resource.setrlimit(kind, (resource.getrlimit(kind)[1], resource.getrlimit(kind)[1]))


def shared_host_tensor(shape, dtype) -> torch.Tensor:
    """A CPU tensor in a MAP_SHARED mapping of an unlinked /dev/shm file: host memory that
    RLIMIT_DATA does not count (the model of an accelerator's host memory)."""
    numel = math.prod(shape)
    nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
    handle, path = tempfile.mkstemp(dir="/dev/shm", prefix="hybridsp_offload_")
    try:
        os.ftruncate(handle, nbytes)
    finally:
        os.close(handle)
    try:
        return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    finally:
        os.unlink(path)


def filesystem_of(path: str) -> str:
    """The type of the file system ``path`` is on (the longest mount point of /proc/mounts above it)."""
    path, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, fstype = line.split()[:3]
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, fstype
    return kind


def _noop() -> None:
    pass


def warm_forkserver(preload: list[str]) -> float:
    """Start the forkserver with ``preload`` imported, so each rank forks with it (the server starts
    once per parent; later preload lists do not restart it). Returns the seconds it took."""
    started = time.perf_counter()
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(preload)
    process = context.Process(target=_noop)
    process.start()
    process.join()
    return time.perf_counter() - started


# --------------------------------------------------------------------------------------------
# bytes


class ByteCounter:
    """Wrap torch.distributed's sending calls for a while; count the bytes this rank sends to others.

    ``bytes``: kind -> bytes (``all_to_all``, ``p2p``, ``all_gather``, ``reduce_scatter``).
    isend/irecv themselves are left alone (P2POp checks that its op *is* torch.distributed.isend);
    their bytes are counted in batch_isend_irecv.
    """

    _NAMES = (
        "all_to_all_single",
        "batch_isend_irecv",
        "send",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_gather",
    )

    def __init__(self):
        self.bytes: dict[str, int] = {}
        self._saved: dict = {}

    def _add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)

    def __enter__(self):
        self._saved = {n: getattr(dist, n) for n in self._NAMES if hasattr(dist, n)}
        saved, add = self._saved, self._add

        def all_to_all_single(
            output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
        ):
            size, me = dist.get_world_size(group), dist.get_rank(group)
            if input_split_sizes:
                row = input.numel() // max(input.shape[0], 1) * input.element_size()
                add("all_to_all", (sum(input_split_sizes) - input_split_sizes[me]) * row)
            else:
                add("all_to_all", input.numel() * input.element_size() * (size - 1) // size)
            return saved["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group, async_op)

        def batch_isend_irecv(ops):
            for op in ops:
                if getattr(op.op, "__name__", "") == "isend":
                    add("p2p", op.tensor.numel() * op.tensor.element_size())
            return saved["batch_isend_irecv"](ops)

        def collective(name, kind, sent):
            def wrapped(*args, **kwargs):
                group = kwargs.get("group", args[2] if len(args) > 2 else None)
                add(kind, sent(args, dist.get_world_size(group)))
                return saved[name](*args, **kwargs)

            return wrapped

        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        dist.all_to_all_single = all_to_all_single
        dist.batch_isend_irecv = batch_isend_irecv
        dist.send = collective("send", "p2p", lambda a, _: nbytes(a[0]))
        for name in ("all_gather_into_tensor", "all_gather_single"):  # torch 2.13 renames the first
            if name in saved:  # ring all-gather: each rank sends its shard W-1 times
                setattr(dist, name, collective(name, "all_gather", lambda a, w: nbytes(a[1]) * (w - 1)))
        dist.reduce_scatter_tensor = collective(  # ring reduce-scatter: (W-1)/W of the input
            "reduce_scatter_tensor", "reduce_scatter", lambda a, w: nbytes(a[1]) * (w - 1) // w
        )
        for name in ("all_to_all", "all_gather"):
            setattr(dist, name, collective(name, f"other:{name}", lambda a, w: 0))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        return False


# --------------------------------------------------------------------------------------------
# machine and results


def command(module: str, argv: list[str] | None = None) -> str:
    """The command line that ran ``module`` (``python -m benchmarks.<group>.<name> ...``), for the results."""
    args = sys.argv[1:] if argv is None else argv
    return f"python -m {module}" + "".join(f" {a}" for a in args)


def load() -> str:
    """The machine's load averages (1, 5, 15 min), as uptime shows them."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def machine_info() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return f"{cpu}, {os.cpu_count()} cores, {memory:.1f} GiB RAM, no GPU; {platform.platform()}"


def software_info(*packages: str) -> str:
    """Python, torch and the installed versions of ``packages`` (default deepspeed, transformers)."""
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    for name in packages or ("deepspeed", "transformers"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} not installed")
    return ", ".join(parts)


def revision() -> str:
    """The commit of the hybridsp that is measured, and whether hybridsp/ had uncommitted edits."""
    import hybridsp

    root = os.path.dirname(os.path.dirname(os.path.abspath(hybridsp.__file__)))
    try:
        git = lambda *a: subprocess.run(  # noqa: E731
            ["git", "-C", root, *a], capture_output=True, text=True, check=True
        ).stdout.strip()
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "hybridsp")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" + uncommitted changes in hybridsp/" if dirty else "")


RESULTS = Path(__file__).resolve().parents[1] / "results"  # the committed results
RESULTS_ENV = "BENCHMARKS_RESULTS"  # when set: the folder that stands in for RESULTS (quick runs)


def results_root() -> Path:
    """Where results go: ``$BENCHMARKS_RESULTS`` when set, else the committed ``benchmarks/results``."""
    return Path(os.environ[RESULTS_ENV]) if os.environ.get(RESULTS_ENV) else RESULTS


def results_dir(question: str) -> str:
    """``benchmarks/results/<question>`` (or its stand-in under ``$BENCHMARKS_RESULTS``)."""
    return str(results_root() / question)


def results_path(question: str, name: str) -> str:
    """``benchmarks/results/<question>/<name>`` (see :func:`results_dir`): a results file, or a prefix for
    :func:`write_results`."""
    return str(results_root() / question / name)


def write_results(prefix: str, markdown: str, data: dict) -> None:
    """``<prefix>.md`` (the report) and ``<prefix>.json`` (everything), the folder created if need be."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".md", "w") as handle:
        handle.write(markdown)
    with open(prefix + ".json", "w") as handle:
        json.dump(data, handle, indent=1)
    print(f"wrote {prefix}.md and {prefix}.json", flush=True)
