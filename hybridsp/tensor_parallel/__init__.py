"""Tensor parallelism over ``mesh.tensor_group``, used by both the DeepSpeed and the transformers
integrations.

Public: :func:`tensor_parallel` (a Hugging Face causal decoder split in place by heads and
intermediate width) and :func:`load_sharded_safetensors` (a checkpoint read straight into the
shards). Inside: ``_layers`` (Megatron-style column/row pieces, sequence parallelism),
``_model_split``, ``_attention_split``, ``_feed_forward_split``, ``_width_norm``, ``_cut_rule``
(``TensorSplit``: the one cut rule), ``_sharded_loading``.
"""

from hybridsp.tensor_parallel._model_split import tensor_parallel
from hybridsp.tensor_parallel._sharded_loading import load_sharded_safetensors

__all__ = ["load_sharded_safetensors", "tensor_parallel"]
