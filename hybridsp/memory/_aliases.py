"""Whether two tensors are the same elements seen the same way.

DeepSpeed ZeRO-3's module hooks hand a module ``input.detach()`` and pass its output on as
``output.detach()``: new tensor objects on the same storage. Code that follows a tensor through such
hooks (the activation offload's marked inputs, the norm rebuild's recorded forward) matches by where
the elements are, not by identity.
"""

from __future__ import annotations

import torch


def same_elements(a: object, b: torch.Tensor) -> bool:
    """``a`` is ``b``, or a tensor viewing the same elements the same way (an alias such as ``b.detach()``:
    same device, dtype, shape, strides, storage and offset)."""
    if a is b:
        return True
    return (
        isinstance(a, torch.Tensor)
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )
