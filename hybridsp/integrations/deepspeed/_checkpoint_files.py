"""Every rank's checkpoint files on rank 0's disk, also when the hosts have disks of their own.

Note [node-local disks]: under ZeRO every rank writes its own partition files
(``zero_pp_rank_<rank>_mp_rank_00_{optim,model}_states.pt``; hybridsp's ZeRO group is all
DP x U x R ranks, so the partition index is the global rank) into ``<save_dir>/<tag>`` on *its
own host's* disk. With node-local disks a lost host takes its partitions with it, and no other
host can resume. :func:`collect_on_rank0` finds out, without configuration, which ranks do not
see rank 0's disk (rank 0 writes a marker with a random name; a rank that cannot see it writes
elsewhere) and copies those ranks' partition files to rank 0 over the process group, so that rank
0's run directory always holds a complete checkpoint. On a shared filesystem nothing is copied
(one small broadcast, one all-gather and two barriers). The copy goes through ``send_object_list``
in chunks of :data:`CHUNK_BYTES` (on NCCL a chunk passes through the current GPU).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist

MARKER_PREFIX = ".hybridsp-rank0-disk-"
CHUNK_BYTES = 64 * 2**20


def partition_files(tag_dir: Path, rank: int) -> list[Path]:
    """The files DeepSpeed wrote for ``rank``'s ZeRO partition in ``tag_dir``."""
    return sorted(path for path in tag_dir.glob(f"zero_pp_rank_{rank}_mp_rank_*") if path.is_file())


def ranks_without_rank0_disk(tag_dir: Path) -> list[int]:
    """Ranks whose ``tag_dir`` is not rank 0's (a collective on every rank)."""
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    marker = tag_dir / f"{MARKER_PREFIX}{token[0]}"
    if dist.get_rank() == 0:
        marker.write_text("")
    dist.barrier()
    sees = [None] * dist.get_world_size()
    dist.all_gather_object(sees, marker.is_file())
    dist.barrier()
    if dist.get_rank() == 0:
        marker.unlink()
    return [rank for rank, seen in enumerate(sees) if not seen]


def _send(tag_dir: Path) -> None:
    files = partition_files(tag_dir, dist.get_rank())
    dist.send_object_list([[(path.name, path.stat().st_size) for path in files]], dst=0)
    for path in files:
        with path.open("rb") as source:
            while chunk := source.read(CHUNK_BYTES):
                dist.send_object_list([chunk], dst=0)


def _receive(tag_dir: Path, rank: int) -> None:
    listing: list[Any] = [None]  # filled with the rank's [(name, size), ...]
    dist.recv_object_list(listing, src=rank)
    for name, size in listing[0]:
        partial = tag_dir / f"{name}.partial"
        with partial.open("wb") as sink:
            written = 0
            while written < size:
                chunk: list[Any] = [None]  # filled with bytes
                dist.recv_object_list(chunk, src=rank)
                sink.write(chunk[0])
                written += len(chunk[0])
        partial.replace(tag_dir / name)


def collect_on_rank0(tag_dir: str | Path) -> list[int]:
    """Note [node-local disks]: copy the partitions of ranks that write elsewhere into rank 0's
    ``tag_dir`` (a collective on every rank); returns those ranks (empty on shared storage)."""
    tag_dir = Path(tag_dir)
    remote = ranks_without_rank0_disk(tag_dir)
    for rank in remote:
        if dist.get_rank() == rank:
            _send(tag_dir)
        elif dist.get_rank() == 0:
            _receive(tag_dir, rank)
    return remote
