"""Hugging Face transformers: Llama-family causal LMs on hybrid sequence-parallel attention.

    from hybridsp import shard_batch, sharded_cross_entropy
    from hybridsp.integrations.transformers import apply

    handle = apply(model, mesh)                         # one call; the model now runs sharded
    local = shard_batch(full_batch, mesh)               # this rank's tokens, labels shifted first
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
    loss = sharded_cross_entropy(out.logits, local["shift_labels"], mesh)
    loss.backward()                                     # sum gradients over the context group
    handle.undo()                                       # the model is exactly what it was

Supported: ``model_type`` in :data:`SUPPORTED_MODEL_TYPES` (Llama, Mistral, Qwen2, Qwen3:
the attention module that projects q/k/v, applies RoPE and calls the ``AttentionInterface``),
transformers >= :data:`MIN_TRANSFORMERS_VERSION`, sliding-window layers (Mistral's
``sliding_window``, Qwen2/Qwen3's ``use_sliding_window`` / ``max_window_layers`` /
``layer_types``: each layer passes its own window) and packed documents (Note [packed
documents]). Refused with a clear error: attention sinks, logit soft-capping, attention
dropout in training, bidirectional configs, a user-supplied 4D mask, and a KV cache that
already holds tokens outside :func:`generate` (long-context generation against a sharded K/V
cache: :mod:`hybridsp.integrations.hf_generate`).

Note [packed documents]: a packed row restarts ``position_ids`` at 0 at each document. The
batch's documents reach every layer as one :class:`~hybridsp.documents.Documents` object under
the model-call keyword ``hybridsp_documents`` (transformers passes model kwargs through to the
attention function, and gradient checkpointing's recomputation sees the same object), so every
layer of a forward shares one block plan and one agreement check. The best source is
:func:`hybridsp.shard_batch`, which knows the boundaries on the host: pass
``hybridsp_documents=local["documents"]`` (the Trainer and the examples do). Without it, the
forward pre-hook that :func:`apply` installs derives them once per forward: from ``cu_seq_lens_q
/ cu_seq_lens_k`` given in transformers' flattened form over the *global* sequence (row ``b``
occupying ``[b S, (b + 1) S)``), else by gathering which of the context group's tokens have
position 0 (one small ``all_gather`` of ``[B, S/C]`` int32 over ``mesh.context_group``). The
balanced layout places tokens by document, so it needs the documents handed down. A row without
restarts is one document.

Note [registration]: :func:`register` adds the module-level function
:func:`hybridsp_attention_forward` to transformers' ``AttentionInterface`` under the name
``"hybridsp"`` (the documented extension point; nothing private is patched). It is
idempotent and happens inside :func:`register` / :func:`apply`, never at import. The entry
is stateless, so it stays registered: a model reaches it only while its config names it,
and ``undo`` restores the config. (transformers offers no public way to remove a global
entry, and removing it would break any other model still switched on.) After
:func:`register`, ``from_pretrained(..., attn_implementation="hybridsp")`` works too; such a
model still needs :func:`apply` to bind its mesh.

Note [binding the mesh]: the attention function receives the attention module as its first
argument, so :func:`apply` binds the mesh *per module*: it sets one attribute
(``_hybridsp_binding``: mesh and kernel backend) on each attention module of this model
instance, and ``undo`` deletes exactly those. No module-level state, no closure registered
per mesh (the registry would grow with every call and entries cannot be removed), no extra
argument the caller must thread through ``forward``. Two models may be switched on with
different meshes at the same time. Applying to a class is refused: a mesh belongs to
processes, not to a class.

Note [no mask]: the mask transformers would build for a shard is wrong (it assumes the
shard's tokens are the sequence 0..S/C-1). transformers' mask builders
(``masking_utils._preprocess_mask_arguments``, since 4.53) return no mask at all for an
implementation that has no entry in ``AttentionMaskInterface``: that is the path for custom
kernels that mask by themselves. ``"hybridsp"`` deliberately has no mask entry (and
:func:`register` refuses if someone added one), so no mask tensor is built. A 2D padding
mask passed to the model (this rank's shard of it when ``C > 1``) is turned by the forward
pre-hook into documents instead (:mod:`hybridsp.integrations.hf_padding`: left, right and
between-document padding are exact on real tokens; a hole inside one sequence is refused).
Causal masking is done by the hybrid attention itself, by global token position, with
``causal=True``.

Note [minimum version]: 4.53 is the first release with ``masking_utils`` and its
"no mask for a custom implementation" exit, and the first in which the Llama, Mistral and
Qwen2/3 models build their masks there; before it each model built a 4D mask for any
unknown implementation (checked in 4.52.4's Llama). ``AttentionInterface`` and
``module.scaling`` are older. The integration's tests pass on 4.53.0 and on 5.24;
:func:`check_transformers_version` raises a clear error for older versions.

Inputs at each call (:func:`apply` checks them with a forward pre-hook when ``C > 1``):
``position_ids`` must be the global positions of this rank's tokens (``shard_batch`` gives
them; the model's default 0..S/C-1 would be wrong RoPE), and ``labels`` must not be passed
(transformers would shift them per shard; use ``sharded_cross_entropy``).
"""
from __future__ import annotations

from hybridsp.integrations.binding import DECODE_KWARG, DOCUMENTS_KWARG  # noqa: F401
from hybridsp.integrations.hf_documents import global_cu_seq_lens  # noqa: F401
from hybridsp.integrations.hf_switch import (  # noqa: F401
    MIN_TRANSFORMERS_VERSION, NAME, SUPPORTED_MODEL_TYPES, HybridAttentionHandle, apply, check_transformers_version,
    hybridsp_attention_forward, register, switch_modules,
)

_LAZY_TRAINER_NAMES = ("HybridSPTrainer", "HybridSPMixin")


def __getattr__(name: str):
    """``HybridSPTrainer`` / ``HybridSPMixin`` from :mod:`hybridsp.integrations.trainer`, imported on first use
    (the Trainer pulls in accelerate; importing this module stays cheap)."""
    if name in _LAZY_TRAINER_NAMES:
        from hybridsp.integrations import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from hybridsp.integrations.hf_generate import Prefill, generate, prefill  # noqa: E402,F401  (long-context inference)

from hybridsp.integrations.hf_loss import causal_lm_loss  # noqa: E402,F401  (the fused-loss path, issue 12)

from hybridsp.integrations.tensor_parallel import tensor_parallel  # noqa: E402,F401  (tensor parallelism, issue 22)
