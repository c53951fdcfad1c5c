"""The batch's packed documents for a switched HF model: the forward pre-hook and the kwargs forms.

:func:`install_input_check` installs the model's forward pre-hook (Note [packed documents] in
:mod:`hybridsp.integrations.transformers`): it refuses a sharded call without ``position_ids`` or
with ``labels`` and hands every layer one :class:`~hybridsp.layout._documents.Documents` under the
``hybridsp_documents`` keyword: the caller's (``shard_batch(...)["documents"]``), else derived once
per forward from ``cu_seq_lens_q/k``, a 2-D padding mask, or the restarts of ``position_ids``.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from hybridsp.integrations.transformers._binding import DECODE_KWARG, DOCUMENTS_KWARG
from hybridsp.integrations.transformers._padding import padded_cu_seq_lens
from hybridsp.layout._documents import Documents, as_documents, chunked_documents
from hybridsp.mesh._hybrid_mesh import HybridMesh


def install_input_check(model: nn.Module, mesh: HybridMesh, window: int | None = None):
    """The model's forward pre-hook (None if its forward takes no ``position_ids``): when ``C > 1``
    it refuses missing ``position_ids`` and given ``labels``; always it derives the packed
    documents of this forward from ``position_ids`` (Note [packed documents]) and refuses
    documents placed for another window than the model's ``window`` (Note [layout window])."""
    signature = inspect.signature(model.forward)
    if "position_ids" not in signature.parameters:
        return None

    def check(module, args, kwargs):
        arguments = signature.bind_partial(*args, **kwargs).arguments
        if mesh.context > 1:
            _refuse_missing_positions_or_labels(arguments)
        if kwargs.get(DECODE_KWARG) is not None:  # a decode step: every rank holds the same new tokens
            return None
        found = _with_documents(args, kwargs, _batch_positions(arguments), mesh, arguments.get("attention_mask"))
        documents = (kwargs if found is None else found[1]).get(DOCUMENTS_KWARG)
        if isinstance(documents, Documents):
            check_placement_window(documents, mesh, window)
        return found

    return model.register_forward_pre_hook(check, with_kwargs=True)


def check_placement_window(documents: Documents, mesh: HybridMesh, window: int | None) -> None:
    """Raise ValueError, quoting both windows, when a layout that places by document balanced the
    packed ``documents`` for another window than the model's (Note [layout window])."""
    if not mesh.token_layout.uses_documents or mesh.ring == 1 or not documents.packed:
        return
    placed = mesh.sliding_window if documents.window is None else documents.window
    if placed != window:
        raise ValueError(
            f"the {mesh.layout} layout placed this batch's tokens for sliding_window={placed} but the model's "
            f"layers use {window} (hybridsp.integrations.transformers.layout_window(model)): shard with "
            f"shard_batch(batch, mesh, sliding_window={window}) or init_mesh(..., sliding_window={window})"
        )


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


def _with_documents(args: tuple, kwargs: dict, position_ids, mesh: HybridMesh, mask=None):
    """The hook's result: kwargs plus this forward's :class:`~hybridsp.layout._documents.Documents` under
    ``hybridsp_documents`` (derived once per forward, shared by every layer), or None. A 2-D
    ``attention_mask`` adds its padding as segments (:mod:`hybridsp.integrations.transformers._padding`)."""
    if kwargs.get(DOCUMENTS_KWARG) is not None:
        return None  # the caller passed shard_batch's documents: nothing to derive, no collective
    if any(kwargs.get(name) is not None for name in _DOC_KWARGS):
        if position_ids is None:
            return None  # the attention converts cu_seq_lens_q/k itself
        batch, seq_len = position_ids.shape[0], position_ids.shape[1] * mesh.context
        documents = as_documents(documents_from_kwargs(kwargs, batch, seq_len), batch, seq_len)
    elif torch.is_tensor(mask) and mask.dim() == 2:
        documents = _documents_of_positions(position_ids, mesh, mask)
    elif position_ids is None:
        return None
    else:
        documents = _documents_of_positions(position_ids, mesh)
    return args, {**kwargs, DOCUMENTS_KWARG: documents}


def _documents_of_positions(position_ids: torch.Tensor | None, mesh: HybridMesh, mask=None) -> Documents:
    """The batch's documents from this rank's ``position_ids`` [B, S/C] and, if given, its 2-D padding
    ``mask`` [B, S/C] (``position_ids`` may then be None on a 1 x 1 mesh); one collective when C > 1."""
    local = position_ids if position_ids is not None else mask
    batch, seq_len = local.shape[0], local.shape[1] * mesh.context
    if mesh.token_layout.uses_documents and mesh.context > 1:
        raise ValueError(
            f"the {mesh.layout} layout places tokens by document, so the documents cannot be found from the "
            f"sharded position_ids: pass hybridsp_documents=shard_batch(...)['documents'] to the model"
        )
    if mask is not None:
        cu_seq_lens = padded_cu_seq_lens(mask, position_ids, mesh)
    else:
        assert position_ids is not None  # _with_documents passes no mask only with position_ids
        cu_seq_lens = global_cu_seq_lens(position_ids, mesh)
    if cu_seq_lens is None:
        return Documents(batch, seq_len)
    return as_documents(documents_from_kwargs({"cu_seq_lens_q": cu_seq_lens}, batch, seq_len), batch, seq_len)


def global_cu_seq_lens(position_ids: torch.Tensor, mesh: HybridMesh) -> torch.Tensor | None:
    """Flattened global document boundaries (int64 ``[N + 1]`` over the unsharded ``B x S`` tokens)
    from this rank's ``position_ids`` [B, S/C] (or [1, S/C]); None if no row is packed.

    A document starts at every row's first token and wherever the position is 0. One
    ``all_gather`` over ``mesh.context_group`` when ``C > 1`` (every context rank must call it).
    """
    from hybridsp.attention._api import gather_sequence  # the integration's only collective helper

    starts = (position_ids == 0).to(torch.int32)  # [B, S/C]
    full = gather_sequence(starts, mesh) if mesh.context > 1 else starts  # [B, S]
    full[:, 0] = 1
    if int(full.sum()) == full.shape[0]:
        return None
    flat = full.reshape(-1).nonzero().flatten()  # [N] flattened starts (each row's 0 included)
    return torch.cat([flat, flat.new_tensor([full.numel()])]).long()  # [N + 1]


def documents_from_kwargs(kwargs: dict, batch: int, seq_len: int):
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
        torch.tensor([e - b * seq_len for e in edges if b * seq_len <= e <= (b + 1) * seq_len]) for b in range(batch)
    ]


def layer_documents(documents, chunk: int | None, batch: int, seq_len: int):
    """The documents one layer attends within (Note [chunked layers]): the batch's (any form
    :func:`hybridsp.hybrid_attn_func` takes, or None), cut every ``chunk`` tokens on a chunked-attention layer.

    Note [chunked layers]: Llama 4's chunked local attention lets a token see the keys of its own chunk of
    ``attention_chunk_size`` tokens only (transformers builds it as a mask; hybridsp builds none). A chunk is a
    block-diagonal mask, so it is a document: the layer gets the batch's documents with a cut every ``chunk``
    tokens from each document's start (for an unpacked row, transformers' chunks exactly; for a packed row,
    the chunks of each document run alone). The cut documents are kept in the batch's memo, so every chunked
    layer of a forward shares one plan.
    """
    if chunk is None:
        return documents
    return chunked_documents(as_documents(documents, batch, seq_len), chunk)
