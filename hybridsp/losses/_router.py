"""The MoE load-balancing loss of a sequence sharded across the context group.

A Mixture-of-Experts causal LM in transformers (Mixtral, Qwen3-MoE, GPT-OSS, OLMoE, ...) given
``output_router_logits=True`` adds ``router_aux_loss_coef * aux`` to its loss, with the Switch
Transformer's load-balancing loss over the router logits of every layer:

    f_e = (top-k picks of expert e) / N        over every real token of every layer (N = tokens x layers)
    P_e = (sum of softmax probabilities of e) / N
    aux = E * sum_e f_e * P_e

(transformers' ``load_balancing_loss_func``; the real tokens are those with ``attention_mask`` 1,
every token without a mask). The loss is not a sum over tokens: ``f`` and ``P`` are means over the
*whole* sequence, and their product is not the mean of the shards' products. Computed per shard
(what a model gives on ``S / C`` tokens) it is wrong in value and gradient.
:func:`sharded_load_balancing_loss` computes the whole sequence's value from this rank's router
logits: the per-expert pick counts, probability sums and the token count, one vector of ``2E + 1``
numbers, are summed over ``mesh.context_group`` by one no-grad all_reduce. Its gradient is this
rank's share, as :func:`hybridsp.sharded_cross_entropy`'s: the picks ``f`` carry no gradient
(top-k), and ``aux`` is linear in ``P`` given ``f``, so

    value     E * sum_e f_e * P_e                  the whole sequence's loss, on every context rank
    gradient  E * sum_e f_e * d(P_e of this rank's tokens)

and the parameter gradients summed over the context group are the unsharded model's (what
DeepSpeed ZeRO 0-2 do with the context ranks; ZeRO-3 and DDP average, see
:func:`hybridsp.integrations.deepspeed._engine.scale_gradients`).

The real tokens of this rank: :func:`real_token_mask` cuts the full batch's ``attention_mask`` (all
ones without one) exactly as :func:`hybridsp.shard_batch` cuts ``input_ids``, with zeros on the
padding ``shard_batch`` adds to reach the layout's multiple.

Note [tensor parallelism]: no reduction over ``mesh.tensor_group``: the tokens are split over the
tensor group only outside the linears (Megatron sequence parallelism: norms and residuals); a
router is a linear on its MoE block's input, which enters the tensor region gathered
(:mod:`hybridsp.tensor_parallel._model_split`), so every tensor rank holds the same logits of all
this context rank's tokens and computes the same statistics and the same value. Its *gradient*,
though, reaches a router whose parameter gradient the tensor split sums over the tensor group (a
parameter kept whole inside the region sees a partial sum from each rank's share of the experts):
replicated on T ranks, the router loss's gradient would count T times. So with ``mesh.tensor = T >
1`` the value is kept and the gradient divided by T.

Precision: the softmax and the top-k run in the logits' dtype, as transformers does; the sums in
fp32, reduced in fp64. A group with no real token gives 0 (transformers' function gives 0/0 = NaN).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from hybridsp.attention._api import shard_tensors
from hybridsp.attention._spec import CuSeqlens
from hybridsp.mesh._hybrid_mesh import HybridMesh, padded_length


def sharded_load_balancing_loss(
    router_logits: Sequence[torch.Tensor] | None,
    token_mask: torch.Tensor | None,
    mesh: HybridMesh,
    *,
    num_experts: int,
    top_k: int,
) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` of the whole sequence, from this rank's router logits.

    Args:
        router_logits: one tensor per MoE layer (the model output's ``router_logits``), each
            [B * S_local, E] (or [B, S_local, E]) over this rank's tokens in their local order.
        token_mask: [B, S_local] (or [B * S_local]) this rank's real tokens, 1 or True where a
            token counts (:func:`real_token_mask`); None: every local token counts.
        mesh: the :class:`~hybridsp.mesh._hybrid_mesh.HybridMesh`; the statistics are summed over
            ``mesh.context_group`` (Note [tensor parallelism]: never over the tensor group; the gradient
            divided by ``mesh.tensor``).
        num_experts: E, the router's number of experts.
        top_k: experts picked per token (``num_experts_per_tok``).

    Returns:
        0-dim fp32 tensor: the value is the whole sequence's auxiliary loss on every rank of the
        context group, the gradient (w.r.t. the router logits) this rank's share (module docstring).
        A collective over the context group: every context rank must call it. Raises ValueError
        on bad input before any communication.
    """
    layers, weights = _checked(router_logits, token_mask, num_experts, top_k)
    counts, probs, rows = local_router_statistics(layers, weights, num_experts, top_k)
    totals = torch.cat([counts, probs.detach(), rows.reshape(1)]).double()  # [2E + 1]
    if mesh.context > 1:
        with torch.no_grad():
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=mesh.context_group)
    loss = balancing_loss(totals, probs, num_experts)
    return loss if mesh.tensor == 1 else loss.detach() + (loss - loss.detach()) / mesh.tensor  # Note [tensor ...]


