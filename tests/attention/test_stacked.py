"""Small plan pieces of one shape in one kernel call (hybridsp.attention._stacked), against float64 masked attention.

Many tiny documents (lengths 1-5 and a uniform 2), per-row documents (B = 2), a window that cuts
them into band pieces, GQA down to one K/V head, on a ring of one, U1xR4 and U2xR2 (torch backend,
which has no varlen entry, so the stacks run): forward and gradients within 1e-5 of the reference.
The split itself: every piece of every batch row computed exactly once, no stack holding two
pieces on one query row, large pieces alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridsp.attention._stacked import MAX_ROWS, stacks_and_singles
from hybridsp.layout._block_plan import build_plan
from hybridsp.layout._documents import normalize_cu_seqlens
from hybridsp.testing import run_distributed
from tests.helpers.references.attention import random_qkv, rel_err
from tests.helpers.references.masks import masked_reference_with_grads

TOLERANCE = 1e-5
SEQ = 96


def _tiny_documents(seed: int) -> list[int]:
    rng = random.Random(seed)
    bounds = [0]
    while bounds[-1] < SEQ:
        bounds.append(min(SEQ, bounds[-1] + rng.randint(1, 5)))
    return bounds


ROWS = {"mixed": [_tiny_documents(1), _tiny_documents(2)], "uniform": [list(range(0, SEQ + 1, 2))] * 2}


def _check(rank, world, meshes):
    from hybridsp import hybrid_attn_func, init_mesh, shard_sequence

    failures = []
    for (ulysses, ring), (name, rows), window, kv_heads in [
        (mesh, rows, window, kv) for mesh in meshes for rows in ROWS.items() for window in (None, 3) for kv in (4, 1)
    ]:
        mesh = init_mesh(ulysses=ulysses, ring=ring)
        q, k, v, dout = random_qkv(2, SEQ, 4, kv_heads, 8, seed=3)
        expected = masked_reference_with_grads(q, k, v, dout, rows_bounds=rows, causal=True, window=window)
        cu = [torch.tensor(row) for row in rows]
        leaves = [shard_sequence(t, mesh, cu_seqlens=cu).clone().requires_grad_() for t in (q, k, v)]
        out = hybrid_attn_func(*leaves, mesh=mesh, cu_seqlens=cu, sliding_window=window, backend="torch")
        out.backward(shard_sequence(dout, mesh, cu_seqlens=cu))
        errors = [
            rel_err(a, shard_sequence(e, mesh, cu_seqlens=cu))
            for a, e in zip([out, *(t.grad for t in leaves)], expected)
        ]
        if max(errors) > TOLERANCE:
            failures.append(f"U{ulysses}xR{ring} {name} window={window} Hkv={kv_heads}: {errors}")
    return failures


@pytest.mark.distributed
def test_tiny_documents_are_exact_on_a_ring_of_one():
    assert run_distributed(_check, 1, [(1, 1)]) == [[]]


@pytest.mark.distributed
def test_tiny_documents_are_exact_on_the_ring_and_under_ulysses():
    assert run_distributed(_check, 4, [(1, 4), (2, 2)]) == [[]] * 4


def test_every_piece_runs_once_and_no_stack_repeats_a_query_row():
    seq, ring = 512, 2
    rows = [_tiny_documents(5) + [seq], list(range(0, 300, 3)) + [400, seq]]
    rows = [sorted(set(r for r in row if r <= seq)) for row in rows]
    plan = build_plan(seq, ring, "zigzag", causal=True, docs=normalize_cu_seqlens(rows, 2, seq), window=4, batch=2)
    for pieces in plan.pieces.values():
        stacks, singles = stacks_and_singles(pieces, 0, 2, torch.device("cpu"))
        want = sorted(
            (p.rows.start, p.keys.start, b)
            for p in pieces
            for b in (range(2) if p.batch == slice(None) else [p.batch.start])
        )
        got = [
            (p.rows.start, p.keys.start, b)
            for p in singles
            for b in (range(2) if p.batch == slice(None) else [p.batch.start])
        ]
        for stack in stacks:
            n, m = stack.like.rows.stop - stack.like.rows.start, stack.like.keys.stop - stack.like.keys.start
            query = list(zip(stack.q_batch.tolist(), stack.q_seq.tolist()))
            assert len(query) == len(set(query)) == stack.size * n, "a stack repeats a query row"
            got += [
                (s, k, b)
                for b, s, k in zip(stack.q_batch[::n].tolist(), stack.q_seq[::n].tolist(), stack.k_seq[::m].tolist())
            ]
        assert sorted(got) == want
        assert all(
            max(p.rows.stop - p.rows.start, p.keys.stop - p.keys.start) <= MAX_ROWS
            for stack in stacks
            for p in [stack.like]
        )
