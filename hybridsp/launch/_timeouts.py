"""The collective timeout of the default process group, for the groups built after it.

Note [group timeouts]: ``torch.distributed.new_group`` without ``timeout=`` does not inherit the
timeout given to ``init_process_group``; it takes torch's backend default (30 minutes on gloo,
10 on NCCL). The mesh's groups carry the ring's send/recv, the Ulysses all-to-all and ZeRO's
gathers, so ``init_process_group(timeout=30 s)`` (``examples/train.py --collective-timeout``)
bounded only the world group's collectives, and a rank waiting on a lost host inside the ring
waited 30 minutes (found by tests/mesh/test_two_hosts.py's lost host). :func:`default_group_timeout`
reads the default group's timeout so that :func:`hybridsp.init_mesh` gives every group the same.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def default_group_timeout() -> datetime.timedelta | None:
    """The timeout the default process group was initialised with; None where torch does not say."""
    if not dist.is_initialized():
        return None
    group = dist.group.WORLD
    for device in ("cuda", "cpu"):
        try:
            # no public getter in torch 2.x; a None group raises AttributeError, caught below
            timeout = group._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None
