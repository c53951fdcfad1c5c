"""The sharded forwards of the recurrent mixers that :mod:`hybridsp.integrations.transformers._linear_layers`
switches: :func:`delta_rule_forward` (Gated DeltaNet) and :func:`mamba2_forward` (Mamba-2), each
``[B, S/C, hidden] -> [B, S/C, hidden]`` over the mesh, the one-token decode steps of a generation
(every head, local), and the per-call helpers they share (documents, padding, this rank's conv channels).

Note [documents and caches]: the batch's :class:`~hybridsp.layout._documents.Documents` reach the
mixers under the model-call keyword ``hybridsp_documents`` (the Qwen3.5 / Qwen3-Next / Nemotron-H
decoder layers pass their keyword arguments through, and the attention switch's forward pre-hook
derives them when the caller gave none). Packed documents restart the state and the conv window.
A cache the model builds by default (``use_cache``) is left untouched: these forwards never take
transformers' in-place one-token decode path. Generation (:func:`hybridsp.integrations.transformers.generate`)
hands them a cache carrying :class:`~hybridsp.linear_attention._decode.LinearStates`: the sharded prefill
fills each layer's final state and conv tail, replicated on every context rank, and each decode
step (the token replicated) runs the whole layer locally with the model's own single-step math
(Note [where the decode states live] there). Any other call that continues a cache (it holds
more tokens than the call brings) is refused, and so are left-padded prompts to generate.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridsp.integrations.transformers._binding import DECODE_KWARG, DOCUMENTS_KWARG
from hybridsp.integrations.transformers._documents import documents_from_kwargs
from hybridsp.linear_attention._conv import halo_conv
from hybridsp.linear_attention._decode import LinearStates, conv_step, prompt_conv_tail, prompt_final_state
from hybridsp.linear_attention._delta_rule import GatedDeltaRule
from hybridsp.linear_attention._heads import to_sequence, to_slot_heads, unit_range
from hybridsp.linear_attention._mamba2 import Mamba2Scan
from hybridsp.linear_attention._passing import pass_states
from hybridsp.linear_attention._slots import slot_call
from hybridsp.mesh._hybrid_mesh import HybridMesh

# --------------------------------------------------------------------------- per-call helpers


def _refuse_continuation(module: nn.Module, hidden_states: torch.Tensor, cache, kwargs: dict) -> None:
    """Raise ValueError for a decode step or a call continuing a cache (Note [documents and caches])."""
    continued = cache is not None and _cached_tokens(cache) > hidden_states.shape[1]
    if kwargs.get(DECODE_KWARG) is not None or continued:
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}): generation and cached decoding "
            f"are not supported for linear-attention layers under hybridsp; undo the switch and call model.generate "
            f"on one process, or call the model with use_cache=False"
        )


def _prompt_states(module: nn.Module, hidden_states: torch.Tensor, cache, kwargs: dict) -> LinearStates | None:
    """The generation's :class:`LinearStates` (a hybridsp prefill or decode step), else None after refusing
    any other continued cache (Note [documents and caches])."""
    store = getattr(cache, "linear_states", None)
    if isinstance(store, LinearStates):
        if module.layer_idx in store.layers and kwargs.get(DECODE_KWARG) is None:
            raise ValueError(
                f"{type(module).__name__} (layer {module.layer_idx}): the generation cache already holds this layer's "
                f"prompt state, but the call carries no {DECODE_KWARG}= step (its decoder layer must pass the model "
                f"call's keyword arguments on to the mixer); decode with hybridsp.integrations.transformers._generation.decode_step"
            )
        return store
    _refuse_continuation(module, hidden_states, cache, kwargs)
    return None


def _module_function(module: nn.Module, name: str):
    return getattr(sys.modules.get(type(module).__module__), name, None)


def _cached_tokens(cache) -> int:
    """Tokens a cache's attention layers hold (0 for a cache of linear layers only, which cannot say)."""
    try:
        return cache.get_seq_length()
    except ValueError:
        return 0


def _documents(kwargs: dict, batch: int, local: int, mesh: HybridMesh):
    """The batch's documents (the keyword, else ``cu_seq_lens_q/k``, else one per row)."""
    documents = kwargs.get(DOCUMENTS_KWARG)
    if documents is None:
        documents = documents_from_kwargs(kwargs, batch, local * mesh.context)
    return slot_call(mesh, documents, batch, local * mesh.context)


