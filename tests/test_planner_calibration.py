"""The planner against the measured CPU ablation of benchmarks/bench_ablation.py (issues 12 and 15)."""

import json
from pathlib import Path


def test_planner_against_the_measured_cpu_ablation():
    """benchmarks/results_ablation_cpu.json (bench_ablation.py: cp8 = U4 x R2, ZeRO-3, fp32,
    V = 32000, 1.5 GiB in all): for every completely searched row, the planner's longest context
    within 15% of the measured one (issue 15) and its step memory at that length within 10% of
    the worst rank's allocated peak (issue 12, item 6); at 1 GiB the planner, like the
    measurement, fits nothing at S = 512."""
    import sys

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import bench_ablation as ablation
    finally:
        sys.path.remove(str(bench))
    rows = json.loads((bench / "results_ablation_cpu.json").read_text())["rows"]
    searched = [r for r in rows if not r.get("at") and r.get("complete") and r.get("longest")]
    assert {tuple(r["techniques"]) for r in searched} >= {(), ("fused_loss",), ("fused_loss", "tiled_mlp")}
    for row in searched:
        techniques, budget = tuple(row["techniques"]), row["budget_total"] // 8
        predicted = ablation.planner_longest(row["vocab"], row["layers"], techniques, budget, row["granularity"])
        assert abs(predicted / row["longest"] - 1) <= 0.15, (techniques, predicted, row["longest"])
        best = next(a for a in row["attempt_list"] if a["ok"] and a["seq_len"] == row["longest"])
        step = ablation.planner_row(row["vocab"], row["layers"], techniques, row["longest"])["step"]
        assert abs(step / best["worst"]["step_alloc_peak"] - 1) <= 0.10, (techniques, step, best["worst"])
        failed = [a for a in row["attempt_list"] if not a["ok"]]
        assert min(a["seq_len"] for a in failed) - row["longest"] <= row["granularity"]  # the search is complete
    for row in (r for r in rows if r.get("at")):
        assert not row["attempt_list"][0]["ok"]
        assert ablation.planner_row(row["vocab"], row["layers"], tuple(row["techniques"]), row["at"])["step"] > \
            row["budget_total"] // 8


def test_planner_against_the_checkpointed_cpu_ablation_rows():
    """The two checkpointed rows of benchmarks/results_ablation_cpu.json (checkpointing + fused
    loss + tiled MLP, with and without activation offload), whose searches stopped for time, so
    the measurement brackets the longest: ``longest`` trained, the smallest failed attempt (if
    any) did not. The planner's longest lies within 15% of that bracket (issue 15) and its step
    memory at the longest measured length within 10% of the worst rank's allocated peak."""
    import sys

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import bench_ablation as ablation
    finally:
        sys.path.remove(str(bench))
    rows = json.loads((bench / "results_ablation_cpu.json").read_text())["rows"]
    checkpointed = {tuple(r["techniques"]): r for r in rows
                    if not r.get("at") and r.get("longest") and "checkpointing" in r["techniques"]}
    assert set(checkpointed) >= {("checkpointing", "fused_loss", "tiled_mlp"),
                                 ("checkpointing", "fused_loss", "tiled_mlp", "activation_offload")}
    for techniques, row in checkpointed.items():
        budget = row["budget_total"] // 8
        predicted = ablation.planner_longest(row["vocab"], row["layers"], techniques, budget, row["granularity"])
        failed = [a["seq_len"] for a in row["attempt_list"] if not a["ok"]]
        low, high = row["longest"], min(failed) if failed else None
        assert predicted >= 0.85 * low, (techniques, predicted, low)
        if high is not None:
            assert predicted <= 1.15 * high, (techniques, predicted, high)
        best = next(a for a in row["attempt_list"] if a["ok"] and a["seq_len"] == row["longest"])
        step = ablation.planner_row(row["vocab"], row["layers"], techniques, row["longest"])["step"]
        assert abs(step / best["worst"]["step_alloc_peak"] - 1) <= 0.10, (techniques, step, best["worst"])


def test_checkpointed_terms_by_hand():
    """The three checkpointed-step terms, against arithmetic written out here (fp32, the CPU
    ablation's model at U4 x R2, T = 1024 local tokens): the attention workspace holds the fp32
    accumulators and the larger of the all-to-all's two q/k/v buffers and the ring's blocks (not
    both); the gradient reduction, after every layer's backward, holds no checkpoint; a
    recomputed fp32 layer's first-norm x is its checkpoint (counted once)."""
    import sys

    from hybridsp.planner import MeshConfig, Techniques, Workload, memory_use
    from hybridsp.planner.memory import attention_workspace_bytes, reduction_bytes

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import bench_ablation as ablation
    finally:
        sys.path.remove(str(bench))
    model = ablation.model_spec(32000, 4)  # h 256, 8 q heads and 4 K/V heads of 32, I 640
    tokens, e = 1024, 4
    config = MeshConfig(1, 4, 2, 3, True)
    workload = Workload(8 * tokens, dtype_bytes=e, techniques=Techniques(fused_loss=True, tiled_mlp=True,
                                                                      collective_copies=1))
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
