"""Data plumbing for :mod:`hybridsp.integrations.transformers._trainer`: replicas, not ranks, consume the data.

The Hugging Face Trainer hands its DataLoaders to accelerate, which shards them over all
``W`` processes (``BatchSamplerShard`` for map-style datasets, ``IterableDatasetShard``
for iterable ones). Under sequence parallelism the unit of data parallelism is the
*replica*: the ``C = U x R`` context ranks of a replica must load the same full batch and
each take its own tokens of it. :func:`shard_loader_over_replicas` re-points accelerate's
shard to ``(DP, dp_rank)`` after ``accelerator.prepare`` (the Trainer does the same for its
``BatchRebalanceSampler``, which it sets to ``(1, 0)``). Every length, remainder and
``skip_first_batches`` that accelerate derives later reads these two attributes, so epochs,
resumption and the evaluation remainder come out those of a DP-only run. With a single
replica, ``even_batches`` is turned off as well: accelerate would otherwise complete a short
last batch with samples from the start of the epoch, which an unsharded single-process run
does not do. (An ``IterableDatasetShard`` always completes it; that case is not changed.)

:func:`gather_over_replicas` is the evaluation loop's ``gather_function``: after the
sharded prediction step every rank of a replica holds the same (full-sequence) values, so
gathering over ``mesh.data_group`` (one rank per replica) gives each replica's values
exactly once, in replica order, and the last batch's duplicated samples are cut as
``accelerator.gather_for_metrics`` cuts them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridsp.mesh._hybrid_mesh import HybridMesh


def shard_loader_over_replicas(dataloader, mesh: HybridMesh):
    """Make an accelerate-prepared DataLoader yield one replica's batches on each of its ranks.

    Returns the same loader. Raises ValueError for loaders whose sharding cannot be re-pointed
    (accelerate's ``dispatch_batches`` / ``split_batches``, a ``datasets.IterableDataset``
    split by ``.shard``). No communication.
    """
    if mesh.context == 1 or mesh.world_size == 1:
        return dataloader
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard  # type: ignore[import-untyped]  # accelerate ships no type information

    if isinstance(dataloader, DataLoaderDispatcher):
        raise ValueError(
            "accelerate's dispatch_batches sends rank 0's batches to all ranks, which cannot give whole "
            "replicas the same batch; set TrainingArguments(accelerator_config={'dispatch_batches': False})"
        )
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for shard in (batch_sampler, getattr(batch_sampler, "batch_sampler", None), getattr(dataloader, "dataset", None)):
        if isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
            if shard.split_batches:
                raise ValueError(
                    "accelerate's split_batches cuts each batch over all ranks; with sequence parallelism the "
                    "context ranks need whole samples: set accelerator_config={'split_batches': False}"
                )
            shard.num_processes, shard.process_index = mesh.dp, mesh.dp_rank
            if mesh.dp == 1 and isinstance(shard, BatchSamplerShard):
                shard.even_batches = False  # one replica: a short last batch stays short, as without sharding
            return dataloader
    raise ValueError(
        f"cannot give the {mesh.context} context ranks of a replica the same batches: the prepared DataLoader "
        f"({type(dataloader).__name__}, dataset {type(getattr(dataloader, 'dataset', None)).__name__}) is not "
        f"sharded by accelerate's BatchSamplerShard or IterableDatasetShard (a datasets.IterableDataset with "
        f"n_shards >= world size is split by .shard(); use a map-style dataset or fewer shards)"
    )


def gather_over_replicas(data: Any, mesh: HybridMesh, gradient_state=None) -> Any:
    """Concatenate ``data`` (tensors, possibly nested in lists/tuples/dicts) over the replicas.

    Each tensor is gathered along dim 0 over ``mesh.data_group`` (sizes along dim 0 may
    differ; the other dims must agree). With accelerate's ``gradient_state`` at the end of a
    dataloader with a positive ``remainder``, the result is cut to it, as
    ``gather_for_metrics`` does. A collective over ``mesh.data_group``; objects that are not
    tensors are gathered with ``all_gather_object``.
    """
    from accelerate.utils import recursively_apply  # type: ignore[import-untyped]  # no type information

    if not _all_tensors(data):
        gathered = [data]
        if mesh.dp > 1:
            gathered = [None] * mesh.dp
            dist.all_gather_object(gathered, data, group=mesh.data_group)
        data = [item for part in gathered for item in (part if isinstance(part, list) else [part])]
    else:
        data = recursively_apply(lambda t: _all_gather_rows(t, mesh), data)
    if gradient_state is not None and gradient_state.end_of_dataloader and gradient_state.remainder > 0:
        cut = gradient_state.remainder
        return data[:cut] if isinstance(data, list) else recursively_apply(lambda t: t[:cut], data)
    return data


def _all_tensors(data: Any) -> bool:
    from accelerate.utils import recursively_apply

    try:
        recursively_apply(lambda x: x, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def _all_gather_rows(tensor: torch.Tensor, mesh: HybridMesh) -> torch.Tensor:
    """[n_i, ...] on each replica -> [sum n_i, ...] in replica order, on every rank."""
    if tensor.dim() == 0:
        tensor = tensor[None]  # [1]
    if mesh.dp == 1:
        return tensor
    rows = torch.tensor([tensor.shape[0]], device=tensor.device)
    sizes = [torch.empty_like(rows) for _ in range(mesh.dp)]
    dist.all_gather(sizes, rows, group=mesh.data_group)
    longest = int(max(size.item() for size in sizes))
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))  # [n_max, ...]
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(mesh.dp)]
    dist.all_gather(parts, padded.contiguous(), group=mesh.data_group)  # in replica (= group rank) order
    return torch.cat([part[: int(size.item())] for part, size in zip(parts, sizes)])  # [sum n_i, ...]
