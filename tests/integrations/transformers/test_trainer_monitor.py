"""HybridSPTrainer with the section's "monitor" block: the health metrics and the probe's error reach
``log_history`` (hence TensorBoard / W&B), and watching changes nothing: the losses equal a run without it."""

from __future__ import annotations

import pytest

from hybridsp.testing import run_distributed
from tests.helpers.workers.monitor import train_with_monitor

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


def test_skip_and_rollback_are_refused_by_the_trainer_monitor():
    from hybridsp.integrations.transformers._monitor_callback import MonitorCallback
    from hybridsp.monitor import MonitorConfig

    with pytest.raises(ValueError, match="on_anomaly='stop' only"):
        MonitorCallback(None, MonitorConfig(on_anomaly="skip"))
