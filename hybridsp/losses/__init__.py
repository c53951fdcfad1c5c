"""Losses over a sequence sharded across the context group, token-weighted over the whole sequence.

Public: :func:`sharded_cross_entropy`, :func:`fused_cross_entropy` (no logits held),
:func:`token_logprobs` / :func:`sequence_logprobs`, :func:`sharded_load_balancing_loss` and
:func:`real_token_mask` (an MoE router's auxiliary loss). Inside: ``_token_tail`` (the tail every
loss shares), ``_cross_entropy``, ``_fused``, ``_logprobs``, ``_router``.
"""

from hybridsp.losses._cross_entropy import sharded_cross_entropy
from hybridsp.losses._fused import fused_cross_entropy
from hybridsp.losses._logprobs import sequence_logprobs, token_logprobs
from hybridsp.losses._router import real_token_mask, sharded_load_balancing_loss

__all__ = [
    "fused_cross_entropy",
    "real_token_mask",
    "sequence_logprobs",
    "sharded_cross_entropy",
    "sharded_load_balancing_loss",
    "token_logprobs",
]
