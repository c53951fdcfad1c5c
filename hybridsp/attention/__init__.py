"""One attention call: Ulysses all-to-all around a ring of K/V blocks.

``api`` (``hybrid_attn_func``, ``HybridAttention``, ``shard_sequence``, ``gather_sequence``) -> ``resolve``
(validate and resolve once: ``RingCall``) -> ``ulysses`` (the all-to-alls) -> ``ring`` / ``ring_function``
(the one autograd shell) over a ``transport/`` -> ``pieces`` / ``varlen`` (a block's plan pieces through
the kernel) -> ``merge`` (log-sum-exp). ``volume``: analytic bytes of one call.
"""
