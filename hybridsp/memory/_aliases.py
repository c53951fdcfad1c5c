"""Whether two tensors are the same elements seen the same way.

DeepSpeed ZeRO-3's module hooks hand a module ``input.detach()`` and pass its output on as
``output.detach()``: new tensor objects on the same storage. Code that follows a tensor through such
hooks (the activation offload's marked inputs, the norm rebuild's recorded forward) matches by where
the elements are, not by identity. The activation offload moves a saved tensor as the stretch of
storage it reaches (:func:`storage_span`), so that any strides (a slice's gaps, an expansion's zero
strides) come back as they were.
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


def storage_span(tensor: torch.Tensor) -> torch.Tensor:
    """The stretch of ``tensor``'s storage its elements reach, as one contiguous 1-D view: ``[n]``, with
    ``n = 1 + sum((size - 1) * stride)`` (``numel`` for a dense tensor in any order; more for a slice,
    less for an expanded one; 0 for an empty one). ``empty_strided(shape, stride)`` has exactly ``n``
    elements of storage, so copying a span into its span restores the tensor with the same strides."""
    reach = 0 if tensor.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return tensor.as_strided((reach,), (1,))  # [n]
