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

Names are imported on first use, so importing this face imports neither transformers nor any
private module (``_switch``, ``_binding``, ``_capabilities``, ``_documents``, ``_padding``,
``_generation``, ``_loss``, ``_checkpoint``, ``_trainer``, ``_peft``, ``_linear_layers``, ``_vision/``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridsp.integrations import lazy_exports

if TYPE_CHECKING:
    from hybridsp.integrations.transformers._adapters import ModelAdapter, default_adapters
    from hybridsp.integrations.transformers._capabilities import layer_windows, layout_window
    from hybridsp.integrations.transformers._checkpoint import export_hf, load_pretrained
    from hybridsp.integrations.transformers._decision import check_switchable
    from hybridsp.integrations.transformers._generation import Prefill, generate, prefill
    from hybridsp.integrations.transformers._loss import causal_lm_loss, model_router_loss
    from hybridsp.integrations.transformers._padding import padded_documents
    from hybridsp.integrations.transformers._peft import base_model
    from hybridsp.integrations.transformers._switch import NAME, HybridAttentionHandle, apply, register
    from hybridsp.integrations.transformers._token_mixers import MixerAdapter, default_mixers
    from hybridsp.integrations.transformers._trainer import HybridSPMixin, HybridSPTrainer
    from hybridsp.integrations.transformers._vision.batch import shard_vlm_batch
    from hybridsp.integrations.transformers._vision.generation import generate_vlm
    from hybridsp.integrations.transformers._vision.model import VLM_MODEL_TYPES
    from hybridsp.tensor_parallel import tensor_parallel

_P = "hybridsp.integrations.transformers."
_EXPORTS = {
    "NAME": _P + "_switch",
    "HybridAttentionHandle": _P + "_switch",
    "ModelAdapter": _P + "_adapters",
    "apply": _P + "_switch",
    "default_adapters": _P + "_adapters",
    "register": _P + "_switch",
    "MixerAdapter": _P + "_token_mixers",
    "default_mixers": _P + "_token_mixers",
    "check_switchable": _P + "_decision",
    "layer_windows": _P + "_capabilities",
    "layout_window": _P + "_capabilities",
    "Prefill": _P + "_generation",
    "generate": _P + "_generation",
    "prefill": _P + "_generation",
    "causal_lm_loss": _P + "_loss",
    "model_router_loss": _P + "_loss",
    "padded_documents": _P + "_padding",
    "export_hf": _P + "_checkpoint",
    "load_pretrained": _P + "_checkpoint",
    "base_model": _P + "_peft",
    "HybridSPTrainer": _P + "_trainer",
    "HybridSPMixin": _P + "_trainer",
    "shard_vlm_batch": _P + "_vision.batch",
    "generate_vlm": _P + "_vision.generation",
    "VLM_MODEL_TYPES": _P + "_vision.model",
    "tensor_parallel": "hybridsp.tensor_parallel",
}
_INTERNAL = "an internal of the switch, not a public name"
_DEPRECATED = {
    "DECODE_KWARG": (_P + "_binding", _INTERNAL),
    "DOCUMENTS_KWARG": (_P + "_binding", "pass the documents as hybridsp_documents=... (the keyword is fixed)"),
    "global_cu_seq_lens": (_P + "_documents", _INTERNAL),
    "MIN_TRANSFORMERS_VERSION": (_P + "_switch", "the supported versions are in pyproject.toml and docs/versions.md"),
    "check_transformers_version": (_P + "_switch", "apply() checks the version itself"),
    "hybridsp_attention_forward": (_P + "_switch", "register() installs it; call apply(model, mesh)"),
    "switch_modules": (_P + "_switch", "call apply(model, mesh), or pass a ModelAdapter to apply"),
}

__all__ = [
    "HybridAttentionHandle",
    "HybridSPMixin",
    "HybridSPTrainer",
    "MixerAdapter",
    "ModelAdapter",
    "NAME",
    "Prefill",
    "VLM_MODEL_TYPES",
    "apply",
    "base_model",
    "causal_lm_loss",
    "check_switchable",
    "default_adapters",
    "default_mixers",
    "export_hf",
    "generate",
    "generate_vlm",
    "layer_windows",
    "layout_window",
    "load_pretrained",
    "model_router_loss",
    "padded_documents",
    "prefill",
    "register",
    "shard_vlm_batch",
    "tensor_parallel",
]

__getattr__ = lazy_exports(__name__, _EXPORTS, _DEPRECATED)
