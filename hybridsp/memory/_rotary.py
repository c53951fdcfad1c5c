"""Rotary position embedding rotated in place, with temporaries of one tile.

Hugging Face's ``apply_rotary_pos_emb`` computes ``q * cos + rotate_half(q) * sin`` as five
autograd ops: while it runs, q, ``q * cos``, ``cat(-q2, q1)``, its product with sin and the sum are
alive together (four q-sized tensors besides q itself, and the same for k). Under split
checkpointing with donated q/k/v this is the step's peak on the per-rank cap
(``benchmarks.memory.step_peak``). :func:`rotate_` computes the same numbers

    x1 <- x1 * cos1 - x2 * sin1           x = [x1 | x2] along the head dim, halves of D / 2
    x2 <- x2 * cos2 + x1_old * sin2

into x itself, tile by tile along the sequence: the only temporaries are one tile's. Bitwise HF's
values: ``(-x2) * sin1`` is ``-(x2 * sin1)`` exactly and ``a + (-b)`` is ``a - b`` exactly. The
backward is the transposed rotation, ``dx1 = g1 * cos1 + g2 * sin2``, ``dx2 = g2 * cos2 - g1 * sin1``:
the sums autograd forms for HF's graph, so gradients are bitwise equal as well (tested); it keeps
cos and sin only, as HF's graph does.

Note [in place]: x is rotated in place only when it is no view (a projection's or a norm's fresh
output, which nothing keeps for backward: linear layers keep their input, RMSNorms theirs) and
rotating does not change its dtype; otherwise the rotation is written to a new tensor (still one
tile of temporaries). If something did keep x for backward, autograd's version check raises at
backward instead of reading rotated values.
"""

from __future__ import annotations

from typing import Any, cast

import torch

DEFAULT_TILE_TOKENS = 1024


def rotate_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, tile_tokens: int = DEFAULT_TILE_TOKENS
) -> torch.Tensor:
    """RoPE of ``x`` [B, S, H * D] or [B, S, H, D] with ``cos``, ``sin`` [B, S, D] (HF's rotary output);
    the rotated x, same shape: x itself where Note [in place] allows, else a new tensor."""
    return cast(torch.Tensor, _Rotate.apply(x, cos, sin, head_dim, tile_tokens))


def check_rotary_shapes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    """Raise ValueError unless x [B, S, H * D or H, D] and cos, sin [B or 1, S, D] fit, D even."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head dim, got {head_dim}")
    fits = (x.dim() == 3 and x.shape[-1] % head_dim == 0) or (x.dim() == 4 and x.shape[-1] == head_dim)
    if not fits:
        raise ValueError(f"x {tuple(x.shape)} is not [B, S, H * {head_dim}] nor [B, S, H, {head_dim}]")
    expected = (x.shape[1], head_dim)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 3 or tuple(table.shape[1:]) != expected or table.shape[0] not in (1, x.shape[0]):
            raise ValueError(
                f"{name} {tuple(table.shape)} does not fit x {tuple(x.shape)}: expected [B or 1, {expected[0]}, "
                f"{head_dim}]"
            )


def _in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Note [in place]: x is no view nor a leaf that requires grad, is contiguous, and keeps its dtype."""
    same_dtype = torch.result_type(x, cos) == x.dtype and torch.result_type(x, sin) == x.dtype
    grad_leaf = x.is_leaf and x.requires_grad  # autograd refuses to modify it in place
    return not x._is_view() and x.is_contiguous() and same_dtype and not grad_leaf


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.view(x.shape[0], x.shape[1], -1, head_dim)  # [B, S, H, D]


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, tile: int
    ) -> torch.Tensor:
        check_rotary_shapes(x, cos, sin, head_dim)
        if _in_place(x, cos, sin):
            out = x
            ctx.mark_dirty(x)
        else:
            out = torch.empty(x.shape, dtype=torch.promote_types(torch.result_type(x, cos), sin.dtype), device=x.device)
            out.copy_(x)
        cos_rows, sin_rows = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, S, 1, D]
        heads = _heads(out, head_dim)  # [B, S, H, D]
        for start in range(0, x.shape[1], tile):
            rows = slice(start, start + tile)
            _rotate_tile(heads[:, rows], cos_rows[:, rows], sin_rows[:, rows])
        ctx.save_for_backward(cos, sin)
        ctx.meta = (head_dim, tile, x.dtype, x.shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        cos, sin = ctx.saved_tensors
        head_dim, tile, dtype, shape = ctx.meta
        grads = grad if grad.dim() == 4 else _heads(grad.contiguous(), head_dim)  # [B, S, H, D]
        out = _gradient_like_hf(grads, torch.result_type(grad, cos), per_head=len(shape) == 4)  # [B, S, H, D]
        cos_rows, sin_rows = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, S, 1, D]
        for start in range(0, shape[1], tile):
            rows = slice(start, start + tile)
            _unrotate_tile(grads[:, rows], cos_rows[:, rows], sin_rows[:, rows], out[:, rows])
        return out.reshape(shape).to(dtype), None, None, None, None


def _gradient_like_hf(grads: torch.Tensor, dtype: torch.dtype, per_head: bool) -> torch.Tensor:
    """An empty [B, S, H, D] for x's gradient, laid out as autograd's for HF's rotation: heads-first for a
    per-head x (HF rotates x.transpose(1, 2) into a fresh heads-first tensor, and a per-head norm before
    it reduces its weight's gradient over that layout); contiguous for a flat x (HF's view backward copies
    the gradient into x's contiguous layout for the projection)."""
    if not per_head:
        return torch.empty(grads.shape, dtype=dtype, device=grads.device)
    batch, seq, heads, dim = grads.shape
    return torch.empty(batch, heads, seq, dim, dtype=dtype, device=grads.device).transpose(1, 2)  # [B, S, H, D]


def _rotate_tile(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [B, t, H, D] <- x * cos + cat(-x2, x1) * sin, in place (cos, sin [B, t, 1, D])."""
    x1, x2 = _halves(x)
    cos1, cos2 = _halves(cos)
    sin1, sin2 = _halves(sin)
    old_x1 = x1.clone()  # [B, t, H, D / 2]
    x1.mul_(cos1).sub_(x2 * sin1)
    x2.mul_(cos2).add_(old_x1 * sin2)


def _unrotate_tile(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """out [B, t, H, D] <- the rotation's transpose applied to grad [B, t, H, D]."""
    g1, g2 = _halves(grad)
    cos1, cos2 = _halves(cos)
    sin1, sin2 = _halves(sin)
    out1, out2 = _halves(out)
    torch.mul(g1, cos1, out=out1)
    out1.add_(g2 * sin2)
    torch.mul(g2, cos2, out=out2)
    out2.sub_(g1 * sin1)
