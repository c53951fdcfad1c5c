"""Partitions written on other disks end up on rank 0's (hybridsp.integrations.deepspeed._checkpoint_files).

Separate disks are simulated by giving ranks different directories for the same tag; the bytes
rank 0 ends up with must equal what each rank wrote.
"""

from __future__ import annotations

import os

import pytest

from hybridsp.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.integration]


def _payload(rank: int, kind: str) -> bytes:
    return bytes((rank * 31 + i + len(kind)) % 251 for i in range(5000 + 777 * rank))


def _write_and_collect(rank, world, base, layouts):
    """For each disk layout (disk index per rank): write this rank's partition in its disk's tag
    folder and collect; returns what each collect reported."""
    from pathlib import Path

    from hybridsp.integrations.deepspeed import _checkpoint_files as checkpoint_collect

    checkpoint_collect.CHUNK_BYTES = 1000  # several chunks per file
    reported = []
    for case, disks in enumerate(layouts):
        tag_dir = Path(base) / f"case{case}" / f"disk{disks[rank]}" / "step1"
        tag_dir.mkdir(parents=True, exist_ok=True)
        for kind in ("optim", "model"):
            (tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt").write_bytes(_payload(rank, kind))
        reported.append(checkpoint_collect.collect_on_rank0(tag_dir))
    return reported


def _rank0_files(base, case: int) -> dict[str, bytes]:
    tag_dir = base / f"case{case}" / "disk0" / "step1"
    return {name: (tag_dir / name).read_bytes() for name in os.listdir(tag_dir)}


def test_partitions_from_other_disks_are_copied_to_rank0_and_a_shared_disk_copies_nothing(tmp_path):
    # case 0: ranks 1 and 2 share a disk that is not rank 0's, rank 3 has its own; case 1: one shared disk
    results = run_distributed(_write_and_collect, 4, str(tmp_path), [[0, 1, 1, 2], [0, 0, 0, 0]], timeout=120)
    assert results == [[[1, 2, 3], []]] * 4
    expected = {
        f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt": _payload(rank, kind)
        for rank in range(4)
        for kind in ("optim", "model")
    }
    for case in (0, 1):
        assert _rank0_files(tmp_path, case) == expected  # complete, and no marker or partial file left behind