def _masked(hidden_states: torch.Tensor, attention_mask) -> torch.Tensor:
    """Padding positions zeroed as the unmodified layer does (a 2-D mask of this rank's tokens)."""
    if torch.is_tensor(attention_mask) and attention_mask.dim() == 2:
        return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    return hidden_states


def _channels(*pieces: tuple[int, int, int]) -> torch.Tensor:
    """Rows ``offset + [lo, hi)`` of each ``(offset, lo, hi)``, concatenated: int64."""
    return torch.cat([torch.arange(offset + lo, offset + hi) for offset, lo, hi in pieces])


def _activation(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _conv(module, x: torch.Tensor, rows: torch.Tensor, call, mesh: HybridMesh, dtype) -> torch.Tensor:
    """The module's conv + activation on this rank's channels ``rows`` of the slot's tokens."""
    rows = rows.to(x.device)
    weight = module.conv1d.weight.squeeze(1)[rows]  # [C_local, K]
    bias = None if module.conv1d.bias is None else module.conv1d.bias[rows]
    return _activation(module.activation)(halo_conv(x, weight, bias, call, mesh.comm_counter)).to(dtype)


# --------------------------------------------------------------------------- Gated DeltaNet


def _delta_projections(module, hidden_states: torch.Tensor):
    """q, k [B, L, Hk, dk]; v, z [B, L, Hv, dv]; b, a [B, L, Hv] before the conv."""
    batch, length, _ = hidden_states.shape
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: per key-head interleaved fused projections
        q, k, v, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states)
        )
        return q, k, v, z, b, a
    mixed = module.in_proj_qkv(hidden_states)  # [B, L, 2 Hk dk + Hv dv]
    q, k, v = mixed.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(batch, length, module.num_k_heads, module.head_k_dim)  # [B, L, Hk, dk]
    k = k.reshape(batch, length, module.num_k_heads, module.head_k_dim)  # [B, L, Hk, dk]
    v = v.reshape(batch, length, module.num_v_heads, module.head_v_dim)  # [B, L, Hv, dv]
    z = module.in_proj_z(hidden_states).reshape(batch, length, module.num_v_heads, module.head_v_dim)  # [B, L, Hv, dv]
    return q, k, v, z, module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)


def delta_rule_forward(
    module, mesh: HybridMesh, kernel, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs
) -> torch.Tensor:
    """A Gated DeltaNet's forward over the mesh: [B, S/C, hidden] -> [B, S/C, hidden] (a generation
    prefill also fills its :class:`LinearStates`; a decode step runs :func:`_delta_decode`)."""
    store = _prompt_states(module, hidden_states, cache, kwargs)
    hidden_states = _masked(hidden_states, attention_mask)
    if store is not None and kwargs.get(DECODE_KWARG) is not None:
        return _delta_decode(module, store, hidden_states)
    batch, length, _ = hidden_states.shape
    hk, hv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    group = hv // hk  # value heads per key head
    q, k, v, z, b, a = _delta_projections(module, hidden_states)
    parts = [
        q,
        k,
        v.reshape(batch, length, hk, group * dv),
        b.reshape(batch, length, hk, group),
        a.reshape(batch, length, hk, group),
    ]  # each [B, L, Hk, f]
    pre = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1) if store is not None else None  # [B, L, C]
    q, k, v, b, a = to_slot_heads(parts, mesh)  # each [B, Ls, hk, f], hk = Hk / U
    slot_len, local_k = q.shape[1], q.shape[2]
    lo, hi = unit_range(hk, mesh)
    call = _documents(kwargs, batch, length, mesh)
    rows = _channels(
        (0, lo * dk, hi * dk),
        (module.key_dim, lo * dk, hi * dk),
        (2 * module.key_dim, lo * group * dv, hi * group * dv),
    )
    mixed = _conv(
        module, torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1), rows, call, mesh, hidden_states.dtype
    )  # [B, Ls, C_local]
    q, k, v = mixed.split([local_k * dk, local_k * dk, local_k * group * dv], dim=-1)
    heads = slice(lo * group, hi * group)
    a = a.reshape(batch, slot_len, local_k * group)  # [B, Ls, hv]
    inputs = {
        "q": q.reshape(batch, slot_len, local_k, dk),  # [B, Ls, hk, dk]
        "k": k.reshape(batch, slot_len, local_k, dk),  # [B, Ls, hk, dk]
        "v": v.reshape(batch, slot_len, local_k * group, dv),  # [B, Ls, hv, dv]
        "g": -module.A_log[heads].float().exp() * F.softplus(a.float() + module.dt_bias[heads]),  # [B, Ls, hv]
        "beta": b.reshape(batch, slot_len, local_k * group).sigmoid(),  # [B, Ls, hv]
    }
    chained: list[Any] | None = [] if store is not None else None
    out = pass_states(GatedDeltaRule(kernel, dv), inputs, call, mesh.comm_counter, chained)  # [B, Ls, hv, dv]
    if store is not None:
        assert pre is not None and chained is not None  # both set with the store
        store.layers[module.layer_idx] = (
            prompt_conv_tail(pre, store, module.conv1d.weight.shape[-1], mesh),
            prompt_final_state(GatedDeltaRule(kernel, dv), inputs, call, chained[0], store, heads, hv, mesh),
        )
    out = to_sequence(out, mesh)  # [B, L, Hv, dv]
    out = module.norm(out.reshape(-1, dv), z.reshape(-1, dv)).reshape(batch, length, -1)  # [B, L, Hv dv]
    return module.out_proj(out)


