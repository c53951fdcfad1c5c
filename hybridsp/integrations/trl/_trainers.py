"""TRL's SFT and DPO trainers with exact hybrid sequence parallelism (``pip install -e ".[trl]"``).

    from hybridsp.integrations.trl._trainers import HybridSFTTrainer, HybridDPOTrainer

    trainer = HybridSFTTrainer(model=model, args=SFTConfig(..., deepspeed="ds_configs/cp4.json"),
                               train_dataset=ds, processing_class=tokenizer)        # TRL's own arguments
    trainer = HybridDPOTrainer(model=model, ref_model=ref, args=DPOConfig(..., deepspeed=...), ...)

Both are :class:`~hybridsp.integrations.transformers._trainer.HybridSPMixin` composed with the TRL trainer
(the mixin first): TRL prepares the datasets, builds its collators, its fused LM head and its
reference model; the mixin switches the attention, shards every batch over the ``U x R``
context ranks of a replica and feeds the replicas (docs/trl-peft.md has the recipes).

Note [SFT loss]: TRL's SFT loss is its fused, chunked negative log-likelihood
(``add_fused_lm_head``: per-token log-probs without the ``[B, S, V]`` logits), normalised by
the step's token count ``num_items_in_batch``; ``loss_type="dft"`` weighs each token by its
detached probability. :meth:`HybridSFTTrainer.compute_loss` calls the same fused head with this
rank's tokens and pre-shifted ``shift_labels`` and normalises by the step's global count, as
the mixin does for the plain Trainer (Note [the loss] in :mod:`~hybridsp.integrations.transformers._trainer`).
``completion_only_loss`` and ``assistant_only_loss`` arrive as ``-100`` labels from TRL's dataset
preparation and need nothing here. Packed and padding-free rows (``packing=True``,
``padding_free=True``) restart ``position_ids`` at each document: :func:`hybridsp.shard_batch`
and the attention take the documents from them (Note [packed rows] in :mod:`hybridsp.data._batch`),
so the collator's flash-attention extras (``cu_seq_lens_*``, ``max_length_*``, ``seq_idx``,
which describe the unsharded row) are dropped. The ``entropy`` and ``mean_token_accuracy``
metrics are summed over the disjoint shards; ``num_tokens`` counts each replica once.
``evaluate()`` computes the same loss per batch (and the same metrics) under no_grad; the
evaluation loop averages it over the replicas, as the plain trainer averages over processes.

Note [DPO]: DPO's loss is a non-linear function of each sequence's summed log-probability
(and the reference model's). :func:`~hybridsp.integrations.trl._logprobs.shard_fused_calls`
makes TRL's own fused call ``model(..., labels=..., fused_lm_head=True)`` exact on full
sequences (per-token values gathered over the context group, gradient on this rank's tokens
only), so ``DPOTrainer``'s loss code, every ``loss_type``, ``ld_alpha``, WPO weighting and its
metrics (``rewards/*``, ``logps/*``, ``logits/*``) run unchanged, on every context rank. A
separate reference model (TRL wraps it in its own DeepSpeed inference engine) is switched and
hooked once here; with PEFT and no ``ref_model`` the reference is the policy with its adapters
disabled, which is already switched (switched once: a second ``apply`` is refused). DPO's loss
is a per-micro-batch mean: the Trainer divides it by the accumulation steps
(``loss_is_scaled_for_ga = False``, as in ``DPOTrainer``).

MoE auxiliary loss (SFT): with TRL's ``router_aux_loss_coef`` on, the loss adds it as TRL does (once
per micro-batch divided by the accumulation steps, not multiplied by the processes: the replicas'
mean), with the whole micro-batch's load-balancing loss (Note [router loss] in
:mod:`~hybridsp.integrations.transformers._trainer`); the logged ``aux_loss`` is that value.

Refused with a ValueError at construction: DPO with MoE auxiliary losses (router logits are not
sharded there), SFT ``loss_type`` other than ``nll``/``dft``, DPO's ``precompute_ref_log_probs`` (TRL
scores the reference over accelerate's per-process data shards, which the context ranks do not
share), and what the mixin refuses. At evaluation, DPO's logits for ``compute_metrics``
(``return_outputs=True``) are refused: full logits are not gathered.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
from trl import DPOTrainer, SFTConfig, SFTTrainer

from hybridsp.data._batch import shard_batch
from hybridsp.integrations.transformers._loss import captured_router_logits, model_router_loss
from hybridsp.integrations.transformers._peft import base_model
from hybridsp.integrations.transformers._switch import apply
from hybridsp.integrations.transformers._trainer import HybridSPMixin
from hybridsp.integrations.trl._logprobs import shard_fused_calls
from hybridsp.losses._logprobs import context_sum

# What TRL's padding-free collator adds for flash-attention's varlen kernels; they describe the
# unsharded row, and hybridsp derives the documents from position_ids instead (Note [SFT loss]).
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
SFT_LOSS_TYPES = ("nll", "dft")


class _WithoutVarlenKeys:
    """A collator that drops :data:`VARLEN_KEYS` from the batches of the one it wraps."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, examples):
        batch = self.collator(examples)
        for key in VARLEN_KEYS:
            batch.pop(key, None)
        return batch


