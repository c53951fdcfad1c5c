"""TRL's GRPO and RLOO trainers with exact hybrid sequence parallelism (``pip install -e ".[trl]"``).

    from hybridsp.integrations.trl import HybridGRPOTrainer, HybridRLOOTrainer

    trainer = HybridGRPOTrainer(model=model, reward_funcs=[my_reward], train_dataset=prompts,
                                args=GRPOConfig(..., deepspeed="ds_configs/cp4.json"),   # has a "hybridsp" section
                                processing_class=tokenizer)
    trainer.train()

Both are :class:`_HybridRLMixin` and :class:`~hybridsp.integrations.transformers._trainer.HybridSPMixin`
composed with the TRL trainer (the mixins first). TRL samples the prompts, generates, calls the
reward functions, computes advantages, its losses and its metrics; what changes (docs/trl-peft.md,
"GRPO and RLOO", has the recipe):

Note [replicas, not ranks]: the ``C = U x R`` context ranks of a replica load the same prompts
(the mixin re-points accelerate's data shard to the ``DP`` replicas). TRL's per-process
arithmetic counts replicas: the generation batch is ``per_device_train_batch_size x DP x
steps_per_generation`` (``steps_per_generation`` as configured; set at construction, before any
collective), each replica is seeded with ``seed + dp_rank`` (TRL: ``seed + process_index``), and
during generation-and-scoring and the loss the trainer sees :class:`~hybridsp.integrations.trl._rollouts.ReplicaAccelerator`
(``gather``, ``reduce``, ``process_index``, ``num_processes`` over the replicas; TRL's module
``gather`` / ``gather_object`` likewise, :func:`~hybridsp.integrations.trl._rollouts.replica_view`).
So the reward gather, the group statistics, the slice a process keeps, the token counts of
``dapo``'s normaliser and every logged metric are those of a ``DP``-process plain run.

Note [identical completions]: by default (``"generation": "plain"`` in the ``"hybridsp"``
section) generation runs on the whole prompt on every context rank with the plain model: the attention switch is undone for TRL's own ``generate`` call (so sampling, its
logits processors and the random draws are exactly TRL's) and put back after it. Every context
rank of a replica starts from the same seed and the same prompts; afterwards context rank 0's
completion ids and random state are broadcast over the context group
(:func:`~hybridsp.integrations.trl._rollouts.agree_on_rollouts`, a few kB), so the completions,
and every later draw (the shuffle of the generation batch), are identical on all of them even
if a device's generation were not bitwise reproducible. With ``"generation": "sharded"`` the policy
stays switched and TRL's ``generate`` call is answered by hybridsp's sharded generation
(:mod:`hybridsp.integrations.trl._generation`: prompt and K/V cache sharded over the context group,
every step's token agreed over it, the random generators advanced alike on every rank, TRL's
post-processing unchanged); no broadcast is needed after it.

Note [sharded scoring]: the policy's, the old policy's and the reference's per-token
log-probabilities (and entropies) come from TRL's fused LM head call
``model(input_ids, attention_mask, labels, fused_lm_head=True)``, which
:func:`~hybridsp.integrations.trl._logprobs.shard_fused_calls` runs on this rank's tokens (labels
shifted on the full sequence first) and whose per-token outputs it all-gathers over the context
group (``[B, S]`` floats per field; never the ``[B, S, V]`` logits); only this rank's positions
carry a gradient, so each rank's backward is its share of the unsharded gradient, which ZeRO sums.
TRL's rows are a left-padded prompt and a right-padded completion: each row is rolled left by its
padding before the call (:func:`~hybridsp.integrations.trl._rollouts.right_aligned`) and the
completion's values are read back in TRL's columns. (RoPE sees positions shifted by the row's
padding, which attention does not depend on: equal up to rounding.) TRL's loss code then runs
unchanged on every context rank: ``grpo``, ``dr_grpo``, ``bnpo``, ``dapo`` (and the others of
the installed TRL), importance sampling, clipping, the KL term, ``num_iterations > 1`` (old
log-probs reused), gradient accumulation.

Refused with a ValueError at construction, before any collective: vLLM and continuous-batching
generation, ``rollout_func``, tools and environments, a generation batch that does not hold
whole prompt groups at the replica count, and with ``"generation": "sharded"`` generation settings
it cannot honour or ``layout="balanced"``; after TRL's constructor (on every rank alike): MoE
auxiliary losses; at the first scoring (on every rank alike): inputs beyond the text (pixel
values, token types of vision-language prompts), which are not sharded.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from accelerate.utils import set_seed  # type: ignore[import-untyped]  # accelerate ships no type information
from trl import GRPOTrainer, RLOOTrainer

from hybridsp.integrations.deepspeed import _config as ds_schema
from hybridsp.integrations.transformers._peft import base_model
from hybridsp.integrations.transformers._switch import apply
from hybridsp.integrations.transformers._trainer import HybridSPMixin
from hybridsp.integrations.trl._generation import config_settings, generate_options, generating_sharded
from hybridsp.integrations.trl._logprobs import shard_fused_calls
from hybridsp.integrations.trl._rollouts import agree_on_rollouts, replica_view, right_aligned

if TYPE_CHECKING:
    # TRL's _BaseTrainer sets loss_is_scaled_for_ga = None, which mypy reads as the type None
    class _RLBase(HybridSPMixin, GRPOTrainer):  # type: ignore[misc]
        """What the type checker sees: the mixin on an online TRL trainer (RLOOTrainer has the same methods)."""
else:
    _RLBase = object

REFUSED_ARGS = ("use_vllm", "use_transformers_continuous_batching", "use_transformers_paged")
REFUSED_KWARGS = ("rollout_func", "tools", "environment_factory")


class _HybridRLMixin(_RLBase):
    """What GRPO and RLOO share under hybrid SP (module notes); first in the bases, then HybridSPMixin."""

    _trl_module = ""  # the TRL module whose gather / gather_object count replicas (Note [replicas, not ranks])

    def __init__(self, *args, hybridsp: dict | None = None, **kwargs):
        name, positional = type(self).__name__, list(args)
        config = kwargs.get("args", positional[2] if len(positional) > 2 else None)
        if config is None:
            raise ValueError(f'{name} needs args= a TRL config with deepspeed= (its "hybridsp" section) set')
        _refuse_unsupported(name, config, kwargs)
        if len(positional) > 2:
            positional[2] = _per_replica(name, config, hybridsp)
        else:
            kwargs["args"] = _per_replica(name, config, hybridsp)
        super().__init__(*positional, hybridsp=hybridsp, **kwargs)  # HybridSPMixin has switched the policy
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError(f"{name} does not shard MoE router logits: set router_aux_loss_coef=0.0")
        policy = base_model(self.model)
        pad = self._pad_token_id()
        self._hybridsp_removers = [shard_fused_calls(policy, self.hybrid_mesh, pad_token_id=pad)]
        reference = getattr(self.ref_model, "module", self.ref_model) if self.ref_model is not None else None
        if reference is not None and base_model(reference) is not policy:  # switched once, never the policy twice
            reference = base_model(reference)
            self._hybridsp_removers.append(apply(reference, self.hybrid_mesh, backend=self.hybrid_config.backend).undo)
            self._hybridsp_removers.append(shard_fused_calls(reference, self.hybrid_mesh, pad_token_id=pad))
        set_seed(self.args.seed + self.hybrid_mesh.dp_rank)  # TRL seeds seed + process_index: one seed per replica

    # ---- generation: the plain model, the same completions on every context rank ---------

    def _generate_single_turn(self, *args, **kwargs):
        """TRL's generation with the attention switch undone, then context rank 0's completions everywhere;
        with ``"generation": "sharded"``, TRL's generation on the switched policy (Note [identical completions])."""
        if self.hybrid_config.generation == "sharded":
            name = type(self).__name__
            options = generate_options(self.generation_kwargs, name)  # ValueError on every rank alike
            unwrapped = self.accelerator.unwrap_model(self.model_wrapped)  # the object TRL calls generate on
            with generating_sharded(unwrapped, base_model(self.model), self.hybrid_mesh, options, name):
                return super()._generate_single_turn(*args, **kwargs)
        self._hybridsp_handle.undo()
        try:
            generated = super()._generate_single_turn(*args, **kwargs)  # GRPO: (ids, logprobs), RLOO: ids
        finally:
            self._hybridsp_handle = apply(base_model(self.model), self.hybrid_mesh, backend=self.hybrid_config.backend)
        return agree_on_rollouts(generated, self.hybrid_mesh)

    def _generate_and_score_completions(self, inputs):
        with replica_view(self, self._trl_module):
            return super()._generate_and_score_completions(inputs)

    # ---- scoring and the loss -----------------------------------------------------------------

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **model_extras,
    ):
        """TRL's per-token log-probs [B, C] (and entropies) of the completion tokens from sharded fused calls
        (Note [sharded scoring]); the aux loss is refused at construction."""
        extras = sorted(key for key, value in model_extras.items() if value is not None)
        if extras:
            raise ValueError(f"{type(self).__name__} scores text only; it cannot shard {extras}")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            ids, mask, labels, index = right_aligned(input_ids[rows], attention_mask[rows], logits_to_keep)
            with self.accelerator.autocast():
                outputs = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            logps.append(outputs.log_probs.gather(1, index))  # [b, C]
            if compute_entropy:
                entropies.append(outputs.entropy.gather(1, index))  # [b, C]
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """The TRL trainer's own loss (its fused calls sharded, its collectives over replicas)."""
        with replica_view(self, self._trl_module):
            return super(HybridSPMixin, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """The TRL trainer's (generation, scoring and loss as in training)."""
        return super(HybridSPMixin, self).prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def undo_hybridsp(self) -> None:
        """Also remove the reference model's switch and both models' fused-call hooks; idempotent."""
        while self._hybridsp_removers:
            self._hybridsp_removers.pop()()
        super().undo_hybridsp()


class HybridGRPOTrainer(_HybridRLMixin, HybridSPMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with hybrid sequence parallelism; same constructor plus ``hybridsp=`` (module notes)."""

    loss_is_scaled_for_ga = True  # as GRPOTrainer: its loss is divided by the accumulation steps already
    _trl_module = GRPOTrainer.__module__


class HybridRLOOTrainer(_HybridRLMixin, HybridSPMixin, RLOOTrainer):
    """``trl.RLOOTrainer`` with hybrid sequence parallelism; same constructor plus ``hybridsp=`` (module notes)."""

    loss_is_scaled_for_ga = False  # as RLOOTrainer: a micro-batch mean, the Trainer divides
    _trl_module = RLOOTrainer.__module__


def _refuse_unsupported(name: str, config, kwargs: dict) -> None:
    refused = [key for key in REFUSED_ARGS if getattr(config, key, False)]
    refused += [key for key in REFUSED_KWARGS if kwargs.get(key) is not None]
    if refused:
        raise ValueError(
            f"{name} generates with the model's own generate() and scores text only; it does not support {refused}: "
            f"leave them unset"
        )


def _per_replica(name: str, config, overrides: dict | None):
    """A copy of the TRL config whose generation batch counts replicas (Note [replicas, not ranks])."""
    deepspeed = getattr(config, "hf_deepspeed_config", None) if config.deepspeed else None
    hybrid = ds_schema.HybridConfig.from_ds_config(deepspeed.config if deepspeed else {}, **dict(overrides or {}))
    if hybrid.generation == "sharded":
        _check_sharded_generation(name, config, hybrid)
    replicas = hybrid.mesh_shape(config.world_size).dp  # ValueError quoting the sizes
    config = copy.copy(config)
    per_generation = config.per_device_train_batch_size * replicas * config.steps_per_generation
    if per_generation % config.num_generations != 0:
        raise ValueError(
            f"{name}: the generation batch per_device_train_batch_size={config.per_device_train_batch_size} x "
            f"{replicas} replicas x steps_per_generation={config.steps_per_generation} = {per_generation} must hold "
            f"whole groups of num_generations={config.num_generations}; change the batch size or num_generations"
        )
    config.generation_batch_size = per_generation
    return config


def _check_sharded_generation(name: str, config, hybrid) -> None:
    """ValueError, before any collective, for what ``"generation": "sharded"`` cannot do (TRL's prompts are left-padded)."""
    generate_options(
        config_settings(config), name
    )  # Note [generation settings] in hybridsp.integrations.trl._generation
    if hybrid.context > 1 and hybrid.layout == "balanced":
        raise ValueError(
            f'{name} with "generation": "sharded" generates left-padded prompts, which layout="balanced" '
            f'cannot place (Note [balanced layout] in hybridsp.integrations.transformers._generation); set "layout": '
            f'"zigzag" or "generation": "plain" in the hybridsp section'
        )
