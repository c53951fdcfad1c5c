"""Losses over a sequence sharded across the context group, token-weighted over the whole sequence.

Public: :func:`sharded_cross_entropy`, :func:`fused_cross_entropy` (no logits held),
:func:`token_logprobs` / :func:`sequence_logprobs` (with :func:`gather_tokens` and :func:`context_sum`, the
pieces they are made of), :func:`sharded_load_balancing_loss` and
:func:`real_token_mask` (an MoE router's auxiliary loss). Inside: ``_token_tail`` (the tail every
loss shares), ``_cross_entropy``, ``_fused``, ``_logprobs``, ``_router``.
"""

from hybridsp.losses._cross_entropy import sharded_cross_entropy
from hybridsp.losses._fused import fused_cross_entropy
from hybridsp.losses._logprobs import context_sum, gather_tokens, sequence_logprobs, token_logprobs
from hybridsp.losses._router import real_token_mask, sharded_load_balancing_loss

__all__ = [
    "context_sum",
    "fused_cross_entropy",
    "gather_tokens",
    "real_token_mask",
    "sequence_logprobs",
    "sharded_cross_entropy",
    "sharded_load_balancing_loss",
    "token_logprobs",
]
