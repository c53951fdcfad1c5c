"""Batches on a sequence-parallel mesh: a full batch -> this rank's tokens.

Public: :func:`shard_batch` (pads, shifts labels, global positions, packed documents; no
communication), :class:`ShardedDataLoader` (``shard_batch`` of each full batch),
:func:`replica_sampler` (every rank of a context group gets the same batch) and :func:`padded_length`
(the length ``shard_batch`` pads to).
"""

from hybridsp.data._batch import ShardedDataLoader, replica_sampler, shard_batch
from hybridsp.mesh import padded_length

__all__ = ["ShardedDataLoader", "padded_length", "replica_sampler", "shard_batch"]
