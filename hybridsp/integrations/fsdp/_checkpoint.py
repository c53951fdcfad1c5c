"""Checkpoints of an FSDP2-sharded model: sharded (DCP) for resuming, consolidated for ``save_pretrained``.

    save_sharded(directory, model, optimizer)      # every rank writes its shards (torch.distributed.checkpoint)
    load_sharded(directory, model, optimizer)      # any world size / U x R: DCP re-shards by parameter name
    full = full_state_dict(model)                   # plain CPU tensors on rank 0, {} elsewhere (a collective)

Note [sharded checkpoints]: the state dicts come from ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``get_optimizer_state_dict``), whose keys are parameter names and whose values
are DTensors: a checkpoint written on ``W`` ranks loads on any other number of ranks, and on any hybrid
mesh (FSDP2 shards over all ``DP x U x R`` ranks, so only ``W`` shapes the shards). Every rank must call
these functions (they are collectives over the default group).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

MODEL_KEY, OPTIMIZER_KEY = "model", "optimizer"


def save_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``model``'s (and ``optimizer``'s) shards under ``directory`` with DCP; every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, object] = {MODEL_KEY: get_model_state_dict(model)}
    if optimizer is not None:
        state[OPTIMIZER_KEY] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=str(directory))


def load_sharded(
    directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, weights: bool = True
) -> None:
    """Read what :func:`save_sharded` wrote: ``model``'s weights (unless ``weights=False``) and
    ``optimizer``'s state (if given; ``model`` is the model it optimizes). Every rank calls it; the world
    size and mesh may differ from the saving run's (Note [sharded checkpoints])."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state: dict[str, object] = {}
    if weights:
        state[MODEL_KEY] = get_model_state_dict(model)
    if optimizer is not None:
        state[OPTIMIZER_KEY] = get_optimizer_state_dict(model, optimizer)
    if not state:
        return
    dcp.load(state, checkpoint_id=str(directory))
    if weights:
        set_model_state_dict(model, state[MODEL_KEY])  # type: ignore[arg-type]
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[OPTIMIZER_KEY])  # type: ignore[arg-type]


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's parameters and buffers as plain CPU tensors on rank 0 (``{}`` on the other ranks),
    for ``save_pretrained(state_dict=...)``; a collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
