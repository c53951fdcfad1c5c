"""Switching one HF model instance to hybrid attention, and the ``AttentionInterface`` entry it reaches.

:func:`register` (Note [registration]), :func:`apply` (Note [binding the mesh]), the call checks
(Note [no mask]) and :func:`hybridsp_attention_forward`.

Note [capabilities]: the switch takes a model by what its attention does, not by its name. Any
causal decoder whose attention modules reach the attention function through transformers'
``AttentionInterface`` (Note [found by what they are] in :mod:`.binding`: Llama, Mistral, Qwen2/3,
their MoE variants, Mixtral, Gemma 2/3, GPT-OSS, DeepSeek-V3's MLA, OLMo 2/3, Phi-3, SmolLM3, Granite,
GLM-4, ...; docs/model-support.md lists what the tests check per family), on transformers >=
:data:`MIN_TRANSFORMERS_VERSION`. What each call receives decides what runs: ``scaling`` (Granite's
``attention_multiplier``, Gemma's ``query_pre_attn_scalar`` arrive that way), the layer's
``sliding_window``, head dims (q/k and v may differ), packed documents (Note [packed documents]).
Position handling stays the model's own, from the global ``position_ids`` (RoPE per layer type,
layers without RoPE). Hybrid linear-attention models (Qwen3.5, Qwen3-Next, Nemotron-H): the same
:func:`apply` also switches their Gated DeltaNet / Mamba-2 mixers, recognised by class
(:mod:`hybridsp.integrations.transformers._token_mixers`; the handle undoes both). What is refused is
decided once, by :func:`~hybridsp.integrations.transformers._decision.decide`, for ``apply`` and
``check_switchable`` alike. Refused, with a line naming what is missing: a model with no such module (its
attention bypasses the interface), encoder-decoders, non-causal attention, chunked-attention layers on a layout that places tokens by document (chunked layers
otherwise run as documents cut into chunks, Note [chunked layers] in :mod:`.documents`),
layers that mix tokens outside attention that no mixer adapter claims by identity (Note [mixers by identity]
in :mod:`.token_mixers`), a model split by transformers' own tensor parallelism, Llama 4's query temperature tuning past ``floor_scale`` tokens under sequence parallelism, attention dropout in training, a ``head_mask``, a user-supplied 4D mask, and a KV
cache that already holds tokens outside :func:`generate` (long-context generation against a sharded
K/V cache: :mod:`hybridsp.integrations.transformers._generation`).

Note [packed documents]: a packed row restarts ``position_ids`` at 0 at each document. The
batch's documents reach every layer as one :class:`~hybridsp.layout._documents.Documents` object under
the model-call keyword ``hybridsp_documents`` (transformers passes model kwargs through to the
attention function, and gradient checkpointing's recomputation sees the same object), so every
layer of a forward shares one block plan and one agreement fingerprint (checked per call). The best source is
:func:`hybridsp.shard_batch`, which knows the boundaries on the host: pass
``hybridsp_documents=local["documents"]`` (the Trainer and the examples do). Without it, the
forward pre-hook that :func:`apply` installs derives them once per forward: from ``cu_seq_lens_q
/ cu_seq_lens_k`` given in transformers' flattened form over the *global* sequence (row ``b``
occupying ``[b S, (b + 1) S)``), else by gathering which of the context group's tokens have
position 0 (one small ``all_gather`` of ``[B, S/C]`` int32 over ``mesh.context_group``). The
balanced layout places tokens by document, so it needs the documents handed down. A row without
restarts is one document.

Note [layout window] and the capability checks: :mod:`hybridsp.integrations.transformers._capabilities`.

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
pre-hook into documents instead (:mod:`hybridsp.integrations.transformers._padding`: left, right and
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

from typing import Any, Sequence

import torch
import transformers
from packaging.version import Version
from torch import nn

from hybridsp._types import BackendName, HeadChunks
from hybridsp.attention._api import hybrid_attn_func
from hybridsp.integrations.transformers._adapters import ModelAdapter
from hybridsp.integrations.transformers._binding import BINDING_ATTR as _BINDING_ATTR
from hybridsp.integrations.transformers._binding import DECODE_KWARG, DOCUMENTS_KWARG, NAME
from hybridsp.integrations.transformers._binding import Binding as _Binding
from hybridsp.integrations.transformers._capabilities import check_position_scaled_queries, chunk_size_of, layout_window
from hybridsp.integrations.transformers._decision import decide
from hybridsp.integrations.transformers._documents import documents_from_kwargs, install_input_check, layer_documents
from hybridsp.integrations.transformers._handle import HybridAttentionHandle, switch_modules
from hybridsp.integrations.transformers._linear_layers import switch_claimed_mixers
from hybridsp.integrations.transformers._token_mixers import MixerAdapter
from hybridsp.kernels import AttentionKernel
from hybridsp.memory._qkv_donation import may_donate_qkv
from hybridsp.mesh._hybrid_mesh import HybridMesh

MIN_TRANSFORMERS_VERSION = "4.53.0"


def check_transformers_version(found: str | None = None) -> None:
    """Raise RuntimeError unless transformers (``found``, default the installed one) is new enough."""
    found = transformers.__version__ if found is None else found
    if Version(found) < Version(MIN_TRANSFORMERS_VERSION):
        raise RuntimeError(
            f"hybridsp's transformers integration needs transformers>={MIN_TRANSFORMERS_VERSION} (its mask builders "
            f"must skip masks for custom attention implementations); found {found}. "
            f"Upgrade: pip install 'transformers>={MIN_TRANSFORMERS_VERSION}'"
        )


def register() -> None:
    """Make ``"hybridsp"`` a transformers attention implementation (idempotent; Note [registration])."""
    check_transformers_version()
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if NAME in ALL_MASK_ATTENTION_FUNCTIONS:
        raise RuntimeError(
            f"a mask function is registered for {NAME!r} in transformers' AttentionMaskInterface, so transformers "
            f"would build a per-shard mask (wrong for a sharded sequence); remove that registration"
        )
    current = AttentionInterface().get(NAME)
    if current is None:
        AttentionInterface.register(NAME, hybridsp_attention_forward)
    elif current is not hybridsp_attention_forward:
        raise RuntimeError(f"another function is registered as attention implementation {NAME!r}: {current!r}")


def hybridsp_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry: causal hybrid attention over the module's mesh.

    Args:
        module: a Llama-family attention module that :func:`apply` bound to a mesh.
        query: [B, H, S_local, D] this rank's queries after RoPE (transformers' layout).
        key, value: [B, H_kv, S_local, D], GQA heads not repeated (the hybrid attention
            handles H_kv < H itself).
        attention_mask: must be None (Note [no mask]).
        scaling: softmax scale; defaults to ``module.scaling``, else 1/sqrt(D) (as transformers' sdpa).
        dropout: must be 0 (attention dropout is not implemented).
        kwargs: the model's extra arguments: ``sliding_window`` (this layer's window) and
            ``cu_seq_lens_q/k`` (global packed documents, Note [packed documents]) are used;
            ``s_aux`` (GPT-OSS's sinks) and ``softcap`` (Gemma 2) go to the hybrid attention's
            ``sinks`` / ``softcap``; ``head_mask`` and ``is_causal=False`` are refused. ``hybridsp_decode`` (set by
            :func:`generate`'s decode steps) sends the call to the decode attention over the sharded cache.

    Returns:
        (out [B, S_local, H, D] in the query's dtype, None): no attention weights.
    """
    binding = _binding_of(module)
    decode = kwargs.get(DECODE_KWARG)  # a decode step over a sharded K/V cache (hf_generate)
    _check_call(query, key, attention_mask, dropout, kwargs, cached=decode is not None)
    query, key, value = _as_autocast(query, key, value)
    if decode is not None:
        _refuse_chunked_decode(module)
        return decode.attend(module, query, key, value, binding, _scale_of(module, scaling), kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D]
    batch, seq_len = q.shape[0], q.shape[1] * binding.mesh.context
    check_position_scaled_queries(module, seq_len, binding.mesh)
    cu_seqlens = kwargs.get(DOCUMENTS_KWARG)  # the batch's Documents: planned and checked once per forward
    if cu_seqlens is None:
        cu_seqlens = documents_from_kwargs(kwargs, batch, seq_len)
    cu_seqlens = layer_documents(cu_seqlens, chunk_size_of(module), batch, seq_len)
    settings: dict[str, Any] = dict(
        softmax_scale=_scale_of(module, scaling),
        sliding_window=kwargs.get("sliding_window"),
        sinks=kwargs.get("s_aux"),
        softcap=kwargs.get("softcap"),
    )
    out = hybrid_attn_func(
        q,
        k,
        v,
        mesh=binding.mesh,
        causal=True,
        backend=binding.backend,
        cu_seqlens=cu_seqlens,
        head_chunks=binding.head_chunks,
        donate_inputs=_donates(module, binding),
        **settings,
    )  # [B, S, H, Dv]
    if binding.tap is not None:  # the exactness probe records this call (Note [probe tap] in hybridsp.monitor)
        binding.tap(module, q, k, v, out, chunk=chunk_size_of(module), **settings)
    return out, None


