"""What TRL's RL trainers do per process, done per replica: the pieces :mod:`hybridsp.integrations.trl._grpo` uses.

TRL's ``GRPOTrainer`` / ``RLOOTrainer`` treat every process as one data-parallel worker: they
gather rewards and token counts over all ``W`` processes, keep the slice
``process_index * n : (process_index + 1) * n`` of the gathered batch, divide by
``num_processes`` and seed each process with ``seed + process_index``. Under sequence
parallelism the worker is the *replica* (its ``C = U x R`` context ranks hold the same prompts,
completions and per-token values), so each of those must count replicas:

- :class:`ReplicaAccelerator` is the trainer's accelerator seen per replica: ``gather`` /
  ``reduce`` / ``pad_across_processes`` over ``mesh.data_group`` (one rank of each replica, in
  replica order), ``process_index = dp_rank``, ``num_processes = DP``; all else is the
  accelerator's own. :func:`replica_view` puts it in place (and TRL's module-level ``gather`` /
  ``gather_object``) for the duration of one call, and puts the originals back.
- :func:`agree_on_rollouts`: context rank 0's completions and random-generator state, on every
  context rank (Note [identical completions] in :mod:`hybridsp.integrations.trl._grpo`).
- :func:`right_aligned`: TRL's left-padded prompt + right-padded completion rows moved to the
  left edge, so the sharded log-prob call (which takes right padding) scores them, and the
  index that reads the completion's values back in TRL's column order.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
import torch.distributed as dist

from hybridsp.integrations.transformers._trainer_data import gather_over_replicas
from hybridsp.mesh._hybrid_mesh import HybridMesh


class ReplicaAccelerator:
    """An accelerate ``Accelerator`` whose collectives and process counts are over replicas (module docstring)."""

    def __init__(self, accelerator, mesh: HybridMesh):
        self._accelerator, self._mesh = accelerator, mesh

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    @property
    def process_index(self) -> int:
        return self._mesh.dp_rank

    @property
    def num_processes(self) -> int:
        return self._mesh.dp

    def gather(self, data):
        """Concatenate ``data`` over the replicas (each replica once), as ``accelerate.gather`` over processes."""
        return gather_over_replicas(data, self._mesh)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        """Sum (or mean) over the replicas; one all_reduce over ``mesh.data_group``."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"ReplicaAccelerator.reduce supports reduction='sum' or 'mean'; got {reduction!r}")
        out = tensor.clone() * scale
        if self._mesh.dp > 1:
            dist.all_reduce(out, group=self._mesh.data_group)
        return out / self._mesh.dp if reduction == "mean" else out

    def pad_across_processes(self, tensor: torch.Tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        """``tensor`` padded along ``dim`` to the longest over the replicas."""
        size = torch.tensor([tensor.shape[dim]], device=tensor.device)
        if self._mesh.dp > 1:
            dist.all_reduce(size, op=dist.ReduceOp.MAX, group=self._mesh.data_group)
        extra = int(size.item()) - tensor.shape[dim]
        if extra == 0:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = extra
        filler = tensor.new_full(shape, pad_index)
        return torch.cat([filler, tensor] if pad_first else [tensor, filler], dim=dim)


def _gather_object(mesh: HybridMesh):
    def gather_object(data):
        """``accelerate.utils.gather_object`` over the replicas: one flat list, replica order."""
        return gather_over_replicas(list(data), mesh)

    return gather_object


@contextlib.contextmanager
def replica_view(trainer, module_name: str) -> Iterator[None]:
    """During the block: ``trainer.accelerator`` is a :class:`ReplicaAccelerator` and the TRL module
    ``module_name``'s ``gather`` / ``gather_object`` gather over the replicas; restored on exit
    (also on an exception). Nested use keeps the outer view."""
    accelerator = trainer.accelerator
    if isinstance(accelerator, ReplicaAccelerator):
        yield
        return
    module = sys.modules[module_name]
    saved = {name: getattr(module, name) for name in ("gather", "gather_object")}
    mesh = trainer.hybrid_mesh
    trainer.accelerator = ReplicaAccelerator(accelerator, mesh)
    # patch the TRL module's functions (restored below)
    module.gather = lambda data: gather_over_replicas(data, mesh)  # type: ignore[attr-defined]
    module.gather_object = _gather_object(mesh)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        trainer.accelerator = accelerator
        for name, value in saved.items():
            setattr(module, name, value)


def agree_on_rollouts(completions: Any, mesh: HybridMesh) -> Any:
    """Context rank 0's ``completions`` (any picklable value) and torch's random state on every rank of
    its context group: one ``broadcast_object_list`` over ``mesh.context_group``. No-op when C = 1."""
    if mesh.context == 1:
        return completions
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None]
    message = [completions, states]
    dist.broadcast_object_list(message, src=mesh.context_members()[0], group=mesh.context_group)
    completions, (cpu_state, cuda_state) = message
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state)
    return completions


def right_aligned(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int):
    """TRL's ``[prompt (left-padded) | completion (right-padded)]`` rows with their left padding moved to the end.

    Args:
        input_ids, attention_mask: [B, S], 1 = real token; each row ``0..0 1..1 0..0``.
        logits_to_keep: C, the completion's columns (the last C of S).

    Returns:
        (ids [B, S], mask [B, S], labels [B, S], index [B, C]): the rows rolled left by their
        leading padding (right-padded now), labels ``-100`` on padding and prompt tokens, and
        ``index`` such that ``log_probs.gather(1, index)`` of the rolled rows' per-token values
        ``[B, S - 1]`` equals TRL's ``log_probs[:, -C:]`` of the original rows. No communication.

    Raises:
        ValueError for a row without a real prompt token (its first completion token has no context).
    """
    batch, seq = input_ids.shape
    real = attention_mask != 0  # [B, S]
    lead = (real.long().cumsum(dim=1) == 0).sum(dim=1)  # [B] leading padding
    prompt = seq - logits_to_keep
    if bool((lead >= prompt).any()):
        row = int((lead >= prompt).nonzero()[0])
        raise ValueError(
            f"row {row} has no real prompt token ({int(lead[row])} padding of {prompt} prompt columns): every "
            f"completion needs a prompt to be scored"
        )
    columns = torch.arange(seq, device=input_ids.device)  # [S]
    source = (columns[None] + lead[:, None]) % seq  # [B, S]: rolled column j holds original column j + lead
    ids, mask = input_ids.gather(1, source), attention_mask.gather(1, source)  # [B, S] each
    labels = ids.masked_fill(mask == 0, -100)  # [B, S]
    labels = labels.masked_fill(columns[None] < (prompt - lead)[:, None], -100)  # prompt tokens are not scored
    index = torch.arange(seq - 1 - logits_to_keep, seq - 1, device=input_ids.device)[None] - lead[:, None]  # [B, C]
    return ids, mask, labels, index
