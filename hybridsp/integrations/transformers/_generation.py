"""Long-context generation for a Hugging Face causal LM switched with :func:`apply`.

    from hybridsp.integrations.transformers import apply, generate

    apply(model, mesh)
    ids = generate(model, input_ids, mesh=mesh, max_new_tokens=64)     # [B, S + new] on every rank

Shape legend: B batch, S prompt tokens, S_pad S padded to the layout's multiple, C = U * R
context ranks, V vocabulary, T new tokens of one model call (1 per decode step).

Note [how the model runs]: generation runs the model's *own* forward, never a copy of its
decoder: so RoPE, q/k norms (Qwen3), biases (Qwen2) and every later change of the model code
apply unchanged. The model is called with ``cache=`` a :class:`HybridCache` (a transformers
``Cache`` whose ``update`` writes into this rank's :class:`~hybridsp.inference.ShardedKVCache`)
and with explicit global ``position_ids``:

- prefill: the padded prompt is sharded in the mesh's layout (:func:`hybridsp.shard_sequence`),
  ``position_ids`` are the tokens' global positions, so RoPE is right. Each layer's
  ``cache.update`` stores this rank's real (unpadded) K/V and hands the K/V back unchanged, and
  the hybrid attention runs exactly as in training (Ulysses all-to-all x ring). Only the last
  prompt token's logits are computed (``logits_to_keep``), on the rank that holds it, and
  broadcast over the context group (B x V floats, once).
- decode: every context rank runs the new token ``[B, 1]`` at position ``S + t``; the rank that
  caches it (Note [balancing] in :mod:`hybridsp.inference._kv_cache`) appends its K/V in
  ``cache.update``; every rank's ``update`` returns its own shard, and the model call carries
  the keyword ``hybridsp_decode=`` a :class:`DecodeStep`, which the ``"hybridsp"`` attention
  function hands the call to: :func:`~hybridsp.inference._decode_attention` (local attention
  over the shard, one all-gather of ``B x H x (D+1)`` fp32 partials per layer, LSE merge).
  The next token is chosen on every rank from its (identical) logits, with every rank's
  generator advanced alike, and context rank 0's choice is broadcast (B int64 per step) so
  the ranks can never disagree even if their logits differed in the last bit.

Note [padding]: a prompt whose length the layout cannot split (zigzag: a multiple of 2R, and
of U inside a slot; :func:`hybridsp.mesh._hybrid_mesh.padded_length`) is padded on the right with token
0 to ``S_pad``. Causal attention keeps the padding invisible to every real prompt token, and
its K/V are never stored in the cache (the padded positions are dropped before ``update``
writes), so decode cannot see them: results equal the unpadded prompt's. New tokens continue
at position ``S``, not ``S_pad``.

Note [left padding]: prompts of different lengths come left-padded with an ``attention_mask``
(``tokenizer.padding_side = "left"``), as for ``model.generate``, which this matches: each row's
RoPE positions count its real tokens (``cumsum(mask) - 1``, 0 on the padding; a new token of
row ``b`` is at ``S - pads_b + t``), the prefill's mask becomes documents in which the padding
is its own segment (:mod:`hybridsp.integrations.transformers._padding`), and every decode step hides each
row's padding keys from its query (``decode_attention(key_mask=...)``). The padding's K/V stay in
the cache (the shards are the same for every row); sliding windows count indices, as
transformers' masks do. Right padding or holes are refused (ValueError).

Note [balanced layout]: every prompt row is one document, and ``layout="balanced"`` places a
one-document row exactly as zigzag does; the prefill hands the model that ``Documents`` (one per
row, ``S_pad`` long) as ``hybridsp_documents``, so the attention plans it without any collective
(the same for every layout). A left-padded prompt would make the padding a document of its own,
which the balanced layout places per row; the sharded cache holds one position set for all rows,
so that case is refused (ValueError, before any collective): use ``layout="zigzag"`` there.

Note [EOS and padding of finished rows]: as ``model.generate``: ``eos_token_id`` not passed takes
the model's ``generation_config.eos_token_id``; ``eos_token_id=None`` (or ``[]``) passed never stops
early, as ``model.generate(..., eos_token_id=None)`` does. A row that produced an EOS gets
``pad_token_id`` from then on (not passed: the generation config's, else the first EOS; ``None``
passed: the first EOS), and generation stops when every row has finished. Only EOS/pad are read from
the generation config; sampling settings come from the arguments (greedy by default).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from hybridsp.attention._api import shard_sequence
from hybridsp.inference import ShardedKVCache
from hybridsp.integrations.transformers._binding import BINDING_ATTR, DECODE_KWARG, DOCUMENTS_KWARG
from hybridsp.integrations.transformers._hybrid_cache import DecodeStep, HybridCache
from hybridsp.integrations.transformers._linear_layers import refuse_generation
from hybridsp.integrations.transformers._padding import left_padded_inputs, left_padding_mask
from hybridsp.integrations.transformers._sampling import (  # noqa: F401  choose_next_tokens: re-exported
    FROM_GENERATION_CONFIG,
    Default,
    check_sampling,
    choose_next_tokens,
    eos_ids,
    pad_id,
)
from hybridsp.layout._documents import Documents
from hybridsp.layout._layouts import layout_permutation
from hybridsp.linear_attention._decode import LinearStates
from hybridsp.mesh._hybrid_mesh import HybridMesh, padded_length

PROMPT_PAD_ID = 0  # fills the prompt up to the layout's multiple; never attended (Note [padding])


@dataclass
class Prefill:
    """The result of :func:`prefill`.

    Attributes:
        cache: the :class:`HybridCache` holding this rank's K/V shard of the prompt.
        next_logits: [B, V] fp32 logits of the last prompt token, on every rank.
        local_logits: [B, S_pad / C, V] this rank's logits (in layout order) if asked, else None.
        prompt_length: S.
        left_padding: [B] int64 pad tokens at the start of each row (an ``attention_mask`` was given), or None.
        real: [B, S + N] bool, False at the left padding (N = the new tokens the cache was sized for), or None.
    """

    cache: HybridCache
    next_logits: torch.Tensor
    local_logits: torch.Tensor | None
    prompt_length: int
    left_padding: torch.Tensor | None = None
    real: torch.Tensor | None = None


def no_grad_for(model: torch.nn.Module):
    """``torch.inference_mode()``, or ``torch.no_grad()`` for a model with DTensor parameters: FSDP2 keeps the
    unsharded parameters it gathers for a forward and reuses that storage in the next one, which a training
    forward cannot write into once it was made an inference tensor."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return torch.no_grad()
    return torch.inference_mode()


