"""The attention layer's saved bytes and backward working set (hybridsp.planner._attention_workspace) against
allocation lists written out from profiler traces of the call, against the measured terms the layer_terms
benchmark keeps in tests/data/planner_layer_terms_cpu.json, and (distributed) against a fresh measurement."""

import json

import pytest

from hybridsp.planner import MeshConfig, ModelSpec, Techniques, Workload
from hybridsp.planner._activations import attention_bytes_per_token, o_proj_input_copied
from hybridsp.planner._attention_workspace import (
    group_tensors,
    kernel_scratch_bytes,
    own_step_bytes,
    visiting_step_bytes,
    worst_step_bytes,
)
from hybridsp.planner._phase_terms import attention_workspace_bytes, mlp_transient_bytes
from tests.helpers.paths import DATA

MIB, KIB = 2**20, 2**10
FIXTURE = DATA / "planner_layer_terms_cpu.json"


def _layer(kv_heads):
    return ModelSpec(8, kv_heads, 64, 512, 1376, 1, 32000, name="layer_terms")  # the benchmark's layer


def _workspace(kv_heads, ulysses, ring, chunks, seq=4096):
    work = Workload(seq, dtype_bytes=4, techniques=Techniques(kv_mode="ring", head_chunks=chunks))
    return attention_workspace_bytes(_layer(kv_heads), work, MeshConfig(1, ulysses, ring))


@pytest.mark.fast
def test_o_proj_input_is_a_view_of_the_kept_output_only_at_u1_with_a_ring_or_head_groups():
    model, e, hd = _layer(2), 2, 8 * 64
    base = e * (hd + hd + 2 * 128) + 4 * 8  # q, out, k + v, fp32 LSE
    for ring, chunks in ((4, 1), (4, 2), (1, 2)):  # the ring's dense accumulator; head groups' token-major out
        assert not o_proj_input_copied(model, 1, ring, chunks)
        assert attention_bytes_per_token(model, 1, e, chunks, ring) == base
    for ulysses, ring, chunks in ((1, 1, 1), (2, 2, 1), (2, 1, 2)):  # a heads-first view, or not the kept output
        assert attention_bytes_per_token(model, ulysses, e, chunks, ring) == base + hd * e


@pytest.mark.fast
def test_u1_r4_worst_step_written_out():
    """U1 x R4, G = 1, Hkv = 2, fp32, S = 4096 (1024 rows per slot): rank 2's step 2, as the profiler
    listed it."""
    expected = (
        2 * MIB  # dout: the o_proj input's gradient (the o_proj input is the call's saved output: nothing freed)
        + (2 + 0.5 + 0.5) * MIB  # fp32 dq, dk, dv accumulators
        + (2 + 0.25 + 0.25) * MIB  # the kernel on all rows against the earlier block's first half: dq, dk, dv
        + 32 * KIB  # its LSE copy
        + MIB  # the aten CPU kernel's tiles: 2 x 256 x 512 fp32
        + (0.25 + 0.25) * MIB * 2  # the received half block and its fp32 dK/dV
        + (0.5 + 0.5) * MIB * 2  # the next block (whole), and this rank's rows copied for its next reader (whole)
        + (0.25 + 0.25) * MIB * 2  # the previous step's dK/dV going home, this rank's coming back (halves)
    )
    assert _workspace(2, 1, 4, 1) == expected


@pytest.mark.fast
def test_u2_r2_own_step_written_out():
    """U2 x R2, G = 1, Hkv = 4 (2 per rank), fp32, S = 4096: the own step (2048 rows per slot)."""
    expected = (
        (2 - 2) * MIB  # the slot dout, less the o_proj input (a copy) freed by o_proj's backward
        + (2 + 1 + 1) * MIB  # fp32 accumulators
        + (2 + 1 + 1 + 2) * MIB  # the kernel on the whole slot: dq, dk, dv, its copy of the heads-first dout
        + 32 * KIB
        + MIB  # LSE copy, tiles
        + (1 + 1) * MIB  # step 1's block, posted
        + (0.5 + 0.5) * MIB  # own rows (the first half, for a later reader) copied: 2 K/V heads are not contiguous
    )
    assert _workspace(4, 2, 2, 1) == expected


@pytest.mark.fast
def test_head_groups_written_out():
    """U1 x R4, G = 2, Hkv = 4: the preallocated dq/dk/dv of all heads plus one group's step (rank 2, step 2);
    U4 x R1: one kernel call, no accumulators."""
    grouped = (
        2 * MIB  # dout (the o_proj input is a view of the call's token-major output: nothing freed)
        + (2 + 1 + 1) * MIB  # dq/dk/dv of every head
        + (1 + 0.5 + 0.5) * MIB  # one group's fp32 accumulators
        + (1 + 0.25 + 0.25 + 1) * MIB  # kernel: dq, dk, dv (half the keys), dout copied out of the group view
        + 16 * KIB
        + MIB
        + (0.25 + 0.25) * MIB * 2  # received half block, its fp32 dK/dV
        + (0.5 + 0.5) * MIB * 2  # next block, send copy
        + (0.25 + 0.25) * MIB * 2  # going home, coming back
    )
    assert _workspace(4, 1, 4, 2) == grouped
    single_call = (2 - 2) * MIB + (2 + 1 + 1 + 2) * MIB + 32 * KIB + MIB  # slot dout - o_proj copy; dq dk dv dout copy
    assert _workspace(4, 4, 1, 1) == single_call


