"""Switching one HF model instance to hybrid attention, and the ``AttentionInterface`` entry it reaches.

:func:`register` (Note [registration]), :func:`apply` (Note [binding the mesh]), the call checks
(Note [no mask]) and :func:`hybridsp_attention_forward`.

Supported: ``model_type`` in :data:`SUPPORTED_MODEL_TYPES` (Llama, Mistral, Qwen2, Qwen3:
the attention module that projects q/k/v, applies RoPE and calls the ``AttentionInterface``),
transformers >= :data:`MIN_TRANSFORMERS_VERSION`, sliding-window layers (Mistral's
``sliding_window``, Qwen2/Qwen3's ``use_sliding_window`` / ``max_window_layers`` /
``layer_types``: each layer passes its own window) and packed documents (Note [packed
documents]). Refused with a clear error: attention sinks, logit soft-capping, attention
dropout in training, bidirectional configs, a user-supplied 4D mask, and a KV cache that
already holds tokens outside :func:`generate` (long-context generation against a sharded K/V
cache: :mod:`hybridsp.integrations.transformers.generation`).

Note [packed documents]: a packed row restarts ``position_ids`` at 0 at each document. The
batch's documents reach every layer as one :class:`~hybridsp.layout.documents.Documents` object under
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

Note [layout window]: ``layout="balanced"`` places tokens so that every ring slot does the same
attention work, and a sliding window changes that work (Note [placement window] in
:mod:`hybridsp.layout.layouts`). The layers' windows come from the model (:func:`layer_windows`:
Qwen2/3 modules carry their own, None on full-attention layers; Mistral's is the config's);
:func:`layout_window` is the one the layout balances for: the window most layers use, a tie
going to full attention (None), then to the larger window, since a full-attention layer does at
least a windowed layer's work. (A model mixing full and windowed layers is balanced for its
majority only; its other layers stay exact, just less balanced.) Pass it to
:func:`hybridsp.shard_batch` (``sliding_window=layout_window(model)``; the Trainer does) or to
``init_mesh(sliding_window=)``; the forward pre-hook refuses, before any collective, documents
placed for another window on a ring of more than one slot.

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
pre-hook into documents instead (:mod:`hybridsp.integrations.transformers.padding`: left, right and
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

import torch
import transformers
from packaging.version import Version
from torch import nn

from hybridsp.attention.api import hybrid_attn_func
from hybridsp.formulas import heads_divisible
from hybridsp.integrations.transformers.binding import BINDING_ATTR as _BINDING_ATTR
from hybridsp.integrations.transformers.binding import DECODE_KWARG, DOCUMENTS_KWARG, attention_modules
from hybridsp.integrations.transformers.binding import Binding as _Binding
from hybridsp.integrations.transformers.documents import documents_from_kwargs, install_input_check
from hybridsp.integrations.transformers.linear_layers import switch_linear_layers
from hybridsp.kernels import AttentionKernel
from hybridsp.mesh.hybrid_mesh import HybridMesh

NAME = "hybridsp"
MIN_TRANSFORMERS_VERSION = "4.53.0"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5_text", "qwen3_next", "nemotron_h")


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
            f"earlier tokens is only supported through hybridsp.integrations.transformers.generation; call the model "
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
        if getattr(self, "undo_linear", None) is not None:
            self.undo_linear()
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
        mesh: the :class:`~hybridsp.mesh.hybrid_mesh.HybridMesh` the model's attention runs over.
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
    from hybridsp.integrations.transformers.vision import (
        model as vlm,  # Qwen2-VL / Qwen2.5-VL: the language model only
    )

    if vlm.is_vision_language_model(model):
        if any(hasattr(m, _BINDING_ATTR) for m in model.modules()):
            raise ValueError(f"{type(model).__name__} is already switched to {NAME}: undo the first handle first")
        return vlm.apply_to_language_model(model, mesh, backend, switch_modules)
    vlm.refuse_other_multimodal(model)
    modules = attention_modules(model)
    _check_model(model, modules, mesh)
    undo_linear = switch_linear_layers(model, mesh, backend)  # checks every linear layer before changing any
    hook = install_input_check(model, mesh, layout_window(model))
    handle = switch_modules(model, modules, _configs_of(model, modules), mesh, backend, hook)
    handle.undo_linear = undo_linear
    return handle


def switch_modules(model: nn.Module, modules: list[nn.Module], configs: list, mesh: HybridMesh, backend, hook):
    """Bind ``modules`` to ``mesh`` and name ``"hybridsp"`` in ``configs`` (no checks); the handle also
    removes ``hook``. The step :mod:`hybridsp.integrations.transformers.vision.model` shares with :func:`apply`."""
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
    # o_proj's inputs, not q_proj's rows: Qwen3.5 / Qwen3-Next double q_proj for an output gate
    heads = module.o_proj.weight.shape[1] // module.head_dim  # this rank's: H/T once tensor-parallel
    if not heads_divisible(heads, mesh.ulysses):
        raise ValueError(
            f"the model's {heads} query heads are not divisible by the Ulysses degree {mesh.ulysses}; choose a "
            f"Ulysses degree that divides {heads} and move the rest of the context ranks to the ring"
        )


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each switchable attention layer's sliding window, in module order (None: full attention)."""
    return [_module_window(m) for m in attention_modules(model)]


def _module_window(module: nn.Module) -> int | None:
    """The window a layer passes to the attention: its own (Qwen2/3), else its config's (Mistral)."""
    window = module.sliding_window if hasattr(module, "sliding_window") else getattr(module.config, "sliding_window",
                                                                                    None)
    return None if window is None else int(window)


def layout_window(model: nn.Module) -> int | None:
    """The window ``layout="balanced"`` balances ``model``'s work for (Note [layout window]): the
    one most layers use; ties to None (full attention), then to the larger window."""
    windows = layer_windows(model)
    if not windows:
        return None
    counts = {w: windows.count(w) for w in windows}
    return max(counts, key=lambda w: (counts[w], w is None, w or 0))


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
