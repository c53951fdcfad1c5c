"""Packed documents and sliding windows across the hybrid attention, against float64 masked attention.

The block plan (:mod:`hybridsp.layout._block_plan`) is checked cell by cell against the dense mask; the
band kernels against float64 math; the whole Ulysses x ring attention, forward and q/k/v
gradients, at world 4 and 8 for (U, R) in {(2,2), (1,4), (4,1), (2,4), (1,8)}.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import hybridsp
from hybridsp import hybrid_attn_func, init_mesh, shard_sequence
from hybridsp.kernels import get_kernel
from hybridsp.kernels._band import band_mask, flash_window
from hybridsp.kernels._flash import FlashAttnKernel
from hybridsp.layout._block_plan import build_plan
from hybridsp.layout._documents import normalize_cu_seqlens
from hybridsp.layout._layouts import layout_permutation
from hybridsp.testing import run_distributed
from tests.helpers.flash_attn_standin import make_standin
from tests.helpers.references.attention import random_qkv, rel_err
from tests.helpers.references.mask_cases import DOCS, ROW2, SEQ, check_meshes, piece_cells
from tests.helpers.references.masks import masked_reference_with_grads, visible_mask

TOLERANCE = 1e-5


# --------------------------------------------------------------------------- plan, no processes


def test_plan_covers_exactly_the_visible_cells_once():
    rng = random.Random(0)
    for _ in range(40):
        ring, layout = rng.choice([1, 2, 3, 4, 8]), rng.choice(["zigzag", "contiguous"])
        seq = 2 * ring * rng.randint(1, 10)
        causal, window = rng.random() < 0.8, rng.choice([None, 1, 2, 5, 17, 70, 1000])
        rows = [[0, *sorted(rng.sample(range(1, seq), min(seq - 1, rng.randint(0, 5)))), seq] for _ in range(2)]
        plan = build_plan(
            seq, ring, layout, causal=causal, docs=normalize_cu_seqlens(rows, 2, seq), window=window, batch=2
        )
        perm, local = layout_permutation(seq, ring, 1, layout), seq // ring
        for b, bounds in enumerate(rows):
            visible = visible_mask(seq, bounds, causal, window)
            for rank, source in itertools.product(range(ring), repeat=2):
                want = visible[perm[rank * local : (rank + 1) * local]][:, perm[source * local : (source + 1) * local]]
                got = sum(
                    (
                        piece_cells(p, local)
                        for p in plan.pieces[(rank, source)]
                        if p.batch == slice(None) or p.batch.start == b
                    ),
                    torch.zeros(local, local, dtype=torch.int32),
                )
                assert torch.equal(got, want.int()), (ring, layout, seq, causal, window, bounds, rank, source)


def test_window_work_and_rows_sent_scale_with_the_window():
    seq, ring = 4096, 4
    dense = build_plan(seq, ring, "zigzag", causal=True, docs=None, window=seq - 1, batch=1)
    for window in (16, 64, 256):
        plan = build_plan(seq, ring, "zigzag", causal=True, docs=None, window=window, batch=1)
        for rank in range(ring):
            # visible cells per rank ~ (S/R) * W; computed cells within a tile-size factor of that
            assert plan.work(rank) <= 3 * (seq // ring) * max(window, 64)
            assert plan.work(rank) < dense.work(rank) / 3
            # zigzag: two chunk edges, each needs the W - 1 keys before it (rank 0's first chunk none)
            assert plan.rows_received(rank) <= 2 * (window - 1)
        assert sum(plan.hulls[(r, s)] is not None for r in range(ring) for s in range(ring)) <= 3 * ring


def test_documents_skip_blocks_of_other_documents():
    # four documents, one per ring slot pair under the contiguous layout: only diagonal blocks visible
    plan = build_plan(256, 4, "contiguous", causal=True, docs=((0, 64, 128, 192, 256),), window=None, batch=1)
    for rank, source in itertools.product(range(4), repeat=2):
        assert (plan.hulls[(rank, source)] is None) == (rank != source)
        if rank == source:
            assert [p.kind for p in plan.pieces[(rank, source)]] == ["causal"]


def test_cu_seqlens_forms_and_errors():
    assert normalize_cu_seqlens(torch.tensor([0, 10, 16]), 2, 16) == ((0, 10, 16), (0, 10, 16))
    assert normalize_cu_seqlens([torch.tensor([0, 16]), [0, 3, 3, 16]], 2, 16) == ((0, 16), (0, 3, 16))
    assert normalize_cu_seqlens(torch.tensor([[0, 16], [0, 16]]), 2, 16) is None  # one document each
    for bad, words in [
        (torch.tensor([0, 10, 15]), "global sequence length 16"),
        (torch.tensor([0, 10, 8, 16]), "decreases from 10 to 8"),
        (torch.tensor([0.0, 16.0]), "integer tensor"),
        ([[0, 16]], "1 batch rows but the batch has 2"),
    ]:
        with pytest.raises(ValueError, match=words):
            normalize_cu_seqlens(bad, 2, 16)


# --------------------------------------------------------------------------- band kernels


def _band_reference(q, k, v, dout, band, scale):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2)) * scale
    scores = scores.masked_fill(~band_mask(q.shape[1], k.shape[1], band), -math.inf)
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1).nan_to_num(0.0), v.repeat_interleave(group, 2))
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


BANDS = [(0, None), (2, 5), (-3, 4), (None, 1), (-2, None), (3, 6)]


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_band_kernels_match_float64(backend, kv_heads):
    kernel = get_kernel(backend)
    q, k, v, dout = random_qkv(2, 12, 4, kv_heads, 16, seed=1)
    k, v = k[:, :9], v[:, :9]
    for band in BANDS:
        out, lse = kernel.forward_band(q, k, v, band=band, softmax_scale=0.25)
        grads = kernel.backward_band(dout, q, k, v, out, lse, band=band, softmax_scale=0.25)
        errors = [rel_err(a, e) for a, e in zip([out, *grads], _band_reference(q, k, v, dout, band, 0.25))]
        assert max(errors) < TOLERANCE, (band, errors)
        empty = ~band_mask(12, 9, band).any(dim=1)  # rows that see nothing: out 0, lse -inf, no NaN
        assert torch.isneginf(lse[:, :, empty]).all() and (out[:, empty] == 0).all()
        assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("version", ["2.8-opaque", "2.6", "2.4"])
def test_flash_band_uses_window_size_and_matches_reference(version):
    kernel, reference = FlashAttnKernel(make_standin(version)), get_kernel("reference")
    q, k, v, dout = random_qkv(2, 12, 4, 2, 16, seed=2, dtype=torch.bfloat16)
    for sk, band in [(12, (0, None)), (12, (0, 4)), (12, (-3, 4)), (9, (3, 6)), (9, (None, 3))]:
        kk, vv = k[:, :sk], v[:, :sk]
        visible = band_mask(12, sk, band)
        q_rows = visible.any(1).nonzero().flatten()
        k_cols = visible.any(0).nonzero().flatten()
        qq = q[:, q_rows[0] : q_rows[-1] + 1]
        kk, vv = kk[:, k_cols[0] : k_cols[-1] + 1], vv[:, k_cols[0] : k_cols[-1] + 1]
        shift = int(q_rows[0]) - int(k_cols[0])
        trimmed = (None if band[0] is None else band[0] - shift, None if band[1] is None else band[1] - shift)
        flash_window(qq.shape[1], kk.shape[1], trimmed)  # valid (non-negative) after trimming
        out, lse = kernel.forward_band(qq, kk, vv, band=trimmed, softmax_scale=0.25)
        out_r, lse_r = reference.forward_band(qq, kk, vv, band=trimmed, softmax_scale=0.25)
        assert (out.float() - out_r.float()).abs().max() < 1e-2 and (lse - lse_r).abs().max() < 1e-4
        d = dout[:, : qq.shape[1]]
        grads = kernel.backward_band(d, qq, kk, vv, out, lse, band=trimmed, softmax_scale=0.25)
        grads_r = reference.backward_band(d, qq, kk, vv, out_r, lse_r, band=trimmed, softmax_scale=0.25)
        for g, g_r in zip(grads, grads_r):
            assert (g.float() - g_r.float()).abs().max() < 3e-2


def test_flash_window_refuses_untrimmed_band():
    assert flash_window(8, 8, (0, 3)) == (3, 0)
    assert flash_window(4, 8, (None, None)) == (-1, -1)
    with pytest.raises(ValueError, match="trim the block"):
        flash_window(8, 8, (2, 5))


# --------------------------------------------------------------------------- distributed


# windows: smaller than one local ring block, between blocks (larger than a zigzag chunk), larger than S
WORLD4 = [((2, 2), "zigzag"), ((1, 4), "contiguous"), ((4, 1), "zigzag"), ((1, 4), "zigzag")]
WORLD8 = [((2, 4), "zigzag"), ((1, 8), "zigzag"), ((1, 8), "contiguous")]


@pytest.mark.distributed
def test_world4_documents_and_windows_equal_float64_masked_attention():
    run_distributed(check_meshes, 4, WORLD4[:3], (5, 100, 300), False)


@pytest.mark.distributed
@pytest.mark.slow
def test_world4_full_matrix():
    run_distributed(check_meshes, 4, WORLD4, (5, 100, 300), True)


@pytest.mark.distributed
@pytest.mark.slow  # a bigger size of the world-4 check above; test_world8_full_matrix holds these meshes too
def test_world8_documents_and_windows_equal_float64_masked_attention():
    run_distributed(check_meshes, 8, WORLD8[:2], (5, 40, 300), False)


@pytest.mark.distributed
def test_odd_ring_with_data_parallel_replicas():
    # R = 3 (two exchanges between the same pair in one step: K/V and dK/dV need their own tags), DP = 2
    run_distributed(check_meshes, 6, [((1, 3), "zigzag")], (5, 100, 300), False, 264, (2,))


@pytest.mark.distributed
@pytest.mark.slow
def test_world8_full_matrix():
    run_distributed(check_meshes, 8, WORLD8, (5, 40, 300), True)


# --------------------------------------------------------------------------- flash varlen path, bf16 rule


def _varlen_vs_per_piece(rank, world):
    """The flash backend through the ring: varlen calls (one per window) against one call per piece."""
    import torch.distributed as dist

    from hybridsp import ring_attention
    from hybridsp.layout._layouts import take_shard
    from tests.helpers.flash_attn_standin import with_varlen

    full = random_qkv(2, 128, 4, 2, 16, seed=1, dtype=torch.bfloat16)
    rows = [[0, 37, 40, 41, 128], [0, 100, 128]]
    worst = 0.0
    for opaque, window in [(False, None), (False, 7), (True, 50)]:
        results = []
        for kernel in (
            FlashAttnKernel(with_varlen(make_standin("2.8"), opaque=opaque)),
            FlashAttnKernel(make_standin("2.8")),
        ):
            q, k, v, dout = (take_shard(t, rank, 0, world).clone().requires_grad_() for t in full)
            out = ring_attention(q, k, v, dist.group.WORLD, cu_seqlens=rows, sliding_window=window, backend=kernel)
            out.backward(dout)
            results.append([out, q.grad, k.grad, v.grad])
        assert FlashAttnKernel(with_varlen(make_standin("2.8"))).supports_varlen
        assert not FlashAttnKernel(make_standin("2.8")).supports_varlen
        worst = max(worst, *(rel_err(a, b) for a, b in zip(*results)))
    assert worst < 1e-2, worst  # bf16 outputs of the same fp32 math: rounding only
    return worst


@pytest.mark.distributed
def test_flash_varlen_path_matches_the_per_piece_path():
    run_distributed(_varlen_vs_per_piece, 4)


def _bf16_rule(rank, world):
    """bf16 hybrid attention with documents + window: error against the fp32 reference at most
    twice the error of the same masked attention computed in bf16 on one process."""
    mesh = init_mesh(ulysses=2, ring=2)
    full32 = random_qkv(2, SEQ, 8, 2, 16, seed=5)
    full16 = [t.bfloat16() for t in full32]
    rows, window = [DOCS, ROW2], 40
    reference = masked_reference_with_grads(*[t.float() for t in full16], rows_bounds=rows, causal=True, window=window)
    q, k, v = (shard_sequence(t, mesh).clone().requires_grad_() for t in full16[:3])
    out = hybrid_attn_func(
        q, k, v, mesh=mesh, cu_seqlens=[torch.tensor(r) for r in rows], sliding_window=window, backend="torch"
    )
    out.backward(shard_sequence(full16[3], mesh))
    ours = [rel_err(a, shard_sequence(e, mesh)) for a, e in zip([out, q.grad, k.grad, v.grad], reference)]
    single = _bf16_single_process(full16, rows, window)
    baseline = [rel_err(shard_sequence(a, mesh), shard_sequence(e, mesh)) for a, e in zip(single, reference)]
    for mine, base in zip(ours, baseline):
        assert mine <= 2 * base, (ours, baseline)


def _bf16_single_process(full16, rows, window):
    """The same-dtype single-device kernel: one fused CPU call over the whole sequence with the
    full document + window mask (bf16), forward and backward (the yardstick of DESIGN.md)."""
    q, k, v, dout = (t.transpose(1, 2) for t in full16)  # [B, H, S, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    visible = torch.stack([visible_mask(q.shape[2], r, True, window) for r in rows])[:, None]  # [B, 1, S, S]
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, -math.inf)
    aten = torch.ops.aten
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, False, attn_mask=mask
    )
    b, h, s, d = dk.shape
    dk, dv = (x.float().reshape(b, h // group, group, s, d).sum(2).to(x.dtype) for x in (dk, dv))
    return [x.transpose(1, 2) for x in (out, dq, dk, dv)]


@pytest.mark.distributed
def test_bf16_within_twice_the_single_process_bf16_error():
    run_distributed(_bf16_rule, 4)


# --------------------------------------------------------------------------- errors, bytes


def _bad_inputs(rank, world):
    mesh = init_mesh(ulysses=2, ring=2)
    q, k, v, _ = (shard_sequence(t, mesh) for t in random_qkv(2, 64, 4, 2, 16))
    messages = {}
    for name, kwargs in {
        "short": dict(cu_seqlens=torch.tensor([0, 10, 60])),
        "rows": dict(cu_seqlens=[torch.tensor([0, 64])] * 3),
        "window": dict(sliding_window=0),
    }.items():
        with pytest.raises(ValueError) as info:
            hybrid_attn_func(q, k, v, mesh=mesh, backend="torch", **kwargs)
        messages[name] = str(info.value)
    assert "global sequence length 64" in messages["short"]
    assert "3 batch rows but the batch has 2" in messages["rows"]
    assert "sliding_window must be a positive number" in messages["window"]
    with pytest.raises(ValueError, match="sliding_window must be"):
        hybridsp.HybridAttention(mesh, sliding_window=-3)
    layer = hybridsp.HybridAttention(mesh, sliding_window=8, backend="torch")  # the module form works too
    assert layer(q, k, v, cu_seqlens=torch.tensor([0, 30, 64])).shape == q.shape


@pytest.mark.distributed
def test_bad_documents_or_window_raise_on_every_rank_before_any_collective():
    run_distributed(_bad_inputs, 4, timeout=300)  # catches a hang; start-up alone can take a minute when busy


def _window_bytes(rank, world, windows):
    import torch.distributed as dist

    from hybridsp import ring_attention
    from hybridsp.layout._layouts import take_shard

    sent = []
    for window in windows:
        q, k, v, dout = (take_shard(t, rank, 0, world).clone().requires_grad_() for t in random_qkv(1, 512, 4, 2, 16))
        counter = hybridsp.CommCounter()
        ring_attention(q, k, v, dist.group.WORLD, sliding_window=window, backend="torch", counter=counter).backward(
            dout
        )
        sent.append(counter.total())
    return sent


@pytest.mark.distributed
def test_window_bytes_scale_with_the_window_not_the_sequence():
    # zigzag, R = 4, chunks of 64 tokens: each rank receives the W - 1 keys before each of its two chunks
    # (rank 0's first chunk has none), so each rank sends W - 1 rows to each of two neighbours at most
    row = 2 * 16 * 4  # K/V heads x D x fp32 bytes, per row of K (or V)
    windows = (5, 33)
    per_rank = run_distributed(_window_bytes, 4, windows)
    for window, sent in zip(windows, zip(*per_rank)):
        bound = 2 * (window - 1) * row * (2 + 2 + 2)  # K, V forward; K, V backward; fp32 dK, dV home
        assert max(sent) == bound and min(sent) > 0, (window, sent, bound)
