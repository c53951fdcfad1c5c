"""Trust in a run: the exactness probe, run health and the rollback policies.

- :func:`verify_parity` (also ``hybridsp.verify_parity`` and ``python -m hybridsp verify``): one
  sharded forward and backward of a switched model against plain float64 attention math, per layer;
  a :class:`ParityReport` of :class:`ParityRow` s, the same on every rank.

docs/verify.md tells the whole story.
"""

from hybridsp.monitor._probe import verify_parity
from hybridsp.monitor._report import ParityReport, ParityRow

__all__ = ["ParityReport", "ParityRow", "verify_parity"]
