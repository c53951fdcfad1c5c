"""What a step's loss and gradients decide: go on, or the anomaly policy (Note [anomaly policy]).

Note [anomaly policy]: an *event* is a non-finite loss, a non-finite gradient norm, or a loss past
``spike_factor`` times the median of the last ``spike_window`` good losses (a spike; judged once the
window holds at least ``min(spike_window, 8)`` losses). Every rank must decide the same: the caller
passes values already reduced over the data-parallel group (the loss and gradient norm a trainer logs
are). The decision is the policy (``"stop"``, ``"skip"``, ``"rollback"``), except that
``max_events_in_row`` events in a row give ``"stop"``. A good step resets the count and joins the window.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

from hybridsp.monitor._config import MonitorConfig

Decision = Literal["ok", "stop", "skip", "rollback"]


@dataclass(frozen=True)
class Verdict:
    """One step's decision and, for an event, what happened (``reason``) and ``events_in_row``."""

    decision: Decision
    reason: str = ""
    events_in_row: int = 0


class LossGuard:
    """Judges each step's (loss, gradient norm) by Note [anomaly policy]; holds the window of good losses."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.losses: deque[float] = deque(maxlen=config.spike_window)
        self.events_in_row = 0
        self.events: list[tuple[int, str, Decision]] = []  # (step, reason, decision): every event logged

    def judge(self, step: int, loss: float, grad_norm: float | None = None) -> Verdict:
        """The decision for ``step``; records an event in :attr:`events`."""
        reason = self._reason(loss, grad_norm)
        if not reason:
            self.events_in_row = 0
            self.losses.append(loss)
            return Verdict("ok")
        self.events_in_row += 1
        decision: Decision = self.config.on_anomaly
        if self.events_in_row >= self.config.max_events_in_row:
            decision, reason = "stop", f"{reason}; {self.events_in_row} events in a row"
        self.events.append((step, reason, decision))
        return Verdict(decision, reason, self.events_in_row)

    def _reason(self, loss: float, grad_norm: float | None) -> str:
        if not math.isfinite(loss):
            return f"non-finite loss {loss}"
        if grad_norm is not None and not math.isfinite(grad_norm):
            return f"non-finite gradient norm {grad_norm}"
        if len(self.losses) >= min(self.config.spike_window, 8):
            median = statistics.median(self.losses)
            if median > 0 and loss > self.config.spike_factor * median:
                return f"loss spike {loss:.4g} > {self.config.spike_factor:g} x median {median:.4g}"
        return ""

    def state_dict(self) -> dict:
        """What a checkpoint keeps so that a resumed run judges the same (the window and the count)."""
        return {"losses": list(self.losses), "events_in_row": self.events_in_row}

    def load_state_dict(self, state: dict) -> None:
        self.losses = deque(state["losses"], maxlen=self.config.spike_window)
        self.events_in_row = int(state["events_in_row"])
