"""TRL's fused log-prob calls on a model switched to hybrid attention: full sequences in, full values out.

TRL's preference and RL trainers (DPO, KTO, GRPO, RLOO) score sequences with one call,

    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)   # [B, S] each
    out.log_probs                                                         # [B, S - 1] per token

(``trl.trainer.utils.add_fused_lm_head``: the LM head runs in chunks and returns per-token
log-probabilities, entropies, ... instead of logits), and then build their losses from
``out.log_probs`` on the full sequence. :func:`shard_fused_calls` makes that same call exact
on a model whose attention :func:`hybridsp.integrations.transformers.apply` switched:

1. a forward pre-hook (run before any other) cuts the full batch as :func:`hybridsp.shard_batch`
   does (labels shifted on the full sequence first, the batch's documents found once on the
   host) and calls the fused head with this rank's ``input_ids``, ``position_ids`` and
   ``shift_labels`` (the fused head's own pre-shifted path) and ``hybridsp_documents``;
2. a forward hook gathers every per-token field over the context group with
   :func:`hybridsp.losses._logprobs.gather_tokens` (one all_gather each; only this rank's
   own positions keep their gradient, Note [local gradient] there) and cuts them back to
   ``[B, S - 1]``.

So the trainer's own loss code runs unchanged on the full per-token values, on every context
rank, and each rank's backward is its share of the unsharded gradient. Calls without
``fused_lm_head=True`` and ``labels`` (e.g. the SFT path, which passes ``shift_labels`` it sharded
itself) pass through untouched. Refused with a ValueError (before any collective): positional
arguments, tensors the layout cannot shard (anything but ``input_ids``, ``attention_mask``,
``position_ids``, ``labels``), left padding (from :func:`~hybridsp.data._batch.shard_batch`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hybridsp.attention._api import shard_sequence
from hybridsp.data._batch import batch_documents, prepare_batch
from hybridsp.layout._documents import Documents
from hybridsp.losses._cross_entropy import IGNORE_INDEX
from hybridsp.losses._logprobs import gather_tokens
from hybridsp.mesh._hybrid_mesh import HybridMesh

SHARDED_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")
PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


class _ShardedFusedCalls:
    """The two hooks and what passes between them (the one call in flight)."""

    def __init__(self, mesh: HybridMesh, pad_token_id: int):
        self.mesh, self.pad_token_id = mesh, pad_token_id
        # (this call's local shift_labels, full length S, scored mask [B, S - 1], documents)
        self.pending: tuple[torch.Tensor, int, torch.Tensor, Documents] | None = None

    def before(self, module, args, kwargs):
        """Forward pre-hook: a full-sequence fused call -> this rank's tokens."""
        if not kwargs.get("fused_lm_head") or kwargs.get("labels") is None:
            return None
        _check_call(args, kwargs)
        batch = {key: kwargs[key] for key in SHARDED_KEYS if kwargs.get(key) is not None}
        full = prepare_batch(batch, self.mesh, pad_token_id=self.pad_token_id)  # each [B, S_pad]
        documents = batch_documents(full["position_ids"])  # host data, as shard_batch hands it on
        local = {key: shard_sequence(value, self.mesh, cu_seqlens=documents) for key, value in full.items()}
        seq_len = batch["input_ids"].shape[1]
        scored = full["shift_labels"][:, : seq_len - 1] != IGNORE_INDEX  # [B, S - 1]
        self.pending = (local["shift_labels"], seq_len, scored, documents)
        rest = {key: value for key, value in kwargs.items() if key not in SHARDED_KEYS}
        return args, {
            **rest,
            "input_ids": local["input_ids"],
            "position_ids": local["position_ids"],
            "shift_labels": local["shift_labels"],
            "hybridsp_documents": documents,
            "use_cache": False,
        }

    def after(self, module, args, kwargs, output):
        """Forward hook: the per-token fields of this rank's tokens -> the full sequence [B, S - 1]."""
        if self.pending is None or kwargs.get("shift_labels") is not self.pending[0]:
            return None
        _, seq_len, scored, documents = self.pending
        self.pending = None
        for name in PER_TOKEN_FIELDS:
            value = getattr(output, name, None)
            if torch.is_tensor(value):
                output[name] = gather_tokens(value, self.mesh, cu_seqlens=documents)[:, : seq_len - 1]  # [B, S - 1]
        if getattr(output, "log_probs", None) is not None and getattr(output, "aux_loss", None) is None:
            output["loss"] = -output.log_probs.sum() / scored.sum().clamp(min=1)  # the fused head's mean NLL
        return output


def _check_call(args: tuple, kwargs: dict) -> None:
    if args:
        raise ValueError(
            f"a sharded fused_lm_head call takes keyword arguments only (input_ids=..., labels=...); got "
            f"{len(args)} positional argument(s)"
        )
    unknown = sorted(key for key, value in kwargs.items() if torch.is_tensor(value) and key not in SHARDED_KEYS)
    if unknown:
        raise ValueError(
            f"hybridsp shards {', '.join(SHARDED_KEYS)} of a fused_lm_head call along the sequence; it cannot "
            f"shard {unknown} (vision inputs, token types): drop them or run this model without sequence parallelism"
        )


def shard_fused_calls(model: nn.Module, mesh: HybridMesh, *, pad_token_id: int = 0) -> Callable[[], None]:
    """Make ``model(..., labels=labels, fused_lm_head=True)`` on full ``[B, S]`` inputs exact under ``mesh``.

    ``model`` is the transformers model that TRL's ``add_fused_lm_head`` patched (for PEFT the
    base model), already switched with :func:`hybridsp.integrations.transformers.apply`.
    Returns a function that removes both hooks (module docstring). Every context rank must
    make the same calls (each gathers over ``mesh.context_group``).
    """
    calls = _ShardedFusedCalls(mesh, pad_token_id)
    before = model.register_forward_pre_hook(calls.before, with_kwargs=True, prepend=True)
    after = model.register_forward_hook(calls.after, with_kwargs=True)

    def remove() -> None:
        before.remove()
        after.remove()

    return remove
