"""What the switch takes, decided by capability, and the windows its layers use.

:func:`check_model` (Note [capabilities] in :mod:`hybridsp.integrations.transformers._switch`): the
attention modules' part of the decision (:mod:`.decision`), ValueError, before anything changes, for a model
hybridsp cannot run exactly; :func:`layer_windows` and :func:`layout_window` (Note [layout window]).

Note [layout window]: ``layout="balanced"`` places tokens so that every ring slot does the same
attention work, and a sliding window changes that work (Note [placement window] in
:mod:`hybridsp.layout._layouts`). The layers' windows come from the model (:func:`layer_windows`:
Qwen2/3 modules carry their own, None on full-attention layers; Mistral's is the config's);
:func:`layout_window` is the one the layout balances for: the window most layers use, a tie
going to full attention (None), then to the larger window, since a full-attention layer does at
least a windowed layer's work. (A model mixing full and windowed layers is balanced for its
majority only; its other layers stay exact, just less balanced.) Pass it to
:func:`hybridsp.shard_batch` (``sliding_window=layout_window(model)``; the Trainer does) or to
``init_mesh(sliding_window=)``; the forward pre-hook refuses, before any collective, documents
placed for another window on a ring of more than one slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from torch import nn

from hybridsp._formulas import heads_divisible
from hybridsp.integrations.transformers._binding import BINDING_ATTR, INTERFACE_NAME, NAME, attention_modules
from hybridsp.mesh._hybrid_mesh import HybridMesh
from hybridsp.tensor_parallel._model_split import tensor_plan

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_model(model: nn.Module, modules: list[nn.Module], mesh: HybridMesh | None) -> None:
    """Raise ValueError, before anything changes, for a model hybridsp cannot run exactly (Note [capabilities])."""
    name = type(model).__name__
    if not modules:
        raise ValueError(
            f"{name} has no attention module that calls transformers' attention interface ({INTERFACE_NAME}): "
            f"hybridsp replaces that call, so a model whose attention bypasses it cannot be switched"
        )
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ValueError(
            f"{name} is an encoder-decoder model; hybridsp's transformers integration takes causal "
            f"decoders (its cross-attention has no causal order over a sharded sequence)"
        )
    if any(hasattr(m, BINDING_ATTR) for m in modules):
        raise ValueError(f"{name} is already switched to {NAME}: undo the first handle before applying again")
    heads = _query_heads(model, modules[0])
    for module in modules:
        _check_module(module, mesh, heads)
    _refuse_chunked_on_document_layout(modules, mesh)


def _query_heads(model: nn.Module, module: nn.Module) -> int | None:
    """The query heads one attention call of this rank receives (H, or H/T once tensor-parallel)."""
    # the model's own config: tensor_parallel may give a module a split copy
    config = cast("PretrainedConfig", getattr(model, "config", None) or module.config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    plan = tensor_plan(model)
    return None if heads is None else heads // (plan.tensor if plan is not None else 1)


def _check_module(module: nn.Module, mesh: HybridMesh | None, heads: int | None) -> None:
    """One attention module: causal, heads divisible by U."""
    config, layer = module.config, getattr(module, "layer_idx", "?")
    if not getattr(module, "is_causal", True) or not getattr(config, "is_causal", True):
        raise ValueError(
            f"layer {layer} ({type(module).__name__}) is not causal; hybridsp's transformers "
            f"integration supports causal decoders only"
        )
    if mesh is not None and heads is not None and not heads_divisible(heads, mesh.ulysses):
        raise ValueError(
            f"the model's {heads} query heads are not divisible by the Ulysses degree {mesh.ulysses}; choose a "
            f"Ulysses degree that divides {heads} and move the rest of the context ranks to the ring"
        )


def chunk_size_of(module: nn.Module) -> int | None:
    """The chunk of a chunked-attention layer (Llama 4's ``attention_chunk_size`` on a layer whose
    ``layer_types`` entry is ``"chunked_attention"``), else None."""
    config, layer = cast("PretrainedConfig", module.config), getattr(module, "layer_idx", None)
    kinds = getattr(config, "layer_types", None)
    if not kinds or layer is None or kinds[layer] != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


def _refuse_chunked_on_document_layout(modules: list[nn.Module], mesh: HybridMesh | None) -> None:
    """Chunked layers attend within chunks cut from the documents (Note [chunked layers] in :mod:`.documents`);
    a layout that places tokens by document would place them for the cut documents instead."""
    chunks = {size for size in map(chunk_size_of, modules) if size is not None}
    if chunks and mesh is not None and mesh.token_layout.uses_documents:
        raise ValueError(
            f"the model has chunked-attention layers (attention_chunk_size={min(chunks)}), which layout="
            f"{mesh.layout!r} cannot run (it places tokens by the batch's documents, not by their chunks); use "
            f"layout='zigzag' or 'contiguous'"
        )


def check_position_scaled_queries(module: nn.Module, seq_len: int, mesh: HybridMesh) -> None:
    """ValueError for Llama 4's attention temperature tuning where it would read shard-local positions: the
    layer scales its queries by ``log1p(floor((i + 1) / floor_scale))`` of the token's index ``i`` in the
    *local* tensor, which is 1 (no scaling) for every index below ``floor_scale - 1`` and wrong beyond it."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return
    if mesh.context <= 1:
        return
    floor_scale = cast(int, module.floor_scale)  # Llama 4 attention's
    if seq_len >= floor_scale:
        raise ValueError(
            f"layer {module.layer_idx} scales queries by token index (attn_temperature_tuning, floor_scale="
            f"{floor_scale}), which it reads from the shard, not the sequence: wrong at {seq_len} tokens over "
            f"{mesh.context} context ranks; set attn_temperature_tuning=False or keep sequences under "
            f"{floor_scale - 1} tokens"
        )


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each switchable attention layer's sliding window, in module order (None: full attention)."""
    return [_module_window(m) for m in attention_modules(model)]


def _module_window(module: nn.Module) -> int | None:
    """The window a layer passes to the attention: its own (Qwen2/3), else its config's (Mistral)."""
    window = (
        cast("int | None", module.sliding_window)
        if hasattr(module, "sliding_window")
        else getattr(module.config, "sliding_window", None)
    )
    return None if window is None else int(window)


def layout_window(model: nn.Module) -> int | None:
    """The window ``layout="balanced"`` balances ``model``'s work for (Note [layout window]): the
    one most layers use; ties to None (full attention), then to the larger window."""
    windows = layer_windows(model)
    if not windows:
        return None
    counts = {w: windows.count(w) for w in windows}
    return max(counts, key=lambda w: (counts[w], w is None, w or 0))
