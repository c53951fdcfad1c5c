"""Generation for vision-language prompts (Qwen2-VL, Qwen2.5-VL): sharded prefill, sharded K/V cache.

    apply(model, mesh)
    ids = generate_vlm(model, {"input_ids": ids, "pixel_values": px, "image_grid_thw": grid}, mesh=mesh,
                       max_new_tokens=32)                # [B, S + new] on every rank

Shape legend: B rows, S prompt tokens, S_pad padded to the layout's multiple, C context ranks.

Note [positions while decoding]: the prompt's 3-D RoPE positions come from
:func:`~hybridsp.integrations.transformers._vision.batch.shard_vlm_batch` (the model's ``get_rope_index`` on the
full prompt). A row's positions after the prompt continue from its largest one:
token ``S + t`` gets RoPE position ``S + t + delta`` on all three axes, with ``delta = max + 1 - S``
(the model's ``rope_deltas``). The model is called with 4-row ``position_ids``: row 0 is the
token's index in the sequence (what the sharded K/V cache and the decode attention's causal
order use; Qwen2-VL passes it to the attention as ``position_ids``), rows 1-3 the RoPE
positions. The prefill and decode steps otherwise follow
:mod:`hybridsp.integrations.transformers._generation` (the same cache, decode attention and token choice).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, cast

import torch
import torch.distributed as dist
from torch import nn

from hybridsp.inference import ShardedKVCache
from hybridsp.integrations.transformers._binding import DECODE_KWARG
from hybridsp.integrations.transformers._generation import (
    agree_across_context,
    cache_argument,
    choose_next_tokens,
    no_grad_for,
)
from hybridsp.integrations.transformers._hybrid_cache import DecodeStep, HybridCache
from hybridsp.integrations.transformers._sampling import FROM_GENERATION_CONFIG, Default, eos_ids, pad_id
from hybridsp.integrations.transformers._switch import NAME
from hybridsp.integrations.transformers._vision.batch import VISION_KEYS, multimodal_positions, shard_vlm_batch
from hybridsp.integrations.transformers._vision.model import VISION_KWARG, language_model_of
from hybridsp.layout._layouts import layout_permutation
from hybridsp.mesh._hybrid_mesh import HybridMesh, padded_length

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def generate_vlm(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    mesh: HybridMesh,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None | Default = FROM_GENERATION_CONFIG,
    pad_token_id: int | None | Default = FROM_GENERATION_CONFIG,
    vision: str = "auto",
) -> torch.Tensor:
    """Greedy continuation of a multimodal prompt with the K/V cache sharded over the context group.

    Args:
        model: a Qwen2-VL / Qwen2.5-VL ``...ForConditionalGeneration`` switched with ``apply(model, mesh)``.
        batch: ``input_ids`` [B, S] (no padding: every row a whole prompt), ``pixel_values`` /
            ``image_grid_thw`` and/or ``pixel_values_videos`` / ``video_grid_thw`` (as the model
            takes them), optional ``mm_token_type_ids``; the same on every context rank.
        mesh: the mesh the model was switched with.
        max_new_tokens: how many tokens to add at most (>= 0).
        eos_token_id, pad_token_id: as ``model.generate`` (not passed: the generation config's; ``eos_token_id=None``
            never stops early; ``pad_token_id=None``: the first EOS), as ``generate``'s.
        vision: ``"auto"``, ``"local"`` or ``"split"`` (who encodes which image, see ``vlm_batch``).

    Returns:
        [B, S + new] int64 on every rank (``new <= max_new_tokens``; fewer when every row ended).

    Raises:
        ValueError, before any collective, for an unswitched model or bad arguments.
    """
    _check(model, batch, max_new_tokens)
    eos = eos_ids(model, eos_token_id)
    pad = pad_id(model, pad_token_id, eos)
    input_ids = batch["input_ids"]
    if max_new_tokens == 0:
        return input_ids.clone()
    with no_grad_for(model):
        cache, logits, delta = _prefill(model, batch, mesh, max_new_tokens, vision)
        pieces, unfinished = [input_ids], torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        eos_tensor = torch.tensor(eos, dtype=torch.long, device=input_ids.device)
        for index in range(max_new_tokens):
            tokens = agree_across_context(choose_next_tokens(logits), mesh)  # [B]
            if eos:
                assert pad is not None  # with an EOS, pad defaults to eos[0]
                tokens = torch.where(unfinished, tokens, torch.full_like(tokens, pad))
                unfinished &= ~torch.isin(tokens, eos_tensor)
            pieces.append(tokens[:, None])
            if index + 1 == max_new_tokens or not bool(unfinished.any()):
                break
            logits = _decode(model, cache, tokens, input_ids.shape[1] + index, delta)
        return torch.cat(pieces, dim=1).clone()  # [B, S + new]


def _prefill(model, batch, mesh: HybridMesh, max_new_tokens: int, vision: str):
    """(cache, next logits [B, V] fp32 on every rank, rope delta [B, 1])."""
    input_ids = batch["input_ids"]
    rows, seq = input_ids.shape
    prompt = {key: value for key, value in batch.items() if key != "attention_mask"}
    local = shard_vlm_batch({**prompt, "labels": input_ids}, mesh, model, vision=vision)
    delta = multimodal_positions(prompt, model, seq).amax(dim=(0, 2))[:, None] + 1 - seq  # [B, 1]
    seq_pad = padded_length(seq, mesh)
    shards = layout_permutation(seq_pad, mesh.ring, mesh.ulysses, mesh.layout).view(mesh.context, -1)  # [C, S_pad/C]
    mine = shards[mesh.context_rank].to(input_ids.device)  # [S_pad/C] sequence indices of this rank's tokens
    real = (mine < seq).nonzero().squeeze(1)
    text_config = cast("PretrainedConfig", language_model_of(model).config)  # the decoder's transformers config
    store = ShardedKVCache(
        mesh,
        text_config.num_hidden_layers,
        positions=mine[real],
        shard_lengths=(shards < seq).sum(1).tolist(),
        new_tokens=max(max_new_tokens - 1, 0),
    )
    cache = HybridCache(store, None if real.numel() == mine.numel() else real)
    last_shard, last_index = (int(i) for i in (shards == seq - 1).nonzero()[0])
    keep = torch.tensor([last_index] * (mesh.context_rank == last_shard), dtype=torch.long, device=input_ids.device)
    positions = torch.cat([mine.expand(rows, -1)[None], local["position_ids"]])  # [4, B, S_pad/C]
    extra = {VISION_KWARG: local[VISION_KWARG]} if VISION_KWARG in local else {}
    out = model(
        input_ids=local["input_ids"],
        position_ids=positions,
        use_cache=True,
        logits_to_keep=keep,
        **{cache_argument(model): cache},
        **extra,
    )
    if mesh.context_rank == last_shard:
        logits = out.logits[:, 0].float().contiguous()  # [B, V]
    else:
        logits = out.logits.new_empty(rows, out.logits.shape[-1], dtype=torch.float32)  # [B, V]
    if mesh.context > 1:
        dist.broadcast(logits, src=mesh.context_members()[last_shard], group=mesh.context_group)
    return cache, logits, delta


def _decode(model, cache: HybridCache, tokens: torch.Tensor, index: int, delta: torch.Tensor) -> torch.Tensor:
    """New tokens [B] at sequence index ``index`` (Note [positions while decoding]); logits [B, V] fp32."""
    cache.store.begin_token(index)
    text = torch.full_like(tokens[:, None], index)  # [B, 1]
    positions = torch.stack([text, text + delta, text + delta, text + delta])  # [4, B, 1]
    out = model(
        input_ids=tokens[:, None],
        position_ids=positions,
        use_cache=True,
        **{cache_argument(model): cache, DECODE_KWARG: DecodeStep(cache.store)},
    )
    return out.logits[:, -1].float()  # [B, V]


def _check(model: nn.Module, batch: Mapping[str, Any], max_new_tokens) -> None:
    """ValueError, quoting what is wrong, before any collective."""
    if getattr(language_model_of(model).config, "_attn_implementation", None) != NAME:
        raise ValueError(f"{type(model).__name__} is not switched to hybridsp: call apply(model, mesh) first")
    ids = batch.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError(f"batch['input_ids'] must be an int64 tensor [B, S]; got {getattr(ids, 'shape', ids)}")
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "generate_vlm takes whole prompts without padding (attention_mask all ones); "
            "generate rows of different lengths separately"
        )
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0; got {max_new_tokens!r}")
    unknown = sorted(
        set(k for k, v in batch.items() if torch.is_tensor(v))
        - set(VISION_KEYS)
        - {"input_ids", "attention_mask", "mm_token_type_ids", "second_per_grid_ts"}
    )
    if unknown:
        raise ValueError(f"generate_vlm does not take {unknown}")
