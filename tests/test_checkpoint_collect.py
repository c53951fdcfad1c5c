"""Partitions written on other disks end up on rank 0's (hybridsp.integrations.checkpoint_collect).

Separate disks are simulated by giving ranks different directories for the same tag; the bytes
rank 0 ends up with must equal what each rank wrote.
"""

from __future__ import annotations

import os

from hybridsp.testing import run_distributed


def _payload(rank: int, kind: str) -> bytes:
    return bytes((rank * 31 + i + len(kind)) % 251 for i in range(5000 + 777 * rank))


def _write_and_collect(rank, world, base, disks):
    from pathlib import Path

    from hybridsp.integrations import checkpoint_collect

    checkpoint_collect.CHUNK_BYTES = 1000  # several chunks per file
    tag_dir = Path(base) / f"disk{disks[rank]}" / "step1"
    tag_dir.mkdir(parents=True, exist_ok=True)
    for kind in ("optim", "model"):
        (tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt").write_bytes(_payload(rank, kind))
    return checkpoint_collect.collect_on_rank0(tag_dir)


def _rank0_files(base) -> dict[str, bytes]:
    tag_dir = base / "disk0" / "step1"
    return {name: (tag_dir / name).read_bytes() for name in os.listdir(tag_dir)}


def test_partitions_from_other_disks_are_copied_to_rank0(tmp_path):
    disks = [0, 1, 1, 2]  # ranks 1 and 2 share a disk that is not rank 0's; rank 3 has its own
    results = run_distributed(_write_and_collect, 4, str(tmp_path), disks, timeout=120)
    assert results == [[1, 2, 3]] * 4
    expected = {f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt": _payload(rank, kind)
                for rank in range(4) for kind in ("optim", "model")}
    assert _rank0_files(tmp_path) == expected  # complete, and no marker or partial file left behind


def test_shared_disk_copies_nothing(tmp_path):
    results = run_distributed(_write_and_collect, 2, str(tmp_path), [0, 0], timeout=120)
    assert results == [[], []]
    assert sorted(_rank0_files(tmp_path)) == sorted(
        f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt" for rank in range(2) for kind in ("optim", "model"))
