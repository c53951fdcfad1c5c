"""alst.compare's rank: one stack of :mod:`benchmarks.common.alst_stacks` trained under a per-rank memory cap.

With ``run.budget`` set, the rank sets the soft ``RLIMIT_DATA`` to its VmData plus the budget, after
the imports (``run.limit_from="imports"``) or after the engine build (default), mmaps every tensor of
256 KiB or more (longest.context's Note [malloc]) and gives hybridsp's activation offload host
copies in /dev/shm, which the limit does not count (``harness.shared_host_tensor``: host memory
is outside an accelerator's).
"""

from __future__ import annotations

from benchmarks.common import alst_stacks, harness
from benchmarks.common.harness import shared_host_tensor

MMAP_THRESHOLD = 256 * 1024


def capped_rank(rank: int, world: int, run: alst_stacks.Run) -> dict:
    """:func:`alst_stacks.train` under ``run.budget`` (no cap when it is None)."""
    run.check(world)
    capped = run.budget is not None
    if not capped:
        return alst_stacks.train(run, host_allocator=shared_host_tensor)
    harness.tensors_via_mmap(MMAP_THRESHOLD)
    if run.limit_from == "imports":
        harness.set_limit("data", harness.memory_status(), run.budget)

    def after_build(status: dict) -> None:
        if run.limit_from == "build":
            harness.set_limit("data", status, run.budget)

    try:
        return alst_stacks.train(run, after_build=after_build, host_allocator=shared_host_tensor)
    finally:
        harness.lift_limit("data")
