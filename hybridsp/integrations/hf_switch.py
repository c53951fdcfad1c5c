"""Switching one HF model instance to hybrid attention, and the ``AttentionInterface`` entry it reaches.

:func:`register` (Note [registration]), :func:`apply` (Note [binding the mesh]), the call checks
(Note [no mask]) and :func:`hybridsp_attention_forward`; the notes are in
:mod:`hybridsp.integrations.transformers`, the public face of the integration.
"""

from __future__ import annotations

import transformers
from packaging.version import Version
from torch import nn

import torch

from hybridsp.attention import hybrid_attn_func
from hybridsp.formulas import heads_divisible
from hybridsp.integrations.binding import BINDING_ATTR as _BINDING_ATTR
from hybridsp.integrations.binding import DECODE_KWARG, DOCUMENTS_KWARG
from hybridsp.integrations.binding import Binding as _Binding
from hybridsp.integrations.hf_documents import documents_from_kwargs, install_input_check
from hybridsp.kernels import AttentionKernel
from hybridsp.mesh import HybridMesh

NAME = "hybridsp"
MIN_TRANSFORMERS_VERSION = "4.53.0"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")


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
        scaling: softmax scale; defaults to ``module.scaling``.
        dropout: must be 0 (attention dropout is not implemented).
        kwargs: the model's extra arguments: ``sliding_window`` (this layer's window) and
            ``cu_seq_lens_q/k`` (global packed documents, Note [packed documents]) are used;
            ``softcap``, ``s_aux`` and ``is_causal=False`` are refused. ``hybridsp_decode`` (set by
            :func:`generate`'s decode steps) sends the call to the decode attention over the sharded cache.

    Returns:
        (out [B, S_local, H, D] in the query's dtype, None): no attention weights.
    """
    binding = _binding_of(module)
    decode = kwargs.get(DECODE_KWARG)  # a decode step over a sharded K/V cache (hf_generate)
    _check_call(query, key, attention_mask, dropout, kwargs, cached=decode is not None)
    if decode is not None:
        return decode.attend(module, query, key, value, binding, module.scaling if scaling is None else scaling, kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D]
    cu_seqlens = kwargs.get(DOCUMENTS_KWARG)  # the batch's Documents: planned and checked once per forward
    if cu_seqlens is None:
        cu_seqlens = documents_from_kwargs(kwargs, q.shape[0], q.shape[1] * binding.mesh.context)
    out = hybrid_attn_func(
        q, k, v, mesh=binding.mesh, causal=True, backend=binding.backend,
        softmax_scale=module.scaling if scaling is None else scaling,
        cu_seqlens=cu_seqlens, sliding_window=kwargs.get("sliding_window"),
    )  # [B, S, H, D]
    return out, None


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
    refused = {name: kwargs[name] for name in ("softcap", "s_aux") if kwargs.get(name) is not None}
    if refused:
        raise ValueError(f"hybridsp attention does not support {refused}; use a config without them")
    if kwargs.get("is_causal") is False:
        raise ValueError("hybridsp attention is causal only; got is_causal=False")
    if key.shape[2] != query.shape[2] and not cached:
        raise ValueError(
            f"hybridsp attention got {query.shape[2]} queries but {key.shape[2]} keys per rank: a KV cache with "
            f"earlier tokens is only supported through hybridsp.integrations.transformers.generate; call the model "
            f"with use_cache=False"
        )


class HybridAttentionHandle:
    """What :func:`apply` changed on one model, and :meth:`undo` to change it back.

    Also a context manager: ``with apply(model, mesh): ...`` undoes on exit. ``undo`` is
    idempotent.
    """

    def __init__(self, model: nn.Module, modules: list[nn.Module], previous: list[tuple], hook):
        self.model, self._modules, self._previous, self._hook = model, modules, previous, hook
        self.active = True

    def undo(self) -> None:
        """Remove the bindings and the input check, restore every config's attention implementation."""
        if not self.active:
            return
        if self._hook is not None:
            self._hook.remove()
        for module in self._modules:
            if hasattr(module, _BINDING_ATTR):
                delattr(module, _BINDING_ATTR)
        for config, implementation in self._previous:  # outer configs first: the setter recurses inward
            config._attn_implementation = implementation
        self.active = False

    def __enter__(self) -> HybridAttentionHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        name, count = type(self.model).__name__, len(self._modules)
        return f"HybridAttentionHandle({name}, {count} attention modules, active={self.active})"


def apply(model: nn.Module, mesh: HybridMesh, *, backend: str | AttentionKernel = "auto") -> HybridAttentionHandle:
    """Switch one model instance to hybrid sequence-parallel attention over ``mesh``.

    Registers ``"hybridsp"`` (idempotent), binds the mesh to every attention module
    (Note [binding the mesh]), sets every config's ``_attn_implementation`` to ``"hybridsp"``
    and, when ``C > 1``, checks each call's inputs (position_ids given, no labels).

    Args:
        model: a transformers model instance (``LlamaForCausalLM``, ``Qwen2Model``, ...) of a
            type in :data:`SUPPORTED_MODEL_TYPES`.
        mesh: the :class:`~hybridsp.mesh.HybridMesh` the model's attention runs over.
        backend: the local attention kernel (``auto``, ``torch``, ``flash``, ``reference``).

    Returns:
        a :class:`HybridAttentionHandle`; ``handle.undo()`` restores the model exactly.

    Raises:
        TypeError for a class; ValueError, before changing anything, for an unsupported model
        or config (the message says what to change); RuntimeError for old transformers.
    """
    if isinstance(model, type):
        raise TypeError(
            f"apply() switches a model instance, got the class {model.__name__}: build the model, then call "
            f"apply(model, mesh) (register() alone makes attn_implementation={NAME!r} loadable)"
        )
    register()
    from hybridsp.integrations import vlm  # Qwen2-VL / Qwen2.5-VL: the language model only (issue 23)

    if vlm.is_vision_language_model(model):
        if any(hasattr(m, _BINDING_ATTR) for m in model.modules()):
            raise ValueError(f"{type(model).__name__} is already switched to {NAME}: undo the first handle first")
        return vlm.apply_to_language_model(model, mesh, backend, switch_modules)
    vlm.refuse_other_multimodal(model)
    modules = [m for m in model.modules() if all(hasattr(m, part) for part in _ATTENTION_PARTS)]
    _check_model(model, modules, mesh)
    return switch_modules(model, modules, _configs_of(model, modules), mesh, backend, install_input_check(model, mesh))


def switch_modules(model: nn.Module, modules: list[nn.Module], configs: list, mesh: HybridMesh, backend, hook):
    """Bind ``modules`` to ``mesh`` and name ``"hybridsp"`` in ``configs`` (no checks); the handle also
    removes ``hook``. The step :mod:`hybridsp.integrations.vlm` shares with :func:`apply`."""
    previous = [(config, config._attn_implementation) for config in configs]
    binding = _Binding(mesh, backend)
    for module in modules:
        setattr(module, _BINDING_ATTR, binding)
    for config in configs:
        config._attn_implementation = NAME
    return HybridAttentionHandle(model, modules, previous, hook)


def _check_model(model: nn.Module, modules: list[nn.Module], mesh: HybridMesh) -> None:
    """Raise ValueError, before anything changes, for a model hybridsp cannot run exactly."""
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no Llama-family attention module (q_proj/k_proj/v_proj/o_proj + scaling); "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if any(hasattr(m, _BINDING_ATTR) for m in modules):
        raise ValueError(
            f"{type(model).__name__} is already switched to {NAME}: undo the first handle before applying again"
        )
    for module in modules:
        _check_module(module, mesh)


def _check_module(module: nn.Module, mesh: HybridMesh) -> None:
    """One attention module: supported type, no sliding window or sinks, causal, heads divisible by U."""
    config, layer = module.config, getattr(module, "layer_idx", "?")
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} is not supported by hybridsp's transformers integration; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    # Sliding windows: Qwen2/3 modules carry their own (None on full-attention layers), Mistral passes the
    # config's; either arrives as the call's ``sliding_window`` keyword and is computed exactly.
    if getattr(module, "sinks", None) is not None:
        raise ValueError(f"layer {layer} uses attention sinks, which hybridsp does not support")
    if not getattr(module, "is_causal", True) or not getattr(config, "is_causal", True):
        raise ValueError(f"layer {layer} is not causal; hybridsp's transformers integration supports causal LMs only")
    heads = module.q_proj.weight.shape[0] // module.head_dim  # this rank's: H/T once tensor-parallel
    if not heads_divisible(heads, mesh.ulysses):
        raise ValueError(
            f"the model's {heads} query heads are not divisible by the Ulysses degree {mesh.ulysses}; choose a "
            f"Ulysses degree that divides {heads} and move the rest of the context ranks to the ring"
        )


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
