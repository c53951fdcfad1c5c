"""HybridSPTrainer with the section's "monitor" block: the health metrics and the probe's error reach
``log_history`` (hence TensorBoard / W&B), and watching changes nothing: the losses equal a run without it."""

from __future__ import annotations

import math

import pytest

from hybridsp.testing import run_distributed
from tests.helpers.workers.monitor import SPIKE_STEP, train_with_monitor, train_with_policy

pytestmark = [pytest.mark.integration, pytest.mark.distributed]


@pytest.mark.slow
@pytest.mark.parametrize("fsdp2", [False, True], ids=["zero1", "fsdp2"])
def test_the_monitor_logs_health_and_parity_and_changes_no_loss(fsdp2):
    watched = run_distributed(train_with_monitor, 2, 1, 2, {"parity_every": 2}, fsdp2)[0]
    plain = run_distributed(train_with_monitor, 2, 1, 2, None, fsdp2)[0]
    assert watched["loss"] == plain["loss"] and len(plain["loss"]) == 4
    rows = watched["hybridsp"]
    assert len(rows) == 4 and all("hybridsp/straggler_ratio" in r and r["hybridsp/bytes_sent"] > 0 for r in rows)
    assert [r["step"] for r in rows if "hybridsp/parity_max_rel" in r] == [2, 4]
    assert all(r["hybridsp/parity_max_rel"] < 1e-5 for r in rows if "hybridsp/parity_max_rel" in r)


def _policy_runs(sharding: str, tmp_path) -> dict:
    skip = run_distributed(train_with_policy, 2, sharding, "skip", str(tmp_path / "skip"), 5)[0]
    rollback = run_distributed(train_with_policy, 2, sharding, "rollback", str(tmp_path / "rollback"), 4)[0]
    resumed = run_distributed(
        train_with_policy, 2, sharding, "skip", str(tmp_path / "resumed"), 5, str(tmp_path / "skip" / "checkpoint-5")
    )[0]
    return {"skip": skip, "rollback": rollback, "resumed": resumed}


def _check_policies(runs: dict) -> None:
    skip, rollback, resumed = runs["skip"], runs["rollback"], runs["resumed"]
    assert skip["dropped"] == rollback["dropped"] == [SPIKE_STEP], (skip["dropped"], rollback["dropped"])
    assert skip["loss"][SPIKE_STEP - 1] > 4 * skip["loss"][SPIKE_STEP - 2]  # the spike was logged, not hidden
    assert skip["sums"][SPIKE_STEP] == skip["sums"][SPIKE_STEP - 1], "skip changed the weights on the dropped step"
    assert rollback["sums"][SPIKE_STEP] == rollback["sums"][SPIKE_STEP - 1]  # back to checkpoint-4 = step 4
    after = slice(SPIKE_STEP, None)  # steps 6 and 7
    assert rollback["loss"][after] == skip["loss"][after], (rollback["loss"], skip["loss"])
    assert resumed["step"][after] == skip["step"][after] and resumed["loss"][after] == skip["loss"][after]
    assert all(math.isfinite(x) for x in skip["loss"][after])


@pytest.mark.parametrize(
    "sharding", ["ddp", pytest.param("zero1", marks=pytest.mark.slow), pytest.param("fsdp2", marks=pytest.mark.slow)]
)
def test_skip_and_rollback_drop_the_spike_and_resume_exactly(sharding, tmp_path):
    """A loss spike at step 5 (logits x 50): ``skip`` leaves the weights as after step 4, ``rollback`` reloads
    checkpoint-4 and reaches the same losses on steps 6-7, and a run resumed from checkpoint-5 (saved after
    the dropped step, with the guard's window) logs the same steps 6-7 as the uninterrupted one."""
    _check_policies(_policy_runs(sharding, tmp_path))


def test_skip_and_rollback_need_one_micro_batch_per_step():
    from types import SimpleNamespace

    from hybridsp.integrations.transformers._monitor_callback import MonitorCallback
    from hybridsp.monitor import MonitorConfig

    trainer = SimpleNamespace(args=SimpleNamespace(gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match="on_anomaly='skip' needs gradient_accumulation_steps 1 \\(got 2\\)"):
        MonitorCallback(trainer, MonitorConfig(on_anomaly="skip"))
    MonitorCallback(trainer, MonitorConfig(on_anomaly="stop"))  # stop judges at the step's end: any accumulation
