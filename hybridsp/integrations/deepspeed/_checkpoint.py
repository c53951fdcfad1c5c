"""DeepSpeed checkpoints that know their mesh, and resuming them on another mesh or world size.

    save_checkpoint(engine, mesh, save_dir, tag, client_state)       # DeepSpeed's save + hybridsp_mesh.json
    plan = plan_resume(load_dir, MeshShape(world, U, R), zero_stage)  # no communication
    if plan.universal:
        convert_to_universal(plan)                                    # rank 0 converts; a barrier
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
    engine = ...                                                      # deepspeed.initialize with that config
    engine.load_checkpoint(plan.load_dir, tag=plan.load_tag)

Note [resume on another mesh]: a ZeRO checkpoint is cut by the data-parallel world it was
written with (its optimizer partitions are per rank of DP x C), so a run that lost a node
cannot load it as it is. DeepSpeed's *universal* checkpoint is its mechanism for that: its own
converter (``deepspeed.checkpoint.ds_to_universal``) rewrites the partitions as one file per
parameter, and ``"checkpoint": {"load_universal": true}`` makes the engine re-partition them for
the world it runs on (ZeRO 1, 2 and 3). The ``C = U x R`` context ranks of a replica hold
identical weights, so any new ``U x R`` works. :func:`save_checkpoint` records the mesh in
``<tag>/hybridsp_mesh.json``; :func:`plan_resume` compares it with the current mesh and
chooses the direct or the universal path, and refuses with one sentence what cannot work (a
checkpoint without ZeRO partitions, a changed ZeRO stage).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from hybridsp.integrations.deepspeed._checkpoint_files import collect_on_rank0
from hybridsp.mesh._hybrid_mesh import HybridMesh, MeshShape

MESH_FILE = "hybridsp_mesh.json"
UNIVERSAL_SUFFIX = "_universal"


@dataclass(frozen=True)
class SavedMesh:
    """What a checkpoint was written with (``<tag>/hybridsp_mesh.json``)."""

    world_size: int
    ulysses: int
    ring: int
    zero_stage: int

    @classmethod
    def of(cls, shape: MeshShape, zero_stage: int) -> SavedMesh:
        return cls(shape.world_size, shape.ulysses, shape.ring, int(zero_stage))

    def describe(self) -> str:
        dp = self.world_size // (self.ulysses * self.ring)
        return f"{self.world_size} ranks (DP {dp} x ulysses {self.ulysses} x ring {self.ring}), ZeRO-{self.zero_stage}"


@dataclass(frozen=True)
class ResumeSource:
    """Where and how to load: ``engine.load_checkpoint(load_dir, tag=load_tag)``."""

    load_dir: Path
    tag: str
    universal: bool
    saved: SavedMesh | None

    @property
    def load_tag(self) -> str:
        return self.tag + UNIVERSAL_SUFFIX if self.universal else self.tag

    @property
    def tag_dir(self) -> Path:
        return self.load_dir / self.tag


def save_checkpoint(engine, mesh: HybridMesh, save_dir: str | Path, tag: str, client_state: dict) -> None:
    """``engine.save_checkpoint`` plus the mesh file of Note [resume on another mesh] (a collective).

    The client state also carries DeepSpeed's ``universal_checkpoint_info`` marker, which its
    converter requires of ZeRO-1/2 checkpoints. Note [complete before latest]: DeepSpeed's rank 0
    writes ``latest`` as soon as its own files are written, while other ranks (other hosts) may
    still be writing theirs; a host lost at that moment left ``latest`` naming a checkpoint with
    missing partitions. Here every rank finishes first (a barrier), the partitions written on
    other disks are copied to rank 0's (:mod:`hybridsp.integrations.deepspeed._checkpoint_files`), then rank
    0 writes the mesh file and only then points ``latest`` at the tag (atomically), so rank 0's
    ``latest`` always names a complete checkpoint. Ranks on other disks write the same two files
    there, so that a restart on every host finds its own partitions and ``latest``.
    """
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    marker = {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
    engine.save_checkpoint(str(save_dir), tag=tag, client_state={**marker, **client_state}, save_latest=False)
    dist.barrier()  # Note [complete before latest]
    elsewhere = collect_on_rank0(Path(save_dir) / tag)  # Note [node-local disks]
    rank = dist.get_rank()
    if rank == 0 or rank in elsewhere:  # other disks get the mesh file and `latest` too
        saved = SavedMesh.of(mesh.shape, engine.zero_optimization_stage())
        (Path(save_dir) / tag / MESH_FILE).write_text(json.dumps(asdict(saved)) + "\n")
        pending = Path(save_dir) / f"latest.tmp{rank}"
        pending.write_text(tag)
        pending.replace(Path(save_dir) / "latest")
    dist.barrier()


def latest_tag(load_dir: str | Path) -> str | None:
    """The tag DeepSpeed's ``latest`` file names in ``load_dir``, or None."""
    latest = Path(load_dir) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def split_checkpoint_path(path: str | Path) -> tuple[Path, str | None]:
    """A run directory (its ``latest`` tag) or one tag's folder inside it -> (load_dir, tag or None)."""
    path = Path(path)
    if (path / "latest").is_file() or not path.is_dir():
        return path, None
    if any(path.glob("*model_states.pt")):
        return path.parent, path.name
    return path, None


