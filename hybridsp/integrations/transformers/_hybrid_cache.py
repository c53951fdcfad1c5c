"""What a generation hands the model call: :class:`HybridCache`, the transformers ``Cache`` over this
rank's :class:`~hybridsp.inference.ShardedKVCache`, and :class:`DecodeStep`, which the ``"hybridsp"``
attention function hands a decode step's attention to. The Notes they name (Note [how the model runs],
Note [left padding]) are in :mod:`hybridsp.integrations.transformers._generation`, which drives them.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from transformers.cache_utils import Cache

from hybridsp.inference import ShardedKVCache, decode_attention
from hybridsp.linear_attention._decode import LinearStates


class HybridCache(Cache):
    """transformers' ``Cache`` interface over this rank's :class:`~hybridsp.inference.ShardedKVCache`.

    ``update(keys, values, layer_idx)`` with keys/values [B, Hkv, T, D]: during the prefill it
    stores the columns ``prompt_index`` (the real tokens; all when None) and returns its input;
    during decode the owner of the current token appends it, and every rank returns its shard
    (views [B, Hkv, L, D]).
    """

    def __init__(self, store: ShardedKVCache, prompt_index: torch.Tensor | None):
        super().__init__(layers=[])
        self.store, self.prompt_index = store, prompt_index
        self.linear_states: LinearStates | None = None  # the recurrent layers' (Note [where the decode states live])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        store = self.store
        if not store.decoding:
            store.write(layer_idx, key_states, value_states, index=self.prompt_index)
            return key_states, value_states
        if store.owns_current:
            store.write(layer_idx, key_states, value_states)
        return store.layer(layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached over the whole context group (what an unsharded cache would hold)."""
        return self.store.total_tokens

    def __repr__(self) -> str:
        return f"HybridCache({self.store!r})"


class DecodeStep:
    """What the ``"hybridsp"`` attention function calls during a decode step (Note [how the model runs]).

    ``index``: the new token's index in the sequence (masks count indices, as transformers' do;
    with left padding a row's RoPE position is smaller). ``real``: [B, S + N] bool, False at each
    row's left padding (Note [left padding]), or None.
    """

    def __init__(self, store: ShardedKVCache, index: int | None = None, real: torch.Tensor | None = None):
        self.store, self.index, self.real = store, index, real

    def attend(self, module: nn.Module, query, key, value, binding, scaling: float, kwargs: dict):
        """query [B, H, T, D], key/value [B, Hkv, L, D] this rank's shard -> (out [B, T, H, D], None)."""
        positions = kwargs.get("position_ids")  # [B, T] (the same for every row without left padding)
        if self.index is not None:
            positions = torch.full((1, 1), self.index, dtype=torch.long, device=query.device)  # [1, T]
        keys_at = self.store.key_positions(cast(int, module.layer_idx))  # [L] this rank's cached tokens' indices
        out = decode_attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),  # [B, T, H, D], [B, L, Hkv, D]
            mesh=binding.mesh,
            softmax_scale=scaling,
            backend=binding.backend,
            query_positions=None if positions is None else positions[0],
            key_positions=keys_at,
            window=kwargs.get("sliding_window"),
            key_mask=None if self.real is None else self.real[:, keys_at],  # [B, L]
            sinks=kwargs.get("s_aux"),
            softcap=kwargs.get("softcap"),
        )  # [B, T, H, Dv]
        return out, None
