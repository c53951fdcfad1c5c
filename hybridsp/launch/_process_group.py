"""Start the default process group for scripts that do not build a DeepSpeed engine.

``init_process_group`` is what the long-context examples (``examples/score_long.py``,
``generate_long.py``, ``long_video.py``) call instead of a bare ``torch.distributed.init_process_group``:

- without a launcher (no ``WORLD_SIZE``) it starts a world of one on a free local port, so
  ``python examples/score_long.py`` runs on one process;
- it applies Note [gloo interface] (:func:`hybridsp.launch._gloo_interface.choose_gloo_interface`)
  before gloo picks the address it advertises to other hosts;
- it takes a collective ``timeout`` (seconds; torch's own default is 30 minutes on gloo), which
  :func:`hybridsp.init_mesh` then gives every group it builds (Note [group timeouts]);
- it adopts a process group that is already initialised (tests, a caller's own set-up).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import MutableMapping

import torch
import torch.distributed as dist

from hybridsp.launch._gloo_interface import choose_gloo_interface

DEFAULT_TIMEOUT_S = 300.0


def single_process_environment(environ: MutableMapping[str, str] | None = None) -> bool:
    """Where no launcher set ``WORLD_SIZE``: the environment of a world of one on a free local port.
    Returns whether it wrote anything."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env:
        return False
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=env.get("MASTER_PORT", str(port)),
    )
    return True


def local_device() -> torch.device:
    """``cuda:LOCAL_RANK`` (made current) where CUDA is available, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def init_process_group(timeout: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> torch.device:
    """The default process group (``backend``; default nccl on CUDA, gloo on CPU) with a ``timeout`` in
    seconds per collective; returns this rank's device (the CPU for gloo). A no-op (but for the device)
    when already initialised."""
    if not (timeout > 0):
        raise ValueError(f"the collective timeout must be a positive number of seconds; got {timeout}")
    device = local_device() if backend in (None, "nccl") else torch.device("cpu")
    if dist.is_initialized():
        return device
    single_process_environment()
    choose_gloo_interface()
    dist.init_process_group(
        backend or ("nccl" if device.type == "cuda" else "gloo"), timeout=datetime.timedelta(seconds=timeout)
    )
    return device
