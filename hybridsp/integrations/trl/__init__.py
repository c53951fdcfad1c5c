"""TRL's SFT and DPO trainers with exact hybrid sequence parallelism: the public face.

    from hybridsp.integrations.trl import HybridSFTTrainer, HybridDPOTrainer

Modules: ``trainers`` (the trainers and their notes), ``logprobs`` (TRL's fused log-prob calls sharded).
TRL is imported on first use of a trainer (``pip install -e ".[trl]"``).
"""

from __future__ import annotations

from hybridsp.integrations import lazy_exports

_EXPORTS = {
    "HybridSFTTrainer": "hybridsp.integrations.trl.trainers",
    "HybridDPOTrainer": "hybridsp.integrations.trl.trainers",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
