"""hybridsp: hybrid Ulysses x ring sequence-parallel attention for long-context training.

The names most programs need are here; each package's face has the rest (docs/api.md lists
the whole public surface):

- :mod:`hybridsp.attention`: ``hybrid_attn_func``, ``HybridAttention``, ``ring_attention``,
  ``shard_sequence`` / ``gather_sequence``, ``CallSpec``
- :mod:`hybridsp.mesh`: ``init_mesh``, ``HybridMesh``; :mod:`hybridsp.launch`: the process group
- :mod:`hybridsp.data`: ``shard_batch``, ``ShardedDataLoader``, ``replica_sampler``
- :mod:`hybridsp.losses`, :mod:`hybridsp.memory`, :mod:`hybridsp.layout`, :mod:`hybridsp.kernels`,
  :mod:`hybridsp.inference`, :mod:`hybridsp.tensor_parallel`, :mod:`hybridsp.planner`
- :mod:`hybridsp.monitor`: ``verify_parity`` (the exactness probe), run health, rollback policies
- :mod:`hybridsp.integrations`: DeepSpeed, transformers, TRL (none imported here)

Modules whose names start with ``_`` are private: they may change without notice.
"""

from hybridsp._comm import CommCounter
from hybridsp._version import __version__
from hybridsp.attention import (
    CallSpec,
    HybridAttention,
    gather_sequence,
    hybrid_attn_func,
    ring_attention,
    shard_sequence,
)
from hybridsp.data import ShardedDataLoader, replica_sampler, shard_batch
from hybridsp.layout import Documents
from hybridsp.losses import fused_cross_entropy, real_token_mask, sharded_cross_entropy, sharded_load_balancing_loss
from hybridsp.memory import (
    ActivationOffload,
    apply_lean_norms,
    apply_lean_rope,
    apply_split_checkpointing,
    apply_tiled_mlp,
    offload_activations,
)
from hybridsp.mesh import HybridMesh, MeshShape, init_mesh
from hybridsp.monitor import verify_parity

__all__ = [
    "ActivationOffload",
    "CallSpec",
    "CommCounter",
    "Documents",
    "HybridAttention",
    "HybridMesh",
    "MeshShape",
    "ShardedDataLoader",
    "__version__",
    "apply_lean_norms",
    "apply_lean_rope",
    "apply_split_checkpointing",
    "apply_tiled_mlp",
    "fused_cross_entropy",
    "gather_sequence",
    "hybrid_attn_func",
    "init_mesh",
    "offload_activations",
    "real_token_mask",
    "replica_sampler",
    "ring_attention",
    "shard_batch",
    "shard_sequence",
    "sharded_cross_entropy",
    "sharded_load_balancing_loss",
    "verify_parity",
]
