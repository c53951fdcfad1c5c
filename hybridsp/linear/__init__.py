"""Deprecated path (keep-old-paths): use ``hybridsp.linear_attention``; removed in hybridsp 0.3."""

from hybridsp._deprecated import moved_module

__getattr__ = moved_module(__name__, "hybridsp.linear_attention", "hybridsp.linear_attention")
