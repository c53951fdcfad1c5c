"""Band-masked attention pieces: the kernel side of :mod:`hybridsp.layout._block_plan`.

A *band* ``(lo, hi)`` (either may be None = unbounded) says that query row ``i`` of a call
sees key column ``j`` iff ``lo <= i - j <= hi``, both counted from the call's own first row
and column. Sliding windows and the window's edges inside a ring block are bands; the
block plan trims every band piece so that each row sees at least one key, but the kernels
here still return out = 0 and lse = -inf for a row that sees none.

The protocol (:class:`hybridsp.kernels._base.AttentionKernel`) declares
``forward_band(q, k, v, *, band, softmax_scale)`` and
``backward_band(dout, q, k, v, out, lse, *, band, softmax_scale)`` with the shapes of the
plain calls; every backend implements them. The functions below are the plain fp32 math
(the reference backend, and what :func:`hybridsp.kernels._select.complete_kernel` gives a user's
kernel object without band calls) and the translation of a band to flash-attn's bottom-right
``window_size``.
"""

from __future__ import annotations

import torch

from hybridsp.kernels._base import (
    Band,
    accumulation_dtype,
    apply_softcap,
    expand_kv_heads,
    lse_for_backward,
    reduce_kv_heads,
)


def band_mask(sq: int, sk: int, band: Band, device: torch.device | str | None = None) -> torch.Tensor:
    """[Sq, Sk] bool, True where row i sees column j (``lo <= i - j <= hi``)."""
    return band_mask_rows(torch.arange(sq, device=device), sk, band)


def band_mask_rows(rows: torch.Tensor, sk: int, band: Band) -> torch.Tensor:
    """[n, Sk] bool: the rows ``rows`` [n] (int) of :func:`band_mask`."""
    lo, hi = band
    diff = rows.unsqueeze(1) - torch.arange(sk, device=rows.device).unsqueeze(0)  # [n, Sk]
    visible = torch.ones(diff.shape, dtype=torch.bool, device=rows.device)
    if lo is not None:
        visible &= diff >= lo
    if hi is not None:
        visible &= diff <= hi
    return visible


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[Sq, Sk] bool -> [Sq, Sk] float mask of ``dtype``: 0 where visible, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, -torch.inf)


def rows_without_keys_to_neg_inf(lse: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """lse [B, H, Sq]: -inf on rows whose mask row is all False (some kernels say 0 or +inf there)."""
    empty = ~visible.any(dim=-1)  # [Sq]
    return lse.masked_fill(empty, -torch.inf) if bool(empty.any()) else lse


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, H, D] fp32, each K/V head repeated for its query group."""
    return expand_kv_heads(x.to(accumulation_dtype(x.dtype)), heads)  # [B, S, H, D]


SCORE_BLOCK_BYTES = 64 * 2**20  # the math kernels' fp32 score block per step (query rows are chunked to fit)


def row_chunks(batch: int, heads: int, sq: int, sk: int) -> list[slice]:
    """Query-row slices whose fp32 scores [B, H, rows, Sk] fit :data:`SCORE_BLOCK_BYTES` (at least one row)."""
    rows = max(1, SCORE_BLOCK_BYTES // max(1, 4 * batch * heads * sk))
    return [slice(start, min(start + rows, sq)) for start in range(0, sq, rows)]


def _masked_scores(
    q: torch.Tensor, k_full: torch.Tensor, band: Band, scale: float, softcap: float | None = None, first_row: int = 0
) -> torch.Tensor:
    """fp32 scores [B, H, n, Sk] of the n query rows ``q`` [B, n, H, D] that start at row ``first_row``
    of the piece, soft-capped when ``softcap`` is set, with the band applied (-inf outside)."""
    scores = apply_softcap(torch.einsum("bqhd,bkhd->bhqk", q.to(k_full.dtype), k_full) * scale, softcap)
    rows = torch.arange(first_row, first_row + q.shape[1], device=q.device)
    return scores.masked_fill(~band_mask_rows(rows, k_full.shape[1], band), -torch.inf)  # [B, H, n, Sk]


def math_forward_band(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, band: Band, softmax_scale: float, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Sq, H, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] -> (out [B, Sq, H, Dv] in q's dtype,
    lse [B, H, Sq] fp32); scores soft-capped by ``softcap`` (:mod:`hybridsp.kernels._base`) when set.
    Query rows in chunks (:func:`row_chunks`), so memory stays one score block whatever Sq."""
    (b, sq, heads, _), dv = q.shape, v.shape[-1]
    k_full, v_full = _expand(k, heads), _expand(v, heads)  # [B, Sk, H, D], [B, Sk, H, Dv]
    out = torch.empty(b, sq, heads, dv, dtype=q.dtype, device=q.device)  # [B, Sq, H, Dv]
    lse = torch.empty(b, heads, sq, dtype=k_full.dtype, device=q.device)  # [B, H, Sq]
    for rows in row_chunks(b, heads, sq, k.shape[1]):
        scores = _masked_scores(q[:, rows], k_full, band, softmax_scale, softcap, rows.start)  # [B, H, n, Sk]
        lse[..., rows] = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse_for_backward(lse[..., rows]).unsqueeze(-1))  # [B, H, n, Sk]
        out[:, rows] = torch.einsum("bhqk,bkhd->bqhd", probs, v_full)  # [B, n, H, Dv]
    return out, lse


