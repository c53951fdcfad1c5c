"""Run health every step, cheap: per-rank step and attention time, the straggler, the ring's work
imbalance, bytes sent, peak memory, and where non-finite values first appear.

:class:`HealthProbe` puts a forward pre-hook and hook on each attention module of a model (undone by
:meth:`HealthProbe.remove`): they time the module (CUDA events on a GPU, no synchronisation until the
step ends) and keep one flag per layer for a non-finite output, on the device. :meth:`HealthProbe.end_step`
then sends one small vector per rank in one ``all_gather`` over the data x context group and returns the
metrics every rank logs the same:

- ``hybridsp/straggler_ratio``, ``hybridsp/straggler_rank``: the slowest rank's step time over the median, and that rank;
- ``hybridsp/attention_seconds``: the largest per-rank attention time of the step;
- ``hybridsp/imbalance``: the busiest ring slot's attention work over the mean slot's, the work of a
  token being the keys it sees (``min(position + 1, window)``, from the positions it was fed);
- ``hybridsp/bytes_sent``: bytes the attention sent this step, summed over the ranks (a ``CommCounter``);
- ``hybridsp/peak_memory``: the largest per-rank peak (CUDA allocator; the resident set on CPU);
- ``hybridsp/nonfinite_layer``, ``hybridsp/nonfinite_rank``: the first layer (and its rank) whose attention
  output held a NaN or inf this step, -1 when none did.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridsp._comm import CommCounter
from hybridsp.mesh._hybrid_mesh import HybridMesh

_FIELDS = ("step_seconds", "attention_seconds", "work", "bytes", "peak", "nonfinite_layer", "ring_rank", "dp_rank")


def attention_work(position_ids: torch.Tensor, window: int | None = None) -> float:
    """Keys seen by this rank's queries: ``sum(min(p + 1, window))`` over the positions [B, S_local]."""
    seen = position_ids.double() + 1.0
    return float((seen if window is None else seen.clamp_max(window)).sum())


class HealthProbe:
    """Per-step health of one rank (see the module docstring); ``modules``: the attention modules to time."""

    def __init__(self, mesh: HybridMesh, modules: list[nn.Module], counter: CommCounter | None = None) -> None:
        self.mesh, self.counter = mesh, counter
        self._handles = []
        self._layers = len(modules)
        self._flags: torch.Tensor | None = None
        self._spans: list[tuple[Any, Any]] = []
        self._open: dict[int, Any] = {}
        for index, module in enumerate(modules):
            self._handles.append(module.register_forward_pre_hook(self._pre(index)))
            self._handles.append(module.register_forward_hook(self._post(index)))
        self._started = time.perf_counter()
        self._bytes_at_start = 0

    def _now(self, device: torch.device):
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _pre(self, index: int):
        def hook(module, args):
            device = next(module.parameters()).device
            self._open[index] = self._now(device)

        return hook

    def _post(self, index: int):
        def hook(module, args, output):
            first = output[0] if isinstance(output, tuple) else output
            self._spans.append((self._open.pop(index, None), self._now(first.device)))
            if self._flags is None:
                self._flags = torch.zeros(self._layers, dtype=torch.bool, device=first.device)
            self._flags[index] |= ~torch.isfinite(first).all()

        return hook

    def begin_step(self) -> None:
        """Start timing a step (call before its first forward)."""
        self._spans, self._flags = [], None
        self._bytes_at_start = self.counter.total() if self.counter is not None else 0
        self._started = time.perf_counter()

    def end_step(self, position_ids: torch.Tensor | None = None, window: int | None = None) -> dict[str, float]:
        """The step's metrics (the module docstring), the same on every rank; a collective over the data x
        context group. ``position_ids``: this rank's positions of the step (for the imbalance)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        attention = sum(_seconds(a, b) for a, b in self._spans if a is not None)
        flags = self._flags.cpu() if self._flags is not None else torch.zeros(0, dtype=torch.bool)
        bad = int(flags.nonzero()[0]) if flags.any() else -1
        mine = [
            time.perf_counter() - self._started,
            attention,
            0.0 if position_ids is None else attention_work(position_ids, window),
            float((self.counter.total() if self.counter is not None else 0) - self._bytes_at_start),
            float(_peak_bytes()),
            float(bad),
            float(self.mesh.ring_rank),
            float(self.mesh.dp_rank),
        ]
        return summarize(self._gather(torch.tensor(mine, dtype=torch.float64)), self.mesh)

    def _gather(self, row: torch.Tensor) -> torch.Tensor:
        group = self.mesh.data_context_group
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else row.device
        parts = [torch.empty_like(row, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, row.to(device), group=group)
        return torch.stack(parts).cpu()  # [ranks, fields]

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def summarize(rows: torch.Tensor, mesh: HybridMesh) -> dict[str, float]:
    """The metrics from every rank's [ranks, fields] row (ranks in the data x context group's order)."""
    col = {name: rows[:, i] for i, name in enumerate(_FIELDS)}
    members = dist.get_process_group_ranks(mesh.data_context_group)
    steps = col["step_seconds"].tolist()
    slowest = max(range(len(steps)), key=steps.__getitem__)
    median = statistics.median(steps)
    slots: dict[tuple[int, int], float] = {}
    for dp, ring, work in zip(col["dp_rank"].tolist(), col["ring_rank"].tolist(), col["work"].tolist()):
        slots[(int(dp), int(ring))] = slots.get((int(dp), int(ring)), 0.0) + work
    per_replica: dict[int, list[float]] = {}
    for (dp, _), work in slots.items():
        per_replica.setdefault(dp, []).append(work)
    imbalance = max((max(w) / (sum(w) / len(w)) if sum(w) > 0 else 1.0) for w in per_replica.values())
    bad = [(int(layer), members[i]) for i, layer in enumerate(col["nonfinite_layer"].tolist()) if layer >= 0]
    first = min(bad) if bad else (-1, -1)
    return {
        "hybridsp/straggler_ratio": steps[slowest] / median if median > 0 else 1.0,
        "hybridsp/straggler_rank": float(members[slowest]),
        "hybridsp/attention_seconds": float(col["attention_seconds"].max()),
        "hybridsp/imbalance": imbalance,
        "hybridsp/bytes_sent": float(col["bytes"].sum()),
        "hybridsp/peak_memory": float(col["peak"].max()),
        "hybridsp/nonfinite_layer": float(first[0]),
        "hybridsp/nonfinite_rank": float(first[1]),
    }


def _seconds(start, end) -> float:
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3


def _peak_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
