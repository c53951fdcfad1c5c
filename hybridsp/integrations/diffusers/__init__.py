"""diffusers' video and image transformers (Wan 2.x, Flux, Qwen-Image) with exact hybrid Ulysses x ring attention.

    handle = hybridsp.integrations.diffusers.apply(transformer, mesh)
    out = transformer(**full_inputs).sample  # full inputs and the full output on every rank
    handle.undo()

Private modules: ``_switch`` (``apply`` and the handle), ``_families`` (where each model's token
streams are cut), ``_plan`` (which tokens each rank holds; pads and masked text as a separate
document), ``_sharding`` (cut and gather), ``_route`` (diffusers' dispatch routed to
``hybrid_attn_func``), ``_rows`` (rows with different text masks, run one by one).
diffusers is imported on first use of a name (``pip install -e ".[diffusers]"``), never here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridsp.integrations import lazy_exports

if TYPE_CHECKING:
    from hybridsp.integrations.diffusers._families import FAMILIES
    from hybridsp.integrations.diffusers._switch import DiffusersHandle, apply

_EXPORTS = {
    "apply": "hybridsp.integrations.diffusers._switch",
    "DiffusersHandle": "hybridsp.integrations.diffusers._switch",
    "FAMILIES": "hybridsp.integrations.diffusers._families",
}

__all__ = ["FAMILIES", "DiffusersHandle", "apply"]

__getattr__ = lazy_exports(__name__, _EXPORTS)