# --------------------------------------------------------------------------- Mamba-2


def mamba2_forward(
    module, mesh: HybridMesh, kernel, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs
) -> torch.Tensor:
    """A Mamba-2 mixer's forward over the mesh: [B, S/C, hidden] -> [B, S/C, hidden] (a generation
    prefill also fills its :class:`LinearStates`; a decode step runs :func:`_mamba2_decode`)."""
    store = _prompt_states(module, hidden_states, cache, kwargs)
    hidden_states = _masked(hidden_states, attention_mask)
    if store is not None and kwargs.get(DECODE_KWARG) is not None:
        return _mamba2_decode(module, store, hidden_states)
    dtype = hidden_states.dtype
    batch, length, _ = hidden_states.shape
    inner, groups, state, heads, dim = (
        module.intermediate_size,
        module.n_groups,
        module.ssm_state_size,
        module.num_heads,
        module.head_dim,
    )
    per_group = heads // groups
    gate, xbc, dt = module.in_proj(hidden_states).split([inner, module.conv_dim, heads], dim=-1)
    x, bm, cm = xbc.split([inner, groups * state, groups * state], dim=-1)
    pre = xbc if store is not None else None  # [B, L, C]
    parts = [
        x.reshape(batch, length, groups, per_group * dim),
        bm.reshape(batch, length, groups, state),
        cm.reshape(batch, length, groups, state),
        dt.reshape(batch, length, groups, per_group),
    ]
    x, bm, cm, dt = to_slot_heads(parts, mesh)  # each [B, Ls, g, f], g = G / U
    slot_len, local = x.shape[1], x.shape[2]
    lo, hi = unit_range(groups, mesh)
    call = _documents(kwargs, batch, length, mesh)
    rows = _channels(
        (0, lo * per_group * dim, hi * per_group * dim),
        (inner, lo * state, hi * state),
        (inner + groups * state, lo * state, hi * state),
    )
    mixed = _conv(
        module, torch.cat([x.flatten(2), bm.flatten(2), cm.flatten(2)], dim=-1), rows, call, mesh, dtype
    )  # [B, Ls, C_local]
    x, bm, cm = mixed.split([local * per_group * dim, local * state, local * state], dim=-1)
    own = slice(lo * per_group, hi * per_group)
    scan = Mamba2Scan(
        kernel,
        -torch.exp(module.A_log[own].float()),
        module.D[own],
        module.dt_bias[own],
        module.time_step_limit,
        module.chunk_size,
        state,
    )
    inputs = {
        "x": x.reshape(batch, slot_len, local * per_group, dim),  # [B, Ls, h, P]
        "dt": dt.reshape(batch, slot_len, local * per_group),  # [B, Ls, h]
        "B": bm.reshape(batch, slot_len, local, state),  # [B, Ls, g, N]
        "C": cm.reshape(batch, slot_len, local, state),  # [B, Ls, g, N]
    }
    chained: list[Any] | None = [] if store is not None else None
    out = pass_states(scan, inputs, call, mesh.comm_counter, chained)  # [B, Ls, h, P]
    if store is not None:
        assert pre is not None and chained is not None  # both set with the store
        store.layers[module.layer_idx] = (
            prompt_conv_tail(pre, store, module.conv1d.weight.shape[-1], mesh),
            prompt_final_state(scan, inputs, call, chained[0], store, own, heads, mesh),
        )
    out = to_sequence(out, mesh).reshape(batch, length, inner)  # [B, L, H P]
    return module.out_proj(module.norm(out, gate).to(dtype))


