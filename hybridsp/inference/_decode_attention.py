"""Attention of a few new queries over a K/V cache sharded across the context group.

Shape legend: B batch, T new tokens (1 per decode step), H query heads, Hkv K/V heads,
L tokens in this rank's cache shard (may be 0), D head dim.

    partial:  q [B, T, H, D] x this rank's k/v [B, L, Hkv, D]  ->  (out, lse)   local kernel
    merge:    all-gather (out, lse) packed as [B, T, H, D+1] fp32 over the C context ranks,
              merge by log-sum-exp (:mod:`hybridsp.attention._merge`), in shard order on every rank

One collective per layer, ``C x B x T x H x (D+1)`` fp32 received per rank, never a gather
of the cache. Every rank merges the same partials in the same order, so every rank gets the
same output bit for bit (the decoded token's hidden state stays replicated).

Masks: by default every cached key is visible to every query (a decode step's token comes
after everything cached). ``query_positions`` / ``key_positions`` with ``causal=True`` (for
T > 1 new tokens) and ``window`` (a sliding window: key visible iff ``0 <= q - k < window``,
Hugging Face's convention) restrict that; the masked path gathers only the keys some query
can see and does the math in fp32.

Memory: the unmasked path hands the shard to the kernel as it lies in the cache (no copy, no
upcast) when the kernel reads GQA K/V natively: the CPU fused kernel and flash-attn do; the
``torch`` backend on CUDA expands K/V heads first (a transient copy of the shard, H/Hkv times
its size, per layer), so on GPUs prefer flash-attn (``backend="auto"`` picks it for fp16/bf16).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridsp._types import BackendName
from hybridsp.attention._merge import merge_blocks
from hybridsp.attention._sinks import merge_sinks
from hybridsp.kernels import AttentionKernel, check_qkv, default_softmax_scale, get_kernel
from hybridsp.kernels._base import expand_kv_heads, lse_for_backward, no_key_result
from hybridsp.mesh._hybrid_mesh import HybridMesh


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: HybridMesh,
    softmax_scale: float | None = None,
    backend: BackendName | AttentionKernel = "auto",
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    window: int | None = None,
    key_mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact attention of the new queries over the whole sharded cache of the context group.

    Args:
        q: [B, T, H, D] the new tokens' queries, the same on every context rank.
        k, v: [B, L, Hkv, D] this rank's cache shard (views are fine; L may differ per rank, be 0).
        mesh: the mesh whose ``context_group`` holds the shards.
        softmax_scale: defaults to 1/sqrt(D).
        backend: the local kernel for the unmasked path (``auto``, ``torch``, ``flash``, ``reference``).
        query_positions: [T] global positions of the new tokens (needed for ``window`` or T > 1).
        key_positions: [L] global positions of this rank's cached tokens (same condition).
        window: sliding window in tokens, or None.
        key_mask: [B, L] bool, False for this rank's cached keys a row must not see (the left
            padding of a batch of prompts), or None.
        sinks: [H] learned sinks (GPT-OSS), merged once per row after the context merge
            (:mod:`hybridsp.attention._sinks`), or None.
        softcap: logit soft-capping (Gemma 2), computed by the fp32 masked path, or None.

    Returns:
        out [B, T, H, Dv] in q's dtype (Dv: v's head dim), identical on every context rank.
    """
    out, lse = local_decode_attention(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        backend=backend,
        query_positions=query_positions,
        key_positions=key_positions,
        window=window,
        key_mask=key_mask,
        softcap=softcap,
    )
    out, lse = _merged_with_lse(out, lse, mesh)
    if sinks is not None:
        out, _ = merge_sinks(out, lse, sinks)
    return out.to(q.dtype)


