"""Run health and the anomaly policy: the monitor block's checks, the loss guard's decisions (spike, non-finite,
events in a row, exact state after a resume), and on gloo ranks the straggler, the ring's work imbalance and
the first non-finite layer, each found on the rank where it was injected."""

from __future__ import annotations

import math

import pytest

from hybridsp.monitor import LossGuard, MonitorConfig
from hybridsp.testing import run_distributed
from tests.helpers.workers.parity import NAN_LAYER, health_steps

pytestmark = [pytest.mark.distributed, pytest.mark.integration]


@pytest.mark.parametrize(
    ("block", "words"),
    [
        ({"on_anomaly": "retry"}, "on_anomaly='retry'"),
        ({"parity_every": -1}, "parity_every=-1"),
        ({"spike_factor": 1.0}, "spike_factor=1.0"),
        ({"parity_evry": 5}, "unknown keys ['parity_evry']"),
    ],
)
def test_a_bad_monitor_block_is_refused_by_name(block, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        MonitorConfig.from_dict(block)


def test_the_guard_skips_a_spike_rolls_back_a_nan_and_stops_after_events_in_a_row():
    losses = [2.0, 1.9, 1.8, 1.9, 2.1, 1.7, 1.8, 1.9]
    skip = LossGuard(MonitorConfig.from_dict({"on_anomaly": "skip", "max_events_in_row": 2}))
    assert [skip.judge(i, x).decision for i, x in enumerate(losses)] == ["ok"] * len(losses)
    assert skip.judge(8, 20.0).decision == "skip"  # 20 > 4 x median
    assert skip.judge(9, 1.8).decision == "ok"  # a good step resets the count
    assert skip.judge(10, math.nan).decision == "skip"
    stopped = skip.judge(11, 1.0, grad_norm=math.inf)
    assert stopped.decision == "stop" and "2 events in a row" in stopped.reason
    assert [e[0] for e in skip.events] == [8, 10, 11]
    rollback = LossGuard(MonitorConfig.from_dict({"on_anomaly": "rollback"}))
    assert rollback.judge(0, math.inf).decision == "rollback"
    assert LossGuard(MonitorConfig()).judge(0, math.nan).decision == "stop"  # the default policy


def test_a_resumed_guard_judges_exactly_as_the_uninterrupted_one():
    config = MonitorConfig.from_dict({"on_anomaly": "skip", "spike_window": 5})
    straight, first = LossGuard(config), LossGuard(config)
    stream = [3.0, 2.5, 2.4, 2.6, 2.2, 2.3, 9.9, 2.1, math.nan, 2.0, 12.0, 1.9]
    for i, x in enumerate(stream[:6]):
        straight.judge(i, x), first.judge(i, x)
    resumed = LossGuard(config)
    resumed.load_state_dict(first.state_dict())
    assert [straight.judge(i, x) for i, x in enumerate(stream[6:])] == [
        resumed.judge(i, x) for i, x in enumerate(stream[6:])
    ]


@pytest.mark.slow
def test_the_sleeping_rank_the_nan_layer_and_the_imbalance_are_found():
    found = run_distributed(health_steps, 4, 2, 2, "zigzag", 2, 1)
    for rank_steps in found[1:]:
        assert rank_steps == found[0]  # every rank logs the same
    steps = found[0]
    assert all(s["hybridsp/straggler_rank"] == 2 and s["hybridsp/straggler_ratio"] > 1.5 for s in steps)
    assert all(s["hybridsp/imbalance"] < 1.05 for s in steps)  # zigzag balances causal work
    assert [s["hybridsp/nonfinite_layer"] for s in steps] == [-1, -1, NAN_LAYER]
    assert steps[2]["hybridsp/nonfinite_rank"] == 1
    assert all(s["hybridsp/peak_memory"] > 0 and s["hybridsp/attention_seconds"] > 0 for s in steps)


@pytest.mark.slow
def test_a_contiguous_layout_shows_its_imbalance():
    steps = run_distributed(health_steps, 2, 1, 2, "contiguous", -1, -1)[0]
    assert all(1.4 < s["hybridsp/imbalance"] < 1.6 for s in steps)  # slots see S^2/8 and 3 S^2/8 keys


def _events_in_a_row(rank, world):
    """RunMonitor.admit then end_step(judge=False), as a loop that drops steps does: two spikes in a row."""
    import torch

    from hybridsp import init_mesh
    from hybridsp.monitor import RunMonitor

    monitor = RunMonitor(torch.nn.Linear(2, 2), init_mesh(1, 1), MonitorConfig(on_anomaly="skip", max_events_in_row=2))
    decisions = []
    for step, loss in enumerate([1.0] * 8 + [100.0, 100.0]):
        monitor.begin_step()
        decisions.append(monitor.admit(step, loss).decision)
        monitor.end_step(step, 0.0 if decisions[-1] != "ok" else loss, judge=False)  # a dropped step logs 0
    return decisions, list(monitor.guard.losses)


def test_a_step_judged_before_its_backward_is_not_judged_again():
    """end_step(judge=False) leaves the guard alone: the second spike in a row stops the run, and the window
    holds each good loss once (judging again had reset the count and put the dropped step's 0 in the window)."""
    decisions, window = run_distributed(_events_in_a_row, 1, timeout=120)[0]
    assert decisions == ["ok"] * 8 + ["skip", "stop"], decisions
    assert window == [1.0] * 8
