"""hybridsp: hybrid Ulysses x ring sequence-parallel attention for long-context training."""

from hybridsp.attention.api import HybridAttention, gather_sequence, hybrid_attn_func, shard_sequence
from hybridsp.attention.ring import ring_attention
from hybridsp.batch import ShardedDataLoader, shard_batch
from hybridsp.comm import CommCounter
from hybridsp.losses.cross_entropy import sharded_cross_entropy
from hybridsp.losses.fused import fused_cross_entropy
from hybridsp.losses.router import real_token_mask, sharded_load_balancing_loss
from hybridsp.memory.lean_norm import apply_lean_norms
from hybridsp.memory.offload import ActivationOffload, offload_activations
from hybridsp.memory.tiled_mlp import apply_tiled_mlp
from hybridsp.mesh.hybrid_mesh import HybridMesh, MeshShape, init_mesh

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
