"""The planner against the measured CPU ablation of benchmarks/longest/ablation.py (longest context and step memory),
as its rows are kept in tests/data/planner_calibration_cpu.json."""

import json

import pytest

from hybridsp.planner import _calibration as calibration
from tests.helpers.paths import DATA

FIXTURE = DATA / "planner_calibration_cpu.json"


def _base_and_rows():
    """(the measured model as a ModelSpec, the measured rows): tests/data/planner_calibration_cpu.json,
    which benchmarks/longest/ablation.py writes with its results."""
    from hybridsp.planner import ModelSpec

    data = json.loads(FIXTURE.read_text())
    return ModelSpec(**data["model"]), data["rows"]


def test_planner_against_the_measured_cpu_ablation():
    """benchmarks/results_ablation_cpu.json (benchmarks/longest/ablation.py: cp8 = U4 x R2, ZeRO-3, fp32,
    V = 32000, 1.5 GiB in all): for every completely searched row, the planner's longest context
    within 15% of the measured one and its step memory at that length within 10% of
    the worst rank's allocated peak; at 1 GiB the planner, like the
    measurement, fits nothing at S = 512."""
    base, rows = _base_and_rows()
    searched = [r for r in rows if not r.get("at") and r.get("complete") and r.get("longest")]
    assert {tuple(r["techniques"]) for r in searched} >= {(), ("fused_loss",), ("fused_loss", "tiled_mlp")}
    for row in searched:
        techniques, budget = tuple(row["techniques"]), row["budget_total"] // 8
        predicted = calibration.longest(base, row["vocab"], row["layers"], techniques, budget, row["granularity"])
        assert abs(predicted / row["longest"] - 1) <= 0.15, (techniques, predicted, row["longest"])
        best = next(a for a in row["attempt_list"] if a["ok"] and a["seq_len"] == row["longest"])
        step = calibration.attempt(base, row["vocab"], row["layers"], techniques, row["longest"])["step"]
        assert abs(step / best["step_alloc_peak"] - 1) <= 0.10, (techniques, step, best)
        failed = [a for a in row["attempt_list"] if not a["ok"]]
        assert min(a["seq_len"] for a in failed) - row["longest"] <= row["granularity"]  # the search is complete
    for row in (r for r in rows if r.get("at")):
        assert not row["attempt_list"][0]["ok"]
        assert (
            calibration.attempt(base, row["vocab"], row["layers"], tuple(row["techniques"]), row["at"])["step"]
            > row["budget_total"] // 8
        )


def test_planner_against_the_checkpointed_cpu_ablation_rows():
    """The two checkpointed rows of benchmarks/results_ablation_cpu.json (checkpointing + fused
    loss + tiled MLP, with and without activation offload), whose searches stopped for time, so
    the measurement brackets the longest: ``longest`` trained, the smallest failed attempt (if
    any) did not. The planner's longest lies within 15% of that bracket and its step
    memory at the longest measured length within 10% of the worst rank's allocated peak."""
    base, rows = _base_and_rows()
    checkpointed = {
        tuple(r["techniques"]): r
        for r in rows
        if not r.get("at") and r.get("longest") and "checkpointing" in r["techniques"]
    }
    assert set(checkpointed) >= {
        ("checkpointing", "fused_loss", "tiled_mlp"),
        ("checkpointing", "fused_loss", "tiled_mlp", "activation_offload"),
    }
    for techniques, row in checkpointed.items():
        budget = row["budget_total"] // 8
        predicted = calibration.longest(base, row["vocab"], row["layers"], techniques, budget, row["granularity"])
        failed = [a["seq_len"] for a in row["attempt_list"] if not a["ok"]]
        low, high = row["longest"], min(failed) if failed else None
        assert predicted >= 0.85 * low, (techniques, predicted, low)
        if high is not None:
            assert predicted <= 1.15 * high, (techniques, predicted, high)
        best = next(a for a in row["attempt_list"] if a["ok"] and a["seq_len"] == row["longest"])
        step = calibration.attempt(base, row["vocab"], row["layers"], techniques, row["longest"])["step"]
        assert abs(step / best["step_alloc_peak"] - 1) <= 0.10, (techniques, step, best)


