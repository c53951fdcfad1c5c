"""One call from a Hugging Face causal LM and a local batch to the loss, without logits.

    local = shard_batch(full_batch, mesh)
    loss = causal_lm_loss(engine_or_model, local, mesh)   # decoder + lm_head through fused_cross_entropy
    engine.backward(loss)

Note [loss inside the lm_head call]: the model runs its own forward (so a DeepSpeed engine's and
ZeRO-3's hooks run exactly as on the logits path); only for the duration of the call the output
embedding's ``forward`` is replaced, on that module instance, by one that returns
:func:`hybridsp.fused_cross_entropy` of its input and its own weight. So the model's
``logits`` field carries the 0-dim loss instead of [B, S_local, V] logits. Under ZeRO-3 the
``lm_head`` weight (or the tied embedding) is then gathered by the module's own DeepSpeed
hooks, once, exactly as for a normal ``lm_head`` call; no gather per chunk. The original
``forward`` is restored when the call returns (or raises).

Note [router loss]: a Mixture-of-Experts model whose forward adds ``router_aux_loss_coef * aux`` to
its loss when given labels (``output_router_logits`` in its config; Mixtral, Qwen3-MoE, GPT-OSS,
OLMoE, ...) gets the same term here, with the whole sequence's load-balancing loss
(:func:`hybridsp.losses._router.sharded_load_balancing_loss`) instead of a shard's. Which models:
:func:`model_router_loss` reads the coefficient, ``num_experts`` and ``num_experts_per_tok`` from
the model and checks, on a few fixed numbers, that the ``load_balancing_loss_func`` of the model's
own module is the Switch Transformer loss that the sharded one reproduces; a model that adds
another router loss is refused (ValueError), one that adds none (DeepSeek-V3) needs nothing.

:func:`share_of_loss` is the same token-weighted loss from logits a forward returned, as
:class:`~hybridsp.integrations.transformers._trainer.HybridSPMixin` computes it (Note [the loss] there).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Mapping, cast

import torch
import torch.nn.functional as F
from torch import nn

from hybridsp.integrations.transformers._peft import base_model
from hybridsp.losses._cross_entropy import IGNORE_INDEX
from hybridsp.losses._fused import fused_cross_entropy
from hybridsp.losses._router import balancing_loss, local_router_statistics, sharded_load_balancing_loss
from hybridsp.losses._token_tail import guard_labels, token_weighted_share
from hybridsp.mesh._hybrid_mesh import HybridMesh


def causal_lm_loss(
    model: nn.Module,
    local_batch: Mapping[str, torch.Tensor],
    mesh: HybridMesh,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token-weighted loss of a causal LM on this rank's tokens, never building the logits.

    Args:
        model: a transformers causal LM switched on with ``apply(model, mesh)``, or a DeepSpeed
            engine around one (``hybridsp.integrations.deepspeed.initialize`` does both).
        local_batch: :func:`hybridsp.shard_batch`'s output: ``input_ids``, ``position_ids`` and
            ``shift_labels``, each [B, S_local].
        mesh: the model's :class:`~hybridsp.mesh._hybrid_mesh.HybridMesh`.
        ignore_index, chunk_size: as in :func:`hybridsp.fused_cross_entropy`.
        token_mask: [B, S_local] this rank's real tokens (:func:`hybridsp.real_token_mask` of the
            full batch); needed only by a model that adds a router loss (Note [router loss]).

    Returns:
        0-dim fp32 loss, equal to ``sharded_cross_entropy(model(...).logits, shift_labels, mesh)``
        in value and gradients (a collective over the context group), plus the model's
        ``router_aux_loss_coef`` times the whole sequence's load-balancing loss for a model
        that adds one (Note [router loss]).
    """
    missing = [key for key in ("input_ids", "position_ids", "shift_labels") if key not in local_batch]
    if missing:
        raise ValueError(f"local_batch lacks {missing}: pass the dict that hybridsp.shard_batch returned")
    inner = getattr(model, "module", model)  # a DeepSpeed engine holds the model as .module
    get_head = getattr(inner, "get_output_embeddings", None)  # a transformers model's
    head = get_head() if get_head is not None else None
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(inner).__name__} has no nn.Linear output embedding (get_output_embeddings() gave "
            f"{type(head).__name__}); causal_lm_loss needs a causal LM with an lm_head"
        )
    if head.bias is not None:
        raise ValueError(
            f"{type(inner).__name__}'s lm_head has a bias; fused_cross_entropy supports a bias-free lm_head only"
        )
    router = model_router_loss(inner)
    if router is not None and token_mask is None:
        raise ValueError(
            f"{type(inner).__name__} adds a router load-balancing loss (router_aux_loss_coef={router.coefficient}): "
            f"pass token_mask=hybridsp.real_token_mask(full_batch, mesh, local_batch['documents']), or turn the "
            f"loss off with output_router_logits=False in the model's config"
        )
    with _loss_as_head_output(head, local_batch["shift_labels"], mesh, ignore_index, chunk_size):
        out = model(
            input_ids=local_batch["input_ids"],
            position_ids=local_batch["position_ids"],
            hybridsp_documents=local_batch.get("documents"),
            use_cache=False,
        )
    if router is None:
        return out.logits
    return out.logits + router.coefficient * router.share(out.router_logits, token_mask, mesh)


