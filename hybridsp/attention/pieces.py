"""Computing a key/value block's plan pieces against the local queries, whatever brought the block.

Both K/V transports (:mod:`hybridsp.attention.transport.p2p` and :mod:`hybridsp.attention.transport.allgather`) hand a block of
key rows and the :class:`~hybridsp.layout.block_plan.Piece` list that says which local query rows see
which of them; these two functions run the pieces and fold the results into the caller's
accumulators. The kernel is complete (:class:`~hybridsp.kernels.base.AttentionKernel`, as
:func:`~hybridsp.kernels.select.resolve_kernel` returns it): kernels with ``supports_varlen`` run a
block's pieces in one call per flash window (:mod:`hybridsp.attention.varlen`); others run one call
per piece, band pieces by the kernel's ``forward_band``/``backward_band``.

Shapes: q [B, S, H, D], dout/out [B, S, H, Dv] local, lse [B, H, S], k_rows [B, rows, Hkv, D],
v_rows [B, rows, Hkv, Dv];
piece keys are counted from ``offset`` in the block's own coordinates (``Piece.shifted``).
"""

from __future__ import annotations

from hybridsp.attention.merge import merge_into
from hybridsp.attention.varlen import backward_block, forward_block
from hybridsp.kernels.base import softcap_kwargs


def _piece_forward(kernel, q, k, v, piece, scale, softcap):
    """(out, lse) of one plan piece; q/k/v already cut to the piece."""
    if piece.kind == "band":
        return kernel.forward_band(q, k, v, band=piece.band, softmax_scale=scale, **softcap_kwargs(softcap))
    return kernel.forward(q, k, v, causal=piece.kind == "causal", softmax_scale=scale, **softcap_kwargs(softcap))


def _piece_backward(kernel, dout, q, k, v, out, lse, piece, scale, softcap):
    """(dq, dk, dv) of one plan piece given the final out/lse cut to its rows."""
    capped = softcap_kwargs(softcap)
    if piece.kind == "band":
        return kernel.backward_band(dout, q, k, v, out, lse, band=piece.band, softmax_scale=scale, **capped)
    return kernel.backward(dout, q, k, v, out, lse, causal=piece.kind == "causal", softmax_scale=scale, **capped)


def forward_pieces(kernel, q, k_rows, v_rows, pieces, offset: int, scale: float, out_acc, lse_acc, plan=None,
                   softcap: float | None = None) -> None:
    """Attend q's piece rows to the block's piece keys; merge into out_acc [B, S, H, Dv] / lse_acc [B, H, S].
    ``plan``: the plan that owns ``pieces`` (varlen index tables are kept on it); ``softcap``: the
    kernel's soft-capping (:mod:`hybridsp.kernels.base`), None for none."""
    if not pieces:
        return
    if kernel.supports_varlen:
        forward_block(kernel, q, k_rows, v_rows, pieces, offset, scale, out_acc, lse_acc, plan, softcap)
        return
    for piece in pieces:
        b, rows, keys = piece.batch, piece.rows, piece.shifted(offset).keys
        block_out, block_lse = _piece_forward(kernel, q[b, rows], k_rows[b, keys], v_rows[b, keys], piece, scale,
                                              softcap)
        merge_into(out_acc[b, rows], lse_acc[b, :, rows], block_out, block_lse)


def backward_pieces(kernel, dout, q, k_rows, v_rows, out, lse, pieces, offset: int, scale: float,
                    dq_acc, dk_acc, dv_acc, plan=None, softcap: float | None = None) -> None:
    """Add the pieces' gradients: dq into dq_acc [B, S, H, D], dk/dv into dk_acc [B, rows, Hkv, D] /
    dv_acc [B, rows, Hkv, Dv] (accumulators in the accumulation dtype; the block's keys counted from ``offset``)."""
    if not pieces:
        return
    if kernel.supports_varlen:
        backward_block(kernel, dout, q, k_rows, v_rows, out, lse, pieces, offset, scale, dq_acc, dk_acc, dv_acc, plan,
                       softcap)
        return
    for piece in pieces:
        b, rows, keys = piece.batch, piece.rows, piece.shifted(offset).keys
        dq, dk, dv = _piece_backward(
            kernel, dout[b, rows], q[b, rows], k_rows[b, keys], v_rows[b, keys], out[b, rows], lse[b, :, rows],
            piece, scale, softcap,
        )
        dq_acc[b, rows] += dq
        dk_acc[b, keys] += dk
        dv_acc[b, keys] += dv
