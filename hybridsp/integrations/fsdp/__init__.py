"""PyTorch FSDP2 (``fully_shard``) over the hybrid mesh, without DeepSpeed: the public face.

    from hybridsp.integrations.fsdp import fully_shard_model, clip_grad_norm_
    mesh = hybridsp.init_mesh(ulysses=2, ring=2)           # mesh.device_mesh / mesh.fsdp_mesh: DeviceMeshes
    hf.apply(model, mesh)                                  # the attention switch first
    fully_shard_model(model, mesh)                         # parameters, gradients, optimizer state over DP x C
    norm = clip_grad_norm_(model.parameters(), 1.0)
    save_sharded(directory, model, optimizer)              # DCP: resumes on any world size and mesh
    model.save_pretrained(out, state_dict=full_state_dict(model))   # rank 0 writes; every rank calls it

Private modules: ``_shard`` (``fully_shard`` per decoder layer over ``mesh.fsdp_mesh``, the gradient
divisor, clipping DTensor gradients, the refusals), ``_checkpoint`` (sharded and consolidated state
dicts), ``_requested`` (FSDP2 asked of ``HybridSPTrainer`` or the TRL trainers, read once; FSDP1
refused). docs/fsdp2.md says what runs where.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridsp.integrations import lazy_exports

if TYPE_CHECKING:
    from hybridsp.integrations.fsdp._checkpoint import full_state_dict, load_sharded, save_sharded
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
    "full_state_dict": _P + "_checkpoint",
    "load_sharded": _P + "_checkpoint",
    "save_sharded": _P + "_checkpoint",
    "fully_shard_model": _P + "_shard",
    "is_fully_sharded": _P + "_shard",
}

__all__ = [
    "check_fsdp2_mesh",
    "clip_grad_norm_",
    "decoder_layers",
    "full_state_dict",
    "fully_shard_model",
    "is_fully_sharded",
    "load_sharded",
    "save_sharded",
]

__getattr__ = lazy_exports(__name__, _EXPORTS)
