"""Hugging Face transformers on hybrid sequence-parallel attention: the public face.

    from hybridsp import shard_batch, sharded_cross_entropy
    from hybridsp.integrations.transformers import apply

    handle = apply(model, mesh)                         # one call; the model now runs sharded
    local = shard_batch(full_batch, mesh)               # this rank's tokens, labels shifted first
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                hybridsp_documents=local["documents"], use_cache=False)
    loss = sharded_cross_entropy(out.logits, local["shift_labels"], mesh)
    loss.backward()                                     # sum gradients over the context group
    handle.undo()                                       # the model is exactly what it was

Modules: ``switch`` (``register``/``apply``, the attention entry and its notes), ``binding``,
``documents`` (the pre-hook), ``padding``, ``generation``, ``loss``, ``checkpoint`` (HF weights under
ZeRO), ``trainer`` / ``trainer_data`` / ``trainer_engine`` (``HybridSPTrainer``), ``peft``, ``vision/`` (Qwen2-VL).
Names are imported on first use, so importing this face imports none of them.
"""

from __future__ import annotations

from hybridsp.integrations import lazy_exports

_EXPORTS = {
    "DECODE_KWARG": "hybridsp.integrations.transformers.binding",
    "DOCUMENTS_KWARG": "hybridsp.integrations.transformers.binding",
    "global_cu_seq_lens": "hybridsp.integrations.transformers.documents",
    "MIN_TRANSFORMERS_VERSION": "hybridsp.integrations.transformers.switch",
    "NAME": "hybridsp.integrations.transformers.switch",
    "HybridAttentionHandle": "hybridsp.integrations.transformers.switch",
    "apply": "hybridsp.integrations.transformers.switch",
    "check_switchable": "hybridsp.integrations.transformers.capabilities",
    "layer_windows": "hybridsp.integrations.transformers.capabilities",
    "layout_window": "hybridsp.integrations.transformers.capabilities",
    "check_transformers_version": "hybridsp.integrations.transformers.switch",
    "hybridsp_attention_forward": "hybridsp.integrations.transformers.switch",
    "register": "hybridsp.integrations.transformers.switch",
    "switch_modules": "hybridsp.integrations.transformers.switch",
    "Prefill": "hybridsp.integrations.transformers.generation",
    "generate": "hybridsp.integrations.transformers.generation",
    "prefill": "hybridsp.integrations.transformers.generation",
    "causal_lm_loss": "hybridsp.integrations.transformers.loss",
    "model_router_loss": "hybridsp.integrations.transformers.loss",
    "tensor_parallel": "hybridsp.tensor_parallel.model_split",
    "HybridSPTrainer": "hybridsp.integrations.transformers.trainer",
    "HybridSPMixin": "hybridsp.integrations.transformers.trainer",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
