"""PyTorch FSDP2 (``fully_shard``) over the hybrid mesh, without DeepSpeed: the public face.

    from hybridsp.integrations.fsdp import fully_shard_model, clip_grad_norm_
    mesh = hybridsp.init_mesh(ulysses=2, ring=2)           # mesh.device_mesh / mesh.fsdp_mesh: DeviceMeshes
    hf.apply(model, mesh)                                  # the attention switch first
    fully_shard_model(model, mesh)                         # parameters, gradients, optimizer state over DP x C
    norm = clip_grad_norm_(model.parameters(), 1.0)

Private modules: ``_shard`` (``fully_shard`` per decoder layer over ``mesh.fsdp_mesh``, the gradient
divisor, clipping DTensor gradients, the refusals), ``_requested`` (FSDP asked of ``HybridSPTrainer`` or
the TRL trainers: a ValueError, never DDP in its place). docs/fsdp2.md says what runs where.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridsp.integrations import lazy_exports

if TYPE_CHECKING:
    from hybridsp.integrations.fsdp._shard import (
        check_fsdp2_mesh,
        clip_grad_norm_,
        decoder_layers,
        fully_shard_model,
        is_fully_sharded,
    )

_P = "hybridsp.integrations.fsdp."
_EXPORTS = {
    "check_fsdp2_mesh": _P + "_shard",
    "clip_grad_norm_": _P + "_shard",
    "decoder_layers": _P + "_shard",
    "fully_shard_model": _P + "_shard",
    "is_fully_sharded": _P + "_shard",
}

__all__ = ["check_fsdp2_mesh", "clip_grad_norm_", "decoder_layers", "fully_shard_model", "is_fully_sharded"]

__getattr__ = lazy_exports(__name__, _EXPORTS)
