"""Which tokens each rank holds and which of them see each other.

``layouts`` (``Zigzag``, ``Contiguous``, ``Balanced``: permutations, shards), ``documents`` (a batch's
packed documents, normalised once), ``block_plan`` (masks as data: the visible pieces of every block),
``balance/`` (the document-balanced runs).
"""
