"""The document-balanced token layout (``layout="balanced"``), against independent references.

- The plan of a balanced layout covers every visible (query, key) cell of float64 masked attention
  exactly once, for random packs (one process).
- ``shard_sequence`` / ``gather_sequence`` with ``cu_seqlens`` round-trip, per row.
- ``hybrid_attn_func`` on tensors sharded that way equals float64 per-document attention (forward and
  dq/dk/dv) at every U x R of world 4 (and 8 in the slow matrix), both K/V transports, windows, GQA,
  B = 2 with different packs per row, documents of length 1 and longer than S/2, boundaries on
  shard edges.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridsp import gather_sequence, hybrid_attn_func, init_mesh, shard_sequence
from hybridsp.layout._block_plan import build_plan
from hybridsp.layout._documents import Documents
from hybridsp.layout._layouts import BALANCED, ZIGZAG, layout_permutation
from hybridsp.testing import run_distributed
from tests.helpers.references.attention import random_qkv, rel_err
from tests.helpers.references.masks import masked_reference_with_grads, visible_mask

TOLERANCE = 1e-5
SEQ = 256
ROW_LONG = (0, 1, 150, 180, 256)  # a length-1 document and one longer than S / 2
ROW_EDGES = (0, 32, 64, 128, 131, 256)  # boundaries on shard edges (S / 8 = 32) and a short document


def _cells(plan, perm, local):
    """{(global query, global key)} each plan piece computes, counting repeats."""
    seen = {}
    for (rank, source), pieces in plan.pieces.items():
        for piece in pieces:
            for i in range(piece.rows.start, piece.rows.stop):
                for j in range(piece.keys.start, piece.keys.stop):
                    d = (i - piece.rows.start) - (j - piece.keys.start)  # bands are piece-relative
                    lo, hi = (0, None) if piece.kind == "causal" else piece.band
                    if piece.kind != "full" and ((lo is not None and d < lo) or (hi is not None and d > hi)):
                        continue
                    cell = (int(perm[rank * local + i]), int(perm[source * local + j]))
                    seen[cell] = seen.get(cell, 0) + 1
    return seen


def _random_pack(rng, seq):
    cuts = sorted(rng.sample(range(1, seq), rng.randint(1, 12)))
    return (0, *cuts, seq)


@pytest.mark.parametrize("ring", [2, 3, 4])
def test_balanced_plan_covers_every_visible_cell_once(ring):
    rng = random.Random(ring)
    seq = 48 * ring
    for _ in range(6):
        bounds = _random_pack(rng, seq)
        for causal, window in [(True, None), (True, 7), (False, None)]:
            plan = build_plan(seq, ring, "balanced", causal=causal, docs=(bounds,), window=window, batch=1)
            seen = _cells(plan, layout_permutation(seq, ring, 1, "balanced", bounds), seq // ring)
            want = visible_mask(seq, bounds, causal, window).nonzero().tolist()
            assert set(seen) == {tuple(c) for c in want}, (bounds, causal, window)
            assert max(seen.values()) == 1


def test_balanced_layout_is_zigzag_for_one_document_and_balances_packs():
    assert BALANCED.slot_runs(64, 4, (0, 64)) == ZIGZAG.slot_runs(64, 4)
    assert torch.equal(layout_permutation(64, 4, 2, "balanced", None), layout_permutation(64, 4, 2, "zigzag"))
    bounds = (0, 3000, 3500, 3600, 8192)  # zigzag puts the long first document's tail work on slot 0
    plans = {
        name: build_plan(8192, 4, name, causal=True, docs=(bounds,), window=None, batch=1)
        for name in ("zigzag", "balanced")
    }
    ratio = {name: max(p.work(r) for r in range(4)) * 4 / sum(p.work(r) for r in range(4)) for name, p in plans.items()}
    assert ratio["balanced"] < ratio["zigzag"] and ratio["balanced"] < 1.1, ratio


def _roundtrip(rank, world):
    mesh = init_mesh(ulysses=2, ring=world // 2, layout="balanced")
    rows = [ROW_LONG, ROW_EDGES]
    x = torch.arange(2 * SEQ * 3, dtype=torch.float32).view(2, SEQ, 3)
    local = shard_sequence(x, mesh, cu_seqlens=rows)
    assert local.shape == (2, SEQ // world, 3)
    assert torch.equal(gather_sequence(local, mesh, cu_seqlens=[torch.tensor(r) for r in rows]), x)
    documents = Documents(2, SEQ, rows=tuple(rows))
    assert torch.equal(shard_sequence(x, mesh, cu_seqlens=documents), local)
    shared = shard_sequence(x, mesh, cu_seqlens=torch.tensor(ROW_LONG))  # one row of boundaries for every row
    assert torch.equal(gather_sequence(shared, mesh, cu_seqlens=torch.tensor(ROW_LONG)), x)


@pytest.mark.distributed
def test_shard_and_gather_sequence_with_documents_round_trip():
    run_distributed(_roundtrip, 4)


def _case(mesh, full, rows, causal, window, kv_comm):
    cu = torch.tensor(rows[0]) if rows[0] == rows[1] else [torch.tensor(r) for r in rows]
    q, k, v = (shard_sequence(t, mesh, cu_seqlens=cu).clone().requires_grad_() for t in full[:3])
    out = hybrid_attn_func(
        q, k, v, mesh=mesh, causal=causal, cu_seqlens=cu, sliding_window=window, backend="torch", kv_comm=kv_comm
    )
    out.backward(shard_sequence(full[3], mesh, cu_seqlens=cu))
    expected = masked_reference_with_grads(*full, rows_bounds=rows, causal=causal, window=window)
    got = [out, q.grad, k.grad, v.grad]
    return max(rel_err(a, shard_sequence(e, mesh, cu_seqlens=cu)) for a, e in zip(got, expected))


CASES = [  # (rows, causal, window)
    ((ROW_LONG, ROW_EDGES), True, None),
    ((ROW_EDGES, ROW_EDGES), True, 20),
    ((ROW_LONG, ROW_EDGES), True, 90),
    ((ROW_LONG, ROW_LONG), False, None),
]


def _check(rank, world, meshes, kv_comms, kv_heads_list, cases):
    failures = []
    for ulysses, ring in meshes:
        for kv_comm in kv_comms:
            mesh = init_mesh(ulysses=ulysses, ring=ring, layout="balanced", kv_comm=kv_comm)
            for kv_heads in kv_heads_list:
                full = random_qkv(2, SEQ, 8, kv_heads, 16, seed=5)
                for rows, causal, window in cases:
                    error = _case(mesh, full, rows, causal, window, kv_comm)
                    if error > TOLERANCE:
                        failures.append(
                            f"U{ulysses} R{ring} {kv_comm} kv={kv_heads} {rows} {causal} W={window}: {error:.2e}"
                        )
    assert not failures, "\n".join(failures)


@pytest.mark.distributed
def test_world4_balanced_equals_float64_per_document_attention():
    run_distributed(_check, 4, [(2, 2), (1, 4)], ("ring", "allgather"), (8, 1), CASES[:3])


@pytest.mark.distributed
def test_world8_balanced_equals_float64_per_document_attention():
    run_distributed(_check, 8, [(1, 8)], ("ring",), (2,), CASES[:1])


@pytest.mark.distributed
@pytest.mark.slow
def test_balanced_full_matrix():
    run_distributed(_check, 4, [(2, 2), (1, 4), (4, 1)], ("ring", "allgather"), (8, 2, 1), CASES)
    run_distributed(_check, 8, [(2, 4), (1, 8), (4, 2)], ("ring", "allgather"), (8, 1), CASES)


def _bytes(rank, world):
    from hybridsp import CommCounter
    from hybridsp.attention._resolve import plan_for
    from hybridsp.attention._volume import hybrid_bytes
    from hybridsp.layout._documents import as_documents

    out = []
    for layout in ("zigzag", "balanced"):
        mesh = init_mesh(ulysses=2, ring=world // 2, layout=layout)
        rows = [ROW_LONG, ROW_EDGES]
        full = random_qkv(2, SEQ, 4, 2, 8, seed=6)
        q, k, v = (shard_sequence(t, mesh, cu_seqlens=rows).clone().requires_grad_() for t in full[:3])
        counter = CommCounter()
        out_ = hybrid_attn_func(q, k, v, mesh=mesh, cu_seqlens=rows, backend="torch", counter=counter)
        out_.backward(torch.ones_like(out_))
        plan = plan_for(as_documents(rows, 2, SEQ), mesh.token_layout, mesh.ring, True, None)
        want = hybrid_bytes(
            batch=2,
            seq_len=SEQ,
            heads=4,
            kv_heads=2,
            head_dim=8,
            ulysses=2,
            ring=mesh.ring,
            ring_rank=mesh.ring_rank,
            element_size=4,
            plan=plan,
        )
        out.append((dict(counter.bytes_sent), want))
    return out


@pytest.mark.distributed
def test_bytes_sent_equal_the_plan_formula_for_both_layouts():
    for per_layout in run_distributed(_bytes, 4):
        for sent, want in per_layout:
            assert sent == want, (sent, want)


def test_planner_reports_what_the_balanced_layout_buys():
    import json
    import subprocess
    import sys

    from hybridsp.planner._packing import pack_bounds, packing_imbalance

    assert pack_bounds([5, 3], 12) == (0, 5, 8, 12)
    skewed = packing_imbalance([3000, 500, 100, 4000, 200], 16384, 4)
    assert skewed["zigzag"] > 1.2 and skewed["balanced"] < 1.05, skewed
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridsp",
            "plan",
            "--model",
            "llama3-8b",
            "--seq-len",
            "131072",
            "--ulysses",
            "2",
            "--ring",
            "4",
            "--doc-lengths",
            "5000,120,800,20000,300",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    packing = json.loads(out)["packing"]
    assert packing["ring"] == 4 and packing["zigzag"] > packing["balanced"] and "balanced" in packing["report"]
    rows = packing["kv_rows"]  # what it costs: rows per ring pass, and the floor for any layout within 5%
    assert 0 <= rows["floor_105"] <= rows["balanced"] and rows["zigzag"] > 0 and "K/V rows" in packing["report"]
