"""FSDP2 inside :class:`~hybridsp.integrations.transformers._trainer.HybridSPTrainer`: the Trainer asks, hybridsp shards.

Note [the Trainer's FSDP2 path] (Note [FSDP under the Trainer] in :mod:`hybridsp.integrations.fsdp._requested`
says why accelerate must not see the request):

==========================  ==========================================================================
accelerator                 built with the FSDP request hidden (:func:`accelerator_without_fsdp`):
                            a plain multi-process accelerator on CPU and GPU alike.
sharding                    after the switch, :func:`shard_trainer_model` runs ``fully_shard`` per decoder
                            layer and on the root over ``mesh.fsdp_mesh`` (all ``DP x U x R`` ranks),
                            gradients divided by ``DP``; mixed precision from the Trainer's ``bf16`` /
                            ``fp16`` (bf16 compute, fp32 gradient reduction), ``cpu_offload``,
                            ``reshard_after_forward``, activation checkpointing (and its offload).
prepare                     the sharded model skips accelerate's DDP wrap: ``prepare_model(...,
                            evaluation_mode=True)`` adds only autocast and ``torch.compile``
                            (:func:`prepare_sharded`); the optimizer is built over the DTensor shards.
gradient norm               :func:`~hybridsp.integrations.fsdp.clip_grad_norm_` (one all-reduce, a plain
                            tensor) in place of accelerate's, so clipping and the logged ``grad_norm`` are
                            the whole model's.
checkpoints                 sharded through DCP (:func:`save_trainer_state` / :func:`load_trainer_state`,
                            the folder ``fsdp2_sharded`` in each checkpoint) for exact resume on any world
                            size or U x R; the model itself consolidated on rank 0 with
                            ``save_pretrained`` (loads into the unmodified model).
==========================  ==========================================================================
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridsp.integrations.fsdp._checkpoint import full_state_dict, load_sharded, save_sharded
from hybridsp.integrations.fsdp._requested import FSDP2Request, fsdp2_request
from hybridsp.integrations.fsdp._shard import fully_shard_model
from hybridsp.mesh._hybrid_mesh import HybridMesh

if TYPE_CHECKING:
    from transformers import Trainer

    _TrainerBase = Trainer  # the type checker sees the Trainer the mixin is composed with
else:
    _TrainerBase = object

SHARDED_FOLDER = "fsdp2_sharded"  # inside a Trainer checkpoint: model and optimizer shards (DCP)
SCHEDULER_FILE = "scheduler.pt"  # the Trainer's own name for it


@contextlib.contextmanager
def accelerator_without_fsdp(args) -> Iterator[None]:
    """While the Trainer builds its accelerator: no FSDP plugin from ``args`` nor from accelerate's
    launcher environment (restored on exit, also on error)."""
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    env = os.environ.get("ACCELERATE_USE_FSDP")
    args.fsdp_plugin_args = None
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    try:
        yield
    finally:
        args.fsdp_plugin_args = plugin_args
        if env is None:
            os.environ.pop("ACCELERATE_USE_FSDP", None)
        else:
            os.environ["ACCELERATE_USE_FSDP"] = env


def mixed_precision_policy(mode: str) -> Any:
    """bf16 / fp16 compute over fp32 parameters with fp32 gradient reduction for the accelerator's mixed
    precision (``"bf16"`` / ``"fp16"``: the Trainer's ``bf16``/``fp16`` flags or accelerate's launcher); None
    for ``"no"`` (and ``"fp8"``, which FSDP2's policy does not take)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(mode))
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype is not None else None


def _layers(model: nn.Module, request: FSDP2Request) -> list[nn.Module] | None:
    """The decoder layers named by the request's classes, none for ``NO_WRAP`` (the root alone), or None (the
    model's ``_no_split_modules``)."""
    if request.wrap_policy == "NO_WRAP":
        return []
    if not request.layer_classes:
        return None
    layers = [m for m in model.modules() if type(m).__name__ in request.layer_classes]
    if not layers:
        raise ValueError(
            f"the FSDP layer classes {list(request.layer_classes)} name no module of {type(model).__name__}: "
            "fix transformer_layer_cls_to_wrap or leave it out (the model's _no_split_modules are used)"
        )
    return layers


def shard_trainer_model(model: nn.Module, mesh: HybridMesh, request: FSDP2Request, mixed_precision: str) -> nn.Module:
    """Activation checkpointing when asked, then ``fully_shard_model`` with the Trainer's settings
    (``mixed_precision``: the accelerator's, ``"no"``, ``"bf16"`` or ``"fp16"``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if request.activation_checkpointing or request.activation_checkpointing_offload:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if request.cpu_offload else None
    return fully_shard_model(
        model,
        mesh,
        layers=_layers(model, request),
        mp_policy=mixed_precision_policy(mixed_precision),
        offload_policy=offload,
        reshard_after_forward=request.reshard_after_forward,
    )


def activation_offload(model: nn.Module, request: FSDP2Request):
    """The checkpointed layers' inputs in host memory (:func:`hybridsp.offload_activations`), or None."""
    if not request.activation_checkpointing_offload:
        return None
    from hybridsp.memory._offload import offload_activations

    return offload_activations(model)


def prepare_sharded(prepare, accelerator, model: nn.Module, *args, **kwargs):
    """``accelerator.prepare`` with the sharded ``model`` kept out of accelerate's DDP wrap (autocast and
    ``torch.compile`` still applied, by ``prepare_model(..., evaluation_mode=True)``)."""
    if not any(obj is model for obj in args):
        return prepare(*args, **kwargs)
    prepared_model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    others = [obj for obj in args if obj is not model]
    prepared_others = iter(_as_tuple(prepare(*others, **kwargs)) if others else ())
    result = tuple(prepared_model if obj is model else next(prepared_others) for obj in args)
    return result[0] if len(result) == 1 else result


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def save_trainer_state(output_dir: str, model: nn.Module, optimizer, scheduler, should_save: bool) -> None:
    """The model and optimizer shards (every rank, DCP) and the scheduler (the saving rank)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    save_sharded(Path(output_dir) / SHARDED_FOLDER, model, optimizer)
    if should_save and scheduler is not None:
        torch.save(scheduler.state_dict(), Path(output_dir) / SCHEDULER_FILE)


def has_sharded_state(checkpoint: str) -> bool:
    return (Path(checkpoint) / SHARDED_FOLDER).is_dir()


def load_trainer_weights(checkpoint: str, model: nn.Module) -> None:
    """The model's weights from a checkpoint's shards (any world size, any U x R)."""
    load_sharded(Path(checkpoint) / SHARDED_FOLDER, model)


def load_trainer_state(checkpoint: str, model: nn.Module, optimizer, scheduler) -> None:
    """The optimizer state (shards) and the scheduler of a checkpoint."""
    optimizer = getattr(optimizer, "optimizer", optimizer)
    load_sharded(Path(checkpoint) / SHARDED_FOLDER, model, optimizer, weights=False)
    scheduler_file = Path(checkpoint) / SCHEDULER_FILE
    if scheduler is not None and scheduler_file.is_file():
        scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


def fsdp2_request_of_trainer(args) -> FSDP2Request | None:
    """FSDP2 asked of the Trainer (Note [FSDP under the Trainer]); ValueError for FSDP1 or FSDP with DeepSpeed."""
    request = fsdp2_request(args)
    if request is not None and args.deepspeed:
        raise ValueError(
            f"HybridSPTrainer got both DeepSpeed (deepspeed={args.deepspeed!r}) and FSDP ({request.asked}): choose one "
            "(ZeRO-3 or FSDP2 both shard parameters, gradients and optimizer state over all ranks)"
        )
    return request


def refuse_deepspeed_state(request: FSDP2Request | None, deepspeed_enabled: bool) -> None:
    """ValueError when FSDP2 is asked for but accelerate's process-wide state already holds DeepSpeed (an
    earlier DeepSpeed trainer in this process, or ``accelerate launch --use_deepspeed``); no communication."""
    if request is not None and deepspeed_enabled:
        raise ValueError(
            f"HybridSPTrainer got FSDP ({request.asked}) but accelerate's state in this process already uses "
            "DeepSpeed (an earlier DeepSpeed trainer here, or a DeepSpeed launch): run FSDP2 in a fresh process"
        )


class FSDP2Checkpoints(_TrainerBase):
    """The Trainer's checkpoint hooks under FSDP2 (Note [the Trainer's FSDP2 path]); the Trainer's own otherwise.
    A base of :class:`~hybridsp.integrations.transformers._trainer.HybridSPMixin`, which sets ``_hybridsp_fsdp2``."""

    _hybridsp_fsdp2: FSDP2Request | None = None  # FSDP2 asked of the Trainer: set as its accelerator is built
    model: nn.Module  # never None: HybridSPMixin refuses model_init

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under FSDP2: the whole model gathered (every rank) and saved by the saving rank with
        ``save_pretrained``, loadable into the unmodified model; otherwise the Trainer's own."""
        if self._hybridsp_fsdp2 is None:
            return super().save_model(output_dir, _internal_call)
        state = full_state_dict(self.model)  # a collective: every rank
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._hybridsp_fsdp2 is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_trainer_state(output_dir, self.model, self.optimizer, self.lr_scheduler, self.args.should_save)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self._hybridsp_fsdp2 is None or not has_sharded_state(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_trainer_weights(resume_from_checkpoint, model if model is not None else self.model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._hybridsp_fsdp2 is None or checkpoint is None or not has_sharded_state(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_trainer_state(checkpoint, self.model, self.optimizer, self.lr_scheduler)
