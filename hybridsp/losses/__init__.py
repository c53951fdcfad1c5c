"""Losses over a sequence sharded across the context group.

``token_tail`` (the token-weighted tail every loss shares), ``cross_entropy`` (``sharded_cross_entropy``),
``fused`` (``fused_cross_entropy`` without logits), ``logprobs`` (per-token and per-sequence log-probs),
``router`` (``sharded_load_balancing_loss``: the MoE auxiliary loss of the whole sequence).
"""
