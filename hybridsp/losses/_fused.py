"""Fused linear + cross-entropy: the loss of ``hidden @ weight.T`` without the [B, S_local, V] logits.

At long context the logits are the largest tensor of a step: ``S/C x V`` per rank, in fp32 for
the loss, and autograd keeps the log-softmax and builds a gradient of the same size.
:func:`fused_cross_entropy` walks the local tokens in chunks of ``c``; for each chunk it builds
the chunk's logits ``[c, V]`` in fp32, takes the loss, turns the logits *in place* into their
gradient ``softmax - onehot`` and immediately contracts it into the gradients of the hidden
states (``[c, h]``) and of the weight (``[V, h]``, accumulated in fp32 over the chunks).

Note [gradient in the forward]: the gradients are computed during the forward pass and kept
for backward (``d hidden`` [B, S_local, h] in the hidden dtype, ``d weight`` [V, h] in fp32),
rather than recomputing each chunk's logits in backward. Reasons: 3 matmuls per chunk instead
of 4; and the weight is needed only once per step, so under ZeRO-3 the partitioned ``lm_head``
is gathered once (in the forward) and backward needs no gather at all. The cost is that both
gradients are held from the loss's forward to its backward, which directly follows it (the loss
is the last op of the forward), so the step's peak does not grow by more than they already
cost in backward. The loss's scale ``1 / N`` (N = valid tokens of the whole context group) is
applied outside, by autograd, exactly as :func:`hybridsp.sharded_cross_entropy` does; backward
scales the kept gradients in place (no second copy), so it runs once (``retain_graph`` refused).

Note [ZeRO-3]: through a module call (``causal_lm_loss``) DeepSpeed's own hooks gather the
``lm_head`` weight once for the forward and take its gradient as for any ``lm_head`` call. Called
directly on a partitioned weight, the weight is gathered once for the call
(``deepspeed.zero.GatheredParameters``, one all-gather for all chunks) and partitioned again
when it returns; its gradient, made in the forward, lands in backward on the parameter's own
``AccumulateGrad`` node (:func:`hybridsp.memory._sharded_params.land_full_gradient` gives the partitioned
parameter its full shape for that moment, no second all-gather), so DeepSpeed's gradient hook
reduce-scatters it exactly once, summed with a tied embedding's gradient by autograd as for
any shared parameter.

Memory (fp32 inputs; T = B x S_local tokens, c = chunk rows, default ``c ~ T h / V``: the
chunk's logits are as large as the hidden states): ``c x V x 4`` bytes for the chunk's
logits/gradient (the gradient is made in place), ``V x h x 4`` for the fp32 weight-gradient
accumulator (added into in place: ``addmm_``) and ``T x h x 4`` for the hidden gradient,
instead of ``~4 x T x V x 4`` on the logits path. bf16 inputs add the chunk's bf16 logits
``c x V x 2`` and the chunk's bf16 weight-gradient product ``V x h x 2`` with its fp32 cast
``V x h x 4`` (measured: 188 MiB at T = 8192, V = 32000, h = 512, c = 132), keep the hidden
gradient in bf16 (``T x h x 2``) and cast the weight gradient once in backward (one more
``V x h x 2``).

Precision: the logits are formed in the input dtype (bf16 matmuls accumulate in fp32) and
reduced in fp32, as ``sharded_cross_entropy(logits.float())`` does; per-chunk weight gradients
are summed in fp32 and cast to the weight's dtype once.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridsp._checks import check_positive
from hybridsp._formulas import default_chunk_size
from hybridsp.losses._cross_entropy import IGNORE_INDEX
from hybridsp.losses._token_tail import guard_labels, token_weighted_share
from hybridsp.memory._sharded_params import gathered, land_full_gradient
from hybridsp.mesh._hybrid_mesh import HybridMesh


def fused_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    shift_labels: torch.Tensor,
    mesh: HybridMesh,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``sharded_cross_entropy(hidden @ weight.T, shift_labels, mesh)`` without building the logits.

    Args:
        hidden: [B, S_local, h] this rank's final hidden states (after the last norm), fp32/bf16/fp16.
        weight: [V, h] the output projection (``lm_head.weight``; a tied input embedding works the
            same), the same dtype as ``hidden``. Under ZeRO-3 call it where the weight is gathered
            (inside the lm_head call: :func:`~hybridsp.integrations.transformers.causal_lm_loss`) or
            directly on the partitioned weight: it is gathered once for the call and its gradient
            reaches ZeRO-3's reduction once, as from a module (Note [ZeRO-3]).
        shift_labels: [B, S_local] integer targets, shifted on the full sequence
            (``shard_batch(...)["shift_labels"]``); ``ignore_index`` marks no loss.
        mesh: the :class:`~hybridsp.mesh._hybrid_mesh.HybridMesh`; the token count is reduced over ``mesh.context_group``.
        ignore_index: target value that contributes neither loss nor count.
        chunk_size: tokens per chunk (default :func:`default_chunk_size` of V, B x S_local and h: the
            chunk's logits as large as ``hidden``, at most 64 MiB); at most ``chunk_size x V`` logits
            exist at a time.

    Returns:
        0-dim fp32 tensor with :func:`hybridsp.sharded_cross_entropy`'s semantics: the value is the
        full batch's token-weighted mean loss on every context rank, the gradients (w.r.t. ``hidden``
        and ``weight``) this rank's share. A collective over the context group.
    """
    vocab = _check_inputs(hidden, weight, shift_labels, ignore_index, chunk_size)
    tokens = hidden.shape[0] * hidden.shape[1]
    chunk = default_chunk_size(vocab, tokens, hidden.shape[-1]) if chunk_size is None else chunk_size
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    safe_labels, bad = guard_labels(shift_labels, vocab, ignore_index)  # [B, S_local]; Note [bad labels]
    with gathered([weight]):
        if needs_grad:
            local_sum = _FusedLinearCrossEntropy.apply(hidden, weight, safe_labels, ignore_index, chunk)
            land_full_gradient(local_sum, 1, weight)  # ZeRO-3: Note [ZeRO-3]
        else:
            local_sum = _chunked_loss(hidden, weight, safe_labels, ignore_index, chunk)
    return token_weighted_share(local_sum, safe_labels, bad, shift_labels, mesh, vocab=vocab, ignore_index=ignore_index)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """local_sum = sum of CE over this rank's valid tokens; gradients made in forward (Note above)."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int, chunk: int
    ) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])  # [T, h]
        labels = shift_labels.reshape(-1)  # [T]
        grad_hidden = torch.empty_like(flat) if ctx.needs_input_grad[0] else None  # [T, h]
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )  # [V, h] fp32 accumulator
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, flat.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = _chunk_logits(flat[rows], weight)  # [c, V] fp32
            total += _loss_and_grad_(logits, labels[rows], ignore_index)  # logits now hold d loss / d logits
            grad_logits = logits.to(weight.dtype)  # [c, V]; no copy for fp32
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])
            if grad_weight is not None and flat.dtype == torch.float32:
                grad_weight.addmm_(grad_logits.t(), flat[rows])  # [V, h], in place: no [V, h] temporary
            elif grad_weight is not None:  # [V, h]: the product in the input dtype, cast to fp32 and summed
                grad_weight += (grad_logits.t() @ flat[rows]).float()
            del logits, grad_logits
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.hidden_shape, ctx.weight_dtype, ctx.consumed = hidden.shape, weight.dtype, False
        return total

    @staticmethod
    def backward(
        ctx: Any, grad_total: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        if ctx.consumed:
            raise RuntimeError(
                "fused_cross_entropy's gradients are made in its forward and handed out once: a second "
                "backward through the same loss (retain_graph=True) is not supported; call it again"
            )
        ctx.consumed = True
        grad_hidden, grad_weight = ctx.saved_tensors
        d_hidden = d_weight = None
        if grad_hidden is not None:  # scaled in place: no second hidden- or weight-sized buffer
            d_hidden = grad_hidden.mul_(grad_total.to(grad_hidden.dtype)).reshape(ctx.hidden_shape)  # [B, S, h]
        if grad_weight is not None:
            d_weight = grad_weight.mul_(grad_total).to(ctx.weight_dtype)  # [V, h]
        return d_hidden, d_weight, None, None, None


def _chunk_logits(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[c, h] x [V, h] -> [c, V] fp32 (the matmul in the input dtype, as the logits path does)."""
    return (rows @ weight.t()).float()


