"""The linear-attention / state-space layers of a hybrid HF model on the U x R mesh.

:func:`switch_linear_layers` finds the recurrent mixers of one model instance by what they are
(Note [finding mixers]), checks every one of them, then replaces each one's ``forward`` on the
instance (no class is patched) with a sharded forward over the mesh; the returned callable undoes
exactly that. The algorithm lives in :mod:`hybridsp.linear_attention`; here is only what the transformers
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

Note [finding mixers]: a Gated DeltaNet has ``A_log``, ``dt_bias``, ``conv1d``, ``norm``,
``out_proj``, key/value head counts and either the Qwen3.5 or the Qwen3-Next projections; a
Mamba-2 mixer has ``A_log``, ``dt_bias``, ``D``, ``conv1d``, ``in_proj``, ``n_groups``,
``ssm_state_size``. Any other module with ``A_log`` is a recurrent layer this module does not
know: refused, so no layer silently runs per shard.

The forwards themselves, and Note [documents and caches] (the batch's documents, and the caches of
a generation), are in :mod:`hybridsp.integrations.transformers._mixer_forwards`.
"""

from __future__ import annotations

import functools
import sys
from typing import cast

import torch
from torch import nn

from hybridsp.integrations.transformers._mixer_forwards import delta_rule_forward, mamba2_forward
from hybridsp.mesh._hybrid_mesh import HybridMesh

MARK = "_hybridsp_linear"  # set on every mixer switch_linear_layers switched (removed by undo)
DELTA_PARTS = (
    "A_log",
    "dt_bias",
    "conv1d",
    "norm",
    "out_proj",
    "num_k_heads",
    "num_v_heads",
    "head_k_dim",
    "head_v_dim",
)
QWEN35_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
QWEN3_NEXT_PROJECTIONS = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")
MAMBA2_PARTS = (
    "A_log",
    "dt_bias",
    "D",
    "conv1d",
    "in_proj",
    "n_groups",
    "ssm_state_size",
    "num_heads",
    "head_dim",
    "intermediate_size",
    "norm",
    "out_proj",
    "chunk_size",
    "time_step_limit",
)


def mixer_kind(module: nn.Module) -> str | None:
    """``"delta_rule"``, ``"mamba2"``, ``"unknown"`` (a module with ``A_log`` of neither kind) or None."""
    has = functools.partial(_has_all, module)
    if has(DELTA_PARTS) and (has(QWEN35_PROJECTIONS) or has(QWEN3_NEXT_PROJECTIONS)):
        return "delta_rule"
    if has(MAMBA2_PARTS):
        return "mamba2"
    return "unknown" if hasattr(module, "A_log") else None


def _has_all(module: nn.Module, parts: tuple[str, ...]) -> bool:
    return all(hasattr(module, part) for part in parts)


def linear_mixers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """The recurrent mixers under ``model`` with their kind, in module order."""
    return [(m, kind) for m in model.modules() if (kind := mixer_kind(m)) is not None]


def switch_linear_layers(model: nn.Module, mesh: HybridMesh, backend=None):
    """Run ``model``'s linear-attention / state-space layers over ``mesh`` (Note [finding mixers]).

    Args:
        model: a transformers model instance (Qwen3.5 text, Qwen3-Next, Nemotron-H, ...).
        mesh: the mesh its attention runs over.
        backend: the attention backend (unused: these layers run the model's own kernels).

    Returns:
        a callable that restores every switched mixer's forward, or None if ``model`` has no
        linear layers.

    Raises:
        ValueError, before changing anything, for a recurrent layer it does not know, a head
        count the Ulysses degree does not divide, a missing kernel, or a model already switched.
    """
    mixers = linear_mixers(model)
    if not mixers:
        return None
    kernels = [_check_mixer(module, kind, mesh) for module, kind in mixers]
    previous = []
    for (module, kind), kernel in zip(mixers, kernels):
        forward = FORWARDS[kind]
        previous.append((module, module.__dict__.get("forward")))
        module.forward = functools.partial(forward, module, mesh, kernel)
        setattr(module, MARK, kind)
    return functools.partial(_undo, previous)


def _undo(previous: list) -> None:
    for module, forward in previous:
        if not hasattr(module, MARK):
            continue  # undone already
        delattr(module, MARK)
        if forward is None:
            del module.forward
        else:
            module.forward = forward


def _check_mixer(module: nn.Module, kind: str, mesh: HybridMesh):
    """The mixer's kernel function; ValueError for what cannot run (nothing changed yet)."""
    name = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if kind == "unknown":
        raise ValueError(
            f"{name} looks like a recurrent (linear-attention / state-space) layer but is neither a Gated DeltaNet nor a "
            f"Mamba-2 mixer hybridsp knows; its state would restart on every shard. Supported: Qwen3.5, Qwen3-Next, "
            f"Nemotron-H"
        )
    if hasattr(module, MARK):
        raise ValueError(f"{name} is already switched to hybridsp: undo the first switch before switching again")
    # plain ints of the mixer's config; nn.Module's stubs type unknown attributes as Tensor | Module
    units = cast(int, module.num_k_heads if kind == "delta_rule" else module.n_groups)
    what = "key heads" if kind == "delta_rule" else "B/C groups"
    if units % mesh.ulysses:
        raise ValueError(
            f"{name} has {units} {what}, not divisible by the Ulysses degree {mesh.ulysses} (each rank must hold whole "
            f"groups); choose a Ulysses degree that divides {units} and move the rest of the context ranks to the ring"
        )
    function = "torch_chunk_gated_delta_rule" if kind == "delta_rule" else "mamba2_chunk_scan"
    kernel = getattr(sys.modules.get(type(module).__module__), function, None)
    if kernel is None:
        raise ValueError(f"{name}: its modeling module defines no {function}, the kernel hybridsp calls")
    return kernel


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


FORWARDS = {"delta_rule": delta_rule_forward, "mamba2": mamba2_forward}
