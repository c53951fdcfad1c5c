"""One object a training loop calls around each step: health, the periodic probe, the anomaly policy.

    monitor = RunMonitor(model, mesh, MonitorConfig.from_dict(section.get("monitor")))
    monitor.begin_step()
    ...forward, backward...
    metrics, verdict = monitor.end_step(step, loss, grad_norm, position_ids=local["position_ids"])
    if verdict.decision == "skip": optimizer.zero_grad()  # "rollback": reload the last checkpoint

``end_step`` returns the health metrics (:mod:`._health`), ``hybridsp/parity_max_rel`` on the steps the
probe ran (``parity_every``; call :meth:`RunMonitor.probe` with the step's full batch), and the
:class:`~hybridsp.monitor._guard.Verdict` of Note [anomaly policy]. A failed probe raises (or warns).
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
from torch import nn

from hybridsp.mesh._hybrid_mesh import HybridMesh
from hybridsp.monitor._config import MonitorConfig
from hybridsp.monitor._guard import LossGuard, Verdict
from hybridsp.monitor._health import HealthProbe
from hybridsp.monitor._probe import verify_parity
from hybridsp.monitor._report import ParityReport


class ParityError(RuntimeError):
    """The probe found the sharded run off its float64 reference (the message names layer, quantity, rank)."""


class RunMonitor:
    """Health every step, the probe every ``parity_every`` steps, the anomaly policy (module docstring)."""

    def __init__(self, model: nn.Module, mesh: HybridMesh, config: MonitorConfig | None = None, counter=None) -> None:
        self.model, self.mesh, self.config = model, mesh, config or MonitorConfig()
        modules = [m for m in model.modules() if hasattr(m, "_hybridsp_binding")]
        self.health = HealthProbe(mesh, modules, counter if counter is not None else mesh.comm_counter)
        self.guard = LossGuard(self.config)
        self.last_report: ParityReport | None = None

    def begin_step(self) -> None:
        self.health.begin_step()

    def parity_due(self, step: int) -> bool:
        every = self.config.parity_every
        return every > 0 and step % every == 0

    def probe(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """Run the probe on the first row of ``batch`` (the full batch); ``{"hybridsp/parity_max_rel": ...}``."""
        row = {k: v[:1] for k, v in batch.items() if torch.is_tensor(v)}
        report = verify_parity(self.model, self.mesh, row)
        self.last_report = report
        worst_rel = max(e.rel_error for r in (*report.rows, report.loss) for e in r.entries())
        if not report.ok:
            worst = report.worst
            where = "the loss" if worst.layer is None else f"layer {worst.layer}"
            message = (
                f"hybridsp parity probe failed at {where}, {worst.quantity}: relative error {worst.rel_error:.3g} "
                f"> tolerance {worst.tolerance:.3g} (rank {worst.rank})\n{report.table()}"
            )
            if self.config.on_parity_failure == "stop":
                raise ParityError(message)
            warnings.warn(message, stacklevel=2)
        return {"hybridsp/parity_max_rel": worst_rel}

    def end_step(
        self,
        step: int,
        loss: float,
        grad_norm: float | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        window: int | None = None,
    ) -> tuple[dict[str, float], Verdict]:
        """The step's health metrics and the anomaly verdict (a collective over the data x context group)."""
        metrics = self.health.end_step(position_ids, window)
        return metrics, self.guard.judge(step, loss, grad_norm)

    def close(self) -> None:
        self.health.remove()
