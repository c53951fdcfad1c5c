"""Head-chunked hybrid attention (``head_chunks=G``): each case against float64 attention written as the
unmodified models write it (tests/helpers/references/attention.py) and against the same call at G = 1
(out, dq, dk, dv, the context-summed sinks gradient), with the bytes each rank sends equal to G = 1's and
to the analytic formula; the setting's checks, its "auto" rule and the config section."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import hybridsp
from hybridsp import hybrid_attn_func, init_mesh, shard_sequence
from hybridsp._formulas import HEAD_CHUNK_BYTES, auto_head_chunks, head_chunk_kv_heads
from hybridsp.attention._resolve import resolve_head_chunks
from hybridsp.attention._volume import hybrid_bytes
from hybridsp.testing import run_distributed
from tests.helpers.references.attention import random_qkv, rel_err, sinks_reference_with_grads

SEQ = 48
TOLERANCE = 1e-5
DOCS = (0, 7, 30, 31, 48)


class Case(NamedTuple):
    ulysses: int
    ring: int
    chunks: int
    heads: int = 8
    kv_heads: int = 4
    layout: str = "zigzag"
    kv_comm: str = "ring"
    dims: tuple[int, int] = (16, 16)  # (q/k head dim, v head dim)
    sinks: bool = False
    softcap: float | None = None
    docs: tuple[int, ...] | None = None
    window: int | None = None
    dtype: torch.dtype = torch.float32
    batch: int = 2


def _run(mesh, case: Case, chunks: int, seed: int):
    """This rank's (out, dq, dk, dv, context-summed dsinks or None) and its bytes sent, at ``chunks``."""
    d, dv = case.dims
    full = random_qkv(case.batch, SEQ, case.heads, case.kv_heads, d, v_head_dim=dv, seed=seed, dtype=case.dtype)
    sinks = torch.linspace(-1.0, 2.0, case.heads).requires_grad_() if case.sinks else None
    cu = None if case.docs is None else torch.tensor(case.docs)
    q, k, v, dout = (shard_sequence(t, mesh, cu_seqlens=cu).clone() for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    counter = hybridsp.CommCounter()
    out = hybrid_attn_func(
        q,
        k,
        v,
        mesh=mesh,
        cu_seqlens=cu,
        sliding_window=case.window,
        sinks=sinks,
        softcap=case.softcap,
        counter=counter,
        head_chunks=chunks,
    )
    out.backward(dout)
    dsinks = None
    if sinks is not None:
        dsinks = sinks.grad.clone()
        dist.all_reduce(dsinks, group=mesh.context_group)  # the framework's sum over the context ranks
    return [out.detach(), q.grad, k.grad, v.grad, dsinks], dict(counter.bytes_sent), full, sinks, cu


def check_cases(rank, world, cases):
    failures = []
    for i, case in enumerate(cases):
        mesh = init_mesh(ulysses=case.ulysses, ring=case.ring, layout=case.layout, kv_comm=case.kv_comm)
        got, sent, full, sinks, cu = _run(mesh, case, case.chunks, seed=i)
        once, sent_once, *_ = _run(mesh, case, 1, seed=i)
        bounds = None if case.docs is None else [list(case.docs)] * case.batch
        expected = sinks_reference_with_grads(
            *full, causal=True, sinks=sinks, softcap=case.softcap, rows_bounds=bounds, window=case.window
        )
        shards = [shard_sequence(e, mesh, cu_seqlens=cu) for e in expected[:4]] + [expected[4]]
        pairs = [(g, e, o) for g, e, o in zip(got, shards, once) if g is not None]
        to_reference = [rel_err(g, e) for g, e, _ in pairs]
        to_once = [rel_err(g, o) for g, _, o in pairs]
        once_to_reference = [rel_err(o, e) for _, e, o in pairs]
        limit = [TOLERANCE] * len(pairs)
        if case.dtype == torch.bfloat16:  # no worse than G = 1's own bf16 error, to rounding
            limit = [2 * e + 1e-3 for e in once_to_reference]
        bad = any(e > lim for e, lim in zip(to_reference, limit)) or max(to_once) > (
            1e-2 if case.dtype == torch.bfloat16 else TOLERANCE
        )
        if bad or sent != sent_once:
            failures.append(f"{case}: vs float64 {to_reference}, vs G=1 {to_once}, bytes {sent} vs {sent_once}")
    assert not failures, "\n".join(failures)


WORLD4 = [
    Case(2, 2, 2, sinks=True, softcap=2.0, dims=(24, 16)),  # MLA-like head dims, sinks, soft-capping
    Case(2, 2, 2, kv_comm="allgather", docs=DOCS, window=9, dtype=torch.bfloat16),
    Case(1, 4, 4, kv_heads=4, sinks=True, window=9),  # no Ulysses: groups are views; Hkv 4 per rank
]
WORLD4_MORE = [
    Case(2, 2, 2, layout="balanced", docs=DOCS, heads=4, kv_heads=4, dims=(16, 12)),
    Case(4, 1, 2, kv_heads=8, dims=(16, 24), sinks=True),  # a ring of one that nothing masks (plan None)
    Case(2, 2, 2, dtype=torch.bfloat16, batch=1),
]


@pytest.mark.distributed
def test_world4_head_groups_equal_float64_and_one_group_with_the_same_bytes():
    run_distributed(check_cases, 4, WORLD4)


@pytest.mark.slow
@pytest.mark.distributed
def test_world4_more_layouts_no_ulysses_and_a_ring_of_one():
    run_distributed(check_cases, 4, WORLD4_MORE)


WORLD6 = [
    Case(3, 2, 2, heads=12, kv_heads=6, kv_comm=kv_comm, layout=layout, docs=docs, window=window, softcap=softcap)
    for kv_comm in ("ring", "allgather")
    for layout, docs, window, softcap in (
        ("zigzag", None, None, None),
        ("contiguous", DOCS, 9, 2.0),
        ("balanced", DOCS, None, None),
    )
] + [
    Case(3, 2, 2, heads=12, kv_heads=6, dims=(24, 13), sinks=True, dtype=torch.float64),
    Case(1, 6, 3, heads=6, kv_heads=3, dims=(24, 13), sinks=True, docs=DOCS, window=5, dtype=torch.bfloat16),
    Case(2, 3, 4, heads=16, kv_heads=8, softcap=3.0, docs=DOCS),
]


@pytest.mark.slow
@pytest.mark.distributed
def test_world6_matrix_of_layouts_transports_masks_and_dtypes():
    run_distributed(check_cases, 6, WORLD6)


def _bytes_at(rank, world, chunks):
    """{kv_comm: bytes sent} of one fwd + bwd at ``chunks`` head groups, with sinks and Dv != D."""
    sent = {}
    for kv_comm in ("ring", "allgather"):
        mesh = init_mesh(ulysses=2, ring=2, kv_comm=kv_comm)
        full = random_qkv(2, 64, 8, 4, 24, v_head_dim=16)
        q, k, v, dout = (shard_sequence(t, mesh).requires_grad_() for t in full)
        counter = hybridsp.CommCounter()
        sinks = torch.zeros(8, requires_grad=True)
        hybrid_attn_func(q, k, v, mesh=mesh, sinks=sinks, counter=counter, head_chunks=chunks).backward(dout)
        sent[kv_comm] = dict(counter.bytes_sent)
    return mesh.ring_rank, sent


@pytest.mark.distributed
def test_bytes_at_two_groups_equal_the_formula_in_both_kv_modes():
    for ring_rank, sent in run_distributed(_bytes_at, 4, 2):
        for kv_comm, counted in sent.items():
            want = hybrid_bytes(
                batch=2,
                seq_len=64,
                heads=8,
                kv_heads=4,
                head_dim=24,
                v_head_dim=16,
                ulysses=2,
                ring=2,
                ring_rank=ring_rank,
                element_size=4,
                kv_comm=kv_comm,
            )
            assert counted == want, (kv_comm, ring_rank)


def _refusals(rank, world):
    mesh = init_mesh(ulysses=2, ring=2)
    raised = {}
    for name, (kv_heads, chunks) in {"one kv head": (1, 2), "not a divisor": (4, 3), "bad": (4, 0)}.items():
        q, k, v, _ = (shard_sequence(t, mesh) for t in random_qkv(1, 32, 8, kv_heads, 16))
        with pytest.raises(ValueError) as info:
            hybrid_attn_func(q, k, v, mesh=mesh, head_chunks=chunks)
        raised[name] = str(info.value)
    q, k, v, _ = (shard_sequence(t, mesh) for t in random_qkv(1, 32, 8, 4, 16))
    hybrid_attn_func(q, k, v, mesh=mesh, head_chunks=2)  # the ranks still talk: nobody hung
    return raised


@pytest.mark.distributed
def test_head_chunks_that_do_not_divide_the_kv_heads_raise_on_every_rank():
    for raised in run_distributed(_refusals, 4):
        assert "K/V heads each Ulysses rank holds: 1 (G must then be 1)" in raised["one kv head"]
        assert "head_chunks=3" in raised["not a divisor"] and "divisor of 2" in raised["not a divisor"]
        assert "positive integer" in raised["bad"]


# --------------------------------------------------------------------------- one process


@pytest.mark.fast
def test_auto_picks_the_smallest_divisor_under_the_target():
    assert auto_head_chunks(8, HEAD_CHUNK_BYTES) == 1
    assert auto_head_chunks(8, HEAD_CHUNK_BYTES + 1) == 2
    assert auto_head_chunks(6, 5 * HEAD_CHUNK_BYTES) == 6  # 1, 2, 3 too big; 6 divides 6
    assert auto_head_chunks(1, 100 * HEAD_CHUNK_BYTES) == 1
    assert head_chunk_kv_heads(8, 2, 4) == 1 and head_chunk_kv_heads(32, 8, 2) == 4


@pytest.mark.fast
def test_resolve_checks_and_auto():
    q, k = torch.zeros(1, 4096, 32, 128), torch.zeros(1, 4096, 8, 128)
    assert resolve_head_chunks(1, q, k, k, ulysses=2, ring=1) == 1
    assert resolve_head_chunks(4, q, k, k, ulysses=2, ring=1) == 4
    # one rank's slot: 8192 tokens x (16 + 16 q/out heads + 2 x 4 K/V heads) x 128 x 4 B = 160 MiB -> G = 4 (40 MiB)
    assert resolve_head_chunks("auto", q, k, k, ulysses=2, ring=1) == 4
    for bad in (0, -1, True, 2.0, "all"):
        with pytest.raises(ValueError, match="head_chunks must be a positive integer"):
            resolve_head_chunks(bad, q, k, k, ulysses=2, ring=1)


@pytest.mark.fast
def test_config_section_and_mesh_shape_carry_head_chunks():
    from hybridsp.integrations.deepspeed import HybridConfig
    from hybridsp.mesh import MeshShape

    config = HybridConfig.from_ds_config({"hybridsp": {"ulysses": 2, "ring": 2, "head_chunks": "auto"}})
    assert config.mesh_shape(8).head_chunks == "auto"
    assert MeshShape(4, 2, 2).head_chunks == 1
    with pytest.raises(ValueError, match="head_chunks must be a positive integer"):
        HybridConfig.from_ds_config({"hybridsp": {"ulysses": 2, "head_chunks": 0}})


def _switched_llama(rank, world, head_chunks):
    """Relative errors of a switched tiny Llama (4 query / 4 K/V heads) at U2xR1 with the switch's
    ``head_chunks`` against the unmodified one-process model: logits, loss, every gradient."""
    from hybridsp.integrations import transformers as hf
    from tests.helpers.models.switched import build, expected_of, make_batch, sharded

    mesh = init_mesh(ulysses=2, ring=1)
    model = build("llama")
    batch = make_batch(32, (32, 32))
    logits, loss, grads = expected_of(model, batch)
    handle = hf.apply(model, mesh, backend="torch", head_chunks=head_chunks)
    got_logits, got_loss, got_grads, _ = sharded(model, mesh, batch)
    assert model.model.layers[0].self_attn._hybridsp_binding.head_chunks == head_chunks
    handle.undo()
    errors = {"logits": rel_err(got_logits, logits), "loss": rel_err(got_loss, loss)}
    return errors | {name: rel_err(got_grads[name], grads[name]) for name in grads}


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.distributed
def test_the_transformers_switch_carries_head_chunks():
    for errors in run_distributed(_switched_llama, 2, 2):
        assert max(errors.values()) < 1e-4, errors


@pytest.mark.fast
def test_compiled_call_refuses_int_head_groups():
    from hybridsp.attention._compiled import compiled_attention
    from tests.helpers.mesh import mesh_at

    q = torch.zeros(1, 8, 4, 16)
    with pytest.raises(ValueError, match='head_chunks must be 1 or "auto"'):
        compiled_attention(
            q,
            q,
            q,
            mesh=mesh_at(2, 1),
            causal=True,
            cu_seqlens=None,
            sliding_window=None,
            softmax_scale=None,
            backend="auto",
            counter=None,
            kv_comm=None,
            sinks=None,
            softcap=None,
            head_chunks=2,
        )


def _output_storage(rank, world):
    """Per mesh (U x R over 2 ranks): is out token-major contiguous, is out's storage one the call keeps
    for backward, and out / dq / dk / dv's largest error against the float64 reference."""
    from tests.helpers.references.attention import reference_with_grads

    answers = {}
    for ulysses, ring in ((1, 2), (2, 1)):
        mesh = init_mesh(ulysses=ulysses, ring=ring)
        full = random_qkv(1, SEQ, 8, 4, 16, seed=3)
        q, k, v, dout = (shard_sequence(t, mesh).clone() for t in full)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        kept = set()

        def pack(tensor):
            kept.add(tensor.untyped_storage().data_ptr())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = hybrid_attn_func(q, k, v, mesh=mesh, head_chunks=2)
        flat = out.reshape(*out.shape[:2], -1)  # [B, L, H * Dv]: what a model hands its output projection
        out.backward(dout)
        expected = [shard_sequence(e, mesh) for e in reference_with_grads(*full, causal=True)]
        errors = [rel_err(g, e) for g, e in zip((out.detach(), q.grad, k.grad, v.grad), expected)]
        answers[(ulysses, ring)] = {
            "contiguous": out.is_contiguous() and flat.data_ptr() == out.data_ptr(),
            "kept": out.untyped_storage().data_ptr() in kept,
            "error": max(errors),
        }
    return answers


@pytest.mark.distributed
def test_the_output_is_token_major_so_the_models_reshape_shares_what_the_call_keeps():
    """Note [token-major out]: at U = 1 the call keeps out itself, and the model's [B, L, H Dv] view of it
    (its output projection's input) is the same storage: no second copy kept per layer."""
    for answers in run_distributed(_output_storage, 2):
        assert all(a["contiguous"] and a["error"] < TOLERANCE for a in answers.values()), answers
        assert answers[(1, 2)]["kept"], answers
