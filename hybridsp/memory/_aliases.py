"""Whether two tensors are the same elements seen the same way, and how to rebuild one's view.

DeepSpeed ZeRO-3's module hooks hand a module ``input.detach()`` and pass its output on as
``output.detach()``: new tensor objects on the same storage. Code that follows a tensor through such
hooks (the activation offload's marked inputs, the norm rebuild's recorded forward) matches by where
the elements are, not by identity. The activation offload moves a saved tensor as the stretch of
storage it reaches (:func:`storage_span`) and restores it into :func:`empty_with` its :class:`Layout`,
so that any strides (a slice's gaps, an expansion's zero strides) and the address alignment come back as
they were.
"""

from __future__ import annotations

from typing import NamedTuple

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


ALIGNMENT_BYTES = 64
"""The address alignment a restored tensor keeps (torch's CPU allocator guarantees 64 bytes, CUDA's more)."""


class Layout(NamedTuple):
    """How a tensor sees its storage: ``shape``, ``stride``, and ``offset``, its storage offset modulo
    :data:`ALIGNMENT_BYTES` (in elements): a restored tensor starts at the same address alignment, so a
    vectorized kernel splits it the same way and rounds the same (a slice one fp64 element in otherwise
    came back 64-byte aligned and gave gradients 1e-14 off plain checkpointing's)."""

    shape: torch.Size
    stride: tuple[int, ...]
    offset: int


def layout_of(tensor: torch.Tensor) -> Layout:
    """``tensor``'s :class:`Layout`."""
    per_alignment = max(1, ALIGNMENT_BYTES // tensor.element_size())
    return Layout(tensor.shape, tensor.stride(), int(tensor.storage_offset()) % per_alignment)


def dense_layout(shape: torch.Size) -> Layout:
    """The :class:`Layout` of a contiguous tensor of ``shape``."""
    return Layout(shape, torch.empty(shape, device="meta").stride(), 0)


def empty_with(
    layout: Layout, dtype: torch.dtype, device: torch.device | str = "cpu", pin: bool = False
) -> torch.Tensor:
    """An uninitialized tensor with ``layout`` (its :func:`storage_span` as long as the saved one's)."""
    shape, stride, offset = layout
    reach = 0 if any(n == 0 for n in shape) else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    storage = torch.empty(offset + reach, dtype=dtype, device=device, pin_memory=pin)  # [offset + n]
    return storage.as_strided(shape, stride, offset)  # the saved [shape] and strides
