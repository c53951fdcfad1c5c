"""Integrations with other libraries, one package each; importing this package imports none of them.

``hybridsp.integrations.deepspeed``     DeepSpeed ZeRO 0-3 over the data-parallel x context ranks, the
                                        ``"hybridsp"`` config section, mesh-aware checkpoints.
``hybridsp.integrations.transformers``  Hugging Face transformers: ``apply(model, mesh)``, generation, the
                                        loss without logits, ``HybridSPTrainer``, PEFT, ``vision/`` (Qwen2-VL).
``hybridsp.integrations.trl``           TRL's SFT, DPO, GRPO and RLOO trainers.

Each face exports its names lazily (:func:`lazy_exports`): ``import hybridsp.integrations.trl`` does not
import TRL until a trainer is asked for.
"""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, table: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that imports ``name`` from ``table[name]`` on first use."""

    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(table[name]), name)

    return __getattr__
