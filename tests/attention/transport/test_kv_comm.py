"""K/V transports (``kv_comm="ring"`` and ``"allgather"``): exactness against float64 and the
bytes each rank sends against the analytic formulas of :mod:`hybridsp.attention._volume`."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from hybridsp import CommCounter, hybrid_attn_func, init_mesh, shard_batch, shard_sequence
from hybridsp._formulas import default_kv_chunks, ring_rows
from hybridsp.attention._transport.allgather import chunk_pieces
from hybridsp.attention._volume import hybrid_bytes
from hybridsp.layout._block_plan import build_plan
from hybridsp.layout._documents import normalize_cu_seqlens
from hybridsp.layout._layouts import layout_permutation
from hybridsp.mesh._hybrid_mesh import HybridMesh, MeshShape, padded_length
from hybridsp.testing import run_distributed
from tests.helpers.references import mask_cases
from tests.helpers.references.attention import random_qkv, reference_with_grads, rel_err
from tests.helpers.references.masks import visible_mask

HEADS, HEAD_DIM, BATCH, SEQ = 8, 16, 2, 64
TOLERANCE = 1e-5


# --------------------------------------------------------------------------- plans, no processes


def _gathered_cells(plan, rank, chunks):
    """Per source: [L, L] int counting how often the all-gather pieces compute each cell."""
    local, rows = plan.local_len, plan.local_len // chunks
    cells = {s: torch.zeros(local, local, dtype=torch.int32) for s in range(plan.ring)}
    for j, pieces in enumerate(chunk_pieces(plan, rank, chunks)):
        for piece in pieces:
            grid = mask_cases.piece_cells(piece.shifted(piece.keys.start), max(local, piece.keys.stop))
            grid = grid[:, : piece.keys.stop - piece.keys.start]  # [L, keys of the piece]
            for column, gathered in enumerate(range(piece.keys.start, piece.keys.stop)):
                source, row = divmod(gathered, rows)
                cells[source][:, j * rows + row] += grid[:local, column]
    return cells


def test_allgather_chunks_cover_each_visible_cell_once():
    rng = random.Random(1)
    for _ in range(30):
        ring, layout = rng.choice([2, 3, 4, 8]), rng.choice(["zigzag", "contiguous"])
        seq = 2 * ring * rng.choice([2, 3, 4, 6])
        causal, window = rng.random() < 0.8, rng.choice([None, None, 1, 3, 7, 1000])
        bounds = [0, *sorted(rng.sample(range(1, seq), rng.randint(0, 3))), seq]
        docs = normalize_cu_seqlens([bounds], 1, seq)
        plan = build_plan(seq, ring, layout, causal=causal, docs=docs, window=window, batch=1)
        local, perm = seq // ring, layout_permutation(seq, ring, 1, layout)
        visible = visible_mask(seq, bounds, causal, window)
        for rank in range(ring):
            chunks = rng.choice([c for c in range(1, local + 1) if local % c == 0])
            cells = _gathered_cells(plan, rank, chunks)
            for source in range(ring):
                want = visible[perm[rank * local : (rank + 1) * local]][:, perm[source * local : (source + 1) * local]]
                want = torch.zeros_like(want) if source == rank else want  # the own block is computed locally
                assert torch.equal(cells[source], want.int()), (ring, layout, seq, causal, window, bounds, rank)


def test_dense_allgather_needs_few_calls():
    # zigzag causal, R = 4, two chunks: at most two calls per chunk (earlier slots' keys, later slots' keys)
    plan = build_plan(64, 4, "zigzag", causal=True, docs=None, window=None, batch=1)
    for rank in range(4):
        assert all(len(pieces) <= 2 for pieces in chunk_pieces(plan, rank, default_kv_chunks(4, 16)))
        assert [p.kind for p in plan.pieces[(rank, rank)]] == ["causal"]  # the diagonal: one call


def test_ring_rows_equal_the_block_plan():
    for ring, layout, causal in itertools.product([2, 3, 4, 8], ["zigzag", "contiguous"], [True, False]):
        plan = build_plan(4 * ring * 2, ring, layout, causal=causal, docs=None, window=None, batch=1)
        for rank in range(ring):
            assert ring_rows(ring, rank, plan.local_len, layout, causal) == (
                plan.rows_sent(rank),
                plan.rows_received(rank),
            )


def test_bad_kv_comm_and_chunks_are_refused_before_any_collective():
    from hybridsp.mesh._hybrid_mesh import MeshShape

    with pytest.raises(ValueError, match="unknown kv_comm 'gather'"):
        MeshShape(4, 2, 2, kv_comm="gather")
    with pytest.raises(ValueError, match="kv_chunks must be a positive integer"):
        MeshShape(4, 2, 2, kv_chunks=0)


# --------------------------------------------------------------------------- distributed


def _mode_errors(mesh, full, expected, causal, kv_comm):
    q, k, v = (shard_sequence(t, mesh).clone().requires_grad_() for t in full[:3])
    out = hybrid_attn_func(q, k, v, mesh=mesh, causal=causal, backend="torch", kv_comm=kv_comm)
    out.backward(shard_sequence(full[3], mesh))
    return [rel_err(a, shard_sequence(e, mesh)) for a, e in zip([out, q.grad, k.grad, v.grad], expected)]


def _allgather_exact(rank, world, meshes, kv_list, chunk_list):
    failures = []
    for causal, kv_heads in itertools.product([True, False], kv_list):
        full = random_qkv(BATCH, SEQ, HEADS, kv_heads, HEAD_DIM, seed=3)
        expected = reference_with_grads(*full, causal=causal)
        for (ulysses, ring), layout, chunks in itertools.product(meshes, ["zigzag", "contiguous"], chunk_list):
            mesh = init_mesh(ulysses=ulysses, ring=ring, layout=layout, kv_comm="allgather", kv_chunks=chunks)
            errors = _mode_errors(mesh, full, expected, causal, None)
            if max(errors) > TOLERANCE:
                failures.append(
                    f"U={ulysses} R={ring} {layout} chunks={chunks} causal={causal} kv={kv_heads}: {errors}"
                )
    assert not failures, "\n".join(failures)


@pytest.mark.distributed
def test_allgather_equals_float64_at_world4():
    # chunks None (default), 1 (one gather) and 8 (two rows per rank per chunk at R=2, one at R=4)
    run_distributed(_allgather_exact, 4, [(1, 4), (2, 2)], [HEADS, 1], [None, 1, 8])


@pytest.mark.distributed
@pytest.mark.slow  # a ring of one gathers nothing: Ulysses alone, which tests/attention/test_hybrid.py checks
def test_allgather_on_a_ring_of_one_at_world4():
    run_distributed(_allgather_exact, 4, [(4, 1)], [HEADS, 1], [None, 1, 8])


@pytest.mark.distributed
def test_allgather_equals_float64_at_world8():
    run_distributed(_allgather_exact, 8, [(1, 8), (2, 4)], [2], [None])


@pytest.mark.distributed
@pytest.mark.slow
def test_allgather_full_matrix_at_world8():
    run_distributed(_allgather_exact, 8, [(1, 8), (2, 4), (4, 2), (8, 1)], [HEADS, 2, 1], [None, 2], timeout=1200)


@pytest.mark.distributed
def test_allgather_serves_documents_and_windows():
    meshes = [((2, 2), "zigzag"), ((1, 4), "contiguous")]
    run_distributed(mask_cases.check_meshes, 4, meshes, (5, 100, 300), False, mask_cases.SEQ, (8, 1), "allgather")


def _bytes_match_formula(rank, world, cases):
    failures = []
    for (ulysses, ring), kv_comm in cases:
        mesh = init_mesh(ulysses=ulysses, ring=ring, kv_comm=kv_comm)
        for dtype, kv_heads in itertools.product([torch.float32, torch.bfloat16], [HEADS, 1]):
            full = random_qkv(BATCH, SEQ, HEADS, kv_heads, HEAD_DIM, seed=2, dtype=dtype)
            q, k, v = (shard_sequence(t, mesh).clone().requires_grad_() for t in full[:3])
            counter = CommCounter()
            hybrid_attn_func(q, k, v, mesh=mesh, backend="torch", counter=counter).backward(
                shard_sequence(full[3], mesh)
            )
            want = hybrid_bytes(
                batch=BATCH,
                seq_len=SEQ,
                heads=HEADS,
                kv_heads=kv_heads,
                head_dim=HEAD_DIM,
                ulysses=ulysses,
                ring=ring,
                ring_rank=mesh.ring_rank,
                element_size=q.element_size(),
                kv_comm=kv_comm,
            )
            if dict(counter.bytes_sent) != want:
                failures.append(
                    f"U={ulysses} R={ring} {kv_comm} {dtype} kv={kv_heads}: {dict(counter.bytes_sent)} != {want}"
                )
    assert not failures, "\n".join(failures)


@pytest.mark.distributed
def test_bytes_sent_equal_the_formula_for_every_mesh_at_world8():
    meshes = [(1, 8), (2, 4), (4, 2), (8, 1)]
    run_distributed(_bytes_match_formula, 8, list(itertools.product(meshes, ["ring", "allgather"])))


def _both_gathers(rank, world):
    import torch.distributed as dist

    from hybridsp.attention._transport.allgather import gather_chunk

    part = torch.full((2, 3, 1, 4), float(rank)) + torch.arange(4.0)  # [B, m, Hkv, D]
    outputs = []
    for direct in (True, False):
        out = torch.empty(world * 2, 3, 1, 4)
        gather_chunk(out, part, dist.group.WORLD, direct=direct).wait()
        outputs.append(out)
    expected = torch.cat([torch.full((2, 3, 1, 4), float(r)) + torch.arange(4.0) for r in range(world)])
    assert torch.equal(outputs[0], expected) and torch.equal(outputs[1], expected)


@pytest.mark.distributed
def test_direct_and_collective_gathers_place_every_rank_alike():
    run_distributed(_both_gathers, 3)


# --------------------------------------------------------------------------- kv_chunks and the batch's padding


def test_padded_length_honours_kv_chunks():
    groups = dict.fromkeys(["ulysses", "ring", "context", "data", "data_context"])  # nothing communicates
    mesh = HybridMesh(MeshShape(2, 1, 2, kv_comm="allgather", kv_chunks=4), 0, groups)
    for seq in (50, 61, 64, 100):
        padded = padded_length(seq, mesh)
        assert padded >= seq and (padded // 2) % 4 == 0 and padded % 4 == 0, (seq, padded)


def _kv_chunks_batch(rank, world):
    mesh = init_mesh(ulysses=1, ring=world, kv_comm="allgather", kv_chunks=4)
    ids = torch.arange(50)[None] % 17
    local = shard_batch({"input_ids": ids, "labels": ids}, mesh)
    q = torch.randn(1, local["input_ids"].shape[1], 2, 8)
    return hybrid_attn_func(q, q, q, mesh=mesh, backend="torch").shape


@pytest.mark.distributed
def test_allgather_chunks_never_meet_a_batch_they_cannot_split():
    assert all(shape[1] == 28 for shape in run_distributed(_kv_chunks_batch, 2))  # 50 -> 56 tokens, 4 chunks of 7
