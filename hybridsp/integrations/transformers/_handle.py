"""What :func:`~hybridsp.integrations.transformers.apply` changes on a model and how it is undone:
:func:`switch_modules` binds the attention modules to the mesh and names ``"hybridsp"`` in the
configs; :class:`HybridAttentionHandle` undoes it. Shared by the generic switch and every
:class:`~hybridsp.integrations.transformers.ModelAdapter`.
"""

from __future__ import annotations

from torch import nn

from hybridsp.integrations.transformers._binding import BINDING_ATTR as _BINDING_ATTR
from hybridsp.integrations.transformers._binding import NAME
from hybridsp.integrations.transformers._binding import Binding as _Binding
from hybridsp.mesh._hybrid_mesh import HybridMesh


class HybridAttentionHandle:
    """What :func:`apply` changed on one model, and :meth:`undo` to change it back.

    Also a context manager: ``with apply(model, mesh): ...`` undoes on exit. ``undo`` is
    idempotent.
    """

    def __init__(self, model: nn.Module, modules: list[nn.Module], previous: list[tuple], hook, undo_linear=None):
        self.model, self._modules, self._previous, self._hook = model, modules, previous, hook
        self._undo_linear = undo_linear  # restores the linear-attention mixers (linear_layers), or None
        self.active = True

    def undo(self) -> None:
        """Remove the bindings and the input check, restore every config's attention implementation."""
        if not self.active:
            return
        if self._hook is not None:
            self._hook.remove()
        self.undo_linear()
        for module in self._modules:
            if hasattr(module, _BINDING_ATTR):
                delattr(module, _BINDING_ATTR)
        for config, implementation in self._previous:  # outer configs first: the setter recurses inward
            config._attn_implementation = implementation
        self.active = False

    def undo_linear(self) -> None:
        """Restore only the linear-attention mixers' own forwards (idempotent; nothing without any)."""
        if self._undo_linear is not None:
            self._undo_linear()

    def __enter__(self) -> HybridAttentionHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        name, count = type(self.model).__name__, len(self._modules)
        return f"HybridAttentionHandle({name}, {count} attention modules, active={self.active})"


def switch_modules(
    model: nn.Module,
    modules: list[nn.Module],
    configs: list,
    mesh: HybridMesh,
    backend,
    hook,
    undo_linear=None,
    head_chunks=None,
):
    """Bind ``modules`` to ``mesh`` and name ``"hybridsp"`` in ``configs`` (no checks); the handle also
    removes ``hook`` and calls ``undo_linear``; ``head_chunks`` goes to every call (None: the mesh's). The step every adapter shares with
    :func:`~hybridsp.integrations.transformers.apply`."""
    previous = [(config, config._attn_implementation) for config in configs]
    binding = _Binding(mesh, backend, head_chunks)
    for module in modules:
        setattr(module, _BINDING_ATTR, binding)
    for config in configs:
        config._attn_implementation = NAME
    return HybridAttentionHandle(model, modules, previous, hook, undo_linear)
