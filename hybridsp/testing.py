"""Run a function on N local processes with a gloo process group, for tests and benchmarks.

    results = run_distributed(fn, world_size, *args, timeout=120)

``fn(rank, world_size, *args)`` must be importable (a module-level function). Every rank
runs in its own process with ``torch.distributed`` initialised (gloo, loopback, one thread
per process). If any rank raises, all processes are killed and an ``AssertionError`` carries
that rank's traceback; if ranks do not finish within ``timeout`` seconds, they are killed and
a ``TimeoutError`` names them. Nothing ever hangs the caller. Returns each rank's return
value, in rank order.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

_GRACE_SECONDS = 3.0

# Note [results by value]: a rank's return value crosses to the parent pickled by the plain pickle
# module. Through the queue's own pickler (torch.multiprocessing's reductions) a tensor travels as a
# shared-memory handle that the parent fetches from the rank's process, which may have exited by
# then: the parent reads a cut message (ConnectionResetError / EOFError). Seen in 2 of 5 launches of
# tests/losses/test_logprobs.py (ranks return tensors) at one revision, 0 of 5 at the one before: a
# race whose timing moved, not a cause in the code under test.


__all__ = ["PRELOAD_ENV", "run_distributed"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any, threads: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300))
        value = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(value)))  # by value: Note [results by value]
    except BaseException:  # report everything to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PRELOAD_ENV = "HYBRIDSP_TEST_PRELOAD"


def _context() -> mp.context.SpawnContext | mp.context.ForkServerContext:
    """forkserver with torch preloaded starts workers in well under a second; spawn otherwise.

    The forkserver imports its preload list once, when the first launch starts it; more
    modules (comma-separated, e.g. transformers model modules) can be named in the
    ``HYBRIDSP_TEST_PRELOAD`` environment variable so that every worker inherits them.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    extra = [name for name in os.environ.get(PRELOAD_ENV, "").split(",") if name]
    context.set_forkserver_preload(["torch", "torch.distributed", "hybridsp", *extra])
    return context


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0, threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; see the module docstring."""
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _launch(fn, world_size, args, timeout, threads)
        except AssertionError as error:  # the free port was taken before rank 0 bound it
            if "EADDRINUSE" not in str(error) or attempt + 1 == _PORT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


_PORT_ATTEMPTS = 3


def _launch(fn: Callable, world_size: int, args: tuple, timeout: float, threads: int) -> list[Any]:
    context = _context()
    results = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, fn, args, results, threads), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        return _collect(results, processes, world_size, timeout)
    finally:
        _stop(processes)


def _collect(results, processes, world_size: int, timeout: float) -> list[Any]:
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(values) + len(failures) < world_size:
        if failures:  # give the other ranks a moment to report their own errors, then stop
            deadline = min(deadline, time.monotonic() + _GRACE_SECONDS)
        try:
            rank, ok, value = results.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= deadline:
                break
            if not failures and any(p.exitcode not in (None, 0) for p in processes):
                failures.update(_crashed(processes, values))
            continue
        if ok:
            values[rank] = pickle.loads(value)
        else:
            failures[rank] = value
    if failures:
        first = min(failures)
        raise AssertionError(f"rank {first} of {world_size} failed:\n{failures[first]}")
    if len(values) < world_size:
        missing = sorted(set(range(world_size)) - set(values))
        raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
    return [values[rank] for rank in range(world_size)]


def _crashed(processes, values) -> dict[int, str]:
    """Ranks whose process died without reporting (e.g. a segfault)."""
    return {
        rank: f"process exited with code {p.exitcode} without reporting"
        for rank, p in enumerate(processes)
        if p.exitcode not in (None, 0) and rank not in values
    }


def _stop(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=5)
