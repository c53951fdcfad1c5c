"""One decision for the preflight and the switch: what :func:`~hybridsp.integrations.transformers.apply`
would switch on a model, or the ValueError it would raise.

:func:`decide` is everything :func:`apply` checks before it changes anything, and
:func:`check_switchable` is :func:`decide` with its answer thrown away, so the two cannot disagree
(Note [capabilities] in :mod:`.switch`; Note [mixers by identity] in :mod:`.token_mixers`). It reads the
model's structure only, so it runs on a model built on the meta device and needs no process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from torch import nn

from hybridsp.integrations.transformers._adapters import ModelAdapter, default_adapters
from hybridsp.integrations.transformers._binding import BINDING_ATTR, NAME, attention_modules
from hybridsp.integrations.transformers._capabilities import check_model
from hybridsp.integrations.transformers._token_mixers import (
    MixerAdapter,
    claimed_mixers,
    default_mixers,
    refuse_unknown_mixers,
)
from hybridsp.mesh._hybrid_mesh import HybridMesh


@dataclass(frozen=True)
class SwitchDecision:
    """What :func:`apply` switches: the model adapter that takes the whole model (then nothing else here
    is used), or the attention modules and the token mixers with the adapter of each."""

    adapter: ModelAdapter | None = None
    attention: list[nn.Module] = field(default_factory=list)
    mixers: list[tuple[nn.Module, MixerAdapter]] = field(default_factory=list)


def decide(
    model: nn.Module,
    mesh: HybridMesh | None,
    adapters: Sequence[ModelAdapter] | None = None,
    mixers: Sequence[MixerAdapter] | None = None,
) -> SwitchDecision:
    """What :func:`apply` would switch on ``model`` over ``mesh`` (None: any mesh's degrees), or ValueError
    naming what it refuses and what to change. Reads the model only."""
    if isinstance(model, type):
        raise TypeError(
            f"apply() switches a model instance, got the class {model.__name__}: build the model, then call "
            f"apply(model, mesh) (register() alone makes attn_implementation={NAME!r} loadable)"
        )
    adapters = default_adapters() if adapters is None else tuple(adapters)
    mixers = default_mixers() if mixers is None else tuple(mixers)
    adapter = next((a for a in adapters if a.matches(model)), None)
    if adapter is not None:
        if any(hasattr(m, BINDING_ATTR) for m in model.modules()):
            raise ValueError(f"{type(model).__name__} is already switched to {NAME}: undo the first handle first")
        preflight = getattr(adapter, "preflight", None)
        if preflight is not None:
            preflight(model, mesh)
        return SwitchDecision(adapter=adapter)
    for other in adapters:
        other.check(model)
    refuse_transformers_tensor_parallel(model)
    claimed = claimed_mixers(model, mixers)
    refuse_unknown_mixers(model, [module for module, _ in claimed])
    modules = attention_modules(model)
    check_model(model, modules, mesh)
    for module, mixer in claimed:
        mixer.check(module, mesh)
    return SwitchDecision(attention=modules, mixers=claimed)


def check_switchable(
    model: nn.Module,
    mesh: HybridMesh | None = None,
    *,
    adapters: Sequence[ModelAdapter] | None = None,
    mixers: Sequence[MixerAdapter] | None = None,
) -> None:
    """Raise ValueError exactly when :func:`apply` would refuse ``model`` (on ``mesh``; None: any mesh's
    degrees) with the same ``adapters`` and ``mixers``; works on a model built on the meta device (nothing is
    read or changed, no collective runs)."""
    decide(model, mesh, adapters, mixers)


def refuse_transformers_tensor_parallel(model: nn.Module) -> None:
    """ValueError for a model transformers split by its own tensor parallelism (``from_pretrained(...,
    tp_plan="auto")`` / ``distributed_config``): its row-parallel layers all-reduce partial outputs over the
    ranks, which would add up different tokens once the ranks hold different parts of the sequence."""
    tp_size = getattr(model, "_tp_size", None)
    if tp_size is not None and tp_size > 1:
        raise ValueError(
            f"{type(model).__name__} was split by transformers' tensor parallelism (tp_size={tp_size}, from tp_plan / "
            f"distributed_config): its all-reduces would sum different tokens under sequence parallelism. Load it "
            f"without tp_plan and use hybridsp's own tensor axis (init_mesh(..., tensor=T) with "
            f"hybridsp.integrations.transformers.tensor_parallel(model, mesh))"
        )
