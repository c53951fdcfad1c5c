"""What :func:`hybridsp.integrations.transformers.apply` leaves on each attention module, and the
decode keyword: the names the switch, generation (:mod:`.hf_generate`) and the Trainer share
(Note [binding the mesh] in :mod:`hybridsp.integrations.transformers`)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridsp.kernels import AttentionKernel
from hybridsp.mesh.hybrid_mesh import HybridMesh

BINDING_ATTR = "_hybridsp_binding"  # the attribute apply() sets on every attention module it switches
DECODE_KWARG = "hybridsp_decode"  # the model-call kwarg that carries a decode step (hf_generate)


@dataclass(frozen=True)
class Binding:
    """What one attention module needs at call time (set by ``apply``)."""

    mesh: HybridMesh
    backend: str | AttentionKernel
DOCUMENTS_KWARG = "hybridsp_documents"  # the model-call kwarg that carries the batch's Documents (shard_batch)


ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")  # what a switchable attention module has


def attention_modules(root) -> list:
    """The attention modules under ``root`` (an ``nn.Module``) the switch can take, in module order."""
    return [m for m in root.modules() if all(hasattr(m, part) for part in ATTENTION_PARTS)]
