"""An RMS norm over a width that the tensor group splits (OLMo 2/3's ``q_norm`` / ``k_norm`` normalise the whole
projected width ``H*D``, every head at once): each rank holds ``W/T`` features and their weights, the sum of
squares is all-reduced (:func:`~hybridsp.tensor_parallel._layers.sum_over_tensor`), so each rank's output is its
slice of the unsplit norm's output.

The norm is taken only when it is the plain form ``weight * x / sqrt(mean(x^2) + eps)`` (computed in fp32, cast
back): :func:`is_plain_rms_norm` runs a fresh instance of the norm's class on a small input and compares, so a
variant (``(1 + weight)`` scaling, a centred layer norm) is refused rather than mis-split.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from hybridsp.tensor_parallel._layers import sum_over_tensor

PROBE_WIDTH = 8


def _plain(weight: torch.Tensor, x: torch.Tensor, eps: float, width: int, squares: torch.Tensor) -> torch.Tensor:
    """``weight * x * rsqrt(squares / width + eps)`` in fp32, cast to ``x``'s dtype."""
    x32 = x.to(torch.float32)
    return (weight * (x32 * torch.rsqrt(squares / width + eps))).to(x.dtype)


def is_plain_rms_norm(norm: nn.Module) -> bool:
    """Whether ``norm``'s class computes the plain RMS norm over its last dim (probed on a fresh CPU instance)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(eps, float):
        return False
    try:
        probe = type(norm)(PROBE_WIDTH, eps=eps)
    except TypeError:
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, PROBE_WIDTH, generator=gen)  # [N, W]
    weight = cast(torch.Tensor, probe.weight)  # the norm's own parameter (a dynamic nn.Module attribute)
    with torch.no_grad():
        weight.copy_(torch.rand(PROBE_WIDTH, generator=gen) + 0.5)
        got = probe(x)
        want = _plain(weight, x, eps, PROBE_WIDTH, x.pow(2).sum(-1, keepdim=True))
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-6, atol=1e-6)


class WidthShardedRMSNorm(nn.Module):
    """The plain RMS norm over a width ``W`` split ``T`` ways: ``x [B, S, W/T]`` -> ``[B, S, W/T]``.

    ``weight`` [W/T] is this rank's slice (the parameter name stays ``weight``); ``eps`` and the full width
    ``W`` are the unsplit norm's.
    """

    def __init__(self, weight: nn.Parameter, eps: float, width: int, group):
        super().__init__()
        self.weight, self.variance_epsilon, self.width, self.group = weight, eps, width, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.to(torch.float32).pow(2).sum(-1, keepdim=True)  # [B, S, 1] this rank's features
        return _plain(self.weight, x, self.variance_epsilon, self.width, sum_over_tensor(squares, self.group))

    def extra_repr(self) -> str:
        return f"width={self.width} (this rank {self.weight.numel()}), eps={self.variance_epsilon}"
