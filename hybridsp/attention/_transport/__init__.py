"""How K/V blocks reach the ring's ranks, behind one protocol (:class:`~.base.Transport`, handing
out :class:`~.base.Block` s): ``p2p`` (``kv_comm="ring"``), ``allgather`` (``kv_comm="allgather"``),
``local`` (a ring of one), ``exchange`` (batched point-to-point sends and every tag they use).
"""
