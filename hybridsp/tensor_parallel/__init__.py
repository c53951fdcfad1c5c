"""Tensor parallelism over ``mesh.tensor_group``: ``layers`` (Megatron-style column/row linears,
sequence parallelism) and ``model_split`` (a Hugging Face causal decoder split in place by heads and
intermediate width: ``attention_split``, ``feed_forward_split``, ``width_norm``; ``plan`` the cut rule,
``sharded_loading`` a checkpoint read into the shards); used by both the DeepSpeed and the transformers
integrations.
"""
