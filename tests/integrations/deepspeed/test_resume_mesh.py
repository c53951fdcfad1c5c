"""The main job resumes a checkpoint on another world size and U x R (DeepSpeed's universal format).

cp4 (U2 x R2, 4 ranks) trains 4 steps with a checkpoint at step 2; the step-2 checkpoint resumed
on 2 ranks as U2 x R1 must give the uninterrupted run's losses at steps 3 and 4 (1e-3 relative).
Both runs are ``examples/train.py``'s ``main`` on gloo ranks (the same code a launcher runs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybridsp.integrations.deepspeed._checkpoint import SavedMesh, plan_resume
from hybridsp.mesh._hybrid_mesh import MeshShape
from hybridsp.testing import run_distributed
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.integration

SMALL_MODEL = [
    "--seq-len",
    "128",
    "--layers",
    "2",
    "--hidden-size",
    "64",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--no-plot",
    "--lr",
    "1e-3",
]


def _config(tmp: Path, stage: int) -> str:
    config = json.loads((ROOT / "ds_configs" / "cp4.json").read_text())
    config["zero_optimization"]["stage"] = stage
    path = tmp / f"cp4_zero{stage}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _train(rank, world, argv):
    sys.path.insert(0, str(ROOT / "examples"))
    import train

    train.main(argv)


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def _resume_on_fewer_ranks(tmp_path: Path, stage: int) -> tuple[dict, dict]:
    config = _config(tmp_path, stage)
    full, resumed = tmp_path / "cp4", tmp_path / "u2r1"
    run_distributed(
        _train,
        4,
        ["--deepspeed", config, *SMALL_MODEL, "--max-steps", "4", "--save-every", "2", "--save-dir", str(full)],
        timeout=400,
    )
    run_distributed(
        _train,
        2,
        [
            "--deepspeed",
            config,
            *SMALL_MODEL,
            "--max-steps",
            "4",
            "--ulysses",
            "2",
            "--ring",
            "1",
            "--resume-from",
            str(full / "step2"),
            "--save-dir",
            str(resumed),
        ],
        timeout=400,
    )
    return _losses(full), _losses(resumed)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [3, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_resume_cp4_checkpoint_on_two_ranks_as_u2r1(tmp_path, stage):
    uninterrupted, resumed = _resume_on_fewer_ranks(tmp_path, stage)
    assert sorted(resumed) == [3, 4], resumed
    for step in (3, 4):
        assert abs(resumed[step] - uninterrupted[step]) <= 1e-3 * abs(uninterrupted[step]), (
            step,
            resumed,
            uninterrupted,
        )
    assert (tmp_path / "cp4" / "step2_universal" / "zero").is_dir()


def _write_checkpoint(root: Path, saved: SavedMesh) -> Path:
    tag = root / "step2"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tag / "hybridsp_mesh.json").write_text(json.dumps(saved.__dict__))
    (root / "latest").write_text("step2")
    return root


@pytest.mark.parametrize(
    "saved,current,universal",
    [
        (SavedMesh(4, 2, 2, 3), MeshShape(4, 2, 2), False),  # same mesh
        (SavedMesh(4, 2, 2, 3), MeshShape(4, 4, 1), False),  # same world, other U x R: same ZeRO partitions
        (SavedMesh(4, 2, 2, 3), MeshShape(2, 2, 1), True),  # lost two ranks
        (SavedMesh(8, 4, 2, 1), MeshShape(4, 2, 1), True),
    ],
)
def test_plan_resume_chooses_direct_or_universal(tmp_path, saved, current, universal):
    plan = plan_resume(_write_checkpoint(tmp_path, saved), current, saved.zero_stage)
    assert plan.universal is universal and plan.tag == "step2"
    assert plan.load_tag == ("step2_universal" if universal else "step2")


def test_plan_resume_refuses_what_cannot_work_in_one_sentence(tmp_path):
    root = _write_checkpoint(tmp_path / "a", SavedMesh(4, 2, 2, 3))
    with pytest.raises(ValueError, match="written with ZeRO-3 and this run uses ZeRO-2"):
        plan_resume(root, MeshShape(2, 2, 1), 2)
    root0 = _write_checkpoint(tmp_path / "b", SavedMesh(4, 2, 2, 0))
    with pytest.raises(ValueError, match="resume it on 4 ranks"):
        plan_resume(root0, MeshShape(2, 2, 1), 0)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        plan_resume(tmp_path / "empty", MeshShape(2, 2, 1), 3)
