"""The one autograd shell of ring attention: a resolved call's plan, driven over any K/V transport.

Note [one shell]: forward and backward are the same loop whatever brings the key/value blocks.
A *transport* (:class:`~hybridsp.attention._transport.base.Transport`:
:mod:`hybridsp.attention._transport.p2p` for ``kv_comm="ring"``, :mod:`hybridsp.attention._transport.allgather`
for ``"allgather"``, :mod:`hybridsp.attention._transport.local` for a ring of one) yields
:class:`~hybridsp.attention._transport.base.Block` s — the rank's own
block first, then the visiting ones, each with the plan pieces the local queries compute against
it — and takes each visiting block's partial dK/dV home (:meth:`send_home`, rounded once to the
input dtype, summed in the accumulation dtype at the owner). The shell only runs pieces and keeps
the accumulators:

    forward:  out_acc, lse_acc (fp32; fp64 for fp64)  <- merge of every block's pieces
    backward: dq_acc  <- every block;  dk/dv_acc <- own block + what the transport brings home

A call whose plan is None (a ring of one that nothing masks) is one kernel call, no merge.
Learned sinks (:mod:`hybridsp.attention._sinks`) are merged once into the final out/lse, which the
backward hands to every kernel call; their own gradient comes from the final out/lse too.

Shapes: q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] local (S = this ring slot's tokens),
out [B, S, H, Dv], lse [B, H, S], sinks [H] (this rank's heads) or None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hybridsp.attention._pieces import backward_pieces, forward_pieces
from hybridsp.attention._sinks import merge_sinks, sink_grad
from hybridsp.attention._transport.base import Block
from hybridsp.kernels import accumulation_dtype
from hybridsp.kernels._base import softcap_kwargs

if TYPE_CHECKING:
    from hybridsp.attention._resolve import RingCall


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, call: RingCall
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, H, Dv] in q's dtype, lse [B, H, S] in the accumulation dtype), sinks merged."""
    if call.plan is None:
        out, lse = call.kernel.forward(
            q, k, v, causal=call.causal, softmax_scale=call.scale, **softcap_kwargs(call.softcap)
        )
        if sinks is None:
            return out, lse
        out, lse = merge_sinks(out, lse.to(accumulation_dtype(q.dtype)), sinks)
        return out.to(q.dtype), lse
    acc = accumulation_dtype(q.dtype)
    out_acc = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=acc, device=q.device)  # [B, S, H, Dv]
    lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), -torch.inf, dtype=acc, device=q.device)
    for block in call.transport(k, v).blocks():
        forward_pieces(call, q, block, out_acc, lse_acc)
    if sinks is not None:
        out_acc, lse_acc = merge_sinks(out_acc, lse_acc, sinks)
    return out_acc.to(q.dtype), lse_acc


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    call: RingCall,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq [B, S, H, D], dk [B, S, Hkv, D], dv [B, S, Hkv, Dv]) in the input dtype, from the final out/lse."""
    if call.plan is None:
        return call.kernel.backward(
            dout, q, k, v, out, lse, causal=call.causal, softmax_scale=call.scale, **softcap_kwargs(call.softcap)
        )
    acc = accumulation_dtype(q.dtype)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
    transport = call.transport(k, v)
    for block in transport.blocks():
        if block.own:
            own = Block(block.pieces, k, v, own=True)  # the local k/v whole, keys from 0
            backward_pieces(call, dout, q, out, lse, own, dq_acc, dk_acc, dv_acc)
            continue
        grads: list[torch.Tensor] | None = None
        if block.pieces:
            assert block.k is not None and block.v is not None  # a block with pieces has arrived
            grads = [
                torch.zeros(block.k.shape, dtype=acc, device=k.device),
                torch.zeros(block.v.shape, dtype=acc, device=v.device),
            ]
            backward_pieces(call, dout, q, out, lse, block, dq_acc, *grads)
        transport.send_home(block, grads, dk_acc, dv_acc)
    transport.finish(dk_acc, dv_acc)
    return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Ring attention of one resolved call (:class:`hybridsp.attention._resolve.RingCall`; Note [one shell])."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, call: RingCall
    ) -> torch.Tensor:
        out, lse = ring_forward(q, k, v, sinks, call)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.call = call
        return out

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.call)
        dsinks = None if sinks is None or not ctx.needs_input_grad[3] else sink_grad(dout, out, lse, sinks)
        return dq, dk, dv, dsinks, None
