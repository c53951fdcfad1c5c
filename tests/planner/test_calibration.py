"""The planner against the measured CPU ablation of benchmarks/longest/ablation.py (longest context and step memory),
as its rows are kept in tests/data/planner_calibration_cpu.json."""

import json

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
    ablation's model at U4 x R2, T = 1024 local tokens): the attention workspace is its backward's
    working set (hybridsp.planner._attention_workspace); the gradient reduction, after every layer's
    backward, holds no checkpoint; a recomputed fp32 layer's first-norm x is its checkpoint (counted once)."""
    from hybridsp.planner import MeshConfig, Techniques, Workload, memory_use
    from hybridsp.planner._phase_terms import attention_workspace_bytes, reduction_bytes

    model = calibration.model_spec(_base_and_rows()[0], 32000, 4)  # h 256, 8 q heads and 4 K/V heads of 32, I 640
    tokens, e = 1024, 4
    config = MeshConfig(1, 4, 2, 3, True)
    workload = Workload(
        8 * tokens, dtype_bytes=e, techniques=Techniques(fused_loss=True, tiled_mlp=True, collective_copies=1)
    )
    mib = 2**20  # a ring slot: 4096 rows of 2 query heads and 1 K/V head (32 wide): q, k + v, out 1 MiB each
    workspace = (
        (1 - 1) * mib  # the slot dout, less the o_proj input (a copy of the heads-first output) freed
        + (1 + 1) * mib  # fp32 dq, dk, dv accumulators
        + (1 + 1 + 1) * mib  # the kernel on the whole slot: dq, dk + dv, its copy of the heads-first dout
        + 4096 * 2 * 4  # its LSE copy
        + 2 * 256 * 512 * 4  # the aten CPU kernel's tiles
        + 1 * mib  # step 1's K/V block (rank 0 reads all of rank 1's)
    )
    assert attention_workspace_bytes(model, workload, config) == workspace
    short = memory_use(model, Workload(1024, dtype_bytes=e, techniques=workload.techniques), config)
    assert short.peak_phase == "gradient reduction" and short.checkpoints == 0
    assert short.total == short.persistent + reduction_bytes(model, workload, config)
    for d, alias in ((4, 4 * 256), (2, 0)):  # bf16: the norm's fp32 x is a new tensor, not the checkpoint
        run = Workload(8 * tokens, dtype_bytes=d, techniques=workload.techniques)
        one = dict(memory_use(model, run, MeshConfig(1, 4, 2, 3, True)).phases)["attention backward"]
        every = dict(memory_use(model, run, MeshConfig(1, 4, 2, 3, False)).phases)["attention backward"]
        layer = 2 * ((4 + 2 * d) * 256 + 4) + (2 * 256 + 2 * 128 + 256) * d + 8 * 4  # norms, attention (tiled MLP)
        assert every - one == tokens * (3 * layer + alias)  # L = 4 layers' saved tensors vs one recomputed