def local_router_statistics(
    layers: Sequence[torch.Tensor], weights: torch.Tensor, num_experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-k picks per expert [E], probability sums per expert [E] with autograd, real rows 0-dim), all fp32.

    ``layers``: [T, E] router logits per layer; ``weights``: [T] fp32, 1 for a real token. Summed
    over the layers, as transformers accumulates them."""
    counts = torch.zeros(num_experts, dtype=torch.float32, device=weights.device)  # [E]
    probs = torch.zeros(num_experts, dtype=torch.float32, device=weights.device)  # [E]
    picked_weights = weights.repeat_interleave(top_k)  # [T * k]
    for logits in layers:
        routing = torch.softmax(logits.to(weights.device), dim=-1)  # [T, E] in the logits' dtype
        chosen = torch.topk(routing, top_k, dim=-1).indices  # [T, k]
        counts = counts.scatter_add(0, chosen.reshape(-1), picked_weights)  # [E]
        probs = probs + (routing.float() * weights[:, None]).sum(dim=0)  # [E]
    return counts, probs, weights.sum() * len(layers)


def balancing_loss(totals: torch.Tensor, local_probs: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` from the group's ``totals`` [2E + 1] (picks, probability sums, rows);
    the gradient through ``local_probs`` [E] only (the rest of the group's sums enter as constants)."""
    rows = totals[-1].clamp_min(1.0)  # no real token: 0, never NaN
    fractions = (totals[:num_experts] / rows).float()  # [E] f_e: no gradient (top-k)
    others = (totals[num_experts:-1] - local_probs.detach().double()).float()  # [E] the other ranks' sums
    return num_experts * (fractions * (local_probs + others)).sum() / rows.float()


def real_token_mask(batch: Mapping[str, torch.Tensor], mesh: HybridMesh, documents: CuSeqlens = None) -> torch.Tensor:
    """This rank's real tokens [B, S_pad / C] (bool), cut as :func:`hybridsp.shard_batch` cuts ``input_ids``.

    Args:
        batch: the full batch given to ``shard_batch``: ``input_ids`` [B, S] and optional
            ``attention_mask`` [B, S] (1 = real; without one every token is real, as in transformers).
        mesh: the same mesh.
        documents: ``shard_batch(...)["documents"]``: the layout that places tokens by document
            (``layout="balanced"``) needs them; other layouts ignore them.

    The padding ``shard_batch`` adds to reach the layout's multiple is never real. No communication.
    """
    ids = batch.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise ValueError(f"real_token_mask needs the full batch's input_ids [B, S]; got keys {sorted(batch)}")
    mask = batch.get("attention_mask")
    if mask is not None and tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask {tuple(mask.shape)} must have the shape of input_ids {tuple(ids.shape)}")
    real = torch.ones_like(ids, dtype=torch.long) if mask is None else (mask != 0).long()  # [B, S]
    extra = padded_length(ids.shape[1], mesh) - ids.shape[1]
    real = torch.nn.functional.pad(real, (0, extra), value=0)  # [B, S_pad]
    return shard_tensors([real], mesh, cu_seqlens=documents)[0] != 0  # [B, S_pad / C]


def _checked(
    router_logits: Sequence[torch.Tensor] | None, token_mask: torch.Tensor | None, num_experts: int, top_k: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """([T, E] per layer, [T] fp32 weights), or ValueError quoting the numbers (before any collective)."""
    if router_logits is None or isinstance(router_logits, torch.Tensor) or len(router_logits) == 0:
        got = "None" if router_logits is None else f"a {type(router_logits).__name__}"
        raise ValueError(
            f"the load-balancing loss needs the router logits of every MoE layer (a tuple of [T, E] tensors); got "
            f"{got}. Run the model with output_router_logits=True and pass outputs.router_logits"
        )
    if not (isinstance(num_experts, int) and isinstance(top_k, int) and 1 <= top_k <= num_experts):
        raise ValueError(f"need integers 1 <= top_k <= num_experts; got top_k={top_k!r}, num_experts={num_experts!r}")
    layers = [_as_rows(logits, index, num_experts) for index, logits in enumerate(router_logits)]
    tokens = {layer.shape[0] for layer in layers}
    if len(tokens) != 1:
        raise ValueError(
            f"the router logits of the layers cover different token counts {sorted(tokens)}; "
            f"pass the router logits of one forward"
        )
    (count,) = tokens
    if token_mask is None:
        return layers, torch.ones(count, dtype=torch.float32, device=layers[0].device)  # [T]
    if token_mask.numel() != count or token_mask.is_complex():
        raise ValueError(
            f"token_mask {tuple(token_mask.shape)} holds {token_mask.numel()} entries for {count} "
            f"router rows [B * S_local]: pass real_token_mask(...) of the same batch and rank"
        )
    return layers, token_mask.reshape(-1).to(device=layers[0].device, dtype=torch.float32)  # [T]


def _as_rows(logits: torch.Tensor, index: int, num_experts: int) -> torch.Tensor:
    """One layer's router logits as [T, E]; ValueError for another expert count or a non-float tensor."""
    if not torch.is_tensor(logits) or not logits.is_floating_point() or logits.dim() not in (2, 3):
        shape = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
        raise ValueError(f"router logits of layer {index} must be a float [T, E] or [B, S, E] tensor; got {shape}")
    if logits.shape[-1] != num_experts:
        raise ValueError(
            f"router logits of layer {index} have {logits.shape[-1]} experts {tuple(logits.shape)}; "
            f"num_experts={num_experts}: pass the model's own number of experts"
        )
    return logits.reshape(-1, num_experts)  # [T, E]
