"""Learned sinks, logit soft-capping and a value head dim apart from q/k's, through the whole hybrid
attention (Ulysses x ring, both K/V transports, every layout, documents and windows), against float64
attention written as the unmodified models write it (tests/helpers/references/attention.py): forward, the
gradients of q, k, v and of the sinks (each rank's sinks.grad summed over the context ranks), and
the bytes the counter records against the analytic formula."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import hybridsp
from hybridsp import HybridAttention, hybrid_attn_func, init_mesh, shard_sequence
from hybridsp.attention._ring import ring_attention
from hybridsp.attention._volume import hybrid_bytes
from hybridsp.testing import run_distributed
from tests.helpers.mesh import mesh_at
from tests.helpers.references.attention import random_qkv, rel_err, sinks_reference_with_grads

TOLERANCE = 1e-5
SEQ = 48


class Case(NamedTuple):
    ulysses: int
    ring: int
    layout: str = "zigzag"
    kv_comm: str = "ring"
    kv_heads: int = 2
    dims: tuple[int, int] = (24, 16)  # (q/k head dim, v head dim)
    sinks: bool = True
    softcap: float | None = None
    docs: tuple[int, ...] | None = None
    window: int | None = None
    dtype: torch.dtype = torch.float32
    heads: int = 4
    backend: str = "auto"  # or "flash-standin": FlashAttnKernel on the CPU stand-in of flash-attn 2.8 (varlen too)


def _backend(name: str):
    """A backend name, or the flash adapter on the CPU stand-in (built in the rank: not picklable)."""
    if name != "flash-standin":
        return name
    from hybridsp.kernels._flash import FlashAttnKernel
    from tests.helpers.flash_attn_standin import make_standin, with_varlen

    return FlashAttnKernel(with_varlen(make_standin("2.8")))


def _sinks(heads, dtype=torch.float32):
    return torch.linspace(-1.0, 2.0, heads).to(dtype)  # logits near the scores' range, so they matter


def _run_case(mesh, case: Case, seed: int):
    """Errors of this rank's (out, dq, dk, dv) shards and of the context-summed sinks grad."""
    d, dv = case.dims
    full = random_qkv(2, SEQ, case.heads, case.kv_heads, d, v_head_dim=dv, seed=seed, dtype=case.dtype)
    sinks = _sinks(case.heads).requires_grad_() if case.sinks else None
    cu = None if case.docs is None else torch.tensor(case.docs)
    q, k, v, dout = (shard_sequence(t, mesh, cu_seqlens=cu).clone() for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = hybrid_attn_func(
        q,
        k,
        v,
        mesh=mesh,
        cu_seqlens=cu,
        sliding_window=case.window,
        sinks=sinks,
        softcap=case.softcap,
        backend=_backend(case.backend),
    )
    out.backward(dout)
    bounds = None if case.docs is None else [list(case.docs)] * 2
    expected = sinks_reference_with_grads(
        *full, causal=True, sinks=sinks, softcap=case.softcap, rows_bounds=bounds, window=case.window
    )
    got = [out, q.grad, k.grad, v.grad]
    errors = [rel_err(a, shard_sequence(e, mesh, cu_seqlens=cu)) for a, e in zip(got, expected[:4])]
    if case.sinks:
        summed = sinks.grad.clone()
        dist.all_reduce(summed, group=mesh.context_group)  # the framework's sum over the context ranks
        errors.append(rel_err(summed, expected[4]))
    return errors, got, sinks


def _single_process_bf16(case: Case, seed: int):
    """(out, dq, dk, dv, dsinks) errors of one bf16 process (ring of one, the same kernel) against
    float64: the yardstick."""
    d, dv = case.dims
    full = random_qkv(2, SEQ, case.heads, case.kv_heads, d, v_head_dim=dv, seed=seed, dtype=torch.bfloat16)
    sinks = _sinks(case.heads).requires_grad_()
    q, k, v = (t.clone().requires_grad_() for t in full[:3])
    cu = None if case.docs is None else torch.tensor(case.docs)
    out = ring_attention(
        q,
        k,
        v,
        None,
        sinks=sinks,
        softcap=case.softcap,
        cu_seqlens=cu,
        sliding_window=case.window,
        backend=_backend(case.backend),
    )
    out.backward(full[3])
    bounds = None if case.docs is None else [list(case.docs)] * 2
    expected = sinks_reference_with_grads(
        *full, causal=True, sinks=sinks, softcap=case.softcap, rows_bounds=bounds, window=case.window
    )
    return [rel_err(a, e) for a, e in zip([out, q.grad, k.grad, v.grad, sinks.grad], expected)]


def check_cases(rank, world, cases):
    failures = []
    for i, case in enumerate(cases):
        mesh = init_mesh(ulysses=case.ulysses, ring=case.ring, layout=case.layout, kv_comm=case.kv_comm)
        errors, _, _ = _run_case(mesh, case, seed=i)
        if case.dtype == torch.bfloat16:
            limits = [2 * e + 1e-3 for e in _single_process_bf16(case, seed=i)]
        else:
            limits = [TOLERANCE] * len(errors)
        if any(e > lim for e, lim in zip(errors, limits)):
            failures.append(f"{case}: {['%.1e' % e for e in errors]} (limits {['%.1e' % x for x in limits]})")
    assert not failures, "\n".join(failures)


DOCS = (0, 7, 30, 31, 48)
WORLD4 = [
    Case(2, 2, softcap=2.0),
    Case(2, 2, kv_comm="allgather", kv_heads=1),
    Case(1, 4, dims=(16, 24), softcap=1.0, kv_heads=4),
    Case(
        1,
        4,
        layout="contiguous",
        kv_comm="allgather",
        kv_heads=1,
        dims=(24, 13),
        docs=DOCS,
        window=9,
        dtype=torch.float64,
    ),
    Case(2, 2, docs=DOCS, window=9, softcap=3.0),
    Case(2, 2, layout="balanced", docs=DOCS),
    Case(4, 1, kv_heads=1, softcap=2.0),  # a ring of one that nothing masks: one kernel call (plan None)
    Case(2, 2, dims=(24, 16), dtype=torch.bfloat16),
    Case(2, 2, dims=(24, 13), softcap=2.0, docs=DOCS, window=9, dtype=torch.bfloat16, backend="flash-standin"),
]


@pytest.mark.distributed
def test_world4_sinks_softcap_and_value_head_dims_equal_the_unmodified_math():
    run_distributed(check_cases, 4, WORLD4)


@pytest.mark.distributed
def test_ring_of_three_with_sinks_and_value_head_dim():
    run_distributed(
        check_cases,
        3,
        [Case(1, 3, softcap=2.0, kv_heads=1, dims=(24, 13)), Case(1, 3, kv_comm="allgather", docs=DOCS, window=9)],
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_world6_ulysses_three_and_more_cases():
    cases = [
        Case(3, 2, kv_heads=1, dims=(24, 13), heads=6),
        Case(3, 2, kv_comm="allgather", softcap=2.0, docs=DOCS, heads=6),
        Case(3, 1, dims=(8, 24), heads=6),
        Case(3, 2, layout="balanced", docs=DOCS, window=9, heads=6, dtype=torch.float64),
    ]
    run_distributed(check_cases, 6, cases, timeout=600)


@pytest.mark.distributed
@pytest.mark.slow
def test_world4_full_matrix():
    cases = [
        Case(u, r, layout, kv_comm, kv, dims, True, cap, docs, window)
        for u, r in [(2, 2), (1, 4)]
        for layout in ("zigzag", "contiguous")
        for kv_comm in ("ring", "allgather")
        for kv, dims in [(4, (24, 16)), (1, (16, 13))]
        for cap in (None, 2.0)
        for docs, window in [(None, None), (DOCS, 9)]
    ]
    run_distributed(check_cases, 4, cases, timeout=900)


def _disagreements(rank, world):
    """Each rank's error message per setting one rank passes differently (None: it ran)."""
    mesh = init_mesh(ulysses=2, ring=2)
    q, k, v, _ = (shard_sequence(t, mesh) for t in random_qkv(1, 32, 4, 2, 8, v_head_dim=8, seed=3))
    odd = rank == 1
    calls = {
        "sinks": lambda: hybrid_attn_func(q, k, v, mesh=mesh, sinks=None if odd else _sinks(4)),
        "sinks dtype": lambda: hybrid_attn_func(
            q, k, v, mesh=mesh, sinks=_sinks(4, torch.float64 if odd else torch.float32)
        ),
        "softcap": lambda: hybrid_attn_func(q, k, v, mesh=mesh, softcap=30.0 if odd else 50.0),
        "value head dim": lambda: hybrid_attn_func(q, k, v[..., :5] if odd else v, mesh=mesh),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    return messages


@pytest.mark.distributed
def test_ranks_that_disagree_on_sinks_softcap_or_value_head_dim_raise_on_every_rank():
    for messages in run_distributed(_disagreements, 4, timeout=300):  # catches a hang
        assert "disagree on sinks" in messages["sinks"] and "disagree on sinks" in messages["sinks dtype"]
        assert "disagree on softcap" in messages["softcap"]
        assert "disagree on value head dim" in messages["value head dim"]


# --------------------------------------------------------------------------- bytes


def _bytes_sent(rank, world, kv_comm):
    mesh = init_mesh(ulysses=2, ring=2, kv_comm=kv_comm)
    full = random_qkv(1, 64, 8, 2, 24, v_head_dim=16)
    q, k, v, dout = (shard_sequence(t, mesh).requires_grad_() for t in full)
    counter = hybridsp.CommCounter()
    hybrid_attn_func(q, k, v, mesh=mesh, sinks=_sinks(8).requires_grad_(), backend="torch", counter=counter).backward(
        dout
    )
    return mesh.ring_rank, dict(counter.bytes_sent)


@pytest.mark.distributed
@pytest.mark.parametrize("kv_comm", ["ring", "allgather"])
def test_bytes_with_a_narrower_value_head_dim_equal_the_formula(kv_comm):
    for ring_rank, sent in run_distributed(_bytes_sent, 4, kv_comm):
        want = hybrid_bytes(
            batch=1,
            seq_len=64,
            heads=8,
            kv_heads=2,
            head_dim=24,
            v_head_dim=16,
            ulysses=2,
            ring=2,
            ring_rank=ring_rank,
            element_size=4,
            kv_comm=kv_comm,
        )
        assert sent == want
        # nothing padded on the wire: K rows at 24 columns and V rows at 16, not 2 x 24
        plain = hybrid_bytes(
            batch=1,
            seq_len=64,
            heads=8,
            kv_heads=2,
            head_dim=24,
            ulysses=2,
            ring=2,
            ring_rank=ring_rank,
            element_size=4,
            kv_comm=kv_comm,
        )
        assert sum(sent.values()) < sum(plain.values())


# --------------------------------------------------------------------------- one process, checks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_process_call_with_sinks_softcap_and_value_dim(dtype):
    full = random_qkv(2, 16, 4, 1, 24, v_head_dim=13, seed=9, dtype=dtype)
    for softcap, backend in [(None, "torch"), (2.0, "auto"), (2.0, "reference")]:
        sinks = _sinks(4, torch.bfloat16).requires_grad_()  # any float dtype; its grad comes back in it
        q, k, v = (t.clone().requires_grad_() for t in full[:3])
        out = ring_attention(q, k, v, None, sinks=sinks, softcap=softcap, backend=backend)
        out.backward(full[3])
        expected = sinks_reference_with_grads(*full, causal=True, sinks=sinks.float(), softcap=softcap)
        errors = [rel_err(a, e) for a, e in zip([out, q.grad, k.grad, v.grad], expected)]
        assert max(errors) < TOLERANCE, (softcap, backend, errors)
        assert sinks.grad.dtype == torch.bfloat16 and rel_err(sinks.grad, expected[4]) < 1e-2


def test_hybrid_attention_module_owns_its_sinks():
    """HybridAttention on a mesh of one process (a context of one uses no process group)."""
    full = random_qkv(1, 16, 4, 2, 8, seed=2)
    module = HybridAttention(mesh_at(1, 1), sinks=_sinks(4), softcap=5.0)
    assert [name for name, _ in module.named_parameters()] == ["sinks"]
    out = module(*full[:3])
    out.backward(full[3])
    expected = sinks_reference_with_grads(*full, causal=True, sinks=module.sinks, softcap=5.0)
    assert rel_err(out, expected[0]) < TOLERANCE and rel_err(module.sinks.grad, expected[4]) < TOLERANCE
    shared = torch.nn.Parameter(_sinks(4))
    assert HybridAttention(mesh_at(1, 1), sinks=shared).sinks is shared  # a model's parameter is kept, not copied


def test_bad_sinks_and_softcap_raise_before_anything_runs():
    q, k, v, _ = random_qkv(1, 8, 4, 2, 8)
    for kwargs, words in [
        ({"sinks": torch.zeros(2)}, r"sinks must have shape \[H\] = \[4\].*got \(2,\)"),
        ({"sinks": torch.zeros(4, dtype=torch.int64)}, "floating tensor"),
        ({"sinks": [0.0] * 4}, "floating tensor"),
        ({"softcap": 0.0}, "softcap must be a finite positive number.*got 0.0"),
        ({"softcap": -1}, "got -1"),
        ({"softcap": 2.0, "backend": "torch"}, "'torch' kernel does not"),
    ]:
        with pytest.raises(ValueError, match=words):
            ring_attention(q, k, v, None, **kwargs)
    with pytest.raises(ValueError, match="k and v must share batch, tokens and heads"):
        ring_attention(q, k, v[:, :, :1], None)
    with pytest.raises(ValueError, match="softcap"):
        HybridAttention(None, softcap=float("inf"))


@pytest.mark.parametrize("cu_seqlens", [None, torch.tensor([0, 3, 8])])
def test_float64_gradcheck_with_sinks_softcap_and_value_head_dim(cu_seqlens):
    """Finite differences of a ring of one (plan None, and the plan path with documents), all four inputs."""
    q, k, v, _ = random_qkv(1, 8, 2, 1, 6, v_head_dim=3, seed=11, dtype=torch.float64)
    sinks = torch.tensor([0.3, -0.5], dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]

    def attention(q, k, v, sinks):
        return ring_attention(q, k, v, None, sinks=sinks, softcap=1.5, cu_seqlens=cu_seqlens, backend="reference")

    assert torch.autograd.gradcheck(attention, inputs)
