"""Inference on a sequence-parallel mesh: a K/V cache that stays sharded, decode by LSE merge.

    cache = ShardedKVCache(mesh, num_layers, positions=..., shard_lengths=..., new_tokens=...)
    out = decode_attention(q, k_shard, v_shard, mesh=mesh)      # one all-gather of partials

:mod:`hybridsp.integrations.transformers._generation` drives both for Hugging Face models.
"""

from hybridsp.inference._decode_attention import decode_attention, local_decode_attention, merge_over_context
from hybridsp.inference._kv_cache import ShardedKVCache, assign_new_tokens

__all__ = ["ShardedKVCache", "assign_new_tokens", "decode_attention", "local_decode_attention", "merge_over_context"]
