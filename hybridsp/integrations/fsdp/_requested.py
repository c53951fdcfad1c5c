"""FSDP asked of :class:`~hybridsp.integrations.transformers._trainer.HybridSPTrainer`: what was asked, read once.

Note [FSDP under the Trainer]: accelerate keeps an FSDP plugin only for GPU-like distributed types, so on
CPU ``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})`` (or ``accelerate launch`` with
``distributed_type: FSDP``) would silently train as DDP, every parameter whole on every rank; on a GPU
accelerate's FSDP2 would shard over its own mesh and average the gradients over all ranks, which is not
the hybrid's gradient (Note [gradient scale under FSDP2] in :mod:`hybridsp.integrations.fsdp._shard`).
So the Trainer never lets accelerate see the request: :func:`fsdp2_request` reads it (from the
Trainer's arguments or accelerate's launcher environment), the accelerator is built without it, and
the Trainer shards the switched model itself with :func:`~hybridsp.integrations.fsdp.fully_shard_model`
over the hybrid mesh, on CPU and GPU alike (:mod:`hybridsp.integrations.transformers._fsdp2_trainer`).
FSDP version 1 is refused in one line (transformers deprecates it; the hybrid needs DTensor shards).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TRUE = ("1", "true", "yes")


@dataclass(frozen=True)
class FSDP2Request:
    """The FSDP2 settings a Trainer user asked for (``TrainingArguments.fsdp_config`` or accelerate's
    ``fsdp_config`` section of its YAML), in the words :func:`fully_shard_model` understands."""

    asked: str  # how it was asked, for messages
    reshard_after_forward: bool = True
    cpu_offload: bool = False  # parameters, gradients and optimizer state in host memory (CPUOffloadPolicy)
    activation_checkpointing: bool = False
    activation_checkpointing_offload: bool = False  # the checkpointed layers' inputs in host memory
    layer_classes: tuple[str, ...] = ()  # decoder layer classes to shard one by one; () = _no_split_modules
    wrap_policy: str = "TRANSFORMER_BASED_WRAP"  # or "NO_WRAP": the root alone (SIZE_BASED_WRAP is refused)


def _flag(value: object) -> bool:
    return str(value).strip().lower() in _TRUE


def _from_trainer_arguments(args) -> FSDP2Request | None:
    if not getattr(args, "fsdp", None):
        return None
    plugin = dict(getattr(args, "fsdp_plugin_args", None) or {})
    config = {k.removeprefix("fsdp_"): v for k, v in (getattr(args, "fsdp_config", None) or {}).items()}
    version = int(plugin.get("fsdp_version", config.get("version", 2)))
    asked = f"TrainingArguments(fsdp={args.fsdp!r}) with FSDP version {version}"
    _refuse_version(version, asked)
    classes = plugin.get("transformer_cls_names_to_wrap") or ",".join(config.get("transformer_layer_cls_to_wrap") or ())
    policy = str(plugin.get("auto_wrap_policy", config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")))
    _refuse_wrap_policy(policy, asked)
    return FSDP2Request(
        asked=asked,
        reshard_after_forward=_flag(plugin.get("reshard_after_forward", config.get("reshard_after_forward", True))),
        cpu_offload=_flag(plugin.get("cpu_offload", config.get("cpu_offload", False))),
        activation_checkpointing=_flag(config.get("activation_checkpointing", False)),
        activation_checkpointing_offload=_flag(config.get("activation_checkpointing_offload", False)),
        layer_classes=tuple(name for name in str(classes).split(",") if name),
        wrap_policy=policy,
    )


def _from_launcher() -> FSDP2Request | None:
    env = os.environ
    if not _flag(env.get("ACCELERATE_USE_FSDP", "false")):
        return None
    version = int(env.get("FSDP_VERSION", "1"))
    asked = f"accelerate's distributed_type FSDP (FSDP_VERSION={version})"
    _refuse_version(version, asked)
    policy = env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    _refuse_wrap_policy(policy, asked)
    return FSDP2Request(
        asked=asked,
        reshard_after_forward=_flag(env.get("FSDP_RESHARD_AFTER_FORWARD", "true")),
        cpu_offload=_flag(env.get("FSDP_OFFLOAD_PARAMS", "false")),
        activation_checkpointing=_flag(env.get("FSDP_ACTIVATION_CHECKPOINTING", "false")),
        activation_checkpointing_offload=_flag(env.get("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "false")),
        layer_classes=tuple(name for name in env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if name),
        wrap_policy=policy,
    )


def _refuse_version(version: int, asked: str) -> None:
    if version != 2:
        raise ValueError(
            f"HybridSPTrainer shards with FSDP2 only; {asked} asks for FSDP{version}: set fsdp_config "
            '{"fsdp_version": 2} (or fsdp_version: 2 in the accelerate config)'
        )


def _refuse_wrap_policy(policy: str, asked: str) -> None:
    if policy not in ("TRANSFORMER_BASED_WRAP", "NO_WRAP"):
        raise ValueError(
            f"HybridSPTrainer shards FSDP2 by decoder layer; {asked} asks for the auto-wrap policy {policy!r}: use "
            "TRANSFORMER_BASED_WRAP (each decoder layer, then the root) or NO_WRAP (the root alone)"
        )


def fsdp2_request(args) -> FSDP2Request | None:
    """The FSDP2 request in ``args`` (``TrainingArguments``) or accelerate's launcher environment, else None;
    ValueError, before any collective, for FSDP version 1 (Note [FSDP under the Trainer])."""
    return _from_trainer_arguments(args) or _from_launcher()