def share_of_loss(logits: torch.Tensor, shift_labels: torch.Tensor, num_items, mesh: HybridMesh) -> torch.Tensor:
    """Value ``DP * replica_sum / N``, gradient ``DP * d(local_sum) / N`` (Note [the loss] in :mod:`hybridsp.integrations.transformers._trainer`).

    ``logits`` [B, S_local, V], ``shift_labels`` [B, S_local]; ``num_items`` the global count N.
    One no-grad all_reduce over the context group, which also carries the bad-label count
    (:mod:`hybridsp.losses._token_tail`: a bad label is an error on every rank, never a hang).
    """
    vocab = logits.shape[-1]
    safe_labels, bad = guard_labels(shift_labels, vocab, IGNORE_INDEX)  # [B, S_local]
    local_sum = F.cross_entropy(
        logits.reshape(-1, vocab).float(), safe_labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return token_weighted_share(
        local_sum,
        safe_labels,
        bad,
        shift_labels,
        mesh,
        vocab=vocab,
        ignore_index=IGNORE_INDEX,
        denominator=num_items,
        scale=mesh.dp,
    )


@dataclass(frozen=True)
class RouterLoss:
    """The router loss a model adds: ``coefficient * load_balancing_loss_func(router_logits, E, top_k, mask)``."""

    coefficient: float
    num_experts: int
    top_k: int

    def share(self, router_logits, token_mask: torch.Tensor | None, mesh: HybridMesh) -> torch.Tensor:
        """The whole sequence's load-balancing loss (unweighted) from a forward's ``router_logits`` (one
        [B * S_local, E] per layer): value the context group's, gradient this rank's share;
        ``token_mask`` [B, S_local]."""
        if router_logits is None:
            raise ValueError(
                f"the model's output has no router_logits although its loss adds router_aux_loss_coef="
                f"{self.coefficient} times the load-balancing loss: run it with output_router_logits=True"
            )
        return sharded_load_balancing_loss(
            router_logits, token_mask, mesh, num_experts=self.num_experts, top_k=self.top_k
        )


def model_router_loss(model: nn.Module, coefficient: float | None = None) -> RouterLoss | None:
    """The router loss ``model(..., labels=...)`` adds to its loss, or None (Note [router loss]).

    Args:
        model: a transformers causal LM, or a DeepSpeed engine / PEFT wrapper around one.
        coefficient: the weight a trainer applies itself (TRL's ``router_aux_loss_coef``); then
            the model's ``output_router_logits`` does not matter. Default: the model's own
            ``router_aux_loss_coef`` when its config has ``output_router_logits`` on.

    Returns None for a zero coefficient or a model without a router loss; ValueError for a router
    loss that :func:`~hybridsp.losses._router.sharded_load_balancing_loss` does not reproduce.
    """
    inner = base_model(getattr(model, "module", model))
    adds_one = hasattr(inner, "router_aux_loss_coef")
    if coefficient is None:
        if not (adds_one and getattr(getattr(inner, "config", None), "output_router_logits", False)):
            return None
        coefficient = cast(float, inner.router_aux_loss_coef)  # a transformers MoE model's attribute
    if not coefficient:
        return None
    experts, top_k = getattr(inner, "num_experts", None), getattr(inner, "num_experts_per_tok", None)
    function = getattr(sys.modules.get(type(inner).__module__), "load_balancing_loss_func", None)
    if not (
        adds_one
        and isinstance(experts, int)
        and isinstance(top_k, int)
        and _is_switch_balancing(function, experts, top_k)
    ):
        raise ValueError(
            f"{type(inner).__name__} has no router loss that hybridsp shards (router_aux_loss_coef="
            f"{coefficient}, num_experts={experts}, num_experts_per_tok={top_k}): hybridsp computes the Switch "
            f"Transformer load-balancing loss of transformers' Mixtral over the whole sequence. Set "
            f"router_aux_loss_coef=0 (or output_router_logits=False) for this model"
        )
    return RouterLoss(float(coefficient), experts, top_k)


def _is_switch_balancing(function, num_experts: int, top_k: int) -> bool:
    """Whether ``function(router_logits, E, top_k, attention_mask)`` gives our loss on fixed numbers
    (2 layers, 2 x 3 tokens, one row padded): no communication, the same answer on every rank."""
    if not callable(function) or not 1 <= top_k <= num_experts:
        return False
    generator = torch.Generator().manual_seed(0)
    layers = tuple(torch.randn(6, num_experts, generator=generator, dtype=torch.float64) for _ in range(2))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # [B, S]
    try:
        theirs = function(layers, num_experts, top_k, mask)
    except (TypeError, ValueError, RuntimeError, IndexError):
        return False
    counts, probs, rows = local_router_statistics(layers, mask.reshape(-1).float(), num_experts, top_k)
    ours = balancing_loss(torch.cat([counts, probs, rows.reshape(1)]).double(), probs, num_experts)
    return torch.is_tensor(theirs) and bool(torch.allclose(theirs.double(), ours.double(), rtol=1e-5, atol=0))


@contextlib.contextmanager
def _loss_as_head_output(head: nn.Linear, shift_labels, mesh, ignore_index, chunk_size):
    """Within the block, ``head(hidden)`` returns the fused loss (Note [loss inside the lm_head call])."""
    if "forward" in vars(head):
        raise RuntimeError(f"{head!r} already has an instance-level forward; nested causal_lm_loss is not supported")

    def loss_forward(hidden: torch.Tensor) -> torch.Tensor:
        return fused_cross_entropy(
            hidden, head.weight, shift_labels, mesh, ignore_index=ignore_index, chunk_size=chunk_size
        )

    head.forward = loss_forward  # type: ignore[method-assign,assignment]  # an instance-level forward, on purpose
    try:
        yield
    finally:
        del head.forward


@contextlib.contextmanager
def captured_router_logits(model: nn.Module):
    """Within the block, the router logits of the model's decoder calls land in the yielded list (the
    last call's tuple at ``[-1]``): for a forward whose output drops them (TRL's fused LM head returns
    ``aux_loss`` only). A forward hook on the decoder (``get_decoder()``), removed when the block ends."""
    inner = base_model(getattr(model, "module", model))
    get_decoder = getattr(inner, "get_decoder", None)  # a transformers model's
    decoder = get_decoder() if get_decoder is not None else getattr(inner, "model", None)
    if not isinstance(decoder, nn.Module):
        raise ValueError(
            f"{type(inner).__name__} has no decoder module (get_decoder()) whose output carries the router logits"
        )
    found: list = []
    handle = decoder.register_forward_hook(
        lambda module, args, output: found.append(getattr(output, "router_logits", None))
    )
    try:
        yield found
    finally:
        handle.remove()
