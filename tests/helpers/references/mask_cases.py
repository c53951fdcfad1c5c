"""Packed documents and sliding windows through the hybrid attention, against float64 masked attention:
the cells a block-plan piece computes, the (documents, causal, window) cases, and the distributed
worker that checks every case on a list of meshes (the attention and K/V-transport tests share it)."""

import torch

from hybridsp import hybrid_attn_func, init_mesh, shard_sequence
from hybridsp.kernels._band import band_mask
from tests.helpers.references.attention import random_qkv, rel_err
from tests.helpers.references.masks import masked_reference_with_grads

TOLERANCE = 1e-5
SEQ = 256
DOCS = [0, 37, 137, 140, 200, 256]  # lengths 37, 100, 3, 60, 56
ROW2 = [0, 1, 130, 256]  # a length-1 document, and one that spans every rank
SPANNING = [0, 256]  # one document: the window alone


def piece_cells(piece, size):
    """[L, L] int: 1 where this piece computes a visible cell."""
    cells = torch.zeros(size, size, dtype=torch.int32)
    n, m = piece.rows.stop - piece.rows.start, piece.keys.stop - piece.keys.start
    if piece.kind == "full":
        visible = torch.ones(n, m, dtype=torch.bool)
    elif piece.kind == "causal":
        assert n == m
        visible = torch.ones(n, n, dtype=torch.bool).tril()
    else:
        visible = band_mask(n, m, piece.band)
    assert visible.any(dim=1).all() and visible.any(dim=0).all(), f"untrimmed piece {piece}"
    cells[piece.rows, piece.keys] = visible.int()
    return cells


def hybrid_case(mesh, full, rows_bounds, causal, window):
    """Max relative error of this rank's (out, dq, dk, dv) shards against the float64 reference."""
    shared = all(b == rows_bounds[0] for b in rows_bounds)
    cu = torch.tensor(rows_bounds[0]) if shared else [torch.tensor(b) for b in rows_bounds]  # both forms
    q, k, v = (shard_sequence(t, mesh).clone().requires_grad_() for t in full[:3])
    out = hybrid_attn_func(q, k, v, mesh=mesh, causal=causal, cu_seqlens=cu, sliding_window=window, backend="torch")
    out.backward(shard_sequence(full[3], mesh))
    expected = masked_reference_with_grads(*full, rows_bounds=rows_bounds, causal=causal, window=window)
    errors = [rel_err(a, shard_sequence(e, mesh)) for a, e in zip([out, q.grad, k.grad, v.grad], expected)]
    assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))
    return max(errors)


def mask_cases(windows, full_matrix, seq=SEQ):
    """(rows_bounds, causal, window) cases: documents, windows and both combined (last document ends at seq)."""
    end = lambda bounds: [*bounds[:-1], seq]  # noqa: E731
    docs, mixed, spanning = [end(DOCS)] * 2, [end(DOCS), end(ROW2)], [end(SPANNING)] * 2
    cases = [
        (docs, True, None),
        (mixed, True, None),
        (spanning, True, windows[0]),
        (mixed, True, windows[0]),
        (docs, True, windows[1]),
        (mixed, True, windows[2]),
    ]
    if full_matrix:
        cases += [
            (docs, False, None),
            (mixed, False, windows[1]),
            (spanning, True, windows[1]),
            (docs, True, windows[0]),
            (mixed, True, windows[1]),
        ]
    return cases


def check_meshes(rank, world, meshes, windows, full_matrix, seq=SEQ, kv_list=(8, 1), kv_comm="ring"):
    failures = []
    for (ulysses, ring), layout in meshes:
        mesh = init_mesh(ulysses=ulysses, ring=ring, layout=layout, kv_comm=kv_comm)
        for kv_heads in [8, 2, 1] if full_matrix else kv_list:
            full = random_qkv(2, seq, 8, kv_heads, 16, seed=3 + mesh.dp_rank)
            for rows_bounds, causal, window in mask_cases(windows, full_matrix, seq):
                error = hybrid_case(mesh, full, rows_bounds, causal, window)
                if error > TOLERANCE:
                    failures.append(
                        f"U={ulysses} R={ring} {layout} kv={kv_heads} docs={rows_bounds} "
                        f"causal={causal} W={window}: {error:.2e}"
                    )
    assert not failures, "\n".join(failures)
