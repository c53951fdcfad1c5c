"""Parameters that a training engine keeps sharded between uses, for code that uses them outside a
module call (the fused loss on ``lm_head.weight``, a tiled MLP's weights in its backward).

The core knows no engine. Each engine's glue lives in its integration and is found by the marker
the engine puts on its parameters (:data:`ENGINE_ADAPTERS`): DeepSpeed ZeRO-3 parameters carry
``ds_id`` and are served by :mod:`hybridsp.integrations.deepspeed._zero`. An adapter module
provides ``gathered(params)`` (a context manager in which the parameters hold their full data) and
``land_full_gradient(output, input_index, param)`` (the full gradient handed to a partitioned
parameter). It is imported only when such a parameter is seen; for plain parameters both calls
are no-ops, so this module imports nothing beyond torch.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import ContextManager, Iterable, cast

import torch

ENGINE_ADAPTERS: tuple[tuple[str, str], ...] = (  # (parameter marker attribute, adapter module)
    ("ds_id", "hybridsp.integrations.deepspeed._zero"),
)


def _adapter(param: torch.Tensor) -> ModuleType | None:
    """The adapter module of the engine that shards ``param``; None for a plain parameter."""
    for marker, module in ENGINE_ADAPTERS:
        if hasattr(param, marker):
            return importlib.import_module(module)
    return None


def gathered(params: Iterable[torch.Tensor]) -> ContextManager[object]:
    """A context manager in which every sharded parameter of ``params`` holds its full data (one
    collective of the parameters' engine for all of them; nothing for plain parameters)."""
    params = list(params)
    adapters = {id(a): a for a in map(_adapter, params) if a is not None}
    if not adapters:
        return contextlib.nullcontext()
    if len(adapters) > 1:
        raise ValueError(f"parameters of {len(adapters)} different engines in one block: shard a model with one engine")
    (adapter,) = adapters.values()
    return cast("ContextManager[object]", adapter.gathered(params))  # the adapter module's (untyped) function


def land_full_gradient(output: torch.Tensor, input_index: int, param: torch.Tensor) -> None:
    """Arm a sharded ``param`` so the full gradient that ``output``'s backward computes for it (its
    input number ``input_index``) lands as a module's backward would land it; nothing for a plain one."""
    adapter = _adapter(param)
    if adapter is not None:
        adapter.land_full_gradient(output, input_index, param)
