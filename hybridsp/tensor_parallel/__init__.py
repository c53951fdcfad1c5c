"""Tensor parallelism over ``mesh.tensor_group``: ``layers`` (Megatron-style column/row linears,
sequence parallelism) and ``model_split`` (a Hugging Face model's linears split in place, sharded loading);
used by both the DeepSpeed and the transformers integrations.
"""
