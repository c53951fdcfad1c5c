"""Tensor-parallel building blocks over ``mesh.tensor_group`` (Megatron-style), torch only.

A column-parallel linear is a plain :class:`torch.nn.Linear` holding a slice of the output
features (rows of the weight, and of the bias); it needs no communication of its own. What
happens around it depends on whether the tensor group also shards the sequence
(Note [sequence parallel in the tensor group]):

    without SP: x [B, S, h] (the same on all T ranks)
        --norm, copy_to_tensor (fwd identity, bwd all-reduce)--> column linears
        --> row linear: local matmul [B, S, h], reduce_from_tensor (fwd all-reduce, bwd identity)
    with SP:    x [B, S/T, h] (this tensor rank's tokens)
        --norm, gather_sequence_shards (fwd all-gather, bwd reduce-scatter)--> [B, S, h]
        --> row linear: local matmul [B, S, h], scatter_tokens (fwd reduce-scatter, bwd all-gather)
            --> [B, S/T, h]

Both pairs move the same bytes per layer (an all-reduce is a reduce-scatter plus an all-gather).

Note [sequence parallel in the tensor group]: with ``sequence_parallel`` on, everything outside
the linears (norms, residual additions) runs on ``1/T`` of the tokens, so their activations
are ``1/T`` as large. A norm's weight then sees only this rank's tokens, so its gradient is a
partial sum: :func:`sum_grad_over_tensor` adds a hook that all-reduces it over the tensor
group, making it equal on every tensor rank (as without SP). The embedding output is split
(:func:`split_tokens`: fwd slice, bwd all-gather) and the final norm's output is gathered
again before the (replicated) LM head (:func:`gather_replicated_tokens`: fwd all-gather, bwd
slice: every tensor rank computes the same loss from it).

gloo (CPU) has no reduce-scatter: there it is an all-reduce followed by taking this rank's
slice (the same values, twice the bytes); NCCL uses ``reduce_scatter_tensor``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

SEQ_DIM = 1  # hidden states are [B, S, h]


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """[..., L, ...] -> [..., T*L, ...] in tensor-rank order."""
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _slice(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's ``1/T`` of ``dim`` (a contiguous copy)."""
    size = dist.get_world_size(group)
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum over the group, keep this rank's ``1/T`` of ``dim``: [.., T*L, ..] -> [.., L, ..]."""
    if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter (module docstring)
        return _slice(_all_reduce(x, group), group, dim)
    size = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()  # [T*L, ...]
    out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))  # [L, ...]
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim)


class _CopyToTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumOverTensor(torch.autograd.Function):
    """Sum over the tensor group, used by every rank: the gradient is the sum of the ranks' gradients too."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _TokenExchange(torch.autograd.Function):
    """One exchange along the sequence dim: ``forward_op`` now, ``backward_op`` on the gradient
    (each ``op(x, group, dim)``: all-gather, reduce-scatter or this rank's slice)."""

    @staticmethod
    def forward(ctx, x, group, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.group, SEQ_DIM), None, None, None


def copy_to_tensor(x, group):
    return _CopyToTensor.apply(x, group)


def reduce_from_tensor(x, group):
    return _ReduceFromTensor.apply(x, group)


def sum_over_tensor(x, group):
    """The sum of ``x`` over the tensor group, which every rank then uses (forward and backward all-reduce;
    e.g. a mean of squares over a width split across the group)."""
    return _SumOverTensor.apply(x, group)


def gather_sequence_shards(x, group):
    """[B, S/T, h] -> [B, S, h]; backward reduce-scatters (the input of column-parallel linears under SP)."""
    return _TokenExchange.apply(x, group, _all_gather, _reduce_scatter)


def scatter_tokens(x, group):
    """[B, S, h] partial sums -> [B, S/T, h] summed; backward all-gathers (row-parallel outputs under SP)."""
    return _TokenExchange.apply(x, group, _reduce_scatter, _all_gather)


def split_tokens(x, group):
    """[B, S, h] replicated -> [B, S/T, h]; backward all-gathers."""
    return _TokenExchange.apply(x, group, _slice, _all_gather)


def gather_replicated_tokens(x, group):
    """[B, S/T, h] -> [B, S, h] that every tensor rank then uses identically; backward slices."""
    return _TokenExchange.apply(x, group, _all_gather, _slice)


def shard_rows(weight: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Rows ``[index*n/parts, (index+1)*n/parts)`` of a [n, ...] tensor (meta tensors stay meta)."""
    return weight.chunk(parts, dim=0)[index]


class RowParallelLinear(nn.Module):
    """``y = reduce(x_shard @ W_shard^T) + b``: the input features are split over the tensor group.

    ``weight`` holds this rank's input columns [out, in/T]; ``bias`` [out] (or None) is replicated
    and added once, after the reduction (parameter names are those of the ``nn.Linear`` it replaces).
    ``sequence_parallel``: reduce-scatter over tokens instead of all-reduce, so the output is
    [B, S/T, out].
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group, sequence_parallel: bool):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.sequence_parallel = group, sequence_parallel
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)  # [B, S, out] partial sum over the tensor group
        y = scatter_tokens(y, self.group) if self.sequence_parallel else reduce_from_tensor(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (1/{dist.get_world_size(self.group)}), out_features={self.out_features}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


def _summed(grad: torch.Tensor, group) -> torch.Tensor:
    return _all_reduce(grad, group)


def sum_grad_over_tensor(param: nn.Parameter, group):
    """Hook ``param`` so its gradient is all-reduced over the tensor group; returns the handle."""
    return param.register_hook(functools.partial(_summed, group=group))
