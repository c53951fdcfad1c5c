"""Losses over a sequence sharded across the context group.

``token_tail`` (the token-weighted tail every loss shares), ``cross_entropy`` (``sharded_cross_entropy``),
``fused`` (``fused_cross_entropy`` without logits), ``logprobs`` (per-token and per-sequence log-probs).
"""
