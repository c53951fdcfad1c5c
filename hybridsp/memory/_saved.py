"""One offloaded checkpoint input: on the device until offloaded, then in host memory or on disk until
the backward restores it (the handle :class:`hybridsp.memory._offload.ActivationOffload`'s pack hook
returns for a marked input).

Note [strides]: a restored input has exactly the saved one's strides: the checkpoint recomputes the
layer from it, and a kernel that takes another path for other strides (``linear`` on a transposed
input) saves other tensors of the same shapes, which the non-reentrant checkpoint would pair with
the forward's without noticing (wrong gradients, found in review, for a transposed input and then
for a slice and an expanded one). So the offload moves the stretch of storage the tensor reaches
(``_aliases.storage_span``: a dense tensor's elements in storage order, a slice's with its gaps, an
expanded one's without the repeats) and restores it into ``_aliases.empty_with`` the saved
``Layout``: same shape, strides and address alignment (a kernel's vectorized loop splits a
misaligned tensor differently, which changes rounding). A slice with gaps moves its gaps too.

Note [in-place changes]: with saved-tensor hooks autograd no longer checks that a saved tensor was
left unchanged; the offload does, from the save on: a marked input whose version counter moved between
its save and the moment its copy is taken raises in the backward, as plain checkpointing does. That
moment is its offload on CPU (the copy is synchronous), its write on CPU's disk tier, its restore when
kept on the device, and on CUDA the completion of the side-stream copy: the handle holds the device
tensor (``copying``, detached: the version counter, not the graph) until the copy's event is seen
reached (polled at each layer's claim, waited for at the forward's end and by a restore) and then
compares the version. An in-place kernel launched before that moment
bumped the version on launch, so a copy it may have torn is caught; one launched later runs after the
copy. A change after the copy is seen done is not seen and does no harm: the backward uses the copy.

Note [disk]: with a disk tier (``spill_dir``) the offloaded inputs leave memory altogether
(:class:`hybridsp.memory._spill.DiskTier`): on CPU the tensor's span itself is handed to the writer
thread; on CUDA a pinned staging copy is, once the side stream's event says it is filled, and the
staging copy is allocated only once its write has a slot (``DiskTier.reserve``; an error before the
write gives the slot back). The backward's prefetch starts the read of the previous input (on CUDA;
the host-to-device copy follows in its restore); a restore waits for its read. The host memory the
offload fills drops to the copies in flight; the disk holds ``offloaded_bytes``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from hybridsp.memory._aliases import Layout, empty_with, layout_of, storage_span
from hybridsp.memory._spill import SpillFile, modified_in_place

if TYPE_CHECKING:
    from hybridsp.memory._offload import ActivationOffload


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


class SavedInput:
    """One marked input: on the device until offloaded, then on host (or disk) until restored.

    ``previous`` is the marked input saved just before this one (the next one the backward
    needs), for the prefetch; a handle owns its host copy (or its spill file), so a graph that is
    never backwarded frees everything with its saved tensors."""

    __slots__ = (
        "owner",
        "device_tensor",
        "host",
        "event",
        "prefetched",
        "previous",
        "spilled",
        "reading",
        "layout",
        "version",
        "changed",
        "copying",
        "__weakref__",
    )
    owner: ActivationOffload
    device_tensor: torch.Tensor | None
    host: torch.Tensor | None
    event: torch.cuda.Event | None
    prefetched: torch.Tensor | None
    previous: SavedInput | None
    spilled: Future[SpillFile] | None
    reading: Future[torch.Tensor] | None
    layout: Layout
    version: int
    changed: bool
    copying: torch.Tensor | None

    def __init__(self, owner: ActivationOffload, tensor: torch.Tensor) -> None:
        self.owner, self.device_tensor = owner, tensor
        self.host = self.event = self.prefetched = self.previous = self.spilled = self.reading = None
        self.copying = None
        self.layout, self.version, self.changed = layout_of(tensor), tensor._version, False

    def offload(self) -> None:
        """Copy to host (side stream on CUDA) or start writing it to disk; drop the device reference."""
        tensor, owner, disk = self.device_tensor, self.owner, self.owner.disk
        assert tensor is not None  # offloaded once, from the device
        self.changed = tensor._version != self.version  # Note [in-place changes]
        span = storage_span(tensor.detach())  # [n], Note [strides]
        if disk is not None and owner.stream is None:  # CPU: the span itself is written (Note [disk])
            self.spilled = disk.write(span, device=tensor.device, version=self.version)
        else:
            self._stage(tensor, span)
        self.device_tensor = None
        owner.stats.offloaded_tensors += 1
        owner.stats.offloaded_bytes += nbytes(span)
        if disk is not None:
            owner.stats.spilled_bytes += nbytes(span)

    def _stage(self, tensor: torch.Tensor, span: torch.Tensor) -> None:
        """``span`` to host memory, and with a disk tier on from there to disk (CUDA's staging copy,
        made only once its write has a slot; the slot is given back if anything before the write fails)."""
        disk = self.owner.disk
        if disk is not None:
            disk.reserve()
        try:
            host = self._copy_to_host(tensor, span)
        except BaseException:
            if disk is not None:
                disk.release()
            raise
        if disk is None:
            self.host = host
        else:  # the pinned copy goes to disk once the copy's event is reached
            self.spilled = disk.write(host, self.event, tensor.device, reserved=True)

    def _copy_to_host(self, tensor: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
        """``span`` ([n], of ``tensor``'s storage) in a new host tensor (copied on the side stream on CUDA)."""
        owner = self.owner
        host = owner.host_allocator(span.shape, span.dtype)  # [n]
        if owner.stream is None:
            return host.copy_(span)
        owner.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(owner.stream):
            host.copy_(span, non_blocking=True)
        tensor.record_stream(owner.stream)  # the block is not reused before the copy is done
        self.event = owner.stream.record_event()
        self.copying = tensor.detach()  # its version counter, not its graph, until the copy is done
        return host

    def settle(self, wait: bool = False) -> bool:
        """Whether the side-stream copy is done (``wait``: wait for it); once done, the device tensor is
        dropped and its version compared (Note [in-place changes])."""
        copying, event = self.copying, self.event
        if copying is None:
            return True
        assert event is not None  # recorded with the copy
        if wait:
            event.synchronize()
        elif not event.query():
            return False
        self.changed = self.changed or copying._version != self.version
        self.copying = None
        return True

    def _read_back(self) -> torch.Tensor:
        """The spilled tensor in host memory (pinned on CUDA), waiting for a read already started."""
        disk, spilled = self.owner.disk, self.spilled
        assert disk is not None and spilled is not None  # spilled
        reading, self.reading = self.reading, None
        if reading is None:
            reading = disk.read(spilled, pin=self.owner.stream is not None, layout=self.layout)
        return disk.result(reading)

    def _copy_back(self, device: torch.device) -> torch.Tensor:
        """The saved tensor on ``device`` with its layout (Note [strides])."""
        owner = self.owner
        if self.spilled is not None:  # read into a tensor with the saved layout
            host = self._read_back()
            if owner.stream is None:
                return host
            span = storage_span(host)  # [n]
        else:
            assert self.host is not None  # offloaded
            span = self.host  # [n]
        if owner.stream is None:
            restored = empty_with(self.layout, span.dtype, device)
            storage_span(restored).copy_(span)
            return restored
        with torch.cuda.stream(owner.stream):  # allocated on the stream that fills it
            restored = empty_with(self.layout, span.dtype, device)
            if self.spilled is None:
                assert self.event is not None  # recorded by the offload
                owner.stream.wait_event(self.event)  # the offload copy has finished
            storage_span(restored).copy_(span, non_blocking=True)
        self.event = owner.stream.record_event()
        return restored

    def prefetch(self) -> None:
        """Start bringing this input back (the read from disk; from host memory the copy itself)."""
        if self.device_tensor is not None or self.prefetched is not None:
            return
        if self.spilled is not None and self.owner.disk is not None:  # only the read: restore copies it over
            if self.reading is None:
                self.reading = self.owner.disk.read(self.spilled, pin=True, layout=self.layout)
        elif self.host is not None:
            self.prefetched = self._copy_back(self.owner.device)

    def restore(self) -> torch.Tensor:
        """The tensor on its device again; starts the prefetch of the previous one."""
        if self.device_tensor is not None:  # kept on the device (the newest inputs)
            if self.device_tensor._version != self.version:
                raise modified_in_place()  # Note [in-place changes]
            return self.device_tensor
        self.settle(wait=True)
        if self.changed:
            raise modified_in_place()
        restored, self.prefetched = self.prefetched, None
        if restored is None:
            restored = self._copy_back(self.owner.device)
        if self.owner.stream is not None:
            current = torch.cuda.current_stream(restored.device)
            assert self.event is not None  # recorded by the copy back
            current.wait_event(self.event)
            restored.record_stream(current)
        self.owner.stats.restored_tensors += 1
        if self.previous is not None and self.owner.prefetch and self.owner.stream is not None:
            self.previous.prefetch()  # on CPU the copy is synchronous: prefetching would only hold memory
        return restored