@pytest.mark.fast
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("send_copy", [True, False])
def test_worst_step_equals_every_rank_and_step(causal, send_copy):
    from dataclasses import replace

    model = _layer(4)
    for ring in range(1, 13):
        work = Workload(4096 * ring, dtype_bytes=2, causal=causal, techniques=Techniques(kv_mode="ring"))
        group = replace(group_tensors(model, work, MeshConfig(1, 1, ring)), send_copy=send_copy)
        every = [own_step_bytes(group, ring, rank, causal) for rank in range(ring)]
        every += [visiting_step_bytes(group, ring, r, s, causal) for r in range(ring) for s in range(1, ring)]
        assert worst_step_bytes(group, ring, causal) == max(every), ring


@pytest.mark.fast
def test_kernel_tiles_follow_the_query_rows():
    assert kernel_scratch_bytes(1024, 1024) == 2 * 256 * 512 * 4
    assert kernel_scratch_bytes(512, 1024) == 2 * 64 * 512 * 4
    assert kernel_scratch_bytes(100, 100) == 2 * 32 * 100 * 4


@pytest.mark.fast
def test_planner_within_10_percent_of_the_measured_layer_terms():
    """Every measured term of the fixture (fp32, one layer of h 512, H 8, D 64, I 1376 per mesh and G; the
    largest rank's) against the planner of today."""
    for mesh, row in json.loads(FIXTURE.read_text())["meshes"].items():
        u, r, seq, kv_heads = row["ulysses"], row["ring"], row["seq"], row["kv_heads"]
        model, tokens = _layer(kv_heads), seq // (u * r)
        mlp = mlp_transient_bytes(model, Workload(tokens, dtype_bytes=4), MeshConfig(1, 1, 1))
        assert abs(mlp / row["mlp_backward"] - 1) <= 0.10, mesh
        for chunks, measured in row["attention"].items():
            g = int(chunks)
            saved = tokens * attention_bytes_per_token(model, u, 4, g, r)
            assert abs(saved / measured["saved"] - 1) <= 0.10, (mesh, g, saved, measured)
            workspace = _workspace(kv_heads, u, r, g, seq)
            assert abs(workspace / measured["backward"] - 1) <= 0.10, (mesh, g, workspace, measured)


def _measured_backward(rank, world, ulysses, ring, seq, chunks, kv_heads):
    """The least of two backward peaks of one call as HF makes it (q/k/v views of heads-first tensors, o_proj
    on the reshaped output; fp32, H 8, D 64, h 512): torch's allocations above the backward's start, the
    forward profiled too so that the saved tensors it frees count; weight gradients not asked for."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from hybridsp import hybrid_attn_func, init_mesh

    mesh = init_mesh(ulysses, ring)
    tokens = seq // (ulysses * ring)
    leaves = [torch.randn(1, h, tokens, 64, requires_grad=True) for h in (8, kv_heads, kv_heads)]  # [B, h, T, D]
    o_proj, grad = torch.randn(512, 8 * 64, requires_grad=True), torch.randn(1, tokens, 512)

    def step():
        q, k, v = (t.transpose(1, 2) for t in leaves)  # [B, T, h, D]
        out = hybrid_attn_func(q, k, v, mesh=mesh, backend="torch", head_chunks=chunks)  # [B, T, H, D]
        y = torch.nn.functional.linear(out.reshape(1, tokens, -1).contiguous(), o_proj)  # [B, T, h]
        del out  # as in a model, whose forward has returned by then: o_proj's saved input alone keeps it
        with record_function("backward"):
            torch.autograd.grad(y, leaves, grad)

    step()
    peaks = []
    for _ in range(2):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = list(prof.profiler.kineto_results.events())
        mark = next(e for e in events if e.name() == "backward")
        window = (mark.start_ns(), mark.start_ns() + mark.duration_ns())
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        live = peak = 0
        for _, nbytes in (m for m in memory if window[0] <= m[0] <= window[1]):
            live += nbytes
            peak = max(peak, live)
        peaks.append(peak)
    return min(peaks)


@pytest.mark.distributed
def test_workspace_against_a_fresh_measurement():
    """A ring of 2 gloo ranks (U1 x R2, S = 2048, Hkv = 4), the largest rank, against the planner (the same
    allocations: equal to rounding)."""
    from hybridsp.testing import run_distributed

    measured = max(run_distributed(_measured_backward, 2, 1, 2, 2048, 1, 4, timeout=300))
    assert abs(_workspace(4, 1, 2, 1, seq=2048) / measured - 1) <= 0.05, measured


@pytest.mark.distributed
@pytest.mark.slow
def test_head_grouped_workspace_against_a_fresh_measurement():
    """U2 x R2, G = 2 on 4 ranks (S = 2048, Hkv = 4)."""
    from hybridsp.testing import run_distributed

    measured = max(run_distributed(_measured_backward, 4, 2, 2, 2048, 2, 4, timeout=600))
    assert abs(_workspace(4, 2, 2, 2, seq=2048) / measured - 1) <= 0.10, measured
