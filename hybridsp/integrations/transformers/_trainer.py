"""Hugging Face ``Trainer`` with exact hybrid sequence parallelism: :class:`HybridSPTrainer`.

    from hybridsp.integrations.transformers import HybridSPTrainer

    args = TrainingArguments(..., deepspeed="ds_configs/cp8.json")   # has a "hybridsp" section
    trainer = HybridSPTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)
    trainer.train()                    # same datasets, collators, logging and checkpoints as Trainer

    class MySFTTrainer(HybridSPMixin, SFTTrainer): ...   # the mixin goes first (Note [composition])

The degrees come from the ``"hybridsp"`` section of the DeepSpeed config (see
:mod:`hybridsp.integrations.deepspeed._engine`); the keyword ``hybridsp={"ulysses": 2, "ring": 2}``
overrides it or, without DeepSpeed, is the only source (DDP). What the subclass changes:

========================  ==================================================================
data                      every context rank of a replica loads the same full batches;
                          accelerate's sharding is re-pointed to the ``DP`` replicas
                          (:mod:`hybridsp.integrations.transformers._trainer_data`); ``len(train loader)``,
                          epochs, ``max_steps`` and the global batch are a DP-only run's.
batches                   each batch is cut with :func:`hybridsp.shard_batch` (labels shifted
                          on the full sequence first); datasets and collators stay unchanged.
loss                      exact token-weighted loss, Note [the loss].
gradients                 exact at ZeRO 0-3 and DDP, Note [gradient scale here].
evaluation, prediction    sharded forward; loss and logits equal an unsharded evaluation,
                          Note [evaluation].
checkpoints               the Trainer's own (DeepSpeed's engine checkpoints); resuming skips
                          batches through the re-pointed shard.
========================  ==================================================================

Note [the loss]: for one optimizer step let ``N`` be the number of valid targets in the whole
global batch (every micro-batch of the accumulation, every replica): counted on the full,
shifted labels in :meth:`HybridSPMixin._get_num_items_in_batch` (the Trainer's own hook for
``num_items_in_batch``) with one no-grad all_reduce over ``mesh.data_group``. A rank's
micro-batch loss is ``DP * replica_sum / N`` in value (the Trainer logs the mean over all
ranks of the per-step sum, which is then exactly the global token mean) with the gradient of
``DP * local_sum / N`` (its own tokens only). ``loss_is_scaled_for_ga = True`` tells the
Trainer not to divide again by the accumulation steps. ``model_accepts_loss_kwargs`` and
``average_tokens_across_devices`` no longer matter: the count is always global.

Note [router loss]: a MoE model whose own loss adds ``router_aux_loss_coef * aux`` (its config's
``output_router_logits``; :func:`~hybridsp.integrations.transformers._loss.model_router_loss`) gets
it here too, with the whole sequence's load-balancing loss of the replica's micro-batch over its
real tokens (:func:`hybridsp.sharded_load_balancing_loss`; the ``attention_mask`` as the model
applies it). As the plain Trainer adds it: once per micro-batch (not divided by the
accumulation steps) and, with ``DP`` replicas, multiplied by ``DP`` as the Trainer multiplies the
model's loss by the processes (``average_tokens_across_devices``), so its gradient is the sum of
the replicas' and the logged loss carries ``DP`` times their mean. The evaluation loss adds it the
same way, once per batch (the Trainer's evaluation scales the model's loss by its processes too).

Note [gradient scale here]: DeepSpeed ZeRO 0-2 sum gradients over the ``DP x C`` ranks and
divide by ``DP`` (the mpu's data-parallel size), so the summed shares above give the unsharded
gradient. ZeRO-3 and DDP average over all ``DP x C`` ranks; a tensor hook multiplies every
incoming gradient by ``C`` there (:func:`hybridsp.integrations.deepspeed._engine.scale_gradients`).
The clipped and logged ``grad_norm`` is then the plain Trainer's (``max_grad_norm`` works).

Note [intercepting deepspeed.initialize] (in :mod:`hybridsp.integrations.transformers._trainer_engine`):
``accelerator.prepare`` builds DeepSpeed's engine with our mpu, batch size and ZeRO-3 hooks.

Note [evaluation]: :meth:`prediction_step` runs the sharded forward under ``no_grad``; the
loss is computed as in training (per batch); logits are gathered over the context group and
un-permuted to the full sequence (with the batch's documents: ``layout="balanced"`` places
tokens by document) only when predictions are wanted (``prediction_loss_only``
skips that; ``preprocess_logits_for_metrics`` then sees full ``[B, S, V]`` logits, as with the
plain Trainer). The evaluation loop's ``gather_function`` gathers over the replicas only
(:func:`~hybridsp.integrations.transformers._trainer_data.gather_over_replicas`).

Note [composition]: the mixin overrides only Trainer hooks (``compute_loss``,
``prediction_step``, ``get_*_dataloader``, ``get_total_train_batch_size``,
``create_accelerator_and_postprocess``, ``evaluation_loop`` and the private
``_get_num_items_in_batch`` of transformers 5.x) and calls ``super()`` for the rest, so
``class HybridSFTTrainer(HybridSPMixin, trl.SFTTrainer)`` composes: TRL's dataset
preparation and collators run unchanged, the mixin replaces its loss. Features that need the
full logits inside the loss (TRL's ``padding_free``, entropy/token-accuracy metrics computed in
``compute_loss``, liger kernels) are not sharded and are refused or bypassed; see docs/hf-trainer.md.

Refused with a ValueError (before any collective): ``model_init`` (the switched model must
exist at construction), ``compute_loss_func`` and ``label_smoothing_factor`` (the loss is
computed here), a batch without ``labels``, and ``"tensor": T > 1`` (Note [no tensor
parallelism] in :mod:`hybridsp.integrations.transformers._trainer_engine`: use
``hybridsp.integrations.deepspeed.initialize``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from transformers import Trainer

from hybridsp.attention._api import gather_sequence
from hybridsp.data._batch import prepare_batch, shard_batch
from hybridsp.integrations.deepspeed import _config as ds_schema
from hybridsp.integrations.deepspeed import _engine as hds
from hybridsp.integrations.fsdp._shard import clip_grad_norm_
from hybridsp.integrations.transformers import _fsdp2_trainer as fsdp
from hybridsp.integrations.transformers._loss import RouterLoss, model_router_loss, share_of_loss
from hybridsp.integrations.transformers._monitor_callback import monitor_callback
from hybridsp.integrations.transformers._peft import switch_attention
from hybridsp.integrations.transformers._trainer_data import gather_over_replicas, shard_loader_over_replicas
from hybridsp.integrations.transformers._trainer_engine import (  # noqa: F401  engine_config: re-exported
    engine_config,
    hybrid_config,
    prepare_with_mesh,
    remove_owned_keys,
)
from hybridsp.integrations.transformers._vision import batch as vlm_batch
from hybridsp.integrations.transformers._vision.model import is_vision_language_model
from hybridsp.losses._cross_entropy import IGNORE_INDEX
from hybridsp.losses._router import real_token_mask
from hybridsp.losses._token_tail import guard_labels, raise_on_bad_labels
from hybridsp.mesh._hybrid_mesh import HybridMesh

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

    _TrainerBase = Trainer  # the type checker sees the Trainer the mixin is composed with
else:
    _TrainerBase = object


class HybridSPMixin(fsdp.FSDP2Checkpoints):
    """Hybrid sequence parallelism for a ``transformers.Trainer`` subclass (module docstring).

    Put it first in the bases. Extra keyword ``hybridsp``: a dict of ``"hybridsp"`` section
    keys (``ulysses``, ``ring``, ``order``, ``layout``, ``backend``) that override the
    DeepSpeed config's section. Attributes after construction: ``hybrid_mesh`` (the
    :class:`~hybridsp.mesh._hybrid_mesh.HybridMesh`), ``hybrid_config`` (the validated
    :class:`~hybridsp.integrations.deepspeed._engine.HybridConfig`).
    """

    loss_is_scaled_for_ga = True  # Note [the loss]: normalised by the whole step's token count
    model: PreTrainedModel | nn.Module  # never None: the Trainer needs a model, and model_init is refused

    def __init__(self, *args, hybridsp: dict | None = None, **kwargs):
        self._hybridsp_overrides = dict(hybridsp or {})
        # removes the gradient-scale hooks (Note [gradient scale here])
        self._hybridsp_unhook: Callable[[], None] | None = None
        self._hybridsp_offload = None  # activation-checkpoint offload, FSDP2's activation_checkpointing_offload
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        self._hybridsp_handle = switch_attention(self.model, self.hybrid_mesh, self.hybrid_config.backend)
        self._router_loss = self._checked_router_loss()  # Note [router loss]
        self._hybridsp_monitor = monitor_callback(self, self.hybrid_config.monitor)  # the "monitor" block, or None
        if self._hybridsp_fsdp2 is not None:  # sharded over DP x C, gradients divided by DP
            fsdp.shard_trainer_model(
                self.model, self.hybrid_mesh, self._hybridsp_fsdp2, self.accelerator.mixed_precision
            )
            self.model_wrapped = self.model
            self._hybridsp_offload = fsdp.activation_offload(self.model, self._hybridsp_fsdp2)
        elif not self.is_deepspeed_enabled:  # DDP averages over DP x C
            self._scale_gradients(self.model)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The Trainer's ``train``; a resumed run's monitor first reads the checkpoint's guard window."""
        if self._hybridsp_monitor is not None:
            self._hybridsp_monitor.resume_from(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _scale_gradients(self, module) -> None:
        """Hooks multiplying ``module``'s incoming gradients by C; replaces earlier ones (one set per
        model, also when an evaluation engine is followed by a training engine)."""
        if self._hybridsp_unhook is not None:
            self._hybridsp_unhook()
            self._hybridsp_unhook = None
        if self.hybrid_mesh.context > 1:
            self._hybridsp_unhook = hds.scale_gradients(module, self.hybrid_mesh.context)

    # ---- setup ---------------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        """The ``"hybridsp"`` section read and checked (before any collective), the Trainer's
        accelerator, the mesh, then our hook on DeepSpeed's engine creation."""
        self.hybrid_config = hybrid_config(self.args, self._hybridsp_overrides)
        self._hybridsp_fsdp2 = fsdp.fsdp2_request_of_trainer(self.args)
        hidden = fsdp.accelerator_without_fsdp(self.args) if self._hybridsp_fsdp2 else contextlib.nullcontext()
        with hds.without_cpu_shm_comm_build(), hidden:
            super().create_accelerator_and_postprocess()
        fsdp.refuse_deepspeed_state(self._hybridsp_fsdp2, self.is_deepspeed_enabled)
        self.hybrid_mesh = _mesh(self.hybrid_config)
        if self.is_deepspeed_enabled:
            remove_owned_keys(self.accelerator.state.deepspeed_plugin, self.args)
        self.accelerator.prepare = functools.partial(prepare_with_mesh, self.accelerator.prepare, self)
        if self._hybridsp_fsdp2 is not None:  # the whole model's norm over DTensor gradients, a plain tensor
            self.accelerator.clip_grad_norm_ = clip_grad_norm_

    def _refuse_unsupported(self) -> None:
        refused = {
            "model_init": self.model_init is not None,
            "compute_loss_func": self.compute_loss_func is not None,
            "label_smoothing_factor": self.args.label_smoothing_factor != 0,
        }
        if any(refused.values()):
            raise ValueError(
                f"HybridSPTrainer computes the sharded loss itself and switches a model that exists at construction; "
                f"it does not support {[k for k, v in refused.items() if v]}: pass model= (not model_init=), no "
                f"compute_loss_func, label_smoothing_factor=0"
            )

    def _router_loss_settings(self) -> RouterLoss | None:
        """The router loss the model adds to its own loss (Note [router loss]); TRL's trainers override it."""
        return model_router_loss(self.model)

    def _checked_router_loss(self) -> RouterLoss | None:
        router = self._router_loss_settings()
        if router is not None and is_vision_language_model(self.accelerator.unwrap_model(self.model)):
            raise ValueError(
                f"{type(self).__name__} does not shard the router loss of a vision-language model "
                f"(router_aux_loss_coef={router.coefficient}): set router_aux_loss_coef=0 or output_router_logits=False"
            )
        return router

    def _router_share(self, router_logits, tensors: dict, documents) -> torch.Tensor:
        """The whole micro-batch's load-balancing loss (unweighted) from this rank's ``router_logits``
        and the full batch ``tensors``; the gradient is this rank's share."""
        mask = real_token_mask(tensors, self.hybrid_mesh, documents)  # [B, S_local]
        assert self._router_loss is not None  # called only when the model has a router loss
        return self._router_loss.share(router_logits, mask, self.hybrid_mesh)

    def undo_hybridsp(self) -> None:
        """Remove what this trainer added to its model (gradient hooks, attention switch); idempotent.

        The model is then the plain model again; the trainer must not train or evaluate after it.
        """
        if self._hybridsp_unhook is not None:
            self._hybridsp_unhook()
            self._hybridsp_unhook = None
        self._hybridsp_handle.undo()

    # ---- data: replicas, not ranks -------------------------------------------------------

    def get_train_dataloader(self):
        return shard_loader_over_replicas(super().get_train_dataloader(), self.hybrid_mesh)

    def get_eval_dataloader(self, eval_dataset=None):
        return shard_loader_over_replicas(super().get_eval_dataloader(eval_dataset), self.hybrid_mesh)

    def get_test_dataloader(self, test_dataset):
        return shard_loader_over_replicas(super().get_test_dataloader(test_dataset), self.hybrid_mesh)

    def get_total_train_batch_size(self, args) -> int:
        """Micro batch x accumulation x DP replicas (the context ranks share their samples)."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.hybrid_mesh.dp

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        """Valid targets of these full micro-batches summed over the replicas (Note [the loss]).

        One no-grad all_reduce over ``mesh.data_group``; None when the batches have no labels.
        """
        if not batch_samples or any("labels" not in batch for batch in batch_samples):
            return None
        labels = [self._full(batch)["shift_labels"] for batch in batch_samples]  # each [B, S]
        vocab = self._vocab_size()
        bad = [
            guard_labels(x, vocab, IGNORE_INDEX)[1] if vocab else torch.zeros_like(x, dtype=torch.bool) for x in labels
        ]  # [B, S] each: targets outside the vocabulary
        count = sum(int((x != IGNORE_INDEX).sum()) for x in labels)
        totals = torch.tensor(
            [float(count), float(sum(int(b.sum()) for b in bad))], dtype=torch.float64, device=device
        )  # [2]: valid targets, bad targets
        if self.hybrid_mesh.dp > 1:
            dist.all_reduce(totals, group=self.hybrid_mesh.data_group)
        # a bad label on one replica: every replica raises here, before the forward (Note [bad labels]);
        # vocab None: no label is flagged on any replica (same model), so the message never reads it
        raise_on_bad_labels(
            int(totals[1]),
            torch.cat([x.flatten() for x in labels]),
            torch.cat([b.flatten() for b in bad]),
            vocab,  # type: ignore[arg-type]  # None: unread
            IGNORE_INDEX,
            self.hybrid_mesh,
        )
        return totals[0]

    def _vocab_size(self) -> int | None:
        """Rows of the output embedding (its full shape under ZeRO-3), else the text config's
        ``vocab_size``, else None: the V the loss will see."""
        get_head = getattr(self.model, "get_output_embeddings", None)  # a transformers model's, a PEFT wrapper's
        head = get_head() if get_head is not None else None
        weight = getattr(head, "weight", None)
        if weight is not None:
            return int(getattr(weight, "ds_shape", weight.shape)[0])
        config = getattr(self.model, "config", None)
        config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        vocab = getattr(config, "vocab_size", None)
        return int(vocab) if vocab else None

    def _full(self, batch) -> dict[str, torch.Tensor]:
        tensors = _batch_tensors(batch)
        if vlm_batch.is_vision_batch(tensors):
            tensors = vlm_batch.text_fields(tensors)
        else:
            tensors = {key: value for key, value in tensors.items() if key not in vlm_batch.EXTRA_KEYS}
        return prepare_batch(tensors, self.hybrid_mesh, pad_token_id=self._pad_token_id())

    def _shard(self, tensors: dict) -> dict:
        """This rank's shard: ``shard_vlm_batch`` for an image/video batch and for a text-only batch of
        a vision-language model under ZeRO-3 with several replicas (with the idle encoder call: Note
        [text-only batches] in :mod:`hybridsp.integrations.transformers._vision.batch`); else
        :func:`shard_batch` (packed rows, the balanced layout and the model's window included)."""
        model = self.accelerator.unwrap_model(self.model)
        if vlm_batch.is_vision_batch(tensors) or self._needs_idle_encoder(model):
            return vlm_batch.shard_vlm_batch(
                tensors, self.hybrid_mesh, model, pad_token_id=self._pad_token_id(), idle_encoder=True
            )
        from hybridsp.integrations.transformers._capabilities import layout_window  # Note [layout window] there

        text = {key: value for key, value in tensors.items() if key not in vlm_batch.EXTRA_KEYS}
        return shard_batch(
            text, self.hybrid_mesh, pad_token_id=self._pad_token_id(), sliding_window=layout_window(model)
        )

    def _needs_idle_encoder(self, model) -> bool:
        """A vision-language model whose vision tower ZeRO-3 gathers collectively across replicas."""
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        return is_vision_language_model(model) and self.hybrid_mesh.dp > 1 and is_deepspeed_zero3_enabled()

    def _pad_token_id(self) -> int:
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        return 0 if pad is None else int(pad)

    # ---- loss ----------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """This rank's share of the exact token-weighted loss of the step (Note [the loss])."""
        if "labels" not in inputs:
            raise ValueError(
                f"HybridSPTrainer needs 'labels' in every batch (causal-LM labels, unshifted); got keys {sorted(inputs)}"
            )
        if num_items_in_batch is None:
            num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        tensors = _batch_tensors(inputs)
        local = self._shard(tensors)
        shift_labels = local.pop("shift_labels")  # [B, S_local]
        documents = local.pop("documents")  # host data: every layer plans once, no collective to find them
        with self._hybridsp_offload or contextlib.nullcontext():
            outputs = model(**local, hybridsp_documents=documents, use_cache=False)
        loss = share_of_loss(outputs.logits, shift_labels, num_items_in_batch, self.hybrid_mesh)
        if self._router_loss is not None:  # Note [router loss]: DP x, as the Trainer scales the model's loss
            aux = self._router_share(getattr(outputs, "router_logits", None), tensors, documents)
            loss = loss + self.hybrid_mesh.dp * self._router_loss.coefficient * aux
            if isinstance(outputs, dict):  # a ModelOutput: the whole sequence's value, not the shard's
                outputs["aux_loss"] = aux.detach()
        if self._hybridsp_monitor is not None and model.training:
            self._hybridsp_monitor.remember(tensors, loss)
        return (loss, outputs) if return_outputs else loss

    # ---- evaluation and prediction -------------------------------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """Sharded forward; (loss, full logits [B, S, V] or None, labels [B, S] or None) (Note [evaluation])."""
        inputs = self._prepare_inputs(inputs)
        has_labels = "labels" in inputs
        batch = _batch_tensors(inputs)
        seq_len = batch["input_ids"].shape[1]
        with torch.no_grad():
            if not has_labels:
                batch["labels"] = batch["input_ids"]  # only to cut the batch; no loss is reported
            local = self._shard(batch)
            shift_labels = local.pop("shift_labels")  # [B, S_local]
            documents = local.pop("documents")
            outputs = model(**local, hybridsp_documents=documents, use_cache=False)
            logits, loss = outputs.logits, None  # [B, S_local, V]
            if has_labels:
                count = self._get_num_items_in_batch([inputs], self.args.device)
                loss = share_of_loss(logits, shift_labels, count, self.hybrid_mesh).detach()
                if self._router_loss is not None:  # Note [router loss]: once per batch, DP x as in training
                    router_logits = getattr(outputs, "router_logits", None)
                    weight = self.hybrid_mesh.dp * self._router_loss.coefficient
                    loss = loss + weight * self._router_share(router_logits, batch, documents)
        if prediction_loss_only:
            return loss, None, None
        full_logits = gather_sequence(logits, self.hybrid_mesh, cu_seqlens=documents)[:, :seq_len]  # [B, S, V]
        return loss, full_logits, inputs.get("labels")

    def evaluation_loop(self, *args, **kwargs):
        """The Trainer's loop, gathering over the replicas (the Trainer resets ``gather_function`` after it)."""
        self.gather_function = functools.partial(
            gather_over_replicas, mesh=self.hybrid_mesh, gradient_state=self.accelerator.gradient_state
        )
        return super().evaluation_loop(*args, **kwargs)


class HybridSPTrainer(HybridSPMixin, Trainer):
    """``transformers.Trainer`` with hybrid Ulysses x ring sequence parallelism (module docstring).

    Same constructor as ``Trainer`` plus the optional keyword ``hybridsp`` (see
    :class:`HybridSPMixin`). Needs ``torch.distributed`` (any launcher: ``deepspeed``,
    ``torchrun``, ``accelerate launch``).
    """


def _batch_tensors(inputs) -> dict[str, torch.Tensor]:
    """The tensors of a collated batch (drops non-tensor values such as ``return_loss``)."""
    return {key: value for key, value in inputs.items() if torch.is_tensor(value)}


def _mesh(hybrid: ds_schema.HybridConfig) -> HybridMesh:
    hybrid.mesh_shape(dist.get_world_size() if dist.is_initialized() else 1)  # ValueError quoting the sizes
    if not dist.is_initialized():
        raise RuntimeError(
            "HybridSPTrainer needs torch.distributed: launch with deepspeed, torchrun or accelerate launch, or, for "
            "one process without a launcher, call hybridsp.launch.init_process_group() before building the Trainer"
        )
    return hds.build_mesh(hybrid)
