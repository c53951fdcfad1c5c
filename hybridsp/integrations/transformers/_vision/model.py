"""Vision-language models (Qwen2-VL, Qwen2.5-VL) on hybrid sequence-parallel attention.

    from hybridsp.integrations.transformers import apply
    from hybridsp.integrations.transformers._vision.batch import shard_vlm_batch

    handle = apply(model, mesh)                     # the language model's attention only
    local = shard_vlm_batch(batch, mesh, model)     # tokens, 3-D positions, this rank's vision work
    labels, documents = local.pop("shift_labels"), local.pop("documents")
    logits = model(**local, hybridsp_documents=documents, use_cache=False).logits  # [B, S_pad / C, V]
    loss = hybridsp.sharded_cross_entropy(logits, labels, mesh)

:func:`hybridsp.integrations.transformers.apply` hands a model whose ``model_type`` is in
:data:`VLM_MODEL_TYPES` to :func:`apply_to_language_model`: it binds the mesh to the
attention modules of the language model and names ``"hybridsp"`` in the *text* config only.
The vision encoder's config keeps its own implementation (eager/sdpa/flash): setting the
outer config would reach every sub-config, so the outer config is not touched.

Note [the forward pre-hook]: the switched model gets a forward pre-hook that takes the
``hybridsp_vision`` keyword (a :class:`~hybridsp.integrations.transformers._vision.batch.VisionShard` from
``shard_vlm_batch``), runs the model's own ``get_image_features`` once on this rank's units
(Note [vision units] there), exchanges features in split mode (one differentiable
``all_to_all_single`` over the context group), and passes the model the features of exactly
this rank's image and video tokens as ``mm_encoder_outputs``. The model's forward then embeds
its local ``input_ids`` and scatters the features into the image/video token positions, as
the unsharded model does for all tokens. With ``C > 1`` the hook refuses raw ``pixel_values``
(every rank would encode every image and the feature counts would not match its tokens),
missing ``position_ids`` and ``labels``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from hybridsp.integrations.transformers._binding import attention_modules
from hybridsp.integrations.transformers._token_mixers import refuse_unknown_mixers
from hybridsp.integrations.transformers._vision.batch import Exchange, VisionShard
from hybridsp.mesh._hybrid_mesh import HybridMesh

if TYPE_CHECKING:
    from transformers import PretrainedConfig

VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
VISION_KWARG = "hybridsp_vision"


def is_vision_language_model(model: nn.Module) -> bool:
    """True for a model instance whose config's ``model_type`` is in :data:`VLM_MODEL_TYPES`."""
    return getattr(getattr(model, "config", None), "model_type", None) in VLM_MODEL_TYPES


def refuse_other_multimodal(model: nn.Module) -> None:
    """ValueError for a model with a vision tower that is not one of :data:`VLM_MODEL_TYPES` (e.g. LLaVA):
    switching every config would also reach its vision encoder."""
    config = getattr(model, "config", None)
    if (
        config is not None
        and getattr(config, "vision_config", None) is not None
        and not is_vision_language_model(model)
    ):
        raise ValueError(
            f"model type {config.model_type!r} has a vision encoder; hybridsp supports the vision-language model "
            f"types {', '.join(VLM_MODEL_TYPES)}. For another one, switch its language model only: "
            f"apply(model.model.language_model, mesh) and feed it inputs_embeds you build and shard yourself"
        )


class VisionLanguageAdapter:
    """The :class:`~hybridsp.integrations.transformers.ModelAdapter` of Qwen2-VL / Qwen2.5-VL: the
    language model's attention is switched; the vision tower runs on each rank's share of the images."""

    name = "vision-language (Qwen2-VL, Qwen2.5-VL)"

    def matches(self, model: nn.Module) -> bool:
        return is_vision_language_model(model)

    def check(self, model: nn.Module) -> None:
        refuse_other_multimodal(model)

    def preflight(self, model: nn.Module, mesh: HybridMesh | None) -> None:
        check_language_model(model, mesh)

    def apply(self, model: nn.Module, mesh: HybridMesh, backend):
        from hybridsp.integrations.transformers._handle import switch_modules

        return apply_to_language_model(model, mesh, backend, switch_modules)


def language_model_of(model: nn.Module) -> nn.Module:
    """The decoder (``...TextModel``) of a ``...ForConditionalGeneration`` or ``...Model``."""
    inner = getattr(model, "model", model)
    return cast(nn.Module, inner.language_model)  # a transformers VLM's decoder


def apply_to_language_model(model: nn.Module, mesh: HybridMesh, backend, switch):
    """Switch the language model's attention of a VLM instance; ``switch`` binds (transformers.py).

    ``switch(model, modules, configs, mesh, backend, hook)`` is
    :func:`hybridsp.integrations.transformers.switch_modules`. Returns its handle. ValueError,
    before anything changes, for heads the Ulysses degree does not divide or a non-causal config.
    """
    text = language_model_of(model)
    modules = check_language_model(model, mesh)
    config = cast("PretrainedConfig", text.config)  # the language model's transformers config
    hook = model.register_forward_pre_hook(_pre_hook(model, mesh), with_kwargs=True)
    try:
        return switch(model, modules, [config], mesh, backend, hook)
    except BaseException:
        hook.remove()
        raise