def _donates(module: nn.Module, binding: _Binding) -> bool:
    """Whether this call's q, k, v may hold their gradients (Note [donated q/k/v] in
    :mod:`hybridsp.memory._qkv_donation`); never while compiling (the compiled call does not donate)."""
    return not torch.compiler.is_compiling() and may_donate_qkv(module, recording=binding.tap is not None)


def _as_autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, the tensors in its dtype, as SDPA takes them (autocast runs attention in lower
    precision; RoPE's fp32 cos/sin would otherwise leave q and k in fp32 beside a bf16 v); else unchanged."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def _refuse_chunked_decode(module: nn.Module) -> None:
    if chunk_size_of(module) is not None:
        raise ValueError(
            f"layer {module.layer_idx} is a chunked-attention layer, which hybridsp's sharded-cache "
            f"generation does not mask by chunk; generate with the unswitched model"
        )


def _scale_of(module: nn.Module, scaling: float | None) -> float | None:
    """The call's scale, else the module's, else None (the kernel's 1/sqrt(D))."""
    return getattr(module, "scaling", None) if scaling is None else scaling


def _binding_of(module: nn.Module) -> _Binding:
    binding = getattr(module, _BINDING_ATTR, None)
    if binding is None:
        raise RuntimeError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) runs attn_implementation "
            f"{NAME!r} but has no mesh: call hybridsp.integrations.transformers.apply(model, mesh) first"
        )
    return binding


