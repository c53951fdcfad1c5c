"""Merging partial attention results by their log-sum-exp, in fp32.

If a query row attends to key blocks ``A`` and ``B`` separately, with results
``(out_a, lse_a)`` and ``(out_b, lse_b)``, the attention over ``A u B`` is

    lse = log(exp(lse_a) + exp(lse_b))
    out = sigmoid(lse_a - lse_b) * out_a + sigmoid(lse_b - lse_a) * out_b

(the two weights are exp(lse_a - lse) and exp(lse_b - lse), written through the difference
of the lse values so that nothing overflows or loses digits when the lse are large). A block in which a row saw no key carries
``lse = -inf`` (weight 0); some kernels say ``+inf`` for that, which is normalised to
``-inf`` first (Note [no key] in :mod:`hybridsp.kernels._base`). A row that has seen no key in any block keeps ``out = 0, lse = -inf``. A NaN
log-sum-exp (a NaN in the inputs) is not "no key": it propagates to the row's output, as it would
in one kernel call over the whole sequence.
"""

from __future__ import annotations

import torch

from hybridsp.kernels._base import as_dtype, no_key_lse_to_neg_inf


def _block_weight(lse_acc: torch.Tensor, block_lse: torch.Tensor) -> torch.Tensor:
    """exp(block_lse - lse) = sigmoid(block_lse - lse_acc) as [B, S, H, 1]; 0 where neither saw a key.

    Computed from the difference alone, so it stays exact when both lse are huge; the
    accumulator's own weight is ``1 - weight``, which :meth:`torch.Tensor.lerp_` applies.
    """
    diff = block_lse - lse_acc  # [B, H, S]; nan where both are -inf, or where either is nan
    weight = torch.sigmoid(diff).masked_fill_(torch.isneginf(block_lse), 0.0)  # a block with no key weighs 0;
    return weight.transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]     a nan lse (nan input) stays nan


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's result into the running accumulators (fp32, or fp64), in place.

    Args:
        out_acc: [B, S, H, D] running output in the accumulation dtype (may be a view of a larger buffer).
        lse_acc: [B, H, S] running log-sum-exp in the same dtype, -inf where nothing was seen yet.
        block_out: [B, S, H, D] this block's output, any float dtype.
        block_lse: [B, H, S] this block's log-sum-exp.
    """
    block_lse = no_key_lse_to_neg_inf(as_dtype(block_lse, lse_acc.dtype))
    out_acc.lerp_(as_dtype(block_out, out_acc.dtype), _block_weight(lse_acc, block_lse))
    lse_acc.copy_(torch.logaddexp(lse_acc, block_lse))


def merge_blocks(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge several blocks' (out [B, S, H, D], lse [B, H, S]) for the same query rows.

    Returns (out [B, S, H, D], lse [B, H, S]) in fp32 (fp64 for fp64 inputs).
    """
    acc = torch.promote_types(outs[0].dtype, torch.float32)
    out_acc = torch.zeros_like(outs[0], dtype=acc)
    lse_acc = torch.full_like(lses[0], -torch.inf, dtype=acc)
    for out, lse in zip(outs, lses):
        merge_into(out_acc, lse_acc, out, lse)
    return out_acc, lse_acc
