"""A differentiable all-gather of small tensors over the ring group, in ring-rank order.

The state passing of the recurrent layers moves only small things over the ring: each run's
transition pair and its last ``K - 1`` convolution inputs. :func:`gather_ring` packs any number
of tensors into one all-gather; its backward sums every rank's gradient of the gathered tensor and
hands each owner its own slice (Note [gather adjoint]), so the gradients of an earlier run's
contribution reach the rank that computed it.

Note [gather adjoint]: the adjoint of "every rank receives x_0 .. x_{R-1}" is "rank r receives
the sum over ranks of the gradient with respect to x_r": an all-reduce of the gathered gradient
followed by taking the own slice (a reduce-scatter; these tensors are small, the all-reduce is
simpler and runs on gloo).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridsp._comm import CommCounter, tensor_bytes


class _GatherRing(torch.autograd.Function):
    """flat [n] -> [R, n] over ``group`` (group-rank order); backward: all-reduce, own slice."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, group: dist.ProcessGroup, counter: CommCounter | None) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        size = dist.get_world_size(group)
        out = flat.new_empty(size * flat.numel())  # [R * n]
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, flat.contiguous(), group=group)
        out = out.view(size, flat.numel())  # [R, n]
        if counter is not None:
            counter.record("linear_allgather", tensor_bytes([flat]) * (size - 1))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        if ctx.counter is not None:
            ctx.counter.record("linear_allreduce", tensor_bytes([grad]))
        return grad[dist.get_rank(ctx.group)], None, None


def gather_ring(
    tensors: list[torch.Tensor], group: dist.ProcessGroup | None, counter: CommCounter | None = None
) -> list[torch.Tensor]:
    """Differentiable: each tensor ``x_i`` (one dtype) -> ``[R, *x_i.shape]``, every ring rank's
    ``x_i`` in ring-rank order, in one all-gather (a group of one: ``x_i[None]``)."""
    if group is None or dist.get_world_size(group) == 1:
        return [t.unsqueeze(0) for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors])  # [sum n_i]
    gathered = _GatherRing.apply(flat, group, counter)  # [R, sum n_i]
    parts = gathered.split([t.numel() for t in tensors], dim=1)
    return [part.reshape(-1, *t.shape) for part, t in zip(parts, tensors)]  # each [R, *shape]