def test_checkpointed_terms_by_hand():
    """The three checkpointed-step terms, against arithmetic written out here (fp32, the CPU
    ablation's model at U4 x R2, T = 1024 local tokens): the attention workspace holds the fp32
    accumulators and the larger of the all-to-all's two q/k/v buffers and the ring's blocks (not
    both); the gradient reduction, after every layer's backward, holds no checkpoint; a
    recomputed fp32 layer's first-norm x is its checkpoint (counted once)."""
    from hybridsp.planner import MeshConfig, Techniques, Workload, memory_use
    from hybridsp.planner._phase_terms import attention_workspace_bytes, reduction_bytes

    model = calibration.model_spec(_base_and_rows()[0], 32000, 4)  # h 256, 8 q heads and 4 K/V heads of 32, I 640
    tokens, e = 1024, 4
    config = MeshConfig(1, 4, 2, 3, True)
    workload = Workload(
        8 * tokens, dtype_bytes=e, techniques=Techniques(fused_loss=True, tiled_mlp=True, collective_copies=1)
    )
    accumulators = tokens * 8 * (32 + 1) * 4
    qkv = tokens * (8 + 4 + 4) * 32 * e  # 4 K/V heads, one per Ulysses rank: none repeated
    kv_block = grad_block = tokens * 2 * 4 * 32 * e  # K+V (dK+dV) of the U-group's sequence, 1 K/V head per rank
    ring = 2 * kv_block + grad_block + 2 * grad_block  # 2 receive blocks, fp32 dK/dV, 2 travelling blocks
    assert attention_workspace_bytes(model, workload, config) == accumulators + max(2 * qkv, ring)
    assert ring > 2 * qkv  # the sum, an earlier revision's term, would add 2 qkv more
    short = memory_use(model, Workload(1024, dtype_bytes=e, techniques=workload.techniques), config)
    assert short.peak_phase == "gradient reduction" and short.checkpoints == 0
    assert short.total == short.persistent + reduction_bytes(model, workload, config)
    for d, alias in ((4, 4 * 256), (2, 0)):  # bf16: the norm's fp32 x is a new tensor, not the checkpoint
        run = Workload(8 * tokens, dtype_bytes=d, techniques=workload.techniques)
        one = dict(memory_use(model, run, MeshConfig(1, 4, 2, 3, True)).phases)["attention backward"]
        every = dict(memory_use(model, run, MeshConfig(1, 4, 2, 3, False)).phases)["attention backward"]
        layer = 2 * ((4 + 2 * d) * 256 + 4) + (2 * 256 + 2 * 128 + 256) * d + 8 * 4  # norms, attention (tiled MLP)
        assert every - one == tokens * (3 * layer + alias)  # L = 4 layers' saved tensors vs one recomputed


_T, _H, _HKV, _D = 2048, 8, 4, 32  # local tokens, heads, K/V heads, head dim of the measured attention call
_MARKER = 77_777  # bytes of a marker allocation (no tensor of the call has this size)


def _backward_peak(rank, world, ulysses, ring):
    """Torch's allocation peak (profiler memory events) of one fp32 hybrid attention backward,
    above what exists when it starts (the saved tensors, which it frees, included): its
    workspace, dout's reshard and its dq/dk/dv."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hybridsp import hybrid_attn_func, init_mesh

    torch.manual_seed(rank)
    mesh = init_mesh(ulysses=ulysses, ring=ring)
    q = torch.randn(1, _T, _H, _D, requires_grad=True)  # [B, S/C, H, D]
    k, v = (torch.randn(1, _T, _HKV, _D, requires_grad=True) for _ in range(2))  # [B, S/C, Hkv, D]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:  # the forward too: every
        out = hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend="torch")  # saved tensor's free is seen
        dout = torch.randn_like(out)
        torch.empty(_MARKER, dtype=torch.uint8)  # a marker, freed at once: the backward starts after it
        out.backward(dout)
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live, start, peak = 0, None, 0
    for event in events:
        live += event.nbytes()
        if start is None and event.nbytes() == _MARKER:
            start = live - _MARKER  # what exists when the backward begins
        if start is not None:
            peak = max(peak, live - start)
    assert start is not None
    return peak


def _planner_workspace(ulysses, ring):
    from hybridsp.planner import MeshConfig, ModelSpec, Techniques, Workload
    from hybridsp.planner._phase_terms import attention_workspace_bytes

    model = ModelSpec(_H, _HKV, _D, _H * _D, 640, 1, 32000, tied_embeddings=True)
    workload = Workload(ulysses * ring * _T, dtype_bytes=4, techniques=Techniques(kv_mode="ring"))
    return attention_workspace_bytes(model, workload, MeshConfig(1, ulysses, ring, 3, False))


@pytest.mark.distributed
def test_ring_attention_workspace_against_a_measured_backward():
    """The planner's attention workspace (accumulators + the ring's K/V and dK/dV blocks) against
    torch's measured peak of one backward on a ring of 2 gloo ranks (2026-12-01, three runs:
    6,160 B per local token, planner 6,176). (U2 x R1 measured 4,640 B in most runs against the
    planner's 5,152, but 6,688 on one rank in one run of three, unexplained: not asserted.)"""
    from hybridsp.testing import run_distributed

    measured = max(run_distributed(_backward_peak, 2, 1, 2, timeout=120))
    planned = _planner_workspace(1, 2)
    assert 0.9 * planned <= measured <= 1.05 * planned, (measured / _T, planned / _T)


@pytest.mark.distributed
@pytest.mark.slow
def test_attention_workspace_is_the_larger_of_all_to_all_and_ring():
    """U2 x R2 on 4 ranks: measured 8,224 B per local token, between the planner's
    accumulators + max(all-to-all, ring) (6,176) and the sum an earlier revision counted (10,272):
    the two sets of buffers partly coexist (the head-layout dout and out the ring backward reads
    come out of the all-to-all). The planner's term is the lower bound; this pins the bracket."""
    from hybridsp.testing import run_distributed

    measured = max(run_distributed(_backward_peak, 4, 2, 2, timeout=180))
    planned = _planner_workspace(2, 2)  # 6,176 B per local token; the sum would be 10,272
    assert planned <= measured <= 10272 * _T, (measured / _T, planned / _T)