def read_saved_mesh(tag_dir: Path) -> SavedMesh | None:
    """The mesh a checkpoint recorded, or None for a checkpoint written without hybridsp's file."""
    path = tag_dir / MESH_FILE
    return SavedMesh(**json.loads(path.read_text())) if path.is_file() else None


def plan_resume(load_dir: str | Path, shape: MeshShape, zero_stage: int, tag: str | None = None) -> ResumeSource:
    """Decide how to resume ``load_dir`` (tag: its ``latest``) on ``shape``; no communication.

    Raises FileNotFoundError when there is no checkpoint, ValueError (one sentence saying what
    to change) when it cannot be resumed on this mesh.
    """
    load_dir, named = split_checkpoint_path(load_dir)
    tag = tag or named or latest_tag(load_dir)
    if tag is None or not (load_dir / tag).is_dir():
        raise FileNotFoundError(f"no checkpoint to resume in {load_dir} (no 'latest' file or tag folder)")
    saved = read_saved_mesh(load_dir / tag)
    current = SavedMesh.of(shape, zero_stage)
    if saved is None or saved == current:
        return ResumeSource(load_dir, tag, universal=False, saved=saved)
    if saved.zero_stage != current.zero_stage:
        raise ValueError(
            f"checkpoint {load_dir / tag} was written with ZeRO-{saved.zero_stage} and this run uses "
            f"ZeRO-{current.zero_stage}; resume it with a config of ZeRO stage {saved.zero_stage}"
        )
    if saved.zero_stage == 0:
        raise ValueError(
            f"checkpoint {load_dir / tag} was written by {saved.describe()} without ZeRO partitions, which "
            f"DeepSpeed cannot convert to another world; resume it on {saved.world_size} ranks"
        )
    if saved.world_size == current.world_size:  # ZeRO partitions over all DP x C ranks: the same partitions
        return ResumeSource(load_dir, tag, universal=False, saved=saved)
    return ResumeSource(load_dir, tag, universal=True, saved=saved)


def convert_to_universal(plan: ResumeSource) -> None:
    """Rank 0 runs DeepSpeed's converter once (skipped when done before); all ranks wait (a collective)."""
    target = plan.load_dir / plan.load_tag
    if dist.get_rank() == 0 and not (target / "zero").is_dir():
        from deepspeed.checkpoint import ds_to_universal

        args = argparse.Namespace(
            input_folder=str(plan.tag_dir),
            output_folder=str(target),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
        with contextlib.redirect_stdout(io.StringIO()):  # the converter prints every file it writes
            ds_to_universal.main(args)
    dist.barrier()
