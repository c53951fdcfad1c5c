"""One object a training loop calls around each step: health, the periodic probe, the anomaly policy.

    monitor = RunMonitor(model, mesh, MonitorConfig.from_dict(section.get("monitor")))
    monitor.begin_step()
    ...forward, backward...
    metrics, verdict = monitor.end_step(step, loss, grad_norm, position_ids=local["position_ids"])
    if verdict.decision == "stop": raise ...          # "skip" / "rollback": monitor.admit(step, loss) before
                                                      # the backward, then end_step(..., judge=False)

``end_step`` returns the health metrics (:mod:`._health`), ``hybridsp/parity_max_rel`` on the steps the
probe ran (``parity_every``; call :meth:`RunMonitor.probe` with the step's full batch), and the
:class:`~hybridsp.monitor._guard.Verdict` of Note [anomaly policy]. A failed probe raises (or warns).
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from hybridsp._comm import CommCounter
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
        modules = [m for m in model.modules() if hasattr(m, "_hybridsp_binding")]  # what apply() switched, by its mark
        self._own_counter = counter is None and mesh.comm_counter is None  # count bytes unless someone already does
        if self._own_counter:
            mesh.comm_counter = CommCounter()
        self.health = HealthProbe(mesh, modules, counter if counter is not None else mesh.comm_counter)
        self.guard = LossGuard(self.config)
        self.last_report: ParityReport | None = None
        self.positions: torch.Tensor | None = None  # the step's first position_ids, for the imbalance
        self._positions_hook = model.register_forward_pre_hook(self._remember_positions, with_kwargs=True)

    def _remember_positions(self, module, args, kwargs) -> None:
        if self.positions is None and torch.is_tensor(kwargs.get("position_ids")):
            self.positions = kwargs["position_ids"].detach()

    def begin_step(self) -> None:
        self.positions = None
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
        judge: bool = True,
    ) -> tuple[dict[str, float], Verdict]:
        """The step's health metrics and the anomaly verdict (a collective over the data x context group).

        ``loss``: this replica's loss of the step (averaged over the data-parallel replicas here, so every
        rank decides alike); ``position_ids``: default the ones the model's first forward of the step got;
        ``judge=False``: the loss was judged already (before the backward, :meth:`admit`), the verdict is "ok"
        and the guard is left as it is."""
        positions = position_ids if position_ids is not None else self.positions
        metrics = self.health.end_step(positions, window)
        if positions is None:
            del metrics["hybridsp/imbalance"]
        loss = _replica_mean(loss, self.mesh)
        metrics["hybridsp/loss"] = loss
        return metrics, self.guard.judge(step, loss, grad_norm) if judge else Verdict("ok")

    def admit(self, step: int, loss: float) -> Verdict:
        """Judge a step's loss before its backward (``"skip"`` / ``"rollback"`` need that): this replica's
        loss, averaged over the replicas here (a collective over the data group), so every rank decides alike.
        The step's :meth:`end_step` then takes ``judge=False``."""
        return self.guard.judge(step, _replica_mean(loss, self.mesh))

    def close(self) -> None:
        """Take every hook off the model."""
        self.health.remove()
        self._positions_hook.remove()
        if self._own_counter:
            self.mesh.comm_counter = None


def _replica_mean(value: float, mesh: HybridMesh) -> float:
    """``value`` averaged over the data-parallel replicas (one all_reduce; NaN and inf carry through)."""
    if mesh.dp == 1:
        return float(value)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=mesh.data_group)
    return float(tensor.item()) / mesh.dp
