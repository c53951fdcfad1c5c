"""examples/train_video_dit.py as a user runs it: ``torchrun --nproc-per-node 2 ... --ulysses 2 --ring 1`` at a
small size (3 latent frames of 8 x 8, 48 video tokens) exits 0, writes ``metrics.jsonl`` (one finite loss per
step, falling) and the picture; on two meshes of 2 ranks (U2xR1, U1xR2) every step's loss equals a one-process
run's (``torchrun --nproc-per-node 1``), to 1e-5. Both are slow: one torchrun of 2 ranks took 19 s at load 6
(starting the ranks and importing diffusers is most of it), two to three of them 90 s at load 8."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers.example_runs import free_port, run_example
from tests.helpers.paths import ROOT

pytest.importorskip("diffusers")
pytest.importorskip("matplotlib")
pytestmark = [pytest.mark.distributed, pytest.mark.integration]

SCRIPT = str(ROOT / "examples" / "train_video_dit.py")
STEPS = 4
SMALL = ["--frames", "3", "--size", "8"]
JOB_SECONDS = 300  # a hang catcher
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _train(tmp_path: Path, name: str, ranks: int, ulysses: int, ring: int) -> list[float]:
    """Run the example under torchrun into tmp_path/name; exit 0, both files written; its per-step losses."""
    out = tmp_path / name
    launcher = ["torchrun", "--nproc-per-node", str(ranks), "--master-port", str(free_port())]
    degrees = ["--ulysses", str(ulysses), "--ring", str(ring)]
    result = run_example(
        [*launcher, SCRIPT, *degrees, "--steps", str(STEPS), *SMALL, "--out", str(out)], tmp_path, JOB_SECONDS
    )
    assert f"wrote {out / 'metrics.jsonl'} and {out / 'video_dit.png'}" in result.stdout, result.stdout[-2000:]
    assert (out / "video_dit.png").read_bytes()[:8] == PNG_SIGNATURE
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(STEPS))
    return [row["loss"] for row in rows]


@pytest.mark.slow
def test_torchrun_u2_trains_and_draws(tmp_path):
    """Two ranks, U2 x R1: exit 0, the picture, a finite loss per step, the last below the first."""
    losses = _train(tmp_path, "u2r1", 2, 2, 1)
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0], losses


@pytest.mark.slow
def test_meshes_of_two_ranks_equal_one_process(tmp_path):
    """U2xR1 and U1xR2 on 2 ranks against one process: every step's loss within 1e-5 (relative)."""
    alone = _train(tmp_path, "alone", 1, 1, 1)
    for ulysses, ring in ((2, 1), (1, 2)):
        sharded = _train(tmp_path, f"u{ulysses}r{ring}", 2, ulysses, ring)
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(sharded, alone)), (ulysses, ring, sharded, alone)
