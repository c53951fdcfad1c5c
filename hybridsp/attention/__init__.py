"""One attention call: Ulysses all-to-all around a ring of K/V blocks.

The public names: :func:`hybrid_attn_func` (and its module form :class:`HybridAttention`),
:func:`ring_attention` (the ring axis alone), :func:`shard_sequence` / :func:`gather_sequence`
(a full tensor to this rank's tokens and back), :class:`CallSpec` (one call's settings as one
object) and :func:`hybrid_bytes` (the bytes one call sends, analytically).

Inside (private modules): ``_api`` -> ``_spec`` / ``_resolve`` (validate and resolve once:
``RingCall``) -> ``_ulysses`` (the all-to-alls) -> ``_ring`` / ``_ring_function`` (the one autograd
shell) over a ``_transport/`` -> ``_pieces`` / ``_varlen`` / ``_stacked`` (a block's plan pieces
through the kernel) -> ``_merge`` (log-sum-exp), ``_sinks``; ``_compiled`` under ``torch.compile``.
"""

from hybridsp._types import KVComm
from hybridsp.attention._api import HybridAttention, gather_sequence, hybrid_attn_func, shard_sequence
from hybridsp.attention._ring import ring_attention
from hybridsp.attention._spec import CallSpec
from hybridsp.attention._volume import hybrid_bytes

__all__ = [
    "CallSpec",
    "HybridAttention",
    "KVComm",
    "gather_sequence",
    "hybrid_attn_func",
    "hybrid_bytes",
    "ring_attention",
    "shard_sequence",
]
