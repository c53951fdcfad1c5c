"""hybridsp: hybrid Ulysses x ring sequence-parallel attention for long-context training."""

from hybridsp._comm import CommCounter
from hybridsp.attention._api import HybridAttention, gather_sequence, hybrid_attn_func, shard_sequence
from hybridsp.attention._ring import ring_attention
from hybridsp.data._batch import ShardedDataLoader, shard_batch
from hybridsp.losses._cross_entropy import sharded_cross_entropy
from hybridsp.losses._fused import fused_cross_entropy
from hybridsp.losses._router import real_token_mask, sharded_load_balancing_loss
from hybridsp.memory._lean_norm import apply_lean_norms
from hybridsp.memory._offload import ActivationOffload, offload_activations
from hybridsp.memory._tiled_mlp import apply_tiled_mlp
from hybridsp.mesh._hybrid_mesh import HybridMesh, MeshShape, init_mesh

__all__ = [
    "ActivationOffload",
    "CommCounter",
    "HybridAttention",
    "HybridMesh",
    "MeshShape",
    "ShardedDataLoader",
    "apply_lean_norms",
    "apply_tiled_mlp",
    "fused_cross_entropy",
    "gather_sequence",
    "hybrid_attn_func",
    "init_mesh",
    "offload_activations",
    "real_token_mask",
    "ring_attention",
    "shard_batch",
    "shard_sequence",
    "sharded_cross_entropy",
    "sharded_load_balancing_loss",
]
