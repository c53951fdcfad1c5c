"""Plain attention math for the exactness probe: the independent reference and the same-dtype baseline.

Nothing here shares code with the kernels or the ring: scores are one matrix product, the mask is
built from the *positions the model was fed* (not from the layout's order), the softmax is torch's.
That is what lets the probe see a permutation applied twice (positions out of order in the gathered
sequence) as well as a wrong kernel, a stale block or a lost denominator.

Mask of query i and key j (positions ``p``, documents starting where ``p == 0``): same document,
``p_j <= p_i``, within ``window`` (``p_i - p_j < window``) and in the same ``chunk``
(``p_i // chunk == p_j // chunk``) when given.
"""

from __future__ import annotations

import torch

_CELLS = 1 << 24  # score elements per query block ([B, g, rows, S]): bounds the reference's memory


def visible(
    positions: torch.Tensor, window: int | None, chunk: int | None, begin: int = 0, end: int | None = None
) -> torch.Tensor:
    """[B, rows, S] bool: key j visible to query i (rows ``begin:end``, default all), from the positions
    [B, S] alone (see the module docstring)."""
    starts = positions == 0
    starts[:, 0] = True
    document = starts.long().cumsum(dim=1)  # [B, S]
    qp, kp = positions[:, begin:end, None], positions[:, None, :]  # [B, rows, 1], [B, 1, S]
    mask = (document[:, begin:end, None] == document[:, None, :]) & (kp <= qp)  # [B, rows, S]
    if window is not None:
        mask &= qp - kp < window
    if chunk is not None:
        mask &= qp // chunk == kp // chunk
    return mask


def _attend(q, k, v, mask, scale: float, sinks, softcap, upcast: bool) -> torch.Tensor:
    """out [B, rows, g, Dv] of q [B, rows, g, D] over k [B, S, D], v [B, S, Dv]; mask [B, rows, S].
    ``upcast``: softmax in fp32 and cast back (the same-dtype baseline, as flash-attn's tests do it)."""
    scores = torch.einsum("bqgd,bkd->bgqk", q, k) * scale  # [B, g, rows, S]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:  # one more key per head: logit sinks[h], value 0
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)  # [B, g, rows, 1]
        scores = torch.cat([scores, sink], dim=-1)  # [B, g, rows, S + 1]
    weights = torch.softmax(scores.float() if upcast else scores, dim=-1).to(q.dtype)
    weights = weights.nan_to_num(0.0)  # a row without any visible key: zeros
    if sinks is not None:
        weights = weights[..., :-1]  # [B, g, rows, S]
    return torch.einsum("bgqk,bkd->bqgd", weights, v)  # [B, rows, g, Dv]


def attention_vjp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    positions: torch.Tensor,
    *,
    dtype: torch.dtype,
    scale: float,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of causal attention of one key/value head and its query heads, in ``dtype``.

    Args:
        q: [B, S, g, D] the g query heads that share this key/value head; k [B, S, D]; v [B, S, Dv];
            dout [B, S, g, Dv]: the gathered tensors of one layer (any dtype; cast to ``dtype``).
        positions: [B, S] the positions the model was fed, gathered the same way.
        dtype: float64 for the reference; the input dtype for the baseline (softmax then runs in fp32).
        scale, window, chunk, sinks ([g] or None), softcap: the call's settings.

    Returns:
        out [B, S, g, Dv], dq [B, S, g, D], dk [B, S, D], dv [B, S, Dv], each in ``dtype``. Queries go in
        blocks (about 16M score elements each), so memory stays bounded at long sequences.
    """
    q, k, v, dout = (t.detach().to(dtype) for t in (q, k, v, dout))
    k, v = k.requires_grad_(), v.requires_grad_()
    sinks = None if sinks is None else sinks.detach().to(dtype)
    batch, seq, heads = q.shape[:3]
    rows = max(1, _CELLS // max(1, batch * heads * seq))
    upcast = dtype in (torch.bfloat16, torch.float16)
    outs, dqs = [], []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for begin in range(0, seq, rows):
        end = min(seq, begin + rows)
        q_block = q[:, begin:end].clone().requires_grad_()  # [B, rows, g, D]
        mask = visible(positions, window, chunk, begin, end)  # [B, rows, S]
        with torch.enable_grad():
            out = _attend(q_block, k, v, mask, scale, sinks, softcap, upcast)
            grads = torch.autograd.grad(out, (q_block, k, v), dout[:, begin:end])
        outs.append(out.detach())
        dqs.append(grads[0])
        dk += grads[1]
        dv += grads[2]
    return torch.cat(outs, dim=1), torch.cat(dqs, dim=1), dk, dv
