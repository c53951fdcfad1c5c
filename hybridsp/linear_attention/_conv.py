"""The short causal depthwise convolution of a recurrent layer over one ring slot's tokens.

Each output sees the ``K`` inputs ending at its token; at a run's start the ``K - 1`` before it
belong to another run, usually on another ring slot. Every slot all-gathers its runs' last
``K - 1`` inputs (the halo; :func:`~hybridsp.linear_attention._gather.gather_ring`, whose backward brings
the halo's gradients home), and each output sums its taps from ``[own tokens, gathered tails,
zero]`` (:func:`~hybridsp.linear_attention._segments.conv_taps`): inputs before the token's document start read
the zero, so packed documents reset the window exactly as the unmodified layer run per document.
"""

from __future__ import annotations

import torch

from hybridsp._comm import CommCounter
from hybridsp.linear_attention._gather import gather_ring
from hybridsp.linear_attention._slots import SlotCall


def halo_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, call: SlotCall, counter: CommCounter | None = None
) -> torch.Tensor:
    """Causal depthwise convolution of a slot's tokens with the halos of the runs before them.

    Args:
        x: [B, L, C] the slot's pre-convolution inputs, in slot order.
        weight: [C, K] per-channel taps (``conv1d.weight.squeeze(1)``, this rank's channels).
        bias: [C] or None.
        call: the batch's :class:`~hybridsp.linear_attention._slots.SlotCall`.

    Returns:
        [B, L, C] in ``weight``'s dtype (no activation), as ``F.conv1d(x, padding=K-1)[..., :L]``
        on the row's natural order, reset at document starts.
    """
    kernel = weight.shape[1]
    x = x.to(weight.dtype)
    if kernel == 1:
        return x * weight[:, 0] + (0 if bias is None else bias)
    zero = x.new_zeros(x.shape[0], 1, x.shape[2])  # [B, 1, C]
    padded = torch.cat([x, zero], dim=1)  # [B, L + 1, C]
    tails = [padded[list(g.rows)][:, g.tails(call.slot, kernel - 1).to(x.device)] for g in call.rows]
    gathered = gather_ring(tails, call.group, counter)  # each [R, b, max_runs * (K-1), C]
    outs = []
    for group, halo in zip(call.rows, gathered):
        halo = halo.transpose(0, 1).flatten(1, 2)  # [b, R * max_runs * (K-1), C]
        rows = list(group.rows)
        ext = torch.cat([x[rows], halo, zero[rows]], dim=1)  # [b, L + R*M*(K-1) + 1, C]
        taps = group.taps(call.slot, kernel).to(x.device)  # [L, K]
        out = sum(ext[:, taps[:, i]] * weight[:, i] for i in range(kernel))  # [b, L, C]
        assert isinstance(out, torch.Tensor)  # kernel >= 2 taps: a tensor, never sum's start 0
        outs.append(out if bias is None else out + bias)
    joined = torch.cat(outs, dim=0)  # [B, L, C] rows in group order
    return joined if len(outs) == 1 else joined[call.row_order().to(x.device)]
