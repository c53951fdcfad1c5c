"""The public :func:`initialize`: the DeepSpeed engine with the attention switch a model needs.

The engine (:mod:`hybridsp.integrations.deepspeed._engine`) knows no model library: it calls the
``switch_attention`` its caller passes. This entry passes the transformers integration's
:func:`~hybridsp.integrations.transformers._switch.apply` for a transformers model (imported only then),
nothing for any other model, and the caller's own switch when one is given.
"""

from __future__ import annotations

import sys

from torch import nn

from hybridsp._types import BackendName
from hybridsp.integrations.deepspeed import _engine as engine
from hybridsp.mesh._hybrid_mesh import HybridMesh


def switch_transformers(model: nn.Module, mesh: HybridMesh, backend: BackendName):
    """The transformers integration's switch for ``model``; returns its undo."""
    from hybridsp.integrations.transformers._switch import apply

    return apply(model, mesh, backend=backend).undo


def default_switch(model: nn.Module) -> engine.AttentionSwitch | None:
    """The attention switch ``model`` needs: the transformers one for a transformers model, else none."""
    transformers = sys.modules.get("transformers")  # a transformers model means it is already imported
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        return switch_transformers
    return None


def initialize(
    model: nn.Module, config, *, switch_attention: engine.AttentionSwitch | None = None, **options
) -> engine.HybridEngine:
    """:func:`hybridsp.integrations.deepspeed._engine.initialize` (same arguments) with ``model``'s
    attention switched: by ``switch_attention`` when given, else by :func:`default_switch`."""
    switch = switch_attention if switch_attention is not None else default_switch(model)
    return engine.initialize(model, config, switch_attention=switch, **options)
