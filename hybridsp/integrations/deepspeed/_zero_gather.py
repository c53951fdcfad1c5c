"""Gather ZeRO-3 partitioned parameters for a block, the DeepSpeed way; a no-op for anything else.

ZeRO-3 keeps each rank's slice of a parameter in ``param.ds_tensor`` and an empty ``param.data``
between uses; ``deepspeed.zero.GatheredParameters`` all-gathers the full tensors for a block and
partitions them again at its end. Parameters that are already available (gathered by their
module's own DeepSpeed hooks) or that are not ZeRO-3 parameters at all are left alone, so code
that calls :func:`gathered` runs unchanged without DeepSpeed (which is imported only when a
ZeRO-3 parameter is seen).
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch


def gathered(params: Iterable[torch.Tensor]):
    """A context manager in which every ZeRO-3 parameter of ``params`` holds its full data.

    One all-gather for all of them (a collective over the parameters' partition group: every
    rank of it must enter the block the same number of times, in the same order).
    """
    pending = [p for p in params if hasattr(p, "ds_id")]
    if not pending:
        return contextlib.nullcontext()
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    pending = [p for p in pending if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if not pending:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(pending, modifier_rank=None)
