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
    less for an expanded one; 0 for an empty one). ``empty_with(layout_of(tensor))``'s span has exactly
    ``n`` elements, so copying a span into it restores the tensor with the same strides."""
    return tensor.as_strided((_reach(tensor.shape, tensor.stride()),), (1,))  # [n]


def _reach(shape: torch.Size, stride: tuple[int, ...]) -> int:
    """The elements of storage a view of ``shape`` and ``stride`` reaches from its first one (0 when empty)."""
    return 0 if any(n == 0 for n in shape) else 1 + sum((n - 1) * s for n, s in zip(shape, stride))


ALIGNMENT_BYTES = 256
"""The address alignment a restored tensor keeps: cuBLASLt picks its algorithm by pointer alignment up to
256 bytes; torch's CPU kernels split their vectorized loops at 64."""


class Layout(NamedTuple):
    """How a tensor sees its storage: ``shape``, ``stride``, and ``align``, its address modulo
    :data:`ALIGNMENT_BYTES`: a restored tensor starts at the same alignment, so a vectorized kernel (or
    cuBLASLt's algorithm choice) splits it the same way and rounds the same (a slice one fp64 element in
    came back aligned and gave gradients 1e-14 off plain checkpointing's)."""

    shape: torch.Size
    stride: tuple[int, ...]
    align: int


def layout_of(tensor: torch.Tensor) -> Layout:
    """``tensor``'s :class:`Layout` (from its address: a storage need not start aligned, e.g. ``frombuffer``)."""
    return Layout(tensor.shape, tensor.stride(), tensor.data_ptr() % ALIGNMENT_BYTES)


def dense_layout(shape: torch.Size) -> Layout:
    """The :class:`Layout` of a contiguous tensor of ``shape``, aligned."""
    return Layout(shape, torch.empty(shape, device="meta").stride(), 0)


def empty_with(
    layout: Layout, dtype: torch.dtype, device: torch.device | str = "cpu", pin: bool = False
) -> torch.Tensor:
    """An uninitialized tensor with ``layout``: its shape and strides, its :func:`storage_span` as long
    as the saved one's, starting at the saved alignment (an address that is not a whole number of
    elements from an aligned one, which no allocator hands out, starts at the allocator's alignment).
    Only a storage that does not start at the alignment wanted gets ``ALIGNMENT_BYTES`` more (pinned
    blocks round up to a power of two)."""
    shape, stride, align = layout
    reach = _reach(shape, stride)
    storage = torch.empty(reach, dtype=dtype, device=device, pin_memory=pin)  # [n]
    if storage.data_ptr() % ALIGNMENT_BYTES == align:
        return storage.as_strided(shape, stride, 0)  # the saved [shape] and strides
    storage = torch.empty(
        ALIGNMENT_BYTES // dtype.itemsize + reach, dtype=dtype, device=device, pin_memory=pin
    )  # [A + n]
    shift = (align - storage.data_ptr()) % ALIGNMENT_BYTES
    start = shift // dtype.itemsize if shift % dtype.itemsize == 0 else 0
    return storage.as_strided(shape, stride, start)  # the saved [shape] and strides
