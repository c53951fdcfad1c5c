"""Which tokens each rank holds and which of them see each other.

Public: the token layouts (:class:`TokenLayout`; :class:`Zigzag`, :class:`Contiguous`,
:class:`Balanced`; :func:`get_layout` by name), a batch's packed documents (:class:`Documents`,
normalised once per batch) and the block plan (:class:`BlockPlan` of :class:`Piece` s: the visible
pieces of every block, masks as data; :func:`build_plan`).

Inside: ``_layouts``, ``_runs_cache``, ``_documents``, ``_block_plan`` (with ``_pieces``: a plan's
pieces and their merging), ``_balance/`` (the document-balanced runs).
"""

from hybridsp._types import LayoutName
from hybridsp.layout._block_plan import BlockPlan, Piece, build_plan
from hybridsp.layout._documents import Documents
from hybridsp.layout._layouts import LAYOUTS, Balanced, Contiguous, TokenLayout, Zigzag, get_layout

__all__ = [
    "LAYOUTS",
    "Balanced",
    "BlockPlan",
    "Contiguous",
    "Documents",
    "LayoutName",
    "Piece",
    "TokenLayout",
    "Zigzag",
    "build_plan",
    "get_layout",
]
