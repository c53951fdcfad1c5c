"""TRL's SFT, DPO, GRPO and RLOO trainers with exact hybrid sequence parallelism: the public face.

    from hybridsp.integrations.trl import HybridSFTTrainer, HybridDPOTrainer
    from hybridsp.integrations.trl import HybridGRPOTrainer, HybridRLOOTrainer

Modules: ``trainers`` (SFT, DPO and their notes), ``grpo`` (GRPO, RLOO and their notes), ``rollouts``
(TRL's per-process arithmetic per replica, identical completions, right-aligned scoring rows),
``logprobs`` (TRL's fused log-prob calls sharded).
TRL is imported on first use of a trainer (``pip install -e ".[trl]"``).
"""

from __future__ import annotations

from hybridsp.integrations import lazy_exports

_EXPORTS = {
    "HybridSFTTrainer": "hybridsp.integrations.trl._trainers",
    "HybridDPOTrainer": "hybridsp.integrations.trl._trainers",
    "HybridGRPOTrainer": "hybridsp.integrations.trl._grpo",
    "HybridRLOOTrainer": "hybridsp.integrations.trl._grpo",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
