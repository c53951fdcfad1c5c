"""The balanced layout with a sliding window, and the byte-bounded cache of slot runs.

- Placing for W = 512 keeps the plan's busiest ring slot within 5% of the mean on lognormal packs
  at R = 2, 4 and 8 (zigzag and the window-blind layout do not); without a window the runs are
  bit-identical to those before windows existed (a digest recorded on the parent commit).
- ``shard_sequence`` / ``gather_sequence`` with ``sliding_window`` round-trip, a ``Documents``
  carries its window to both and to the attention, a contradicting window is refused.
- ``hybrid_attn_func`` on tensors placed for a window equals float64 per-document windowed
  attention (forward and dq/dk/dv), the window reaching it on the documents or on the mesh.
- Many distinct packs never grow the runs cache beyond its byte budget.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from hybridsp import gather_sequence, hybrid_attn_func, init_mesh, shard_sequence
from hybridsp.layout._block_plan import build_plan
from hybridsp.layout._documents import Documents
from hybridsp.layout._layouts import BALANCED, get_layout, layout_permutation
from hybridsp.layout._runs_cache import RUNS_CACHE, RunsCache, entry_bytes
from hybridsp.testing import run_distributed
from tests.helpers.packs import lognormal_pack
from tests.helpers.references.attention import random_qkv, rel_err
from tests.helpers.references.masks import masked_reference_with_grads

SEQ = 16384
WINDOW = 512
# sha256 over repr(BALANCED.slot_runs(4096, R, lognormal_pack(4096, seed))) for seeds 0..49, R = 2, 4,
# computed on the commit before windows (c94a3aa)
NO_WINDOW_DIGEST = "1660715b3514d3ef2accd427016285425685631bffc70ca75892db8b09ff967a"


def _plan_ratio(layout, bounds, ring, window):
    plan = build_plan(SEQ, ring, layout, causal=True, docs=(bounds,), window=window, batch=1)
    work = [plan.work(r) for r in range(ring)]
    return max(work) * ring / sum(work)


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_placing_for_the_window_balances_the_plan_within_5_percent(ring):
    windowed = get_layout("balanced", WINDOW)
    worst = {"zigzag": 0.0, "blind": 0.0, "windowed": 0.0}
    for seed in range(12):
        bounds = lognormal_pack(SEQ, seed)
        for name, layout in (("zigzag", "zigzag"), ("blind", BALANCED), ("windowed", windowed)):
            worst[name] = max(worst[name], _plan_ratio(layout, bounds, ring, WINDOW))
    assert worst["windowed"] <= 1.05, worst
    assert worst["windowed"] < worst["blind"] - 0.05 and worst["windowed"] < worst["zigzag"] - 0.1, worst


def test_without_a_window_the_runs_are_those_of_before():
    digest = hashlib.sha256()
    for seed in range(50):
        for ring in (2, 4):
            digest.update(repr(BALANCED.slot_runs(4096, ring, lognormal_pack(4096, seed))).encode())
    assert digest.hexdigest() == NO_WINDOW_DIGEST


def test_the_window_is_part_of_the_layout():
    assert get_layout("balanced", None) is BALANCED and get_layout("zigzag", 64) is get_layout("zigzag")
    assert get_layout("balanced", 64) == BALANCED.placing(64) != BALANCED
    assert len({BALANCED, BALANCED.placing(64), BALANCED.placing(64), BALANCED.placing(65)}) == 3
    bounds = lognormal_pack(4096, 3)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    assert BALANCED.placing(longest).slot_runs(4096, 4, bounds) == BALANCED.slot_runs(4096, 4, bounds)
    assert BALANCED.placing(64).slot_runs(4096, 4, bounds) != BALANCED.slot_runs(4096, 4, bounds)
    with pytest.raises(ValueError, match="positive number of tokens or None; got 0"):
        BALANCED.placing(0)


def test_many_distinct_packs_stay_within_the_cache_budget():
    small = RunsCache(max_bytes=200_000)
    for seed in range(300):
        bounds = lognormal_pack(4096, seed)
        small.get(("pack", seed), bounds, lambda b=bounds: BALANCED._runs(4096, 4, b))
        assert small.nbytes <= small.max_bytes
    assert 0 < len(small) < 300 and small.misses == 300
    runs = BALANCED._runs(4096, 4, lognormal_pack(4096, 0))
    assert entry_bytes(lognormal_pack(4096, 0), runs) > 1000  # the estimate counts the boundaries and runs
    for seed in range(200):  # the process-wide cache, through the layout: bounded too
        layout_permutation(4096, 2, 2, "balanced", lognormal_pack(4096, 1000 + seed))
    assert RUNS_CACHE.nbytes <= RUNS_CACHE.max_bytes
    with pytest.raises(ValueError, match="budget of >= 0 bytes; got -1"):
        RunsCache(-1)


ROWS = (lognormal_pack(512, 7), (0, 40, 400, 512))  # documents longer than the window, short ones


def _roundtrip(rank, world):
    mesh = init_mesh(ulysses=2, ring=world // 2, layout="balanced")
    x = torch.arange(2 * 512 * 3, dtype=torch.float32).view(2, 512, 3)
    local = shard_sequence(x, mesh, cu_seqlens=list(ROWS), sliding_window=32)
    assert not torch.equal(local, shard_sequence(x, mesh, cu_seqlens=list(ROWS)))  # the window moved tokens
    assert torch.equal(gather_sequence(local, mesh, cu_seqlens=list(ROWS), sliding_window=32), x)
    documents = Documents(2, 512, ROWS, window=32)
    assert torch.equal(shard_sequence(x, mesh, cu_seqlens=documents), local)
    assert torch.equal(gather_sequence(local, mesh, cu_seqlens=documents), x)
    with pytest.raises(ValueError, match="sliding_window=16 was given but the documents were placed for window 32"):
        shard_sequence(x, mesh, cu_seqlens=documents, sliding_window=16)
    windowed = init_mesh(ulysses=2, ring=world // 2, layout="balanced", sliding_window=32)
    assert torch.equal(shard_sequence(x, windowed, cu_seqlens=list(ROWS)), local)  # the mesh's default


@pytest.mark.distributed
def test_shard_and_gather_with_a_window_round_trip():
    run_distributed(_roundtrip, 4)


def _attention(rank, world, ulysses, window):
    full = random_qkv(2, 512, 4, 2, 16, seed=3)
    errors = {}
    # (where the placement window comes from, the layer's own window): a full-attention layer of a
    # model placed for a window computes exactly too
    for source, layer in (("documents", window), ("mesh", window), ("documents", None)):
        mesh = init_mesh(
            ulysses=ulysses,
            ring=world // ulysses,
            layout="balanced",
            sliding_window=window if source == "mesh" else None,
        )
        cu = Documents(2, 512, ROWS, window=window) if source == "documents" else list(ROWS)
        q, k, v = (shard_sequence(t, mesh, cu_seqlens=cu).clone().requires_grad_() for t in full[:3])
        out = hybrid_attn_func(q, k, v, mesh=mesh, cu_seqlens=cu, sliding_window=layer, backend="torch")
        out.backward(shard_sequence(full[3], mesh, cu_seqlens=cu))
        expected = masked_reference_with_grads(*full, rows_bounds=ROWS, causal=True, window=layer)
        got = [out, q.grad, k.grad, v.grad]
        errors[source, layer] = max(rel_err(a, shard_sequence(e, mesh, cu_seqlens=cu)) for a, e in zip(got, expected))
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("ulysses", [1, 2])
def test_windowed_balanced_attention_equals_float64_reference(ulysses):
    for errors in run_distributed(_attention, 4, ulysses, 32):
        assert max(errors.values()) < 1e-5, errors


def test_plan_work_counts_the_block_plans_cells():
    from hybridsp.layout._balance.refine import plan_work
    from hybridsp.layout._balance.work import TiledWindow

    for window, ring, seed in ((512, 8, 19), (64, 4, 3), (2048, 2, 5)):
        bounds = lognormal_pack(SEQ, seed)
        layout = get_layout("balanced", window)
        plan = build_plan(SEQ, ring, layout, causal=True, docs=(bounds,), window=window, batch=1)
        runs = layout.slot_runs(SEQ, ring, bounds)
        assert plan_work(runs, bounds, TiledWindow.of(window)) == [plan.work(r) for r in range(ring)]
