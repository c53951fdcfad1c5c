"""The linear-attention / state-space layers of a hybrid HF model on the U x R mesh.

:func:`switch_linear_layers` checks every recurrent mixer an adapter claims, then replaces each one's
``forward`` on the instance (no class is patched) with a sharded forward over the mesh; the returned callable
undoes exactly that. Which modules are switched is decided by identity (Note [mixers by identity] in
:mod:`.token_mixers`): the classes :func:`~hybridsp.integrations.transformers._token_mixers.default_mixers`
claims, or the adapters passed to ``apply(..., mixers=)``; every other token mixer makes ``apply`` refuse.

The algorithm lives in :mod:`hybridsp.linear_attention`; here is only what the transformers
modules look like:

- Gated DeltaNet (``Qwen3_5GatedDeltaNet``, ``Qwen3NextGatedDeltaNet``): projections per token
  (Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` through the module's own
  ``fix_query_key_value_ordering``), then the head split by key-head group
  (:mod:`hybridsp.linear_attention._heads`), the causal conv with halos (:mod:`hybridsp.linear_attention._conv`), the
  delta rule with state passing (:mod:`hybridsp.linear_attention._delta_rule`), back to the sequence shard,
  the gated norm with ``z`` and ``out_proj`` on this rank's tokens.
- Mamba-2 (``NemotronHMamba2Mixer``): ``in_proj``, the split by ``B``/``C`` group, conv, the scan
  with state passing (:mod:`hybridsp.linear_attention._mamba2`), back, the grouped gated norm and ``out_proj``.

The kernels are the model module's own functions (``torch_chunk_gated_delta_rule``,
``mamba2_chunk_scan``: whatever transformers bound under those names).

The forwards themselves, and Note [documents and caches] (the batch's documents, and the caches of
a generation), are in :mod:`hybridsp.integrations.transformers._mixer_forwards`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from hybridsp.integrations.transformers._token_mixers import (
    MARK,
    MixerAdapter,
    RecurrentMixerAdapter,
    claimed_mixers,
    default_mixers,
)
from hybridsp.mesh._hybrid_mesh import HybridMesh


def mixer_kind(module: nn.Module) -> str | None:
    """``"delta_rule"`` or ``"mamba2"`` for a class a default adapter claims, else None."""
    adapter = next((a for a in default_mixers() if a.matches(module)), None)
    return adapter.kind if isinstance(adapter, RecurrentMixerAdapter) else None


def linear_mixers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """The mixers under ``model`` the default adapters claim, with their kind, in module order."""
    return [(m, kind) for m in model.modules() if (kind := mixer_kind(m)) is not None]


def switch_linear_layers(
    model: nn.Module, mesh: HybridMesh, backend=None, mixers: tuple[MixerAdapter, ...] | None = None
):
    """Run ``model``'s token mixers that ``mixers`` (None: the defaults) claim over ``mesh``.

    Args:
        model: a transformers model instance (Qwen3.5 text, Qwen3-Next, Nemotron-H, ...).
        mesh: the mesh its attention runs over.
        backend: the attention backend (unused: these layers run the model's own kernels).
        mixers: the :class:`~hybridsp.integrations.transformers.MixerAdapter` s to ask.

    Returns:
        a callable that undoes every switched mixer, or None if no adapter claims a module of ``model``.

    Raises:
        ValueError, before changing anything, for an instance an adapter cannot run on ``mesh`` (a head or
        group count the Ulysses degree does not divide, a missing kernel, a mixer already switched). Modules no
        adapter claims are not looked at here: ``apply`` refuses them (:func:`.token_mixers.refuse_unknown_mixers`).
    """
    claimed = claimed_mixers(model, default_mixers() if mixers is None else mixers)
    for module, adapter in claimed:
        adapter.check(module, mesh)
    return switch_claimed_mixers(claimed, mesh)


def switch_claimed_mixers(claimed: list[tuple[nn.Module, MixerAdapter]], mesh: HybridMesh):
    """Switch each already checked ``(module, adapter)``; the undo of all of them, or None for none."""
    if not claimed:
        return None
    undos = [adapter.switch(module, mesh) for module, adapter in claimed]
    return functools.partial(_undo_all, undos)


def _undo_all(undos: list) -> None:
    for undo in undos:
        undo()


def refuse_generation(model: nn.Module, left_padding: torch.Tensor | None) -> None:
    """Raise ValueError if ``model`` has switched linear layers and the prompts are left-padded
    (``left_padding``: the [B, S] mask, None without padding); generate and prefill ask before any collective."""
    switched = [m for m in model.modules() if hasattr(m, MARK)]
    if switched and left_padding is not None:
        pads = sorted(set((~left_padding).sum(1).tolist()))
        raise ValueError(
            f"{type(model).__name__} has {len(switched)} linear-attention / state-space layers switched to hybridsp; "
            f"generate takes their prompts without left padding (got {pads[:4]} pad tokens per row: the padding "
            f"would run through their recurrent state). Generate rows of different lengths in separate calls"
        )
