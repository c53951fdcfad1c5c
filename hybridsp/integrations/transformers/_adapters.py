"""Model adapters: families :func:`~hybridsp.integrations.transformers.apply` switches their own way
instead of the generic path (every module that calls the attention interface)."""

from __future__ import annotations

from typing import Protocol

from torch import nn

from hybridsp._types import BackendName
from hybridsp.integrations.transformers._handle import HybridAttentionHandle
from hybridsp.kernels import AttentionKernel
from hybridsp.mesh._hybrid_mesh import HybridMesh


class ModelAdapter(Protocol):
    """A model family :func:`apply` switches its own way instead of the generic path (every module
    that calls the attention interface). :func:`apply` asks each adapter in turn: the first whose
    ``matches(model)`` is true switches the model; a model no adapter matches goes through every
    adapter's ``check(model)`` (a ValueError for relatives it cannot switch), then the generic path.
    ``check_switchable`` asks the matching adapter's ``preflight`` (the same decision, nothing changed).
    """

    name: str

    def matches(self, model: nn.Module) -> bool:
        """Whether this adapter switches ``model``."""
        ...

    def check(self, model: nn.Module) -> None:
        """Raise ValueError, before anything changes, for a model of this family's kind that no
        adapter switches (e.g. a vision tower of another family)."""
        ...

    def preflight(self, model: nn.Module, mesh: HybridMesh | None) -> None:
        """Raise ValueError exactly where :meth:`apply` would refuse ``model`` on ``mesh`` (None: any mesh);
        changes nothing and runs no collective (works on the meta device)."""
        ...

    def apply(
        self, model: nn.Module, mesh: HybridMesh, backend: BackendName | AttentionKernel
    ) -> HybridAttentionHandle:
        """Switch ``model`` (its preflight first, nothing changed on failure); the handle undoes it."""
        ...


def default_adapters() -> tuple[ModelAdapter, ...]:
    """The adapters :func:`apply` uses unless given others: the vision-language models (Qwen2-VL,
    Qwen2.5-VL: the language model's attention only)."""
    from hybridsp.integrations.transformers._vision.model import VisionLanguageAdapter

    return (VisionLanguageAdapter(),)
