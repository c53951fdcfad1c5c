"""examples/train.py with the section's "monitor" block: health metrics and the probe in metrics.jsonl and the
PNG, and the anomaly policies on an injected loss spike: "skip" drops the step, "rollback" reloads the last
checkpoint and replays to the same weights, and resuming after the event is exact. Both runs are the example's
``main`` on gloo ranks; the spike is a monkeypatch of the loss inside the worker."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybridsp.testing import run_distributed
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

SMALL = ["--seq-len", "64", "--layers", "2", "--hidden-size", "32", "--heads", "4", "--kv-heads", "2", "--lr", "1e-3"]
SPIKE_STEP = 3  # 0-based: the fourth step's loss is multiplied by 50


def _config(tmp: Path, policy: str) -> str:
    config = json.loads((ROOT / "ds_configs" / "cp2.json").read_text())
    config["hybridsp"].update(ulysses=1, ring=2)
    config["hybridsp"]["monitor"] = {"parity_every": 2, "on_anomaly": policy, "spike_window": 2}
    path = tmp / f"{policy}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _train_with_spike(rank, world, argv):
    sys.path.insert(0, str(ROOT / "examples"))
    import train

    import hybridsp

    original_step, original_loss = train.train_step, hybridsp.sharded_cross_entropy
    current = {}

    def step(engine, mesh, windows, index, *args, **kwargs):
        current["step"] = index
        return original_step(engine, mesh, windows, index, *args, **kwargs)

    def loss(*args, **kwargs):
        value = original_loss(*args, **kwargs)
        return value * 50 if current.get("step") == SPIKE_STEP else value

    train.train_step, hybridsp.sharded_cross_entropy = step, loss
    try:
        train.main(argv)
    finally:
        train.train_step, hybridsp.sharded_cross_entropy = original_step, original_loss


def _rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _run(tmp: Path, policy: str, name: str, *extra: str) -> dict[int, dict]:
    out = tmp / name
    argv = [
        "--deepspeed",
        _config(tmp, policy),
        *SMALL,
        "--max-steps",
        "6",
        "--save-every",
        "2",
        "--save-dir",
        str(out),
    ]
    run_distributed(_train_with_spike, 2, [*argv, *extra], timeout=600)
    return _rows(out)


@pytest.mark.slow
def test_skip_and_rollback_drop_the_spike_and_resuming_is_exact(tmp_path):
    skipped = _run(tmp_path, "skip", "skip")
    assert skipped[SPIKE_STEP + 1]["decision"] == "skip" and "loss spike" in skipped[SPIKE_STEP + 1]["event"]
    assert all("event" not in skipped[s] for s in skipped if s != SPIKE_STEP + 1)
    assert all("hybridsp/straggler_ratio" in r and "hybridsp/imbalance" in r for r in skipped.values())
    assert [s for s, r in skipped.items() if "hybridsp/parity_max_rel" in r] == [2, 4, 6]
    assert all(r["hybridsp/parity_max_rel"] < 1e-4 for r in skipped.values() if "hybridsp/parity_max_rel" in r)
    assert (tmp_path / "skip" / "loss.png").exists()
    rolled = _run(tmp_path, "rollback", "rollback")
    assert rolled[SPIKE_STEP + 1]["decision"] == "rollback"
    for step in (5, 6):  # back to step 2, step 3 replayed, step 4 skipped: the same weights as skipping
        assert rolled[step]["loss"] == pytest.approx(skipped[step]["loss"], rel=1e-6, abs=0)
    resumed = _run(tmp_path, "skip", "resumed", "--resume-from", str(tmp_path / "skip" / "step4"))
    for step in (5, 6):
        assert resumed[step]["loss"] == pytest.approx(skipped[step]["loss"], rel=1e-6, abs=0)


def test_a_bad_monitor_block_is_one_error_before_training(tmp_path):
    config = json.loads((ROOT / "ds_configs" / "cp2.json").read_text())
    config["hybridsp"]["monitor"] = {"on_anomaly": "retry"}
    from hybridsp.integrations.deepspeed import HybridConfig

    with pytest.raises(ValueError, match="on_anomaly='retry'"):
        HybridConfig.from_ds_config(config)
