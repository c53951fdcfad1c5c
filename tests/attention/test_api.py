"""hybrid_attn_func and HybridAttention as users call them, against independent references: cu_seqlens
given positionally to the module (float64 masked attention), a NaN in one query, key or value row (one
kernel call over the whole sequence)."""

from __future__ import annotations

import pytest
import torch

from hybridsp import HybridAttention, gather_sequence, hybrid_attn_func, init_mesh, shard_sequence
from hybridsp.testing import run_distributed
from tests.helpers.references.attention import random_qkv, rel_err
from tests.helpers.references.masks import masked_reference_with_grads

pytestmark = pytest.mark.distributed

DOCS = (0, 10, 40, 64)


def _module_positional_documents(rank, world):
    mesh = init_mesh(ulysses=1, ring=world)
    full = random_qkv(1, 64, 4, 2, 8, seed=1)
    attn = HybridAttention(mesh, backend="torch")
    q, k, v = (shard_sequence(t, mesh) for t in full[:3])
    out = attn(q, k, v, torch.tensor(DOCS))  # documented positional form: forward(q, k, v, cu_seqlens)
    expected = masked_reference_with_grads(*full, rows_bounds=[DOCS], causal=True, window=None)[0]
    return rel_err(out, shard_sequence(expected, mesh))


@pytest.mark.parametrize("world", [1, 2])
def test_hybrid_attention_module_takes_cu_seqlens_positionally(world):
    assert max(run_distributed(_module_positional_documents, world)) < 1e-5


def _nan_query(rank, world):
    mesh = init_mesh(ulysses=1, ring=world)
    q, k, v, _ = random_qkv(1, 32, 2, 2, 8, seed=2)
    q[0, 20, 1, 3] = float("nan")  # one query row of one head
    out = hybrid_attn_func(*(shard_sequence(t, mesh) for t in (q, k, v)), mesh=mesh, backend="torch")
    whole = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True
    )[0].transpose(1, 2)  # one kernel call
    return torch.isnan(out), torch.isnan(shard_sequence(whole, mesh))


def test_nan_in_a_query_propagates_like_one_kernel_call():
    results = run_distributed(_nan_query, 2)
    assert any(want.any() for _, want in results)  # the NaN row lives on one rank
    assert all(torch.equal(got, want) for got, want in results)


NAN_AT = {"q": 3, "k": 4, "v": 12}  # S=16 zigzag: q row 3 and k row 4 see only their own block's keys


def _nan_pattern(x):
    """[B, S, H, D] -> [B, S, H] bool: which rows hold a NaN."""
    return torch.isnan(x).any(-1)


def _one_kernel_call(q, k, v, dout):
    """NaN patterns of (out, dq, dk, dv) of one aten CPU kernel call on the whole causal sequence."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(t(q), t(k), t(v), 0.0, True)[:2]
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        t(dout), t(q), t(k), t(v), out, lse, 0.0, True
    )
    return [_nan_pattern(t(x)) for x in (out, *grads)]


def _defined_nan(q, k, v):
    """NaN patterns of (out, dq, dk, dv) that causal attention defines: a row is NaN when a score or value it
    sees is; dq where out is; dk (dv) of keys seen by a NaN row (by a row with a NaN score)."""
    group = q.shape[2] // k.shape[2]
    per_head = lambda x: _nan_pattern(x).repeat_interleave(group, dim=2)  # noqa: E731  [B, S, H]
    seen = lambda rows: rows.flip(1).cummax(1).values.flip(1)  # noqa: E731  key j: some row i >= j is set
    by_kv = lambda rows: rows.unflatten(2, (k.shape[2], group)).any(-1)  # noqa: E731  [B, S, Hkv]
    score_nan = _nan_pattern(q) | per_head(k).cummax(1).values  # [B, S, H]
    out = score_nan | per_head(v).cummax(1).values
    return out, out, by_kv(seen(out)), by_kv(seen(score_nan))


def _nan_rows(rank, world, ulysses):
    mesh = init_mesh(ulysses=ulysses, ring=world // ulysses)
    results = {}
    for which, row in NAN_AT.items():
        q, k, v, dout = random_qkv(1, 16, 4, 2, 8, seed=2)
        {"q": q, "k": k, "v": v}[which][0, row, 1, 3] = float("nan")
        local = [shard_sequence(t, mesh).requires_grad_() for t in (q, k, v)]
        out = hybrid_attn_func(*local, mesh=mesh, backend="torch")
        out.backward(shard_sequence(dout, mesh))
        got = [_nan_pattern(gather_sequence(x, mesh)) for x in (out.detach(), *(t.grad for t in local))]
        patterns = got, _one_kernel_call(q, k, v, dout), _defined_nan(q, k, v)
        results[which] = [[x.tolist() for x in kind] for kind in patterns]  # lists: no tensors through the queue
    return results


@pytest.mark.parametrize("ulysses,world", [(1, 2), (2, 4)])
def test_nan_in_a_row_shows_where_one_kernel_call_shows_it(ulysses, world):
    """Out: exactly one kernel call's pattern for a NaN query or key; a NaN value, and the gradients, make the
    single call spread NaN through 0 x NaN in its block products (rows that cannot see it), so there the ring
    must lie between the defined pattern and the single call's."""
    for which, patterns in run_distributed(_nan_rows, world, ulysses)[0].items():
        got, single, defined = ([torch.tensor(x) for x in kind] for kind in patterns)
        assert defined[0].any(), which
        for name, g, s, d in zip(("out", "dq", "dk", "dv"), got, single, defined):
            assert not (d & ~g).any() and not (g & ~s).any(), (which, name)
        if which != "v":
            assert torch.equal(got[0], single[0]), which


def _empty_batch(rank, world, ulysses):
    mesh = init_mesh(ulysses=ulysses, ring=world // ulysses)
    q, k, v, _ = random_qkv(1, 16, 4, 2, 8)
    q, k, v = (shard_sequence(t[:0], mesh).requires_grad_() for t in (q, k, v))  # B = 0 on every rank
    out = hybrid_attn_func(q, k, v, mesh=mesh, backend="torch")
    out.sum().backward()
    return tuple(out.shape), tuple(q.grad.shape), tuple(k.grad.shape)


@pytest.mark.parametrize("ulysses", [2, 1])
def test_an_empty_batch_gives_an_empty_output_and_gradients(ulysses):
    """B = 0 (a data loader's empty last batch) runs through the all-to-alls and the ring: shapes like q's."""
    for out, dq, dk in run_distributed(_empty_batch, 2, ulysses):
        assert out == (0, 8, 4, 8) and dq == (0, 8, 4, 8) and dk == (0, 8, 2, 8)
