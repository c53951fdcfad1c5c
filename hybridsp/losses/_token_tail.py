"""The token-weighted tail shared by every sharded loss: labels guarded, one all-reduce, the scaled share.

:func:`hybridsp.sharded_cross_entropy`, :func:`hybridsp.fused_cross_entropy` and the HF Trainer's
loss (:func:`hybridsp.integrations.transformers._loss.share_of_loss`) all end the same way: this rank has the sum of its
tokens' losses; the value must be the mean over the whole context group's valid tokens and the
gradient this rank's share. The pieces:

    safe, bad = guard_labels(shift_labels, vocab, ignore_index)     # before the loss kernel
    local_sum = <cross-entropy sum over safe>                        # any kernel
    loss = token_weighted_share(local_sum, safe, bad, shift_labels, mesh, vocab=..., ignore_index=...)

Note [bad labels]: a target outside ``[0, V)`` makes ``cross_entropy`` raise on the rank that
holds it, before the all-reduce; the other ranks would then wait in the collective (with NCCL
until its timeout). :func:`guard_labels` replaces such targets by ``ignore_index`` so the kernel
runs everywhere, :func:`token_weighted_share` counts them in the same all-reduce as the loss
(no extra collective) and every rank of the context group raises the same ValueError together.
The log-probabilities (:mod:`hybridsp.losses._logprobs`) use the same guard: their all-reduce of the
sums carries the count too, and a per-token call given the mesh agrees on it in
:func:`agree_on_labels`.

Under ``torch.compile`` the check is the operator ``torch.ops.hybridsp.checked_totals`` (it reads the
count on the host and raises there; the graph does not break, and it returns the totals the loss uses,
so it is never dropped).

Labels of any integer dtype (int32 from a numpy pipeline, int64) are accepted; the kernel gets int64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridsp.mesh._hybrid_mesh import HybridMesh


def guard_labels(shift_labels: torch.Tensor, vocab: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(safe int64 labels, bad mask), both [B, S_local]: targets outside ``[0, vocab)`` (other than
    ``ignore_index``) are marked bad and replaced by ``ignore_index`` (Note [bad labels])."""
    if shift_labels.is_floating_point() or shift_labels.is_complex() or shift_labels.dtype == torch.bool:
        raise ValueError(f"shift_labels must hold integer token ids; got dtype {shift_labels.dtype}")
    labels = shift_labels.long()  # [B, S_local]; int32/int16/uint8 labels are fine
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))  # [B, S_local]
    return labels.masked_fill(bad, ignore_index), bad


def token_weighted_share(
    local_sum: torch.Tensor,
    safe_labels: torch.Tensor,
    bad: torch.Tensor,
    shift_labels: torch.Tensor,
    mesh: HybridMesh,
    *,
    vocab: int,
    ignore_index: int,
    denominator: torch.Tensor | float | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """``scale x (local_sum + rest of the group's sum) / N``: value the group's loss, gradient this rank's share.

    Args:
        local_sum: 0-dim sum of this rank's token losses (with autograd).
        safe_labels, bad: :func:`guard_labels`' output [B, S_local].
        shift_labels: the caller's labels (only quoted in the bad-label error).
        mesh: the reduction runs over ``mesh.context_group`` (one no-grad fp64 all_reduce of 3 numbers).
        vocab, ignore_index: as given to :func:`guard_labels`.
        denominator: N; default the context group's count of valid tokens. The Trainer passes the
            step's count over replicas and accumulation steps (a tensor or number).
        scale: multiplies value and gradient (the Trainer's ``mesh.dp``).

    Returns:
        0-dim fp32 tensor. ``N`` is clamped to at least 1: no valid token gives 0, never NaN.
        Raises ValueError on every context rank together when any rank had a bad label.
    """
    local_count = (safe_labels != ignore_index).sum()
    totals = torch.stack([local_sum.detach().double(), local_count.double(), bad.sum().double()])  # [3]
    if mesh.context > 1:
        with torch.no_grad():
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=mesh.context_group)
    if torch.compiler.is_compiling():  # the host read in an operator: no graph break (Note [bad labels])
        totals = torch.ops.hybridsp.checked_totals(totals, shift_labels, bad, vocab, ignore_index, mesh.rank)
    else:
        raise_on_bad_labels(int(totals[2].item()), shift_labels, bad, vocab, ignore_index, mesh)
    count = totals[1] if denominator is None else torch.as_tensor(denominator, device=totals.device).double()
    others = (totals[0] - local_sum.detach().double()).float()  # the rest of the group's loss: value only
    return (local_sum + others) / (count.clamp_min(1.0) / scale).float()


def agree_on_labels(
    shift_labels: torch.Tensor, bad: torch.Tensor, mesh: HybridMesh | None, *, vocab: int, ignore_index: int
) -> None:
    """ValueError on every context rank together when any rank's ``bad`` [B, S_local] (from
    :func:`guard_labels`) is set: one no-grad all_reduce of one number over ``mesh.context_group``;
    no communication for ``mesh=None`` or a context of one (then only this rank's labels count)."""
    total = bad.sum().double()  # 0-dim
    if mesh is not None and mesh.context > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mesh.context_group)
    raise_on_bad_labels(int(total.item()), shift_labels, bad, vocab, ignore_index, mesh)


def raise_on_bad_labels(
    total_bad: int,
    shift_labels: torch.Tensor,
    bad: torch.Tensor,
    vocab: int,
    ignore_index: int,
    mesh: HybridMesh | None,
) -> None:
    """ValueError quoting the count and a few ids when the group holds any bad label (Note [bad labels]).

    ``mesh`` only names this rank in the message (None: a single process, rank 0)."""
    if total_bad == 0:
        return
    raise ValueError(
        _bad_labels_message(total_bad, shift_labels, bad, vocab, ignore_index, 0 if mesh is None else mesh.rank)
    )


def _bad_labels_message(
    total_bad: int, shift_labels: torch.Tensor, bad: torch.Tensor, vocab: int, ignore_index: int, rank: int
) -> str:
    local = shift_labels[bad][:4].tolist()
    return (
        f"{total_bad} target id(s) in shift_labels lie outside the vocabulary [0, {vocab}) of the logits "
        f"(ignore_index={ignore_index}); this rank ({rank}) has {int(bad.sum())}, e.g. {local}. "
        f"Check the tokenizer's vocabulary against the model's vocab_size"
    )


@torch.library.custom_op("hybridsp::checked_totals", mutates_args=())
def _checked_totals(
    totals: torch.Tensor, shift_labels: torch.Tensor, bad: torch.Tensor, vocab: int, ignore_index: int, rank: int
) -> torch.Tensor:
    """A copy of ``totals`` [3] (loss sum, count, bad count) once the bad count is 0, else the ValueError."""
    total_bad = int(totals[2].item())
    if total_bad:
        raise ValueError(_bad_labels_message(total_bad, shift_labels, bad, vocab, ignore_index, rank))
    return totals.clone()


@_checked_totals.register_fake
def _(
    totals: torch.Tensor, shift_labels: torch.Tensor, bad: torch.Tensor, vocab: int, ignore_index: int, rank: int
) -> torch.Tensor:
    return torch.empty_like(totals)
