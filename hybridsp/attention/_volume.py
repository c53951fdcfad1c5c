"""Analytic bytes each rank sends in one hybrid attention forward + backward.

The formulas themselves live in :mod:`hybridsp._formulas` (torch-free, shared with the planner);
this module adds :func:`hybrid_bytes` with a ``plan`` argument: the rows a call's
:class:`~hybridsp.layout._block_plan.BlockPlan` ships (packed documents, windows, the balanced layout), which the
byte counter is tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridsp import _formulas as formulas

if TYPE_CHECKING:
    from hybridsp.layout._block_plan import BlockPlan


def hybrid_bytes(*, plan: BlockPlan | None = None, **shape: Any) -> dict[str, int]:
    """:func:`hybridsp._formulas.hybrid_bytes`; with ``plan`` (the call's
    :class:`~hybridsp.layout._block_plan.BlockPlan`: packed documents, windows, the balanced layout) the ring rows
    are the plan's hulls (``rows_sent`` / ``rows_received``) instead of the dense formula."""
    rank = shape.get("ring_rank", 0)
    rows = None if plan is None else (plan.rows_sent(rank), plan.rows_received(rank))
    return formulas.hybrid_bytes(**shape, rows=rows)
