"""Host-process settings for CPU runs: freed memory goes back to the OS; ranks share the cores.

Note [flat RSS]: with glibc's defaults, a training step's large temporary buffers come from
malloc arenas that keep freed memory and fragment; a 300-step soak of the main job on 8 CPU
ranks then showed each rank's RSS swinging by ~20-30 MiB from step to step and drifting by
up to 5.7% between step 50 and step 300 (benchmarks/results/soak/soak.md). Serving allocations of
128 KiB and more by mmap (given back on free), trimming the heap top at 128 KiB and keeping
two arenas made the same soak's RSS flat (max +0.5% per rank) and ~80 MiB lower per rank.
The settings apply to this process only (``mallopt``); on anything but glibc this does nothing.

Note [threads per rank]: a launcher starts one process per rank; each would use as many torch
threads as the machine has cores, so 8 CPU ranks on 2 cores ran 16 busy compute threads, and
every collective waited for descheduled peers. :func:`share_cpu_cores` gives each of the
node's ranks ``cores // ranks per node`` threads (at least 1) unless ``OMP_NUM_THREADS`` says
otherwise, as torchrun does and as ``hybridsp.testing`` does for the tests. The ranks per node
come from :mod:`hybridsp.launch._launcher` (DeepSpeed's launcher says ``LOCAL_SIZE``, not
``LOCAL_WORLD_SIZE``: reading only the latter ran 16 threads for 8 ranks on 2 cores).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
import traceback

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_THRESHOLD_BYTES = 128 * 1024


def return_freed_memory_to_os() -> bool:
    """Apply Note [flat RSS]; returns whether glibc accepted every setting."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    settings = ((_M_MMAP_THRESHOLD, _THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, _THRESHOLD_BYTES), (_M_ARENA_MAX, 2))
    return all(mallopt(option, value) == 1 for option, value in settings)


def share_cpu_cores() -> int:
    """Note [threads per rank] (CPU runs only); returns the torch thread count now in force."""
    import torch

    if torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    from hybridsp.launch import ranks_per_node

    ranks = ranks_per_node(1)  # LOCAL_SIZE under deepspeed, LOCAL_WORLD_SIZE under torchrun, ...
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    return torch.get_num_threads()


@contextlib.contextmanager
def end_rank_on_error():
    """Note [prompt exit]: a rank that fails (e.g. a collective timed out on a lost host) prints its
    traceback and ends at once (``os._exit(1)``), skipping interpreter teardown.

    Measured on two network namespaces (tests/mesh/test_two_hosts.py, ``--collective-timeout 30``):
    after host B vanished, host A's job took 86 s to end although its ring receive timed out after
    30 s — the interpreter's teardown of the process groups waits on operations still pending
    with the dead host; with this, it ends within 60 s (the timeout, the step in flight and the
    launcher's clean-up). Clean exits (``SystemExit``, e.g. the one-line config errors) are left
    alone.
    """
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:  # any failure ends this rank now
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def close_process_group() -> None:
    """A finished rank's clean end: every rank done, then the default process group destroyed before the
    interpreter exits. Left to exit-time destructors, gloo's worker threads once aborted a rank that had
    finished and saved ("terminate called without an active exception", exit 250: an SFT example run in
    the test suite)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
