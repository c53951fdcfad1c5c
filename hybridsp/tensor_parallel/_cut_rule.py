"""What :func:`~hybridsp.tensor_parallel._model_split.tensor_parallel` did to a model, and the one rule that cuts
a full tensor into this rank's shard (used to split in place, to load a checkpoint shard, to compare a gradient).

A split parameter is cut along one dim ``d``. Most are one block: rank ``t`` of ``T`` keeps the ``t``-th of ``T``
equal chunks. A fused parameter is several blocks along ``d`` (Phi-3's ``qkv_proj`` rows ``[H*D | Hkv*D | Hkv*D]``,
a concatenated ``gate_up_proj`` ``[I | I]``): each block is chunked ``T`` ways and the rank's chunks are
concatenated in block order, so the shard has the same fused layout over ``1/T`` of each block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

PLAN_ATTR = "_hybridsp_tensor"  # the attribute of a split model that holds its plan


@dataclass
class TensorSplit:
    """Which parameter is split along which dim (``split_dims``), fused block sizes where not one block
    (``split_blocks``), and the hooks installed (``handles``)."""

    tensor: int
    rank: int
    sequence_parallel: bool
    split_dims: dict[str, int] = field(default_factory=dict)  # parameter name -> split dim
    split_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> block sizes along the dim
    handles: list = field(default_factory=list)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of parameter ``name`` given its full tensor (the tensor itself when replicated)."""
        if name not in self.split_dims:
            return full
        return take_shard(full, self.split_dims[name], self.split_blocks.get(name), self.tensor, self.rank)


def take_shard(full: torch.Tensor, dim: int, blocks: tuple[int, ...] | None, tensor: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``1/tensor`` of every block of ``full`` along ``dim``, concatenated (a view for one block;
    meta tensors stay meta)."""
    if blocks is None:
        return full.chunk(tensor, dim=dim)[rank]
    pieces = [block.chunk(tensor, dim=dim)[rank] for block in full.split(list(blocks), dim=dim)]
    return torch.cat(pieces, dim=dim)


def split_parameter(
    module: nn.Module, attr: str, name: str, plan: TensorSplit, dim: int, blocks: tuple[int, ...] | None = None
) -> None:
    """Replace ``module.<attr>`` by this rank's shard (a new parameter, ``requires_grad`` kept) and record it
    in ``plan`` under the full name ``name``."""
    param = getattr(module, attr)
    with torch.no_grad():
        piece = take_shard(param, dim, blocks, plan.tensor, plan.rank).clone()
    setattr(module, attr, nn.Parameter(piece, requires_grad=param.requires_grad))
    plan.split_dims[name] = dim
    if blocks is not None:
        plan.split_blocks[name] = tuple(blocks)


def tensor_plan(model: nn.Module) -> TensorSplit | None:
    """The :class:`TensorSplit` of a model :func:`~hybridsp.tensor_parallel._model_split.tensor_parallel` changed,
    else None."""
    return getattr(model, PLAN_ATTR, None)
