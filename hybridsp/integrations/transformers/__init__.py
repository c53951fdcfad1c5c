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
    "DECODE_KWARG": "hybridsp.integrations.transformers._binding",
    "DOCUMENTS_KWARG": "hybridsp.integrations.transformers._binding",
    "global_cu_seq_lens": "hybridsp.integrations.transformers._documents",
    "MIN_TRANSFORMERS_VERSION": "hybridsp.integrations.transformers._switch",
    "NAME": "hybridsp.integrations.transformers._switch",
    "HybridAttentionHandle": "hybridsp.integrations.transformers._switch",
    "apply": "hybridsp.integrations.transformers._switch",
    "check_switchable": "hybridsp.integrations.transformers._capabilities",
    "layer_windows": "hybridsp.integrations.transformers._capabilities",
    "layout_window": "hybridsp.integrations.transformers._capabilities",
    "check_transformers_version": "hybridsp.integrations.transformers._switch",
    "hybridsp_attention_forward": "hybridsp.integrations.transformers._switch",
    "register": "hybridsp.integrations.transformers._switch",
    "switch_modules": "hybridsp.integrations.transformers._switch",
    "Prefill": "hybridsp.integrations.transformers._generation",
    "generate": "hybridsp.integrations.transformers._generation",
    "prefill": "hybridsp.integrations.transformers._generation",
    "causal_lm_loss": "hybridsp.integrations.transformers._loss",
    "model_router_loss": "hybridsp.integrations.transformers._loss",
    "tensor_parallel": "hybridsp.tensor_parallel._model_split",
    "HybridSPTrainer": "hybridsp.integrations.transformers._trainer",
    "HybridSPMixin": "hybridsp.integrations.transformers._trainer",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
