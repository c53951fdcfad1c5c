"""Deprecated path (keep-old-paths): use ``hybridsp.tensor_parallel``; removed in hybridsp 0.3."""

from hybridsp._deprecated import moved_module

__getattr__ = moved_module(__name__, "hybridsp.tensor_parallel._model_split", "hybridsp.tensor_parallel")