# --------------------------------------------------------------------------- decode steps (every head, local)


def _conv_decode(module, store: LinearStates, pre: torch.Tensor, dtype) -> torch.Tensor:
    """The conv + activation of one token [B, 1, C] from the layer's tail (which moves on)."""
    tail, state = store.layers[module.layer_idx]
    out, tail = conv_step(tail, pre, module.conv1d.weight.squeeze(1), module.conv1d.bias)  # [B, 1, C]
    store.layers[module.layer_idx] = (tail, state)
    return _activation(module.activation)(out).to(dtype)


def _delta_decode(module, store: LinearStates, hidden_states: torch.Tensor) -> torch.Tensor:
    """One token [B, 1, hidden] (the same on every context rank) through the whole layer, all heads, with the
    model's own recurrent step (``torch_recurrent_gated_delta_rule``, else its chunked kernel)."""
    batch = hidden_states.shape[0]
    dk, dv = module.head_k_dim, module.head_v_dim
    q, k, v, z, b, a = _delta_projections(module, hidden_states)
    pre = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)  # [B, 1, C]
    mixed = _conv_decode(module, store, pre, hidden_states.dtype)  # [B, 1, C]
    q, k, v = mixed.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    step = _module_function(module, "torch_recurrent_gated_delta_rule") or _module_function(
        module, "torch_chunk_gated_delta_rule"
    )
    tail, state = store.layers[module.layer_idx]
    out, state = step(
        q.reshape(batch, 1, -1, dk),
        k.reshape(batch, 1, -1, dk),
        v.reshape(batch, 1, -1, dv),  # [B, 1, H, d]
        g=-module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias),
        beta=b.sigmoid(),
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # [B, 1, Hv, dv]
    store.layers[module.layer_idx] = (tail, state.float())
    out = module.norm(out.reshape(-1, dv), z.reshape(-1, dv)).reshape(batch, 1, -1)  # [B, 1, Hv dv]
    return module.out_proj(out)


def _mamba2_decode(module, store: LinearStates, hidden_states: torch.Tensor) -> torch.Tensor:
    """One token [B, 1, hidden] through the whole mixer, all heads, with the model's own
    ``mamba2_selective_state_update`` (which updates the state in place)."""
    batch, dtype = hidden_states.shape[0], hidden_states.dtype
    inner, groups, size, heads, dim = (
        module.intermediate_size,
        module.n_groups,
        module.ssm_state_size,
        module.num_heads,
        module.head_dim,
    )
    gate, xbc, dt = module.in_proj(hidden_states).split([inner, module.conv_dim, heads], dim=-1)
    x, bm, cm = _conv_decode(module, store, xbc, dtype).split([inner, groups * size, groups * size], dim=-1)
    _, state = store.layers[module.layer_idx]
    update = _module_function(module, "mamba2_selective_state_update")
    out = update(
        state,
        x.reshape(batch, heads, dim),
        dt.transpose(1, 2).expand(-1, -1, dim),  # [B, H, P]
        (-torch.exp(module.A_log.float()))[:, None, None].expand(-1, dim, size),  # [H, P, N]
        bm.reshape(batch, groups, size),
        cm.reshape(batch, groups, size),  # [B, G, N]
        module.D[:, None].expand(-1, dim),
        z=None,
        dt_bias=module.dt_bias[:, None].expand(-1, dim),
        dt_softplus=True,
    )  # [B, H, P]
    return module.out_proj(module.norm(out.reshape(batch, 1, -1), gate).to(dtype))