def _refuse_aux_loss(trainer) -> None:
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError(
            f"{type(trainer).__name__} does not shard MoE router logits: set router_aux_loss_coef=0.0 in the config "
            f"(the load-balancing loss of a sharded batch would be computed per shard)"
        )


# TRL's _BaseTrainer sets loss_is_scaled_for_ga = None, which mypy reads as the type None
class HybridSFTTrainer(HybridSPMixin, SFTTrainer):  # type: ignore[misc]
    """``trl.SFTTrainer`` with hybrid sequence parallelism; same constructor plus ``hybridsp=`` (Note [SFT loss])."""

    def __init__(self, *args, **kwargs):
        loss_type = getattr(_config(args, kwargs, position=1), "loss_type", "nll")
        if loss_type not in SFT_LOSS_TYPES:  # before TRL's constructor and its collectives
            raise ValueError(f"HybridSFTTrainer supports loss_type in {SFT_LOSS_TYPES}; got {loss_type!r}")
        super().__init__(*args, **kwargs)
        self.data_collator = _WithoutVarlenKeys(self.data_collator)

    def _router_loss_settings(self):
        """TRL's coefficient, when TRL adds the router loss (``aux_loss_enabled``; MoE auxiliary loss above)."""
        return model_router_loss(self.model, coefficient=self.router_aux_loss_coef) if self.aux_loss_enabled else None

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """This rank's share of TRL's fused NLL (or DFT) loss of the step (Note [SFT loss])."""
        if "labels" not in inputs:
            raise ValueError(f"HybridSFTTrainer needs 'labels' in every batch; got keys {sorted(inputs)}")
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1  # TRL's aux scale
        if num_items_in_batch is None:
            num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        tensors = {key: value for key, value in inputs.items() if torch.is_tensor(value) and key not in VARLEN_KEYS}
        local = shard_batch(tensors, self.hybrid_mesh, pad_token_id=self._pad_token_id())
        shift_labels = local.pop("shift_labels")  # [B, S_local]
        documents = local.pop("documents")  # host data: the attention plans once per forward
        routed = self._router_loss is not None
        capture: contextlib.AbstractContextManager[list[Any]] = (
            captured_router_logits(model) if routed else contextlib.nullcontext([])
        )
        with capture as router_logits:
            outputs = model(
                **local,
                shift_labels=shift_labels,
                hybridsp_documents=documents,
                fused_lm_head=True,
                use_cache=False,
                **({"output_router_logits": True} if routed else {}),
            )
        per_token = -outputs.log_probs  # [B, S_local], 0 where not scored
        if cast(SFTConfig, self.args).loss_type == "dft":  # SFTTrainer makes its args an SFTConfig
            per_token = per_token * outputs.log_probs.exp().detach()
        count = torch.as_tensor(num_items_in_batch, device=per_token.device).double().clamp_min(1.0)
        loss = context_sum(per_token.sum(), self.hybrid_mesh) * (self.hybrid_mesh.dp / count).float()
        if routed:  # the fused output drops the router logits: captured from the decoder
            assert self._router_loss is not None  # routed
            aux = self._router_share(router_logits[-1] if router_logits else None, tensors, documents)
            loss = loss + self._router_loss.coefficient * aux / steps
            self._log_aux_loss(aux)
        self._log_token_metrics(outputs, inputs)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """Loss only: :meth:`compute_loss` under no_grad (TRL's loss and eval metrics, as in SFTTrainer);
        with predictions: the mixin's sharded forward that gathers the full logits."""
        if not prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _log_aux_loss(self, aux: torch.Tensor) -> None:
        """TRL's ``aux_loss`` metric: the mean over the ranks (each holds its replica's whole value)."""
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather(aux.detach()[None]).mean().item())

    def _log_token_metrics(self, outputs, inputs) -> None:
        """TRL's ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` from the disjoint shards."""
        mode = "train" if self.model.training else "eval"
        gather = self.accelerator.gather  # all ranks, nothing dropped: the shards are disjoint
        with torch.no_grad():
            sums = torch.stack([outputs.label_mask.sum(), outputs.entropy.sum(), outputs.is_top1.sum()]).double()
            valid, entropy, correct = gather(sums[None]).sum(dim=0).tolist()  # [W, 3] -> exact sums
        self._metrics[mode]["entropy"].append(entropy / valid if valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
        if mode == "train":
            mask = inputs.get("attention_mask")
            tokens = mask.sum() if mask is not None else torch.tensor(inputs["input_ids"].numel())
            # every context rank holds the replica's full batch: count it once
            tokens = int(gather(tokens.to(self.args.device)).sum().item())
            self._total_train_tokens += tokens // self.hybrid_mesh.context
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]


