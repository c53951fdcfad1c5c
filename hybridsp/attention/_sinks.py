"""Learned attention sinks (GPT-OSS's ``s_aux``): one extra logit per query head, with value zero.

A sink ``s_h`` acts as one more key that every query row of head ``h`` sees, with logit ``s_h``
(not scaled, not soft-capped) and a zero value. It enters the log-sum-exp merge once per row,
after every key block has been merged (:func:`merge_sinks`):

    lse' = logaddexp(lse, s_h)        out' = out * exp(lse - lse') = out * sigmoid(lse - s_h)

Backward: each kernel's backward given the *final* ``out'`` / ``lse'`` is exact for dq, dk and dv
(``exp(score - lse')`` are the real keys' probabilities, and the ``rowsum(dout * out')`` every
kernel subtracts is ``sum_j p_j dout.v_j`` including the sink, whose value is zero). The sink's
own gradient (:func:`sink_grad`) is

    d s_h = - sum over rows of exp(s_h - lse') * rowsum(dout * out')

Note [sink gradient convention]: a rank's ``sinks.grad`` is the sum over the query rows it
computes (its tokens; under Ulysses its head slice of the ring slot's tokens, and zero for the
other heads). Summed over the context ranks, as every parameter gradient under sequence
parallelism is, it is the gradient of one process over the whole sequence.

Shapes: out [B, S, H, Dv], lse [B, H, S] (accumulation dtype), sinks [H] (any float dtype).
"""

from __future__ import annotations

import torch


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out' [B, S, H, Dv], lse' [B, H, S]) in lse's dtype: the sinks [H] merged in once per row.

    A row that saw no key (lse -inf) keeps out 0; a NaN lse stays NaN.
    """
    logit = sinks.to(lse.dtype).view(1, -1, 1)  # [1, H, 1]
    final = torch.logaddexp(lse, logit.expand_as(lse))  # [B, H, S]
    weight = torch.sigmoid(lse - logit).masked_fill_(torch.isneginf(lse), 0.0)  # [B, H, S] = exp(lse - lse')
    return out.to(lse.dtype) * weight.transpose(1, 2).unsqueeze(-1), final  # [B, S, H, Dv]


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d sinks [H] in sinks' dtype, from dout / final out [B, S, H, Dv] and final lse [B, H, S]
    (Note [sink gradient convention])."""
    acc = lse.dtype
    row_dot = (dout.to(acc) * out.to(acc)).sum(-1)  # [B, S, H]
    final = lse.transpose(1, 2)  # [B, S, H]
    prob = torch.exp(sinks.to(acc).view(1, 1, -1) - final).masked_fill_(torch.isneginf(final), 0.0)  # [B, S, H]
    return -(prob * row_dot).sum(dim=(0, 1)).to(sinks.dtype)  # [H]
