"""The ``"monitor"`` block of the ``"hybridsp"`` section (DeepSpeed config, ``HybridSPTrainer(hybridsp=...)``,
``examples/train.py``), checked once::

    "monitor": {"parity_every": 2000, "on_parity_failure": "stop",
                "on_anomaly": "stop", "spike_factor": 4.0, "spike_window": 50, "max_events_in_row": 3}

``parity_every``: run the exactness probe on one micro-batch row every N optimizer steps (0: never; default
2,000, where its cost stays under 1% of the run: docs/verify.md);
``on_parity_failure``: ``"stop"`` (raise, naming layer and quantity) or ``"warn"``; ``on_anomaly``: what a
non-finite loss or gradient or a loss spike (past ``spike_factor`` times the median of the last
``spike_window`` losses) does: ``"stop"`` (the default: an error naming the last checkpoint), ``"skip"``
(that step's update is dropped on every rank) or ``"rollback"`` (reload the last good checkpoint, skip
the batch); ``max_events_in_row`` events in a row stop the run whatever the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, Mapping

AnomalyPolicy = Literal["stop", "skip", "rollback"]
ParityAction = Literal["stop", "warn"]
POLICIES: tuple[AnomalyPolicy, ...] = ("stop", "skip", "rollback")
DEFAULT_PARITY_EVERY = 2000  # the probe costs ~15 steps (benchmarks e2e.monitor_cost): < 1% at this interval


@dataclass(frozen=True)
class MonitorConfig:
    """The checked ``"monitor"`` block (see the module docstring for each field)."""

    parity_every: int = DEFAULT_PARITY_EVERY
    on_parity_failure: ParityAction = "stop"
    on_anomaly: AnomalyPolicy = "stop"
    spike_factor: float = 4.0
    spike_window: int = 50
    max_events_in_row: int = 3

    @classmethod
    def from_dict(cls, block: Mapping[str, Any] | None) -> MonitorConfig:
        """The block as given (None: the defaults); ValueError naming an unknown key or a bad value."""
        block = dict(block or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(block) - known)
        if unknown:
            raise ValueError(f'unknown keys {unknown} in the hybridsp "monitor" block; it takes {sorted(known)}')
        config = cls(**block)
        config.check()
        return config

    def check(self) -> None:
        """ValueError quoting the value and saying what to change."""
        if self.on_anomaly not in POLICIES:
            raise ValueError(f"monitor on_anomaly={self.on_anomaly!r}: use one of {list(POLICIES)}")
        if self.on_parity_failure not in ("stop", "warn"):
            raise ValueError(f"monitor on_parity_failure={self.on_parity_failure!r}: use 'stop' or 'warn'")
        for name in ("parity_every", "spike_window", "max_events_in_row"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "parity_every" else 1):
                raise ValueError(
                    f"monitor {name}={value!r}: give a whole number >= {0 if name == 'parity_every' else 1}"
                )
        if not self.spike_factor > 1.0:
            raise ValueError(
                f"monitor spike_factor={self.spike_factor!r}: give a number > 1 (a multiple of the median)"
            )
