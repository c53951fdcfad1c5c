"""hybridsp: hybrid Ulysses x ring sequence-parallel attention for long-context training."""

from hybridsp.attention import HybridAttention, gather_sequence, hybrid_attn_func, shard_sequence
from hybridsp.batch import ShardedDataLoader, shard_batch
from hybridsp.comm import CommCounter
from hybridsp.loss import sharded_cross_entropy
from hybridsp.mesh import HybridMesh, MeshShape, init_mesh
from hybridsp.offload import ActivationOffload, offload_activations
from hybridsp.ring import ring_attention

__all__ = [
    "ActivationOffload",
    "CommCounter",
    "HybridAttention",
    "HybridMesh",
    "MeshShape",
    "ShardedDataLoader",
    "gather_sequence",
    "hybrid_attn_func",
    "init_mesh",
    "offload_activations",
    "ring_attention",
    "shard_batch",
    "shard_sequence",
    "sharded_cross_entropy",
]
