"""Adapter wrappers (PEFT): which module the hybrid attention switch and its input checks belong on.

``peft.get_peft_model(model, LoraConfig(...))`` returns a ``PeftModel`` whose ``forward`` takes
no ``position_ids`` parameter and calls the wrapped transformers model with keyword arguments.
:func:`hybridsp.integrations.transformers.apply` installs its input check and the packed-document
detection (Note [packed documents] there) as a forward pre-hook on the model it is given, reading
``position_ids`` from the forward's signature; on the wrapper that hook would never see them.
So the switch goes on :func:`base_model`: the adapters' LoRA layers live inside it and run as
usual, only the attention function and the hook change. :func:`switch_attention` is that switch,
as :class:`~hybridsp.integrations.transformers._trainer.HybridSPMixin` makes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from hybridsp._types import BackendName
    from hybridsp.integrations.transformers._handle import HybridAttentionHandle
    from hybridsp.mesh._hybrid_mesh import HybridMesh


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (``model.get_base_model()``), else ``model`` itself."""
    getter = getattr(model, "get_base_model", None)
    return getter() if callable(getter) else model


def switch_attention(model, mesh: HybridMesh, backend: BackendName) -> HybridAttentionHandle:
    """:func:`~hybridsp.integrations.transformers.apply` on :func:`base_model` of ``model`` (HybridSPTrainer's switch)."""
    from hybridsp.integrations.transformers._switch import apply

    return apply(base_model(model), mesh, backend=backend)  # a PEFT wrapper: the model inside it
