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
:func:`register` refuses if someone added one), so no mask tensor is built; a 2D padding
mask passed to the model is dropped, which is exact for right padding once the loss ignores
the padding (see :mod:`hybridsp.batch`). Causal masking is done by the hybrid attention
itself, by global token position, with ``causal=True``.

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

import inspect

import torch
import transformers
from packaging.version import Version
from torch import nn

from hybridsp.attention import hybrid_attn_func
from hybridsp.documents import Documents, as_documents
from hybridsp.formulas import heads_divisible
from hybridsp.integrations.binding import BINDING_ATTR as _BINDING_ATTR  # the names hf_generate shares
from hybridsp.integrations.binding import DECODE_KWARG
from hybridsp.integrations.binding import Binding as _Binding
from hybridsp.kernels import AttentionKernel
from hybridsp.mesh import HybridMesh

NAME = "hybridsp"
MIN_TRANSFORMERS_VERSION = "4.53.0"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")
DOCUMENTS_KWARG = "hybridsp_documents"  # the model-call kwarg that carries the batch's Documents (shard_batch)


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
        cu_seqlens = _documents_from_kwargs(kwargs, q.shape[0], q.shape[1] * binding.mesh.context)
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
    modules = [m for m in model.modules() if all(hasattr(m, part) for part in _ATTENTION_PARTS)]
    _check_model(model, modules, mesh)
    configs = _configs_of(model, modules)
    previous = [(config, config._attn_implementation) for config in configs]
    binding = _Binding(mesh, backend)
    for module in modules:
        setattr(module, _BINDING_ATTR, binding)
    for config in configs:
        config._attn_implementation = NAME
    hook = _input_check(model, mesh)
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


def _input_check(model: nn.Module, mesh: HybridMesh):
    """The model's forward pre-hook (None if its forward takes no ``position_ids``): when ``C > 1``
    it refuses missing ``position_ids`` and given ``labels``; always it derives the packed
    documents of this forward from ``position_ids`` (Note [packed documents])."""
    signature = inspect.signature(model.forward)
    if "position_ids" not in signature.parameters:
        return None

    def check(module, args, kwargs):
        arguments = signature.bind_partial(*args, **kwargs).arguments
        if mesh.context > 1:
            _refuse_missing_positions_or_labels(arguments)
        if kwargs.get(DECODE_KWARG) is not None:  # a decode step: every rank holds the same new tokens
            return None
        return _with_documents(args, kwargs, _batch_positions(arguments), mesh)

    return model.register_forward_pre_hook(check, with_kwargs=True)


def _refuse_missing_positions_or_labels(arguments: dict) -> None:
    """Raise ValueError for a sharded call without position_ids or with labels."""
    if arguments.get("position_ids") is None:
        raise ValueError(
            "a model switched to hybridsp needs position_ids: the global positions of this rank's tokens "
            "(shard_batch(...)['position_ids']); the default 0..S_local-1 would give wrong RoPE angles"
        )
    if arguments.get("labels") is not None:
        raise ValueError(
            "do not pass labels to a model switched to hybridsp: transformers would shift them inside each "
            "shard. Take shard_batch(...)['shift_labels'] to hybridsp.sharded_cross_entropy(logits, ..., mesh)"
        )


# --------------------------------------------------------------------------- packed documents

_DOC_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")


def _batch_positions(arguments: dict) -> torch.Tensor | None:
    """position_ids expanded to the batch's rows ([1, S] broadcasts), or None."""
    positions = arguments.get("position_ids")
    tokens = arguments.get("input_ids")
    tokens = arguments.get("inputs_embeds") if tokens is None else tokens
    if positions is None:
        return None
    positions = positions.unsqueeze(0) if positions.dim() == 1 else positions  # [S] -> [1, S]
    if tokens is None or positions.shape[0] != 1:
        return positions
    return positions.expand(tokens.shape[0], -1)  # [B, S]


