"""Host objects as ``torch.compile``'s graphs hand them to hybridsp's custom operators.

A graph passes an :class:`OpaqueRef` to an operator as an input without looking inside it: no guard
on what it holds, so a new batch's documents run the same graph (Note [compiled call] in
:mod:`hybridsp.attention._compiled`). A mesh and a batch's documents each carry one (``.opaque``), made
with them outside any graph. Importing this module registers the type with ``torch.library`` (as
defining a custom operator does); nothing else changes.
"""

from __future__ import annotations

from typing import Any

from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBaseMeta


class OpaqueRef(metaclass=OpaqueBaseMeta):
    """A reference to one host object (``value``: a mesh, a batch's documents)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:  # any host object: the reader knows which it handed over
        self.value = value

    def __repr__(self) -> str:
        return f"OpaqueRef({self.value!r})"


register_opaque_type(OpaqueRef, typ="reference")