class HybridDPOTrainer(HybridSPMixin, DPOTrainer):
    """``trl.DPOTrainer`` with hybrid sequence parallelism; same constructor plus ``hybridsp=`` (Note [DPO])."""

    loss_is_scaled_for_ga = False  # DPO's loss is a micro-batch mean, as in DPOTrainer

    def __init__(self, *args, **kwargs):
        if getattr(_config(args, kwargs, position=2), "precompute_ref_log_probs", False):  # before any collective
            raise ValueError(
                "HybridDPOTrainer does not support precompute_ref_log_probs=True: TRL scores the reference over "
                "accelerate's per-process shards of the dataset, which the context ranks of a replica do not share. "
                "Pass a ref_model (or train a PEFT adapter without one) and leave precompute_ref_log_probs=False"
            )
        super().__init__(*args, **kwargs)  # the mixin has switched the policy
        _refuse_aux_loss(self)  # the same decision on every rank
        policy = base_model(self.model)
        pad = self._pad_token_id()
        self._hybridsp_removers = [shard_fused_calls(policy, self.hybrid_mesh, pad_token_id=pad)]
        reference = _unwrapped(self.ref_model) if self.ref_model is not None else None
        if reference is not None and base_model(reference) is not policy:  # never switch the policy twice
            reference = base_model(reference)
            self._hybridsp_removers.append(apply(reference, self.hybrid_mesh, backend=self.hybrid_config.backend).undo)
            self._hybridsp_removers.append(shard_fused_calls(reference, self.hybrid_mesh, pad_token_id=pad))
        self._tp_size = self.hybrid_mesh.context  # TRL divides its token count by the ranks sharing a batch

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """DPOTrainer's own loss; its fused calls are sharded by the hooks (Note [DPO])."""
        return super(HybridSPMixin, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """DPOTrainer's (its loss and metrics through the sharded fused calls)."""
        if not prediction_loss_only:
            raise ValueError(
                "HybridDPOTrainer evaluates the loss and metrics only: full logits for compute_metrics are not "
                "gathered under sequence parallelism; pass no compute_metrics (or prediction_loss_only=True)"
            )
        return super(HybridSPMixin, self).prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def undo_hybridsp(self) -> None:
        """Also remove the reference model's switch and both models' fused-call hooks; idempotent."""
        while self._hybridsp_removers:
            self._hybridsp_removers.pop()()
        super().undo_hybridsp()


def _config(args: tuple, kwargs: dict, position: int):
    """The trainer's ``args`` (its TRL config) from the constructor's arguments, or None."""
    return kwargs.get("args", args[position] if len(args) > position else None)


def _unwrapped(model):
    """The module inside a DeepSpeed engine or DDP wrapper (``.module``), else ``model``."""
    return getattr(model, "module", model)
