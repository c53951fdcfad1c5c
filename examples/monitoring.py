"""The ``"monitor"`` block of the ``"hybridsp"`` section in train.py: run health, the probe, the anomaly policy.

    "hybridsp": {"ulysses": 2, "ring": 2, "monitor": {"parity_every": 500, "on_anomaly": "skip"}}

Each step logs the health metrics of :class:`hybridsp.monitor.RunMonitor` into metrics.jsonl (and the PNG's
panels); every ``parity_every`` steps the exactness probe runs on the first row of the step's batch. The
loss of each micro-batch is judged *before* its backward (:class:`hybridsp.monitor.LossGuard`, every rank
alike): ``"stop"`` raises an error naming the last checkpoint; ``"skip"`` drops the step (no backward, no
optimizer step, on every rank); ``"rollback"`` reloads the last checkpoint, replays the steps after it and
skips the offending one. The guard's state and the skipped steps travel in the checkpoint, so resuming
after any of them is exact. ``skip`` and ``rollback`` need ``gradient_accumulation_steps`` 1 (a dropped
micro-batch would leave the earlier ones' gradients half accumulated).
"""

from __future__ import annotations

import math

import torch
from preflight import RunConfigError

STATE_KEY = "hybridsp_monitor"  # the checkpoint's client-state entry


class ExampleMonitor:
    """train.py's side of :class:`hybridsp.monitor.RunMonitor` (module docstring)."""

    def __init__(self, engine, mesh, block: dict, accumulation: int, save_dir) -> None:
        from hybridsp.monitor import MonitorConfig, RunMonitor

        config = MonitorConfig.from_dict(block)
        if config.on_anomaly != "stop" and accumulation != 1:
            raise RunConfigError(
                f"monitor on_anomaly={config.on_anomaly!r} needs gradient_accumulation_steps 1 (got {accumulation}); "
                f"use on_anomaly='stop' or one micro-batch per step"
            )
        self.engine, self.mesh, self.save_dir = engine, mesh, save_dir
        self.run = RunMonitor(engine.module, mesh, config)
        self.skipped: set[int] = set()  # steps whose update was dropped
        self.rollback_pending = False
        self.events: list[dict] = []
        self.last_checkpoint: str | None = None
        self.batch: dict | None = None

    def begin_step(self) -> None:
        self.run.begin_step()
        self.batch = None

    def admits(self, step: int, loss: torch.Tensor, batch: dict) -> bool:
        """Judge a micro-batch's loss before its backward: True to go on; False to drop it (skip or rollback)."""
        if self.batch is None:
            self.batch = batch
        if step in self.skipped:  # replaying after a rollback: the offending step stays skipped
            return False
        verdict = self.run.admit(step, float(loss.detach()))
        if verdict.decision == "ok":
            return True
        self.events.append({"step": step + 1, "event": verdict.reason, "decision": verdict.decision})
        if verdict.decision == "stop":
            raise RuntimeError(
                f"step {step + 1}: {verdict.reason}; the run stops (monitor on_anomaly). Last checkpoint: "
                f"{self.last_checkpoint or 'none saved yet'}"
            )
        self.skipped.add(step)
        self.rollback_pending = verdict.decision == "rollback"
        return False

    def end_step(self, step: int, loss: float) -> dict:
        """The step's health metrics, and the probe's on its interval (a collective)."""
        metrics, _ = self.run.end_step(step, loss if math.isfinite(loss) else 0.0, judge=False)  # judged in admits
        metrics.pop("hybridsp/loss", None)
        if self.run.parity_due(step + 1) and self.batch is not None:
            metrics.update(self.run.probe(self.batch))
        return metrics

    def rollback(self, replay) -> None:
        """Reload the last checkpoint and ``replay(step)`` every step after it up to the skipped one."""
        self.rollback_pending = False
        if self.last_checkpoint is None:
            raise RuntimeError("monitor on_anomaly='rollback' found no checkpoint to go back to: set --save-every")
        _, client = self.engine.load_checkpoint(str(self.save_dir), tag=self.last_checkpoint)
        self.load_state(client)
        for step in range(int(client["step"]), max(self.skipped) + 1):
            replay(step)

    def state(self, tag: str) -> dict:
        """The checkpoint's client-state entry (called as the checkpoint ``tag`` is saved)."""
        self.last_checkpoint = tag
        return {STATE_KEY: {"guard": self.run.guard.state_dict(), "skipped": sorted(self.skipped)}}

    def load_state(self, client_state: dict | None) -> None:
        saved = (client_state or {}).get(STATE_KEY)
        if saved:
            self.run.guard.load_state_dict(saved["guard"])
            self.skipped |= set(saved["skipped"])


def example_monitor(engine, mesh, config: dict, accumulation: int, save_dir):
    """An :class:`ExampleMonitor` for the config's ``"monitor"`` block, or None without one."""
    block = config.get("hybridsp", {}).get("monitor")
    return None if block is None else ExampleMonitor(engine, mesh, block, accumulation, save_dir)


HEALTH_PANELS = (  # metric, axis label, log scale
    ("hybridsp/straggler_ratio", "slowest / median step", False),
    ("hybridsp/imbalance", "busiest / mean ring slot", False),
    ("hybridsp/parity_max_rel", "probe: max rel. error", True),
)


def draw_health(axes, history: list[dict], loss_axis) -> None:
    """The health panels beside the loss: one axis per :data:`HEALTH_PANELS` entry; the steps the anomaly
    policy dropped are red lines there and red crosses on ``loss_axis``."""
    events = [r for r in history if "event" in r]
    if events:
        loss_axis.plot([r["step"] for r in events], [r["loss"] for r in events], "x", color="tab:red", label="dropped")
        loss_axis.legend()
    for axis, (key, label, log) in zip(axes, HEALTH_PANELS):
        rows = [r for r in history if key in r]
        axis.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o" if len(rows) < 30 else None)
        axis.set(xlabel="step", ylabel=label, title=key.split("/")[1])
        if log and rows:
            axis.set_yscale("log")
        for row in events:
            axis.axvline(row["step"], color="tab:red", alpha=0.4)
        axis.grid(alpha=0.3)
