"""Per-token and per-sequence log-probabilities of sequences sharded over the context group.

Preference and RL losses (DPO, IPO, KTO, ORPO, GRPO, RLOO) are functions of each sequence's
summed token log-probabilities ``logp[b] = sum_i log p(y[b, i+1] | y[b, :i+1])`` over its scored
tokens, or of the per-token values themselves. Under sequence parallelism every rank of a
context group holds ``S / C`` tokens of every sequence (:func:`hybridsp.shard_batch`), so each
rank sees only part of each sum. The helpers here complete them:

    local = shard_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, mesh)
    logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                   hybridsp_documents=local["documents"]).logits
    logp = sequence_logprobs(logits, local["shift_labels"], mesh)      # [B], the full sums
    loss = -F.logsigmoid(beta * ((logp[:B//2] - ref[:B//2]) - (logp[B//2:] - ref[B//2:]))).mean()
    loss.backward()                                                   # this rank's share

Note [local gradient]: :func:`context_sum` and :func:`gather_tokens` return the *full* value
on every context rank, but only this rank's own part carries a gradient (the other ranks'
parts enter as constants). Any loss ``L`` built from them has the unsharded value on every
rank, and this rank's backward gives ``dL/d(full) * d(local)/d(params)`` restricted to its own
tokens. Summed over the context ranks, that is exactly ``dL/d(params)`` of the unsharded
model (chain rule: ``d full / d params = sum_c d local_c / d params``), for any
differentiable ``L``, however non-linear in the sums. This is the same contract as
:func:`hybridsp.sharded_cross_entropy`: the parameter gradients must be *summed* over the
context ranks (DeepSpeed ZeRO 0-2 do; ZeRO-3 and DDP average, see
:func:`hybridsp.integrations.deepspeed._engine.scale_gradients`). One collective per call, no autograd
through it.

A target outside ``[0, V)`` (other than ``ignore_index``) is a ValueError quoting the count and a few
ids, raised on every context rank together, as for :func:`hybridsp.sharded_cross_entropy` (Note [bad
labels] in :mod:`hybridsp.losses._token_tail`, the one guard they share): :func:`sequence_logprobs`
counts such targets in its one all-reduce, :func:`token_logprobs` given ``mesh`` in one all-reduce of
one number (without ``mesh`` it raises on the rank that holds them, with no communication).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridsp.attention._api import gather_sequence, shard_sequence
from hybridsp.attention._spec import CuSeqlens
from hybridsp.losses._cross_entropy import IGNORE_INDEX
from hybridsp.losses._token_tail import agree_on_labels, guard_labels, raise_on_bad_labels
from hybridsp.mesh._hybrid_mesh import HybridMesh


def context_sum(local: torch.Tensor, mesh: HybridMesh) -> torch.Tensor:
    """The sum of ``local`` over the context group; the gradient is ``local``'s own (Note [local gradient]).

    ``local`` any shape (e.g. [B] per-sequence partial sums), the same shape on every context
    rank. One no-grad all_reduce over ``mesh.context_group`` (every context rank must call it).
    """
    if mesh.context == 1:
        return local
    total = local.detach().clone()
    with torch.no_grad():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mesh.context_group)
    return local + (total - local.detach())  # value: the group's sum; gradient: the identity on local


def gather_tokens(local: torch.Tensor, mesh: HybridMesh, cu_seqlens: CuSeqlens = None) -> torch.Tensor:
    """Per-token values of this rank's shard [B, S/C, ...] -> the full sequence [B, S, ...] in token order.

    Every context rank gets the same values; only this rank's own positions carry a gradient
    (Note [local gradient]). Works for any dtype (booleans, counts). ``cu_seqlens``: the batch's
    documents (``shard_batch(...)["documents"]``), needed by layouts that place tokens by
    document (``layout="balanced"``). One all_gather over ``mesh.context_group``.
    """
    if mesh.context == 1:
        return local
    full = gather_sequence(local.detach(), mesh, cu_seqlens=cu_seqlens)  # [B, S, ...] in token order, no autograd
    if not local.requires_grad:
        return full
    positions = torch.arange(full.shape[1], device=local.device).expand(full.shape[:2])  # [B, S]
    mine = shard_sequence(positions, mesh, cu_seqlens=cu_seqlens)  # [B, S/C]: the positions this rank holds
    mine = mine.reshape(*mine.shape, *([1] * (local.dim() - 2))).expand_as(local)  # [B, S/C, ...]
    return full.scatter(1, mine, local)  # [B, S, ...]: own positions differentiable


def token_logprobs(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    *,
    mesh: HybridMesh | None = None,
) -> torch.Tensor:
    """``log p(shift_labels)`` under ``logits``, per token, in fp32; 0 where the label is ``ignore_index``.

    ``logits`` [B, S_local, V], ``shift_labels`` [B, S_local] (already shifted on the full
    sequence, as :func:`hybridsp.shard_batch` returns them) -> [B, S_local]. ``mesh``: pass it when
    the shards go on to a collective (:func:`gather_tokens`), so that a target outside the
    vocabulary raises on every context rank (one all_reduce of one number); without it there is
    no communication and only the rank holding such a target raises (module docstring).
    """
    logp, bad = _guarded_token_logprobs(logits, shift_labels, ignore_index)  # [B, S_local] each
    agree_on_labels(shift_labels, bad, mesh, vocab=logits.shape[-1], ignore_index=ignore_index)
    return logp


def _guarded_token_logprobs(
    logits: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [B, S_local] fp32, 0 where ignored or bad; bad-target mask [B, S_local]) of logits
    [B, S_local, V]: targets outside the vocabulary are ignored here and reported by the caller."""
    if tuple(logits.shape[:-1]) != tuple(shift_labels.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} do not match: expected "
            f"logits [B, S_local, V] and shift_labels [B, S_local] of the same rank"
        )
    vocab = logits.shape[-1]
    safe_labels, bad = guard_labels(shift_labels, vocab, ignore_index)  # Note [bad labels] in token_tail
    nll = F.cross_entropy(
        logits.reshape(-1, vocab).float(), safe_labels.reshape(-1), ignore_index=ignore_index, reduction="none"
    )  # [B * S_local], 0 where ignored
    return -nll.view(shift_labels.shape), bad  # [B, S_local]


def sequence_logprobs(
    logits: torch.Tensor, shift_labels: torch.Tensor, mesh: HybridMesh, *, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Each sequence's summed log-probability of its scored tokens, over the whole (sharded) sequence.

    Args:
        logits: [B, S_local, V] this rank's logits.
        shift_labels: [B, S_local] this rank's targets (``shard_batch(...)["shift_labels"]``);
            ``ignore_index`` marks tokens that are not scored (prompt, padding).
        mesh: the context group the sequence is sharded over.

    Returns:
        [B] fp32, the unsharded sums on every context rank, with this rank's share of the
        gradient (Note [local gradient]). One all_reduce of B + 1 numbers over the context group
        (the sums and the count of targets outside the vocabulary: ValueError on every rank if any).
    """
    logp, bad = _guarded_token_logprobs(logits, shift_labels, ignore_index)  # [B, S_local] each
    sums = logp.sum(dim=1)  # [B]
    totals = context_sum(torch.cat([sums, bad.sum().to(sums.dtype).reshape(1)]), mesh)  # [B + 1]
    raise_on_bad_labels(int(totals[-1].item()), shift_labels, bad, logits.shape[-1], ignore_index, mesh)
    return totals[:-1]  # [B]
