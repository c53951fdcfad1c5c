"""hybridsp: hybrid Ulysses x ring sequence-parallel attention for long-context training."""

from hybridsp.attention import HybridAttention, gather_sequence, hybrid_attn_func, shard_sequence
from hybridsp.comm import CommCounter
from hybridsp.mesh import HybridMesh, MeshShape, init_mesh
from hybridsp.ring import ring_attention

__all__ = [
    "CommCounter",
    "HybridAttention",
    "HybridMesh",
    "MeshShape",
    "gather_sequence",
    "hybrid_attn_func",
    "init_mesh",
    "ring_attention",
    "shard_sequence",
]
