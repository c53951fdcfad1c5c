"""The one autograd shell of ring attention: a resolved call's plan, driven over any K/V transport.

Note [one shell]: forward and backward are the same loop whatever brings the key/value blocks.
A *transport* (:class:`~hybridsp.attention.transport.base.Transport`:
:mod:`hybridsp.attention.transport.p2p` for ``kv_comm="ring"``, :mod:`hybridsp.attention.transport.allgather`
for ``"allgather"``, :mod:`hybridsp.attention.transport.local` for a ring of one) yields
:class:`~hybridsp.attention.transport.base.Block` s — the rank's own
block first, then the visiting ones, each with the plan pieces the local queries compute against
it — and takes each visiting block's partial dK/dV home (:meth:`send_home`, rounded once to the
input dtype, summed in the accumulation dtype at the owner). The shell only runs pieces and keeps
the accumulators:

    forward:  out_acc, lse_acc (fp32; fp64 for fp64)  <- merge of every block's pieces
    backward: dq_acc  <- every block;  dk/dv_acc <- own block + what the transport brings home

A call whose plan is None (a ring of one that nothing masks) is one kernel call, no merge.

Shapes: q/out [B, S, H, D], k/v [B, S, Hkv, D] local (S = this ring slot's tokens), lse [B, H, S].
"""

from __future__ import annotations

import torch

from hybridsp.attention.pieces import backward_pieces, forward_pieces
from hybridsp.kernels import accumulation_dtype


def _forward(q, k, v, call):
    """(out [B, S, H, D] in q's dtype, lse [B, H, S] in the accumulation dtype)."""
    if call.plan is None:
        return call.kernel.forward(q, k, v, causal=call.causal, softmax_scale=call.scale)
    acc = accumulation_dtype(q.dtype)
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), -torch.inf, dtype=acc, device=q.device)
    for block in call.transport(k, v).blocks():
        forward_pieces(call.kernel, q, block.k, block.v, block.pieces, block.offset, call.scale, out_acc, lse_acc,
                       call.plan)
    return out_acc.to(q.dtype), lse_acc


def _backward(dout, q, k, v, out, lse, call):
    """(dq [B, S, H, D], dk, dv [B, S, Hkv, D]) in the input dtype."""
    if call.plan is None:
        return call.kernel.backward(dout, q, k, v, out, lse, causal=call.causal, softmax_scale=call.scale)
    acc = accumulation_dtype(q.dtype)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
    transport = call.transport(k, v)
    for block in transport.blocks():
        if block.own:
            backward_pieces(call.kernel, dout, q, k, v, out, lse, block.pieces, 0, call.scale, dq_acc, dk_acc, dv_acc,
                            call.plan)
            continue
        grads = None
        if block.pieces:
            grads = [torch.zeros(block.k.shape, dtype=acc, device=k.device),
                     torch.zeros(block.v.shape, dtype=acc, device=v.device)]
            backward_pieces(call.kernel, dout, q, block.k, block.v, out, lse, block.pieces, block.offset,
                            call.scale, dq_acc, *grads, call.plan)
        transport.send_home(block, grads, dk_acc, dv_acc)
    transport.finish(dk_acc, dv_acc)
    return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Ring attention of one resolved call (:class:`hybridsp.attention.resolve.RingCall`; Note [one shell])."""

    @staticmethod
    def forward(ctx, q, k, v, call):
        out, lse = _forward(q, k, v, call)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = _backward(dout, *ctx.saved_tensors, ctx.call)
        return dq, dk, dv, None