def prefill(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    mesh: HybridMesh,
    max_new_tokens: int = 0,
    all_logits: bool = False,
    attention_mask: torch.Tensor | None = None,
) -> Prefill:
    """Run the prompt sequence-parallel and fill a K/V cache that stays sharded (a collective).

    Args:
        model: a causal LM switched with ``apply(model, mesh)``.
        input_ids: [B, S] the whole prompt, the same on every rank of the context group.
        mesh: the mesh the model was switched with.
        max_new_tokens: how many tokens :func:`generate` will produce (sizes the cache).
        all_logits: also return this rank's logits of every local token (``local_logits``).
        attention_mask: [B, S] 0/1, left padding only (Note [left padding]), or None.

    Returns:
        a :class:`Prefill`. Raises ValueError, before any collective, for bad arguments.
    """
    _check_inputs(model, input_ids, mesh, max_new_tokens)
    mask = _checked_mask(attention_mask, input_ids, mesh)
    refuse_generation(model, mask)
    with no_grad_for(model):
        return _prefill(model, input_ids, mesh, max_new_tokens, all_logits, mask)


def _prefill(model, input_ids, mesh, max_new_tokens, all_logits, mask=None) -> Prefill:
    batch, seq = input_ids.shape
    seq_pad, device = padded_length(seq, mesh), input_ids.device
    ids = torch.nn.functional.pad(input_ids, (0, seq_pad - seq), value=PROMPT_PAD_ID)  # [B, S_pad]
    shards = layout_permutation(seq_pad, mesh.ring, mesh.ulysses, mesh.layout).view(mesh.context, -1)  # [C, S_pad/C]
    mine = shards[mesh.context_rank].to(device)  # [S_pad/C] global positions of this rank's tokens
    # one document per row (Note [balanced layout]): the hook then derives nothing, with no collective
    inputs = {"position_ids": mine.expand(batch, -1), DOCUMENTS_KWARG: Documents(batch, seq_pad)}  # [B, S_pad/C]
    if mask is not None:
        inputs = left_padded_inputs(mask, seq_pad, mine)  # per-row position_ids, attention_mask
    real = (mine < seq).nonzero().squeeze(1)  # local indices of the unpadded tokens
    store = ShardedKVCache(
        mesh,
        _num_layers(model),
        positions=mine[real],
        shard_lengths=(shards < seq).sum(1).tolist(),
        new_tokens=max(max_new_tokens - 1, 0),
    )
    cache = HybridCache(store, None if real.numel() == mine.numel() else real)
    cache.linear_states = LinearStates(seq, mine)
    last_shard, last_index = (int(i) for i in (shards == seq - 1).nonzero()[0])
    keep = (
        0
        if all_logits
        else torch.tensor([last_index] * (mesh.context_rank == last_shard), dtype=torch.long, device=device)
    )
    out = model(
        input_ids=shard_sequence(ids, mesh),
        use_cache=True,
        logits_to_keep=keep,
        **{cache_argument(model): cache, **inputs},
    )
    local = out.logits  # [B, S_pad/C, V], or [B, 1 or 0, V]
    if mesh.context_rank == last_shard:
        next_logits = (local[:, last_index] if all_logits else local[:, 0]).float().contiguous()  # [B, V]
    else:
        next_logits = local.new_empty(batch, local.shape[-1], dtype=torch.float32)  # [B, V]
    if mesh.context > 1:
        dist.broadcast(next_logits, src=mesh.context_members()[last_shard], group=mesh.context_group)
    if mask is None:
        return Prefill(cache, next_logits, local if all_logits else None, seq)
    real = torch.nn.functional.pad(mask, (0, max(max_new_tokens, 1)), value=True)  # [B, S + N]
    return Prefill(cache, next_logits, local if all_logits else None, seq, (~mask).sum(1), real)


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    mesh: HybridMesh,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None | Default = FROM_GENERATION_CONFIG,
    pad_token_id: int | None | Default = FROM_GENERATION_CONFIG,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    output_logits: bool = False,
    streamer=None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Continue ``input_ids`` with a K/V cache that stays sharded over the context group.

    Args:
        model: a Llama-family causal LM switched with ``apply(model, mesh)``.
        input_ids: [B, S] int64, the whole prompt, the same on every rank of the context group.
        mesh: the mesh the model was switched with.
        max_new_tokens: how many tokens to add at most (>= 0).
        eos_token_id: token id(s) that end a row; not passed: the model's generation config's; None or []:
            never stop early, as ``model.generate(..., eos_token_id=None)`` (Note [EOS ...]).
        pad_token_id: fills finished rows; not passed: the generation config's, else the first EOS; None: the
            first EOS.
        do_sample: False: greedy (argmax). True: sample from ``softmax(logits / temperature)``
            restricted to the ``top_k`` most likely tokens and the ``top_p`` nucleus (the order
            and rules of transformers' warpers).
        generator: the random generator for sampling (None: torch's global one). Seed it alike
            on every rank (every rank draws; context rank 0's token is used everywhere).
        output_logits: also return the raw logits that chose each new token.
        streamer: an object with ``put(ids)`` and ``end()`` (transformers' streamer protocol,
            e.g. ``TextStreamer``): ``put`` gets the prompt [B, S] once, then each new token [B].
        attention_mask: [B, S] 0/1 for left-padded prompts (Note [left padding]); None: no padding.

    Returns:
        [B, S + new] int64 on every rank, ``new <= max_new_tokens`` (fewer when all rows hit EOS);
        with ``output_logits``, the pair (ids, logits [B, new, V] fp32), like ``model.generate``'s
        ``output_logits`` stacked.

    Raises:
        ValueError, before any collective, for a model not switched to ``mesh`` or bad arguments.
    """
    _check_inputs(model, input_ids, mesh, max_new_tokens)
    check_sampling(do_sample, temperature, top_k, top_p)
    mask = _checked_mask(attention_mask, input_ids, mesh)
    refuse_generation(model, mask)
    eos = eos_ids(model, eos_token_id)
    pad = pad_id(model, pad_token_id, eos)
    with no_grad_for(model):
        ids, logits = _generate(
            model,
            input_ids,
            mesh,
            max_new_tokens,
            eos,
            pad,
            dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator),
            streamer,
            mask,
        )
    ids = ids.clone()  # normal tensors, usable outside inference mode
    return (ids, logits.clone()) if output_logits else ids


def _generate(
    model, input_ids, mesh, max_new_tokens, eos: list[int], pad: int | None, sampling: dict, streamer, mask=None
):
    if streamer is not None:
        streamer.put(input_ids)
    if max_new_tokens == 0:
        if streamer is not None:
            streamer.end()
        return input_ids, input_ids.new_empty(input_ids.shape[0], 0, 0, dtype=torch.float32)
    state = _prefill(model, input_ids, mesh, max_new_tokens, all_logits=False, mask=mask)
    eos_tensor = torch.tensor(eos, dtype=torch.long, device=input_ids.device)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    pieces, logits, all_logits = [input_ids], state.next_logits, []
    for index in range(max_new_tokens):
        all_logits.append(logits)
        tokens = agree_across_context(choose_next_tokens(logits, **sampling), mesh)  # [B]
        if eos:
            assert pad is not None  # with an EOS, pad_id defaults to it
            tokens = torch.where(unfinished, tokens, torch.full_like(tokens, pad))
            unfinished &= ~torch.isin(tokens, eos_tensor)
        pieces.append(tokens[:, None])
        if streamer is not None:
            streamer.put(tokens)
        if index + 1 == max_new_tokens or not bool(unfinished.any()):
            break
        logits = decode_step(model, state, tokens, state.prompt_length + index)
    if streamer is not None:
        streamer.end()
    return torch.cat(pieces, dim=1), torch.stack(all_logits, dim=1)  # [B, S + new], [B, new, V]


def decode_step(model: nn.Module, state: Prefill, tokens: torch.Tensor, position: int) -> torch.Tensor:
    """Run new tokens [B] (the same on every context rank) at global ``position``; logits [B, V] fp32.

    Appends their K/V to the shard of the rank that :func:`~hybridsp.inference.assign_new_tokens`
    picks (``prefill(..., max_new_tokens=N)`` sized the cache for N - 1 such steps). A collective.
    """
    state.cache.store.begin_token(position)
    positions = torch.full_like(tokens[:, None], position)  # [B, 1]
    step = DecodeStep(state.cache.store)
    if state.left_padding is not None:  # Note [left padding]: RoPE counts real tokens, masks count indices
        positions = positions - state.left_padding[:, None].to(positions.device)  # [B, 1]
        step = DecodeStep(state.cache.store, index=position, real=state.real)
    out = model(
        input_ids=tokens[:, None],
        position_ids=positions,
        use_cache=True,
        **{cache_argument(model): state.cache, DECODE_KWARG: step},
    )
    return out.logits[:, -1].float()  # [B, V]


def agree_across_context(tokens: torch.Tensor, mesh: HybridMesh) -> torch.Tensor:
    """Context rank 0's tokens [B] on every rank of the context group."""
    if mesh.context > 1:
        tokens = tokens.contiguous()
        dist.broadcast(tokens, src=mesh.context_members()[0], group=mesh.context_group)
    return tokens


def cache_argument(model: nn.Module) -> str:
    """The forward's cache keyword: ``cache`` (transformers >= 5.?) or ``past_key_values``."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _bound_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, BINDING_ATTR)]


def _num_layers(model: nn.Module) -> int:
    return max(cast(int, m.layer_idx) for m in _bound_modules(model)) + 1  # transformers attention's index


def _checked_mask(attention_mask, input_ids: torch.Tensor, mesh: HybridMesh) -> torch.Tensor | None:
    """The left-padding mask [B, S] bool or None (:func:`left_padding_mask`); ValueError, before any
    collective, for left padding on a layout that places tokens by document (Note [balanced layout])."""
    mask = left_padding_mask(attention_mask, input_ids)
    if mask is not None and mesh.token_layout.uses_documents and mesh.context > 1:
        pads = sorted(set((~mask).sum(1).tolist()))
        raise ValueError(
            f"generate on a layout={mesh.layout!r} mesh takes prompts without left padding (got {pads[:4]} pad "
            f"tokens per row): the padding would be a document of its own and move each row's tokens differently. "
            f"Build the mesh with layout='zigzag' for left-padded batches (the same placement for unpadded rows)"
        )
    return mask


def _check_inputs(model: nn.Module, input_ids, mesh: HybridMesh, max_new_tokens) -> None:
    """Raise ValueError, quoting what is wrong, before any collective."""
    modules = _bound_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} is not switched to hybridsp: call "
            f"hybridsp.integrations.transformers.apply(model, mesh) before generate/prefill"
        )
    if any(getattr(m, BINDING_ATTR).mesh is not mesh for m in modules):
        raise ValueError("the model was switched with a different mesh than the one passed to generate/prefill")
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"{type(model).__name__} has no language-model head (no logits_to_keep argument); generate needs a "
            f"...ForCausalLM model"
        )
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        shape = tuple(input_ids.shape) if torch.is_tensor(input_ids) else type(input_ids).__name__
        raise ValueError(f"input_ids must be an int64 tensor [B, S]; got {shape}")
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must hold at least one token per row; got shape {tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0; got {max_new_tokens!r}")
