"""Trust in a run: the exactness probe, run health and the anomaly (rollback) policies.

- :func:`verify_parity` (also ``hybridsp.verify_parity`` and ``python -m hybridsp verify``): one
  sharded forward and backward of a switched model against plain float64 attention math, per layer;
  a :class:`ParityReport` of :class:`ParityRow` s, the same on every rank.
- :class:`MonitorConfig`: the ``"monitor"`` block of the ``"hybridsp"`` section.
- :class:`RunMonitor`: what a training loop calls around each step: :class:`HealthProbe` (straggler,
  imbalance, bytes, peak memory, non-finite layer), the probe every ``parity_every`` steps
  (:class:`ParityError` when it fails), and :class:`LossGuard` (``"stop"``, ``"skip"``, ``"rollback"``).

docs/verify.md tells the whole story.
"""

from hybridsp.monitor._config import MonitorConfig
from hybridsp.monitor._guard import LossGuard, Verdict
from hybridsp.monitor._health import HealthProbe
from hybridsp.monitor._probe import verify_parity
from hybridsp.monitor._report import ParityReport, ParityRow
from hybridsp.monitor._run import ParityError, RunMonitor

__all__ = [
    "HealthProbe",
    "LossGuard",
    "MonitorConfig",
    "ParityError",
    "ParityReport",
    "ParityRow",
    "RunMonitor",
    "Verdict",
    "verify_parity",
]
