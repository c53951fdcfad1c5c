"""Integrations with other libraries, one package each; importing this package imports none of them.

``hybridsp.integrations.deepspeed``     DeepSpeed ZeRO 0-3 over the data-parallel x context ranks, the
                                        ``"hybridsp"`` config section, mesh-aware checkpoints.
``hybridsp.integrations.transformers``  Hugging Face transformers: ``apply(model, mesh)``, generation, the
                                        loss without logits, ``HybridSPTrainer``, PEFT, vision-language models.
``hybridsp.integrations.trl``           TRL's SFT, DPO, GRPO and RLOO trainers.

Each face imports its names on first use (:func:`lazy_exports`), so ``import hybridsp.integrations.trl``
does not import TRL until a trainer is asked for; the same names are imported under ``TYPE_CHECKING``
so type checkers and IDEs see their real types.
"""

from __future__ import annotations

import importlib
from typing import Callable

from hybridsp._deprecated import warn_deprecated


def lazy_exports(
    package: str, table: dict[str, str], deprecated: dict[str, tuple[str, str]] | None = None
) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``name`` is imported from ``table[name]`` on first use.

    ``deprecated`` maps names that left the face to ``(module, advice)``: they still resolve, with a
    ``DeprecationWarning`` that gives the advice (what to use instead).
    """
    deprecated = deprecated or {}

    def __getattr__(name: str) -> object:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        if name in deprecated:
            module, advice = deprecated[name]
            warn_deprecated(f"{package}.{name}", advice)
            return getattr(importlib.import_module(module), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