def _loss_and_grad_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Sum of CE over the valid rows of ``logits`` [c, V] fp32; turns ``logits`` into d sum / d logits."""
    valid = labels != ignore_index  # [c]
    safe = torch.where(valid, labels, torch.zeros_like(labels))  # [c]
    target = logits.gather(1, safe[:, None]).squeeze(1)  # [c]
    top = logits.amax(dim=-1, keepdim=True)  # [c, 1]
    logits.sub_(top).exp_()  # in place (torch.logsumexp would allocate a second [c, V])
    total = logits.sum(dim=-1, keepdim=True)  # [c, 1]
    lse = (top + total.log()).squeeze(1)  # [c]
    loss = ((lse - target) * valid).sum()
    logits.div_(total)  # softmax
    logits.scatter_add_(1, safe[:, None], torch.full_like(lse[:, None], -1.0))  # softmax - onehot
    logits.mul_(valid[:, None])  # ignored rows: no gradient
    return loss


def _chunked_loss(
    hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int, chunk: int
) -> torch.Tensor:
    """The loss value only (no grad needed): chunked, nothing kept."""
    flat, labels = hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1)  # [T, h], [T]
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        for start in range(0, flat.shape[0], chunk):
            logits = _chunk_logits(flat[start : start + chunk], weight)  # [c, V]
            total += torch.nn.functional.cross_entropy(
                logits, labels[start : start + chunk], ignore_index=ignore_index, reduction="sum"
            )
    return total


def _check_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int, chunk_size: int | None
) -> int:
    """Raise ValueError, quoting the numbers, before any collective; returns V."""
    if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(shift_labels.shape):
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and shift_labels {tuple(shift_labels.shape)} do not match: expected "
            f"hidden [B, S_local, h] and shift_labels [B, S_local] of the same rank (shard_batch's shift_labels)"
        )
    shape: tuple[int, ...] = tuple(getattr(weight, "ds_shape", weight.shape))
    if len(shape) != 2 or shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight {shape} must be [V, h] with h = hidden's last dimension {hidden.shape[-1]} "
            f"(pass lm_head.weight, not its transpose)"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype; cast one of them")
    check_positive(chunk_size, "chunk_size", integer=True, unit="tokens", or_none="the default")
    return shape[0]
