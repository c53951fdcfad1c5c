"""Instance-level forwards put on a model's modules, and the handle that takes them off again.

:func:`patch_forwards` is how the memory techniques switch modules (``tiled_mlp``, ``lean_norm``, ``split_checkpoint``):
each module gets an instance attribute ``forward`` (its class is untouched, other instances and
other models are not affected); :class:`ForwardPatch` ``undo()`` deletes those attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from hybridsp._checks import check_positive


@dataclass
class ForwardPatch:
    """What a technique changed: ``modules`` with an instance-level forward, the ``tile_tokens`` it uses
    (None: it does not tile);
    ``undo()`` restores every module (idempotent); a context manager that undoes at exit."""

    modules: list[nn.Module]
    tile_tokens: int | None
    active: bool = True

    def undo(self) -> None:
        if not self.active:
            return
        for module in self.modules:
            if "forward" in vars(module):
                del module.forward
        self.active = False

    def __enter__(self) -> ForwardPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def patch_forwards(
    modules: list[nn.Module],
    make_forward: Callable[[nn.Module], Callable[..., Any]],
    tile_tokens: int | None,
    *,
    model: nn.Module,
    what: str,
) -> ForwardPatch:
    """Give each of ``modules`` the forward ``make_forward(module)``; ``what`` names them in errors.

    Raises ValueError (nothing changed) when ``modules`` is empty, one already has an instance-level
    forward, or ``tile_tokens`` is neither None (the technique does not tile) nor a positive int.
    """
    if not modules:
        raise ValueError(f"{type(model).__name__} has no {what}")
    if any("forward" in vars(m) for m in modules):
        raise ValueError(f"a module of {type(model).__name__} already has an instance-level forward (switched twice?)")
    if tile_tokens is not None:
        check_positive(tile_tokens, "tile_tokens", integer=True, unit="rows (tokens)")
    for module in modules:
        module.forward = make_forward(module)
    return ForwardPatch(modules, tile_tokens)
