"""TRL's SFT, DPO, GRPO and RLOO trainers with exact hybrid sequence parallelism: the public face.

    from hybridsp.integrations.trl import HybridSFTTrainer, HybridDPOTrainer
    from hybridsp.integrations.trl import HybridGRPOTrainer, HybridRLOOTrainer

Private modules: ``_trainers`` (SFT, DPO and their notes), ``_grpo`` (GRPO, RLOO and their notes), ``_rollouts``
(TRL's per-process arithmetic per replica, identical completions, right-aligned scoring rows),
``_logprobs`` (TRL's fused log-prob calls sharded).
TRL is imported on first use of a trainer (``pip install -e ".[trl]"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridsp.integrations import lazy_exports

if TYPE_CHECKING:
    from hybridsp.integrations.trl._grpo import HybridGRPOTrainer, HybridRLOOTrainer
    from hybridsp.integrations.trl._trainers import HybridDPOTrainer, HybridSFTTrainer

_EXPORTS = {
    "HybridSFTTrainer": "hybridsp.integrations.trl._trainers",
    "HybridDPOTrainer": "hybridsp.integrations.trl._trainers",
    "HybridGRPOTrainer": "hybridsp.integrations.trl._grpo",
    "HybridRLOOTrainer": "hybridsp.integrations.trl._grpo",
}

__all__ = ["HybridDPOTrainer", "HybridGRPOTrainer", "HybridRLOOTrainer", "HybridSFTTrainer"]

__getattr__ = lazy_exports(__name__, _EXPORTS)
