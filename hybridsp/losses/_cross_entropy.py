"""Token-weighted cross-entropy over a sequence sharded across the context group.

Each context rank holds ``S / C`` tokens of every sequence (:func:`hybridsp.shard_batch`
lays them out and shifts the labels first). The unsharded loss is the mean over every
non-ignored token of the full batch,

    loss = sum_c local_sum_c / sum_c local_count_c

so every rank needs the *global* count, never its own (a rank with few valid tokens must
not weigh as much as one with many). :func:`sharded_cross_entropy` returns

    value     sum_c local_sum_c / N           the unsharded loss, equal on every context rank
    gradient  d(local_sum) / N                this rank's share

with ``N = max(1, global count)``, found by one no-grad ``all_reduce`` over
``mesh.context_group`` (no autograd through a collective). Summed over the context group,
the parameter gradients equal the unsharded model's: that is what DeepSpeed ZeRO 0-2 does
when it treats the context ranks as extra data-parallel ranks (sum over DP x context, divide
by DP). A wrapper that *averages* over the context ranks too sees 1/C of that.

A shard, or the whole batch, with no valid token gives loss 0 and zero gradients, never NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridsp.losses._token_tail import guard_labels, token_weighted_share
from hybridsp.mesh._hybrid_mesh import HybridMesh

IGNORE_INDEX = -100


def sharded_cross_entropy(
    logits: torch.Tensor, shift_labels: torch.Tensor, mesh: HybridMesh, *, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Cross-entropy of this rank's tokens, weighted by the context group's token count.

    Args:
        logits: [B, S_local, V] this rank's logits (any float dtype; reduced in fp32).
        shift_labels: [B, S_local] integer targets, already shifted on the full sequence
            (``shard_batch(...)["shift_labels"]``); ``ignore_index`` marks no loss.
        mesh: the :class:`~hybridsp.mesh._hybrid_mesh.HybridMesh`; the reduction runs over ``mesh.context_group``.
        ignore_index: target value that contributes neither loss nor count.

    Returns:
        0-dim fp32 tensor: the value is the full batch's mean loss (the same on every rank of
        the context group); the gradient is this rank's share (see the module docstring).
        A collective over the context group: every context rank must call it.
    """
    _check_shapes(logits, shift_labels)
    vocab = logits.shape[-1]
    safe_labels, bad = guard_labels(shift_labels, vocab, ignore_index)  # [B, S_local]; Note [bad labels]
    local_sum = F.cross_entropy(
        logits.reshape(-1, vocab).float(), safe_labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )  # an all-ignored shard sums to exactly 0
    return token_weighted_share(local_sum, safe_labels, bad, shift_labels, mesh, vocab=vocab, ignore_index=ignore_index)


def _check_shapes(logits: torch.Tensor, shift_labels: torch.Tensor) -> None:
    """Raise ValueError, quoting the shapes, unless logits [B, S, V] match labels [B, S]."""
    if logits.dim() < 2 or tuple(logits.shape[:-1]) != tuple(shift_labels.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} do not match: "
            f"expected logits [B, S_local, V] and shift_labels [B, S_local]; pass this rank's logits and "
            f"the shift_labels that shard_batch returned for the same rank"
        )