def local_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    backend: BackendName | AttentionKernel = "auto",
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    window: int | None = None,
    key_mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial: (out [B, T, H, Dv], lse [B, H, T] fp32); a row that sees no key gives 0, -inf.
    ``softcap`` (Gemma 2) sends every call to the fp32 masked path, which caps the scores."""
    check_qkv(q, k, v, causal=False)
    scale = default_softmax_scale(q.shape[-1], softmax_scale)
    visible = _with_key_mask(
        _visibility(q.shape[1], k.shape[1], query_positions, key_positions, window),
        key_mask,
        q.shape[0],
        q.shape[1],
        k.shape[1],
    )  # None, [T, L] or [B, T, L]
    if k.shape[1] == 0 or (visible is not None and not bool(visible.any())):
        return no_key_result(q, torch.float32, v.shape[-1])
    if softcap is None and (visible is None or bool(visible.all())):
        kernel = get_kernel(backend, device=q.device, dtype=q.dtype)
        return kernel.forward(q, k, v, causal=False, softmax_scale=scale)
    if visible is None:
        visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device)  # [T, L]
    return _masked_attention(q, k, v, visible, scale, softcap)


def _visibility(
    t: int, length: int, query_positions: torch.Tensor | None, key_positions: torch.Tensor | None, window: int | None
) -> torch.Tensor | None:
    """[T, L] bool: which cached key each new query sees; None when all are visible."""
    if window is None and t == 1:
        return None
    if query_positions is None or key_positions is None:
        raise ValueError(
            f"decode attention with {t} new tokens or a window ({window}) needs query_positions [T] and "
            f"key_positions [L] to build the mask; got {query_positions is not None} / {key_positions is not None}"
        )
    if query_positions.shape != (t,) or key_positions.shape != (length,):
        raise ValueError(
            f"query_positions must be [{t}] and key_positions [{length}]; got {tuple(query_positions.shape)} and "
            f"{tuple(key_positions.shape)}"
        )
    distance = query_positions[:, None] - key_positions[None, :]  # [T, L]
    visible = distance >= 0
    if window is not None:
        visible &= distance < window
    return visible


def _with_key_mask(
    visible: torch.Tensor | None, key_mask: torch.Tensor | None, batch: int, t: int, length: int
) -> torch.Tensor | None:
    """``visible`` ([T, L] or None) restricted per row by ``key_mask`` [B, L]: [B, T, L], or unchanged."""
    if key_mask is None:
        return visible
    if tuple(key_mask.shape) != (batch, length) or key_mask.dtype != torch.bool:
        raise ValueError(
            f"key_mask must be a bool tensor [B, L] = [{batch}, {length}]; got {key_mask.dtype} "
            f"of shape {tuple(key_mask.shape)}"
        )
    if bool(key_mask.all()):
        return visible
    base = torch.ones(t, length, dtype=torch.bool, device=key_mask.device) if visible is None else visible  # [T, L]
    return base[None] & key_mask[:, None, :]  # [B, T, L]


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention over the keys some query sees (``visible`` [T, L] or per row [B, T, L]):
    (out [B, T, H, D] in q's dtype, lse [B, H, T])."""
    per_row = visible if visible.dim() == 3 else visible[None]  # [B or 1, T, L]
    keep = per_row.any(dim=1).any(dim=0).nonzero().squeeze(1)  # [L'] columns visible to some query
    keys = expand_kv_heads(k.index_select(1, keep), q.shape[2]).float()  # [B, L', H, D]
    values = expand_kv_heads(v.index_select(1, keep), q.shape[2]).float()  # [B, L', H, D]
    scores = torch.einsum("bthd,blhd->bhtl", q.float(), keys) * scale  # [B, H, T, L']
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~per_row[:, None][..., keep], -torch.inf)  # mask [B or 1, 1, T, L']
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, T]
    probs = torch.exp(scores - lse_for_backward(lse).unsqueeze(-1))  # [B, H, T, L']; rows without keys: 0
    out = torch.einsum("bhtl,blhd->bthd", probs, values)  # [B, T, H, D]
    return out.to(q.dtype), lse


def merge_over_context(out: torch.Tensor, lse: torch.Tensor, mesh: HybridMesh) -> torch.Tensor:
    """All context ranks' partials merged by LSE: out [B, T, H, Dv], lse [B, H, T] -> fp32 [B, T, H, Dv].

    One ``all_gather`` of ``[B, T, H, Dv+1]`` fp32 over ``mesh.context_group``; merged in shard
    order, so the result is bitwise identical on every rank.
    """
    return _merged_with_lse(out, lse, mesh)[0]


def _merged_with_lse(out: torch.Tensor, lse: torch.Tensor, mesh: HybridMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_over_context` and the merged lse [B, H, T] (fp32)."""
    if mesh.context == 1:
        return out.float(), lse.float()
    packed = torch.cat([out.float(), lse.transpose(1, 2).unsqueeze(-1)], dim=-1).contiguous()  # [B, T, H, Dv+1]
    gathered = [torch.empty_like(packed) for _ in range(mesh.context)]
    dist.all_gather(gathered, packed, group=mesh.context_group)  # ascending global rank order
    by_rank = dict(zip(sorted(mesh.context_members()), gathered))
    parts = [by_rank[member] for member in mesh.context_members()]  # shard order r * U + u
    outs = [part[..., :-1] for part in parts]  # each [B, T, H, Dv]
    lses = [part[..., -1].transpose(1, 2) for part in parts]  # each [B, H, T]
    return merge_blocks(outs, lses)
