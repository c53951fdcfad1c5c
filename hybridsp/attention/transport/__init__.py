"""How K/V blocks reach the ring's ranks: ``p2p`` (``kv_comm="ring"``), ``allgather``
(``kv_comm="allgather"``), ``exchange`` (batched point-to-point sends and their tags).
"""