def _with_documents(args: tuple, kwargs: dict, position_ids, mesh: HybridMesh):
    """The hook's result: kwargs plus this forward's :class:`~hybridsp.documents.Documents` under
    ``hybridsp_documents`` (derived once per forward, shared by every layer), or None."""
    if kwargs.get(DOCUMENTS_KWARG) is not None:
        return None  # the caller passed shard_batch's documents: nothing to derive, no collective
    tokens = position_ids if position_ids is not None else None
    if any(kwargs.get(name) is not None for name in _DOC_KWARGS):
        if tokens is None:
            return None  # the attention converts cu_seq_lens_q/k itself
        batch, seq_len = tokens.shape[0], tokens.shape[1] * mesh.context
        documents = as_documents(_documents_from_kwargs(kwargs, batch, seq_len), batch, seq_len)
    elif position_ids is None:
        return None
    else:
        documents = _documents_of_positions(position_ids, mesh)
    return args, {**kwargs, DOCUMENTS_KWARG: documents}


def _documents_of_positions(position_ids: torch.Tensor, mesh: HybridMesh) -> Documents:
    """The batch's documents from this rank's ``position_ids`` [B, S/C] (one collective when C > 1)."""
    batch, seq_len = position_ids.shape[0], position_ids.shape[1] * mesh.context
    if mesh.token_layout.uses_documents and mesh.context > 1:
        raise ValueError(
            f"the {mesh.layout} layout places tokens by document, so the documents cannot be found from the "
            f"sharded position_ids: pass hybridsp_documents=shard_batch(...)['documents'] to the model"
        )
    cu_seq_lens = global_cu_seq_lens(position_ids, mesh)
    if cu_seq_lens is None:
        return Documents(batch, seq_len)
    return as_documents(_documents_from_kwargs({"cu_seq_lens_q": cu_seq_lens}, batch, seq_len), batch, seq_len)


def global_cu_seq_lens(position_ids: torch.Tensor, mesh: HybridMesh) -> torch.Tensor | None:
    """Flattened global document boundaries (int64 ``[N + 1]`` over the unsharded ``B x S`` tokens)
    from this rank's ``position_ids`` [B, S/C] (or [1, S/C]); None if no row is packed.

    A document starts at every row's first token and wherever the position is 0. One
    ``all_gather`` over ``mesh.context_group`` when ``C > 1`` (every context rank must call it).
    """
    from hybridsp.attention import gather_sequence  # the integration's only collective helper

    starts = (position_ids == 0).to(torch.int32)  # [B, S/C]
    full = gather_sequence(starts, mesh) if mesh.context > 1 else starts  # [B, S]
    full[:, 0] = 1
    if int(full.sum()) == full.shape[0]:
        return None
    flat = full.reshape(-1).nonzero().flatten()  # [N] flattened starts (each row's 0 included)
    return torch.cat([flat, flat.new_tensor([full.numel()])]).long()  # [N + 1]


def _documents_from_kwargs(kwargs: dict, batch: int, seq_len: int):
    """Per-row global boundaries for :func:`hybrid_attn_func` from ``cu_seq_lens_q/k``, or None.

    ``cu_seq_lens_q`` (Note [packed documents]) covers the flattened global ``B x S`` tokens;
    row boundaries are added where missing (documents never cross rows). ValueError if
    ``cu_seq_lens_q`` and ``cu_seq_lens_k`` differ or do not end at ``B x S``.
    """
    cu_q, cu_k = (kwargs.get(name) for name in _DOC_KWARGS)
    if cu_q is None and cu_k is None:
        return None
    cu_q = cu_k if cu_q is None else cu_q
    if cu_k is not None and not torch.equal(torch.as_tensor(cu_q).cpu(), torch.as_tensor(cu_k).cpu()):
        raise ValueError("hybridsp attention needs cu_seq_lens_q == cu_seq_lens_k (self-attention over documents)")
    bounds = [int(x) for x in torch.as_tensor(cu_q).tolist()]
    if not bounds or bounds[0] != 0 or bounds[-1] != batch * seq_len:
        raise ValueError(
            f"cu_seq_lens_q must run from 0 to B x S = {batch} x {seq_len} = {batch * seq_len} over the global "
            f"(unsharded) tokens of the batch; got {bounds[:4]}... ending at {bounds[-1] if bounds else None}"
        )
    edges = sorted(set(bounds) | {b * seq_len for b in range(batch + 1)})
    return [
        torch.tensor([e - b * seq_len for e in edges if b * seq_len <= e <= (b + 1) * seq_len])
        for b in range(batch)
    ]

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
