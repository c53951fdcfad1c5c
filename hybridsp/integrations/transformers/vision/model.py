"""Deprecated path (keep-old-paths): use ``hybridsp.integrations.transformers``; removed in hybridsp 0.3."""

from hybridsp._deprecated import moved_module

__getattr__ = moved_module(
    __name__, "hybridsp.integrations.transformers._vision.model", "hybridsp.integrations.transformers"
)