def math_backward_band(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    band: Band,
    softmax_scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This band piece's share of (dq [B, Sq, H, D], dk [B, Sk, Hkv, D], dv [B, Sk, Hkv, Dv]) given the
    final out [B, Sq, H, Dv] / lse [B, H, Sq]. With ``softcap`` c the capped score ``t = c tanh(s / c)``
    of the scaled score s passes ``dt/ds = 1 - (t / c)^2`` on to q and k. Query rows in chunks."""
    (b, sq, heads, _), kv_heads = q.shape, k.shape[2]
    k_full, v_full = _expand(k, heads), _expand(v, heads)  # [B, Sk, H, D], [B, Sk, H, Dv]
    acc = k_full.dtype
    dq = torch.empty(q.shape, dtype=acc, device=q.device)  # [B, Sq, H, D]
    dk, dv = torch.zeros_like(k_full), torch.zeros_like(v_full)  # [B, Sk, H, D], [B, Sk, H, Dv]
    for rows in row_chunks(b, heads, sq, k.shape[1]):
        scores = _masked_scores(q[:, rows], k_full, band, softmax_scale, softcap, rows.start)  # [B, H, n, Sk]
        probs = torch.exp(scores - lse_for_backward(lse[..., rows].to(acc)).unsqueeze(-1))  # [B, H, n, Sk]
        dout_rows = dout[:, rows].to(acc)  # [B, n, H, Dv]
        dv += torch.einsum("bhqk,bqhd->bkhd", probs, dout_rows)
        row_dot = (dout_rows * out[:, rows].to(acc)).sum(-1).transpose(1, 2).unsqueeze(-1)  # [B, H, n, 1]
        dscores = probs * (torch.einsum("bqhd,bkhd->bhqk", dout_rows, v_full) - row_dot) * softmax_scale
        if softcap is not None:  # a masked cell's -inf score must not make 0 * inf
            dscores = dscores * (1 - (scores.masked_fill(torch.isneginf(scores), 0.0) / softcap) ** 2)  # [B, H, n, Sk]
        dq[:, rows] = torch.einsum("bhqk,bkhd->bqhd", dscores, k_full)  # [B, n, H, D]
        dk += torch.einsum("bhqk,bqhd->bkhd", dscores, q[:, rows].to(acc))
    dk, dv = reduce_kv_heads(dk, kv_heads), reduce_kv_heads(dv, kv_heads)  # [B, Sk, Hkv, D(v)]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def flash_window(sq: int, sk: int, band: Band) -> tuple[int, int]:
    """flash-attn's ``(window_size_left, window_size_right)`` (-1 = unbounded) for a band.

    flash-attn measures windows from the bottom-right diagonal ``i + Sk - Sq``: row i sees
    ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``, so ``left = hi + Sk - Sq`` and
    ``right = Sq - Sk - lo``. A trimmed band (every row and column sees something) always
    gives non-negative values; anything else raises ValueError.
    """
    lo, hi = band
    left = -1 if hi is None else hi + sk - sq
    right = -1 if lo is None else sq - sk - lo
    if (hi is not None and left < 0) or (lo is not None and right < 0):
        raise ValueError(
            f"band {band} on a {sq} x {sk} block leaves rows or columns without keys, which flash-attn's "
            f"window cannot express; trim the block first (hybridsp.layout._block_plan does)"
        )
    return left, right
