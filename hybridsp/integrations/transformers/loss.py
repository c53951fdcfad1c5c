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
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch
from torch import nn

from hybridsp.losses.cross_entropy import IGNORE_INDEX
from hybridsp.losses.fused import fused_cross_entropy
from hybridsp.mesh.hybrid_mesh import HybridMesh


def causal_lm_loss(
    model: nn.Module,
    local_batch: Mapping[str, torch.Tensor],
    mesh: HybridMesh,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The token-weighted loss of a causal LM on this rank's tokens, never building the logits.

    Args:
        model: a transformers causal LM switched on with ``apply(model, mesh)``, or a DeepSpeed
            engine around one (``hybridsp.integrations.deepspeed.initialize`` does both).
        local_batch: :func:`hybridsp.shard_batch`'s output: ``input_ids``, ``position_ids`` and
            ``shift_labels``, each [B, S_local].
        mesh: the model's :class:`~hybridsp.mesh.hybrid_mesh.HybridMesh`.
        ignore_index, chunk_size: as in :func:`hybridsp.fused_cross_entropy`.

    Returns:
        0-dim fp32 loss, equal to ``sharded_cross_entropy(model(...).logits, shift_labels, mesh)``
        in value and gradients (a collective over the context group).
    """
    missing = [key for key in ("input_ids", "position_ids", "shift_labels") if key not in local_batch]
    if missing:
        raise ValueError(f"local_batch lacks {missing}: pass the dict that hybridsp.shard_batch returned")
    inner = getattr(model, "module", model)  # a DeepSpeed engine holds the model as .module
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(inner).__name__} has no nn.Linear output embedding (get_output_embeddings() gave "
            f"{type(head).__name__}); causal_lm_loss needs a causal LM with an lm_head"
        )
    if head.bias is not None:
        raise ValueError(
            f"{type(inner).__name__}'s lm_head has a bias; fused_cross_entropy supports a bias-free lm_head only"
        )
    with _loss_as_head_output(head, local_batch["shift_labels"], mesh, ignore_index, chunk_size):
        out = model(input_ids=local_batch["input_ids"], position_ids=local_batch["position_ids"],
                    hybridsp_documents=local_batch.get("documents"), use_cache=False)
    return out.logits


@contextlib.contextmanager
def _loss_as_head_output(head: nn.Linear, shift_labels, mesh, ignore_index, chunk_size):
    """Within the block, ``head(hidden)`` returns the fused loss (Note [loss inside the lm_head call])."""
    if "forward" in vars(head):
        raise RuntimeError(f"{head!r} already has an instance-level forward; nested causal_lm_loss is not supported")

    def loss_forward(hidden: torch.Tensor) -> torch.Tensor:
        return fused_cross_entropy(hidden, head.weight, shift_labels, mesh, ignore_index=ignore_index,
                                   chunk_size=chunk_size)

    head.forward = loss_forward
    try:
        yield
    finally:
        del head.forward
