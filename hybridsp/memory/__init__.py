"""Memory techniques outside attention, each modelled by the planner.

Public: :func:`apply_tiled_mlp`, :func:`apply_lean_norms` (RMSNorm keeping no normalized copy),
:func:`apply_lean_rope` (q and k rotated in place as projected),
:func:`apply_split_checkpointing` (each decoder layer checkpointed as an attention and an MLP half),
:func:`offload_activations` / :class:`ActivationOffload`. Inside: ``_forward_patch`` (the
instance-level forwards and their undo), ``_sharded_params`` (parameters an engine keeps
sharded, gathered through that engine's integration).
"""

from hybridsp.memory._lean_norm import apply_lean_norms
from hybridsp.memory._offload import ActivationOffload, offload_activations
from hybridsp.memory._rope_attention import apply_lean_rope
from hybridsp.memory._split_checkpoint import apply_split_checkpointing
from hybridsp.memory._tiled_mlp import apply_tiled_mlp

__all__ = [
    "ActivationOffload",
    "apply_lean_norms",
    "apply_lean_rope",
    "apply_split_checkpointing",
    "apply_tiled_mlp",
    "offload_activations",
]
