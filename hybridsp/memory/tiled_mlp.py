"""Deprecated path (keep-old-paths): use ``hybridsp.memory``; removed in hybridsp 0.3."""

from hybridsp._deprecated import moved_module

__getattr__ = moved_module(__name__, "hybridsp.memory._tiled_mlp", "hybridsp.memory")
