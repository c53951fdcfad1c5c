"""Lean RoPE: Llama-form attention modules rotating q and k in place (:mod:`hybridsp.memory._rotary`).

:func:`apply_lean_rope` gives each attention module whose forward is one of the read forms
(:data:`~hybridsp.memory._attention_forms.FORMS`: Llama's, Mistral's, Qwen2's, Qwen3's, compared as syntax trees, with the family's
``apply_rotary_pos_emb`` and ``rotate_half`` Llama's) an instance-level forward that does what that
forward does, in the same order of values, except that

- each projection is rotated as soon as it is made (q, then k, then v is projected), in place
  with one tile of temporaries, instead of HF's five-op rotation after all three projections:
  about four q-sized and four k-sized tensors fewer at the attention forward's peak, which under
  split checkpointing with donated q/k/v is the step's peak on the per-rank cap;
- nothing else: the cache update, the attention interface call (its kwargs, the form's sliding
  window), the output projection are the form's.

Outputs and gradients are bitwise those of the unmodified model (tested for each form, eager and
sdpa, with and without checkpointing). The forward hands q, k, v to the attention function alone,
as the forms it replaces do, so the transformers switch still donates them
(:mod:`hybridsp.memory._qkv_donation`; the forward carries :data:`HANDS_QKV_ALONE`).
"""

from __future__ import annotations

import sys
from functools import lru_cache
from typing import Any, Callable

import torch
from torch import nn

from hybridsp.memory._attention_forms import HANDS_QKV_ALONE, AttentionForm, read_form
from hybridsp.memory._forward_form import same_function
from hybridsp.memory._forward_patch import ForwardPatch, patch_forwards
from hybridsp.memory._rotary import DEFAULT_TILE_TOKENS, rotate_

LeanRopeHandle = ForwardPatch  # what apply_lean_rope returns: ``undo()`` restores every attention module


@lru_cache(maxsize=None)
def _llama_rotary(module_name: str) -> bool:
    """The module ``module_name`` rotates as Llama does (its apply_rotary_pos_emb and rotate_half)."""
    from transformers.models.llama import modeling_llama

    home = sys.modules[module_name]
    return all(
        same_function(getattr(home, name, None), getattr(modeling_llama, name))
        for name in ("apply_rotary_pos_emb", "rotate_half")
    )


def form_of(cls: type) -> AttentionForm | None:
    """The read form of ``cls.forward``, or None."""
    form = read_form(cls)
    return form if form is not None and _llama_rotary(cls.__module__) else None


def find_rope_attention(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` whose class has a read form (:func:`form_of`)."""
    return [m for m in model.modules() if form_of(type(m)) is not None]


def apply_lean_rope(model: nn.Module, *, tile_tokens: int = DEFAULT_TILE_TOKENS) -> LeanRopeHandle:
    """Switch every attention module of ``model`` with a read form to the lean rotation (module
    docstring); returns the undo handle.

    Raises:
        ValueError (nothing changed) when the model has no such module (forms in :data:`FORMS`), one
        is already switched, or ``tile_tokens < 1``.
    """
    return patch_forwards(
        find_rope_attention(model),
        lambda module: _bound_forward(module, tile_tokens),
        tile_tokens,
        model=model,
        what="attention module with Llama's, Mistral's, Qwen2's or Qwen3's forward and Llama's rotary embedding",
    )


def _bound_forward(module: nn.Module, tile: int) -> Callable[..., tuple[torch.Tensor, Any]]:
    form = form_of(type(module))
    assert form is not None  # find_rope_attention chose it

    def forward(
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        if cache is None:  # the forms' deprecated name for it
            cache = kwargs.pop("past_key_values", None)
        assert position_embeddings is not None, "the attention forms need position_embeddings (cos, sin)"
        return lean_rope_attention(
            module, form, hidden_states, position_embeddings, attention_mask, cache, tile, kwargs
        )

    setattr(forward, HANDS_QKV_ALONE, True)
    return forward


def lean_rope_attention(
    module: Any,
    form: AttentionForm,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache: Any,
    tile: int,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, Any]:
    """The form's forward with q and k rotated in place as projected: (output [B, S, h], weights)."""
    batch_and_seq = hidden_states.shape[:-1]
    heads_shape = (*batch_and_seq, -1, module.head_dim)
    cos, sin = position_embeddings
    query = _rotated(module, "q", hidden_states, heads_shape, cos, sin, form.qk_norm, tile)  # [B, H, S, D]
    key = _rotated(module, "k", hidden_states, heads_shape, cos, sin, form.qk_norm, tile)  # [B, Hkv, S, D]
    value = module.v_proj(hidden_states).view(heads_shape).transpose(1, 2)  # [B, Hkv, S, D]
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    attention = _interface(module)
    extra = {} if form.sliding_window is None else {"sliding_window": form.sliding_window(module)}
    dropout = 0.0 if not module.training else module.attention_dropout
    out, weights = attention(
        module, query, key, value, attention_mask, dropout=dropout, scaling=module.scaling, **extra, **kwargs
    )
    out = out.reshape(*batch_and_seq, -1).contiguous()  # [B, S, H * D]
    return module.o_proj(out), weights


def _rotated(
    module: Any,
    which: str,
    hidden_states: torch.Tensor,
    heads_shape: tuple[int, ...],
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_norm: bool,
    tile: int,
) -> torch.Tensor:
    """Project ``which`` ("q" or "k"), norm it per head where the form does, rotate it: [B, H, S, D]."""
    projected = getattr(module, f"{which}_proj")(hidden_states)  # [B, S, H * D]
    if qk_norm:
        projected = getattr(module, f"{which}_norm")(projected.view(heads_shape))  # [B, S, H, D]
    rotated = rotate_(projected, cos, sin, module.head_dim, tile)
    return rotated.view(heads_shape).transpose(1, 2)  # [B, H, S, D]


def _interface(module: Any) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The attention function the form would call: the config's, else its family's eager one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager)
