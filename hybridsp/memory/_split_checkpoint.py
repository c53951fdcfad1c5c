"""Split checkpointing: each decoder layer checkpointed as two regions, attention then MLP.

With HF activation checkpointing a decoder layer is one checkpointed region: its backward first
recomputes the *whole* layer, then differentiates the MLP, then the attention. While the MLP's
backward runs (the step's peak with a tiled loss and tiled MLP), everything the recomputed
attention keeps for its own backward is alive too: the norm's output, q, k, v, the attention
output, the projections' input (about five ``[B, S_local, h]`` activations, measured by
``benchmarks.memory.step_peak``). :func:`apply_split_checkpointing` checkpoints each layer as

    h1  = checkpoint(x  -> x  + self_attn(input_layernorm(x)))           # the attention half
    out = checkpoint(h1 -> h1 + mlp(post_attention_layernorm(h1)))       # the MLP half

so the backward recomputes and differentiates the MLP half alone, frees it, then recomputes and
differentiates the attention half: the two halves' saved tensors are never alive together. The
price: every layer keeps ``h1`` as well as ``x`` (one more ``[B, S_local, h]`` per layer;
:func:`hybridsp.offload_activations` sends both to host), and nothing is recomputed twice.
Outputs and gradients are bitwise those of layer-level checkpointing (the same ops in the same
order; tested).

Note [norm input kept]: inside the attention half the q/k/v projections keep the half's input x
instead of the norm's output and rebuild it in their backward (:mod:`hybridsp.memory._norm_rebuild`):
the norm's output is then not alive through the attention's backward, the step's peak. Bitwise the
same rows (the norm's own forward on the same x), one norm forward more per layer.

Note [which layers]: the split is the pre-norm decoder layer of Llama: a layer qualifies when its
forward's body is, statement for statement, ``LlamaDecoderLayer.forward``'s (compared as syntax
trees, so 66 transformers classes qualify: Mistral, Qwen2/3 and their MoE, Gemma, OLMo, DeepSeek-V2/3,
...). Anything else (Gemma-2's four norms, hybrid linear-attention layers) raises ValueError naming
the class: checkpoint such layers whole.

Note [when it splits]: exactly when the HF layer would checkpoint (``gradient_checkpointing`` on,
training, gradients enabled), with the layer's own checkpoint function (``use_reentrant`` and the
other ``gradient_checkpointing_kwargs`` as the user set them) and the same cache handling (the
cache is dropped under checkpointing). Otherwise the layer runs its own forward unchanged.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Callable, cast

import torch
from torch import nn

from hybridsp.memory._forward_form import has_forward_of
from hybridsp.memory._forward_patch import ForwardPatch, patch_forwards
from hybridsp.memory._norm_rebuild import NormInputKept

SPLIT_AT = "post_attention_layernorm"  # the submodule that starts the MLP half
_HALVES = ("input_layernorm", "self_attn", SPLIT_AT, "mlp")
_CACHE_KEYS = ("cache", "past_key_values", "layer_past")

SplitCheckpointHandle = ForwardPatch  # what apply_split_checkpointing returns: ``undo()`` restores every layer


def _is_llama_form(cls: type) -> bool:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return has_forward_of(cls, LlamaDecoderLayer)


def find_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Every HF ``GradientCheckpointingLayer`` of ``model`` (the layers checkpointing would wrap)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and hasattr(m, "self_attn")]


def _check_splittable(layers: list[nn.Module], model: nn.Module) -> None:
    for layer in layers:
        missing = [name for name in _HALVES if not isinstance(getattr(layer, name, None), nn.Module)]
        if missing or not _is_llama_form(cast(type, type(layer))):
            reason = f"it has no {missing}" if missing else "its forward is not LlamaDecoderLayer's"
            raise ValueError(
                f"cannot split {type(layer).__name__} of {type(model).__name__} into an attention and an MLP half: "
                f"{reason} (split checkpointing needs the pre-norm attention + MLP layer); checkpoint it whole "
                "(model.gradient_checkpointing_enable() alone)"
            )


def attention_half(layer: Any, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``x + self_attn(input_layernorm(x))``: [B, S_local, h] -> [B, S_local, h] (``kwargs``: the layer's).

    The projections keep x for the norm's output (Note [norm input kept])."""
    with NormInputKept(layer.input_layernorm, hidden_states) as kept:
        attended, _ = layer.self_attn(hidden_states=kept.normalized(), **kwargs)
    return cast(torch.Tensor, hidden_states + attended)  # [B, S_local, h]


def mlp_half(layer: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """``h1 + mlp(post_attention_layernorm(h1))``: [B, S_local, h] -> [B, S_local, h]."""
    return cast(torch.Tensor, hidden_states + layer.mlp(getattr(layer, SPLIT_AT)(hidden_states)))  # [B, S_local, h]


def _split_forward(layer: Any) -> Callable[..., torch.Tensor]:
    original = partial(type(layer).forward, layer)
    names = list(inspect.signature(type(layer).forward).parameters)[2:]  # after self, hidden_states

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not (getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled()):
            return cast(torch.Tensor, original(hidden_states, *args, **kwargs))
        kwargs.update(zip(names, args))  # positional arguments by the layer's own names
        if not getattr(layer, "_can_checkpoint_with_cache", False):  # HF keeps a read-only cache
            kwargs.update({key: None for key in _CACHE_KEYS if kwargs.get(key) is not None})
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        checkpoint = layer._gradient_checkpointing_func  # HF's, with the user's checkpointing kwargs
        h1 = checkpoint(partial(attention_half, layer, **kwargs), hidden_states)  # [B, S_local, h]
        return cast(torch.Tensor, checkpoint(partial(mlp_half, layer), h1))  # [B, S_local, h]

    forward.splits_at = SPLIT_AT  # type: ignore[attr-defined]  # read by the activation offload
    return forward


def second_half_entry(layer: nn.Module) -> nn.Module | None:
    """The submodule whose first argument is ``layer``'s saved ``h1``, when ``layer`` is split."""
    forward = vars(layer).get("forward")
    name = getattr(forward, "splits_at", None)
    return getattr(layer, name) if name else None


def apply_split_checkpointing(model: nn.Module) -> SplitCheckpointHandle:
    """Checkpoint each decoder layer of ``model`` as an attention half and an MLP half (module
    docstring); returns the undo handle. Takes effect where HF checkpointing is on
    (``model.gradient_checkpointing_enable()``, before or after this call).

    Raises:
        ValueError (nothing changed) when the model has no HF decoder layer, one is not of the
        pre-norm attention + MLP form (Note [which layers]), or one is already switched.
    """
    layers = find_decoder_layers(model)
    _check_splittable(layers, model)
    return patch_forwards(
        layers, _split_forward, None, model=model, what="Hugging Face decoder layer (GradientCheckpointingLayer)"
    )
