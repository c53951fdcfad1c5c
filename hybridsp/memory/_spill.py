"""The activation offload's disk tier: offloaded inputs written to unlinked files on a local disk.

At the memory frontier the offloaded checkpoint inputs outgrow host memory before the device runs out:
Llama-3-8B at 7.6M tokens on 8 H100 keeps ~239 GiB of them per GPU in host memory (the planner's
breakdown), ~1.9 TiB of a node's 2 TiB, and split checkpointing keeps two per layer. A step there
takes hours, so the few GB/s of a local NVMe drive carry the traffic easily.
:class:`DiskTier` takes them out of memory altogether: each offloaded tensor's bytes go to its own
file in ``directory``, unlinked as soon as it is opened (nothing is left behind by a crash; the space
is freed when the handle closes, with the graph that saved it), written and read back by one
background thread so the forward and the backward go on meanwhile.

Note [what stays in memory]: the process keeps a file descriptor per tensor. The bytes pass through
the kernel's page cache, which the kernel writes back and may evict (it is not the process's resident
memory, but in a container it is charged to the cgroup until evicted). Writes and reads are plain
``pwrite``/``preadv`` of the tensor's bytes (short counts continued), so every dtype round-trips
bitwise; the offload writes a saved tensor's storage span and reads it back into a tensor with the
saved layout (``_aliases.storage_span``, ``_aliases.empty_with``).

Note [in flight]: at most ``max_writes_in_flight`` writes are queued (default 2): a forward that
outruns the disk waits for the oldest instead of holding every not-yet-written tensor (on CPU the
tensor itself, on CUDA its pinned staging copy, which the offload allocates only after
:meth:`DiskTier.reserve` has a slot for it). The one worker runs jobs in order, so the backward's
first read waits for every earlier write. On CUDA the worker sets the tensors' device first (no
context on device 0 from every rank).

Note [in-place changes]: a tensor changed in place after it was saved (autograd's version counter
moved from the ``version`` its writer recorded when it saved it) while it waits to be written raises
when read back, as autograd does without saved-tensor hooks (with hooks it checks nothing). A change
after the write is not seen and does no harm: the read returns the bytes written.

Note [failures]: a write that fails (disk full, too many open files, I/O error) is raised, with the
directory named and the remedy for its errno, when
the tensor is read back in the backward, or already at :meth:`DiskTier.check` (the offload's
``__exit__``, the end of the forward) if it has finished by then: a full disk stops the step with a
clear error, it never corrupts it.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import torch

from hybridsp._formulas import SPILL_WRITES_IN_FLIGHT
from hybridsp.memory._aliases import Layout, dense_layout, empty_with, storage_span

_PREFIX = "hybridsp_spill_"
_Done = TypeVar("_Done")
_REMEDY = {
    errno.ENOSPC: "free space there or pass another spill_dir",
    errno.EDQUOT: "free space there or pass another spill_dir",
    errno.EMFILE: "raise the open-file limit (ulimit -n; one descriptor per offloaded tensor)",
    errno.ENFILE: "raise the system's open-file limit (one descriptor per offloaded tensor)",
    errno.EACCES: "make it writable or pass another spill_dir",
}


def modified_in_place() -> RuntimeError:
    """The error for a saved tensor changed in place before it was kept (Note [in-place changes])."""
    return RuntimeError(
        "an offloaded activation was modified in place after it was saved for the backward (autograd's "
        "version counter moved): the step's gradients would be wrong; do not modify a checkpointed "
        "layer's input in place"
    )


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy: [numel * itemsize] uint8."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data  # [N] bytes


class SpillFile:
    """One tensor's bytes in an unlinked file; the descriptor closes with this object (or at once
    when the write fails)."""

    def __init__(self, directory: str, tensor: torch.Tensor, version: int) -> None:
        self.shape, self.dtype, self.nbytes = tensor.shape, tensor.dtype, tensor.numel() * tensor.element_size()
        data = _bytes_of(tensor.contiguous())
        handle, path = tempfile.mkstemp(dir=directory, prefix=_PREFIX)
        os.unlink(path)
        self._closer = weakref.finalize(self, os.close, handle)
        self.fd, written = handle, 0
        try:
            while written < self.nbytes:
                written += os.pwrite(handle, data[written:], written)
        except OSError:
            self.close()  # at once: a traceback may keep this object alive
            raise
        self.changed = tensor._version != version  # Note [in-place changes]

    def read(self, pin: bool, layout: Layout | None = None) -> torch.Tensor:
        """The tensor again on the host (pinned when ``pin``): contiguous, or with ``layout`` (the bytes
        are its storage span, ``_aliases.storage_span``)."""
        if self.changed:
            raise modified_in_place()
        restored = empty_with(layout if layout is not None else dense_layout(self.shape), self.dtype, pin=pin)
        data, done = _bytes_of(storage_span(restored)), 0
        if len(data) != self.nbytes:
            raise ValueError(f"a layout reaching {len(data)} bytes cannot hold the {self.nbytes} bytes written")
        while done < self.nbytes:
            got = os.preadv(self.fd, [data[done:]], done)
            if got == 0:
                raise OSError(errno.EIO, f"spill file ended after {done} of {self.nbytes} bytes")
            done += got
        return restored

    def close(self) -> None:
        self._closer()


class DiskTier:
    """Unlinked files in ``directory`` for the activation offload, written and read by one thread.

    Args:
        directory: an existing, writable directory on a local disk (NVMe scratch); not ``/dev/shm``
            or another memory-backed file system, which would keep the bytes in memory.
        max_writes_in_flight: writes queued before :meth:`write` waits for the oldest (Note [in flight]).
    """

    def __init__(self, directory: str | os.PathLike[str], max_writes_in_flight: int = SPILL_WRITES_IN_FLIGHT) -> None:
        path = os.fspath(directory)
        if not os.path.isdir(path):
            raise ValueError(f"spill_dir {path!r} is not a directory: create it, or pass an existing one")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"spill_dir {path!r} is not writable by this process: pass a directory it can write")
        if not isinstance(max_writes_in_flight, int) or max_writes_in_flight < 1:
            raise ValueError(f"max_writes_in_flight must be an integer >= 1; got {max_writes_in_flight!r}")
        self.directory, self.max_writes_in_flight = path, max_writes_in_flight
        self._pool: ThreadPoolExecutor | None = None
        self._writes = threading.Condition()
        self._in_flight = 0
        self._failure: BaseException | None = None

    def _executor(self, device: torch.device | None = None) -> ThreadPoolExecutor:
        if self._pool is None:
            cuda = device is not None and device.type == "cuda"
            on_device = partial(torch.cuda.set_device, device) if cuda else None
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridsp-spill", initializer=on_device)
        return self._pool

    def reserve(self) -> None:
        """Wait for a free slot among the writes in flight and take it (Note [in flight]); a
        :meth:`write` with ``reserved=True`` uses it, :meth:`release` gives it back unused."""
        with self._writes:
            self._writes.wait_for(lambda: self._in_flight < self.max_writes_in_flight)
            self._in_flight += 1

    def release(self) -> None:
        """Give back a slot (a reserved one unused, or a finished write's)."""
        with self._writes:
            self._in_flight -= 1
            self._writes.notify_all()

    def write(
        self,
        tensor: torch.Tensor,
        ready: Any = None,
        device: torch.device | None = None,
        *,
        version: int | None = None,
        reserved: bool = False,
    ) -> Future[SpillFile]:
        """Start writing ``tensor`` (a CPU tensor; kept alive until written). ``ready``: an event the
        writer waits on first (the copy from ``device`` that fills ``tensor``). ``version``: the
        version counter's value when it was saved (default: now); the read raises if it has moved by
        the time the bytes are written (Note [in-place changes]). ``reserved``: a slot is already
        taken (:meth:`reserve`)."""
        if not reserved:
            self.reserve()
        saved_version = tensor._version if version is None else version

        def job() -> SpillFile:
            if ready is not None:
                ready.synchronize()
            return SpillFile(self.directory, tensor, saved_version)

        try:
            future = self._executor(device).submit(job)
        except BaseException:
            self.release()  # nothing will finish it
            raise
        future.add_done_callback(self._written)
        return future

    def _written(self, future: Future[SpillFile]) -> None:
        with self._writes:
            if self._failure is None and not future.cancelled() and future.exception() is not None:
                self._failure = future.exception()
        self.release()

    def read(self, spilled: Future[SpillFile], pin: bool = False, layout: Layout | None = None) -> Future[torch.Tensor]:
        """Start reading a written tensor back into host memory (``layout``: :meth:`SpillFile.read`)."""
        return self._executor().submit(lambda: self.result(spilled).read(pin, layout))

    def result(self, job: Future[_Done]) -> _Done:
        """What a write or read made; a failed one raises naming the directory and the remedy."""
        try:
            return job.result()
        except OSError as error:
            remedy = _REMEDY.get(error.errno or 0, "check the disk, or pass another spill_dir")
            raise RuntimeError(
                f"an offloaded activation's file in spill_dir {self.directory!r} failed: {error}; {remedy}"
            ) from error

    def check(self, wait: bool = False) -> None:
        """Raise the first write that failed so far (``wait``: after every write started so far is done;
        otherwise the unfinished ones are checked when read back)."""
        if wait and self._pool is not None:
            self._pool.submit(lambda: None).result()  # the one worker runs jobs in order
        with self._writes:
            failure, self._failure = self._failure, None
        if failure is not None:
            failed: Future[None] = Future()
            failed.set_exception(failure)
            self.result(failed)

    def clear_failures(self) -> None:
        """Forget the failures not raised yet (a step that stopped early left them; the next starts clean)."""
        with self._writes:
            self._failure = None

    def close(self) -> None:
        """Stop the thread (after the queued work)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._failure = None
