"""The activation offload's disk tier: offloaded inputs written to unlinked files on a local disk.

At the memory frontier the offloaded checkpoint inputs outgrow host memory before the device runs out:
Llama-3-8B at 7.6M tokens on 8 H100 keeps ~239 GiB of them per GPU in host memory (the planner's
breakdown), ~1.9 TiB of a node's 2 TiB, and split checkpointing keeps two per layer. A step there
takes hours, so the few GB/s of a local NVMe drive carry the traffic easily.
:class:`DiskTier` takes them out of memory altogether: each offloaded tensor's bytes go to its own
file in ``directory``, unlinked as soon as it is opened (nothing is left behind by a crash; the space
is freed when the handle closes, with the graph that saved it), written and read back by one
background thread so the forward and the backward go on meanwhile.

Note [what stays in memory]: the file's pages pass through the kernel's page cache (which the kernel
may evict; it is not the process's memory); the process keeps only a file descriptor per tensor.
Writes and reads are plain ``pwrite``/``preadv`` of the tensor's bytes, so every dtype round-trips
bitwise.

Note [failures]: a write that fails (disk full, I/O error) is raised, with the directory named, when
the tensor is read back in the backward, or already at :meth:`DiskTier.check` (the offload's
``__exit__``, the end of the forward) if it has finished by then: a full disk stops the step with a
clear error, it never corrupts it.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

_PREFIX = "hybridsp_spill_"
_Done = TypeVar("_Done")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy: [numel * itemsize] uint8."""
    return tensor.view(torch.uint8).reshape(-1).numpy().data  # [N] bytes


class SpillFile:
    """One tensor's bytes in an unlinked file; the descriptor closes with this object."""

    def __init__(self, directory: str, tensor: torch.Tensor) -> None:
        self.shape, self.dtype, self.nbytes = tensor.shape, tensor.dtype, tensor.numel() * tensor.element_size()
        handle, path = tempfile.mkstemp(dir=directory, prefix=_PREFIX)
        os.unlink(path)
        self._closer = weakref.finalize(self, os.close, handle)
        self.fd = handle
        data, written = _bytes_of(tensor.contiguous()), 0
        try:
            while written < self.nbytes:
                written += os.pwrite(handle, data[written:], written)
        except OSError:
            self.close()  # at once: a traceback may keep this object alive
            raise

    def read(self, pin: bool) -> torch.Tensor:
        """The tensor again, contiguous, on the host (pinned when ``pin``)."""
        restored = torch.empty(self.shape, dtype=self.dtype, pin_memory=pin)
        data, done = _bytes_of(restored), 0
        while done < self.nbytes:
            got = os.preadv(self.fd, [data[done:]], done)
            if got == 0:
                raise OSError(f"spill file ended after {done} of {self.nbytes} bytes")
            done += got
        return restored

    def close(self) -> None:
        self._closer()


class DiskTier:
    """Unlinked files in ``directory`` for the activation offload, written and read by one thread.

    Args:
        directory: an existing, writable directory on a local disk (NVMe scratch); not ``/dev/shm``
            or another memory-backed file system, which would keep the bytes in memory.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        path = os.fspath(directory)
        if not os.path.isdir(path):
            raise ValueError(f"spill_dir {path!r} is not a directory: create it, or pass an existing one")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"spill_dir {path!r} is not writable by this process: pass a directory it can write")
        self.directory = path
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[SpillFile]] = []

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridsp-spill")
        return self._pool

    def write(self, tensor: torch.Tensor, ready: Any = None) -> Future[SpillFile]:
        """Start writing ``tensor`` (a CPU tensor; kept alive until written). ``ready``: an event the
        writer waits on first (the device-to-host copy that fills ``tensor``)."""

        def job() -> SpillFile:
            if ready is not None:
                ready.synchronize()
            return SpillFile(self.directory, tensor)

        future = self._executor().submit(job)
        self._pending = [f for f in self._pending if not f.done()] + [future]
        return future

    def read(self, spilled: Future[SpillFile], pin: bool = False) -> Future[torch.Tensor]:
        """Start reading a written tensor back into host memory."""
        return self._executor().submit(lambda: self.result(spilled).read(pin))

    def result(self, job: Future[_Done]) -> _Done:
        """What a write or read made; a failed one raises naming the directory."""
        try:
            return job.result()
        except OSError as error:
            raise RuntimeError(
                f"an offloaded activation's file in spill_dir {self.directory!r} failed: {error}; free space "
                "there or pass another spill_dir"
            ) from error

    def check(self, wait: bool = False) -> None:
        """Raise the first finished write that failed (the unfinished ones are checked when read, or
        here with ``wait``: every write started so far is waited for)."""
        for future in self._pending:
            if wait or future.done():
                self.result(future)
        self._pending = [f for f in self._pending if not f.done()]

    def close(self) -> None:
        """Stop the thread (after the queued work)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