def _check_call(
    query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, kwargs: dict, cached: bool = False
) -> None:
    """Raise ValueError for a call the hybrid attention cannot compute exactly (``cached``: a decode step)."""
    if attention_mask is not None:
        raise ValueError(
            f"hybridsp attention got an attention mask of shape {tuple(attention_mask.shape)}: masks are not "
            f"supported (causal masking is built in); pass right-padded batches through shard_batch instead"
        )
    if dropout > 0:
        raise ValueError(
            f"attention dropout {dropout} is not supported by hybridsp attention; set config.attention_dropout=0"
        )
    refused = {name: kwargs[name] for name in ("head_mask",) if kwargs.get(name) is not None}
    if refused:
        raise ValueError(f"hybridsp attention does not support {refused}; use a config without them")
    if kwargs.get("is_causal") is False:
        raise ValueError("hybridsp attention is causal only; got is_causal=False")
    if key.shape[2] != query.shape[2] and not cached:
        raise ValueError(
            f"hybridsp attention got {query.shape[2]} queries but {key.shape[2]} keys per rank: a KV cache with "
            f"earlier tokens is only supported through hybridsp.integrations.transformers._generation; call the model "
            f"with use_cache=False"
        )


def apply(
    model: nn.Module,
    mesh: HybridMesh,
    *,
    backend: BackendName | AttentionKernel = "auto",
    adapters: Sequence[ModelAdapter] | None = None,
    mixers: Sequence[MixerAdapter] | None = None,
    head_chunks: HeadChunks | None = None,
) -> HybridAttentionHandle:
    """Switch one model instance to hybrid sequence-parallel attention over ``mesh``.

    Registers ``"hybridsp"`` (idempotent), binds the mesh to every attention module
    (Note [binding the mesh]), sets every config's ``_attn_implementation`` to ``"hybridsp"``,
    switches the token mixers an adapter claims (Note [mixers by identity] in :mod:`.token_mixers`)
    and, when ``C > 1``, checks each call's inputs (position_ids given, no labels).

    Args:
        model: a transformers causal decoder instance (``LlamaForCausalLM``, ``Qwen2Model``,
            ``Gemma3ForCausalLM``, ...) whose attention calls the attention interface (Note [capabilities]).
        mesh: the :class:`~hybridsp.mesh._hybrid_mesh.HybridMesh` the model's attention runs over.
        backend: the local attention kernel (``auto``, ``torch``, ``flash``, ``reference``).
        adapters: the :class:`ModelAdapter` s to ask before the generic path (None:
            :func:`default_adapters`); pass ``(*default_adapters(), MyAdapter())`` to add one.
        mixers: the :class:`MixerAdapter` s that switch token mixers other than attention (None:
            :func:`default_mixers`: Gated DeltaNet and Mamba-2); pass ``(*default_mixers(), MyMixer())`` to
            add one. Any other module that mixes tokens makes ``apply`` refuse.
        head_chunks: every attention call's head groups (``hybrid_attn_func``'s ``head_chunks``; None:
            ``mesh.head_chunks``, which the ``"hybridsp"`` config section sets; adapters use the mesh's).

    Returns:
        a :class:`HybridAttentionHandle`; ``handle.undo()`` restores the model exactly.

    Raises:
        TypeError for a class; ValueError, before changing anything and before any collective, for an
        unsupported model or config (the message says what to change; ``check_switchable`` raises the same);
        RuntimeError for old transformers.
    """
    decision = decide(model, mesh, adapters, mixers)
    register()
    if decision.adapter is not None:
        return decision.adapter.apply(model, mesh, backend)
    modules = decision.attention
    undo_linear = switch_claimed_mixers(decision.mixers, mesh)
    hook = install_input_check(model, mesh, layout_window(model))
    return switch_modules(model, modules, _configs_of(model, modules), mesh, backend, hook, undo_linear, head_chunks)


def _configs_of(model: nn.Module, modules: list[nn.Module]) -> list:
    """Every distinct config the model's attention reads, outer before inner (sub-configs after)."""
    found: dict[int, object] = {}
    pending = [getattr(model, "config", None)] + [m.config for m in modules]
    while pending:
        config = pending.pop(0)
        if config is None or id(config) in found:
            continue
        found[id(config)] = config
        pending += [getattr(config, key, None) for key in getattr(config, "sub_configs", {})]
    return list(found.values())