def check_language_model(model: nn.Module, mesh: HybridMesh | None) -> list[nn.Module]:
    """The language model's attention modules; ValueError, before anything changes, for heads the Ulysses
    degree does not divide, a non-causal layer or a token mixer outside attention (Note [mixers by identity])."""
    text = language_model_of(model)
    modules = attention_modules(text)
    config = cast("PretrainedConfig", text.config)  # the language model's transformers config
    if not modules:
        raise ValueError(f"{type(model).__name__}'s language model has no q/k/v/o attention module to switch")
    if mesh is not None and config.num_attention_heads % mesh.ulysses:
        raise ValueError(
            f"the language model's {config.num_attention_heads} query heads are not divisible by the Ulysses degree "
            f"{mesh.ulysses}; choose a Ulysses degree that divides {config.num_attention_heads}"
        )
    if not all(getattr(m, "is_causal", True) for m in modules):
        raise ValueError("hybridsp switches causal language models only; a language-model layer is not causal")
    refuse_unknown_mixers(text, [])
    return modules


def _pre_hook(model: nn.Module, mesh: HybridMesh):
    signature = inspect.signature(model.forward)

    def hook(module, args, kwargs):
        shard = kwargs.pop(VISION_KWARG, None)
        if mesh.context > 1:
            _refuse(signature.bind_partial(*args, **kwargs).arguments, shard)
        if shard is None:
            return args, kwargs
        return args, {**kwargs, "mm_encoder_outputs": encode_shard(module, shard, mesh)}

    return hook


def _refuse(arguments: dict, shard) -> None:
    """ValueError for a sharded call the model would compute wrongly."""
    given = [k for k in ("pixel_values", "pixel_values_videos") if arguments.get(k) is not None]
    if given:
        raise ValueError(
            f"do not pass {given} to a vision-language model switched to hybridsp: cut the batch with "
            f"hybridsp.integrations.transformers._vision.batch.shard_vlm_batch(batch, mesh, model) and pass its 'hybridsp_vision'"
        )
    if arguments.get("position_ids") is None:
        raise ValueError(
            "a vision-language model switched to hybridsp needs position_ids: the 3-D RoPE positions of this "
            "rank's tokens (shard_vlm_batch(...)['position_ids']); the model would compute them per shard"
        )
    if arguments.get("labels") is not None:
        raise ValueError(
            "do not pass labels to a model switched to hybridsp: take shard_vlm_batch(...)['shift_labels'] to "
            "hybridsp.sharded_cross_entropy(logits, ..., mesh)"
        )


def encode_shard(model: nn.Module, shard: VisionShard, mesh: HybridMesh) -> dict:
    """``mm_encoder_outputs`` for this rank's tokens: features [n_img, D] / [n_vid, D] (a collective in split mode)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    get_image_features = cast(Callable[..., Any], model.get_image_features)  # a Qwen2-VL model's method
    pooled = get_image_features(shard.pixels, shard.grid, return_dict=True).pooler_output
    features = torch.cat(list(pooled), dim=0)  # [n_encoded, D]
    if shard.exchange is not None:
        features = exchange_features(features, shard.exchange, mesh)  # [n_local_tokens, D]
    outputs = {}
    if shard.has_images:
        # transformers' Qwen2-VL holds a tuple of per-image features in pooler_output (its annotation: a Tensor)
        outputs["image"] = BaseModelOutputWithPooling(pooler_output=(features.index_select(0, shard.image_rows),))  # type: ignore[arg-type]
    if shard.has_videos:
        outputs["video"] = BaseModelOutputWithPooling(pooler_output=(features.index_select(0, shard.video_rows),))  # type: ignore[arg-type]  # as above
    return outputs


def exchange_features(features: torch.Tensor, exchange: Exchange, mesh: HybridMesh) -> torch.Tensor:
    """Split mode's all_to_all: [n_encoded, D] -> [sum recv_counts, D] (received in source order)."""
    send = features.index_select(0, exchange.send_rows.to(features.device))  # [sum send_counts, D]
    return _AllToAll.apply(send, exchange.send_counts, exchange.recv_counts, mesh.context_group)


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of a group by ``send_counts``; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, send, send_counts, recv_counts, group):
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        received = send.new_empty(sum(recv_counts), *send.shape[1:])  # [sum recv_counts, D]
        dist.all_to_all_single(received, send.contiguous(), recv_counts, send_counts, group=group)
        return received

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        back = grad.new_empty(sum(send_counts), *grad.shape[1:])  # [sum send_counts, D]
        dist.all_to_all_single(back, grad.contiguous(), send_counts, recv_counts, group=ctx.group)
        return back, None, None, None
