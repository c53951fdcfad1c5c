"""ALST's two gradient defects, each as a comparison against one-process DeepSpeed (alst.compare --part defects).

Both compare, for the first step from the same weights and the same window, the norm of the full
reduced gradient that DeepSpeed reports (``engine.get_global_grad_norm()``: before clipping) and the
norm of the lm_head weight's full gradient (``safe_get_full_grad``; the model ties it to the
embedding), each divided by the reference's. 1.0 is right.

1. :func:`zero2_gradient_scale`: ALST's recipe at ZeRO-2 (and ZeRO-1). Each rank's loss is the
   tutorial's all-gathered, token-weighted mean, i.e. the whole sequence's loss on every rank; its
   backward (the all-gather's adjoint sums the SP ranks' output gradients) gives each rank SP times
   its tokens' share of the gradient. ZeRO-3 divides the reduced gradient by the SP x DP ranks of the
   partition group, which cancels that; ZeRO-1/2 divide by DP only (DeepSpeed's ``stage_1_and_2``:
   ``world / sequence_parallel_size``), so the gradients come out SP times too large. Adam's update
   hides a constant factor; gradient clipping, the reported norm and SGD do not. hybridsp at the
   same stage and U is the control (1.0).
2. :func:`fused_logits_head_gradient`: ArcticTraining's ``TiledFusedLogitsLoss`` (``output_reduction
   ="sum"``, then the division by the rank's counted tokens and the weighted all-gather). It computes
   the lm_head weight's gradient inside its forward with an output gradient of 1 and, in its backward,
   rescales only the hidden states' gradient by the real output gradient ``g``; the weight's gradient
   is therefore ``1/g`` times too large, and ``g = SP / (S - 1)`` here (ZeRO-3; S - 1 counted tokens),
   i.e. the counted tokens per rank. DeepSpeed's own ``sequence_tiled_compute`` (the tutorial's
   tiled loss) is the control (1.0).
3. :func:`tied_tiled_loss`: with the lm_head tied to the embedding (``examples/train.py``'s model),
   either tiled loss fails under ZeRO-3 (an assertion in ``stage3.__reduce_and_partition_ipg_grads``:
   the tied weight enters the reduce bucket twice, once from the loss's own backward calls and once
   from the embedding). That is why the comparison's model is untied (``Run.tied``); hybridsp's fused
   loss trains the tied model (the control).
"""

from __future__ import annotations

from dataclasses import replace

from benchmarks.alst import _ranks as alst_ranks
from benchmarks.common import alst_stacks, harness


def _first_step(run: alst_stacks.Run) -> dict:
    world = 1 if run.stack == "reference" else run.context
    trace = harness.launch(alst_ranks.capped_rank, world, run, timeout=1800)[0]
    return {"norm": trace["norms"][0], "head_norm": trace["head_norms"][0], "loss": trace["losses"][0]}


def _ratios(runs: dict[str, alst_stacks.Run], reference: alst_stacks.Run) -> dict:
    """{name: {norm, head_norm, loss, norm_ratio, head_ratio}} against ``reference``'s first step."""
    want = _first_step(reference)
    rows = {"reference": want}
    for name, run in runs.items():
        got = _first_step(run)
        got.update(norm_ratio=got["norm"] / want["norm"], head_ratio=got["head_norm"] / want["head_norm"])
        rows[name] = got
    return rows


def zero2_gradient_scale(base: alst_stacks.Run, sp: int, stage: int = 2) -> dict:
    """Defect 1: ALST's recipe at ZeRO-``stage`` against one process at the same stage (hybridsp: control)."""
    base = replace(base, steps=1, head_norm=True, stage=stage, features="plain", budget=None)
    runs = {
        f"alst SP{sp}": replace(base, stack="alst", ulysses=sp, ring=1),
        f"hybridsp U{sp}xR1": replace(base, stack="hybridsp", ulysses=sp, ring=1),
    }
    return {
        "what": f"ZeRO-{stage}, S={base.seq_len}, SP={sp}: first-step gradient norms / one process's",
        "expected": {f"alst SP{sp}": float(sp), f"hybridsp U{sp}xR1": 1.0},
        "rows": _ratios(runs, alst_stacks.reference_of(base)),
    }


def fused_logits_head_gradient(base: alst_stacks.Run, sp: int) -> dict:
    """Defect 2: ALST with TiledFusedLogitsLoss (and with sequence_tiled_compute, the control) at ZeRO-3."""
    base = replace(base, steps=1, head_norm=True, stage=3, features="tiled", budget=None)
    runs = {
        "alst TiledFusedLogitsLoss": replace(base, stack="alst", ulysses=sp, alst_loss="fused_logits"),
        "alst sequence_tiled_compute": replace(base, stack="alst", ulysses=sp, alst_loss="sequence_tiled"),
    }
    return {
        "what": f"ZeRO-3, S={base.seq_len}, SP={sp}, TiledMLP on: first-step gradient norms / one process's",
        "expected": {
            "alst TiledFusedLogitsLoss": f"lm_head: (S - 1) / SP = {(base.seq_len - 1) / sp:g}",
            "alst sequence_tiled_compute": 1.0,
        },
        "rows": _ratios(runs, alst_stacks.reference_of(base)),
    }


def tied_tiled_loss(base: alst_stacks.Run, sp: int) -> dict:
    """Defect 3: ALST's tiled loss on a tied lm_head under ZeRO-3 (hybridsp's fused loss: the control)."""
    base = replace(base, steps=1, head_norm=True, stage=3, features="tiled", budget=None, tied=True)
    runs = {
        "alst sequence_tiled_compute, tied": replace(base, stack="alst", ulysses=sp),
        "alst TiledFusedLogitsLoss, tied": replace(base, stack="alst", ulysses=sp, alst_loss="fused_logits"),
        f"hybridsp U{sp}xR1 fused loss, tied": replace(base, stack="hybridsp", ulysses=sp),
    }
    want = _first_step(alst_stacks.reference_of(base))
    rows = {"reference": want}
    for name, run in runs.items():
        try:
            got = _first_step(run)
            got.update(norm_ratio=got["norm"] / want["norm"], head_ratio=got["head_norm"] / want["head_norm"])
        except AssertionError as error:
            got = {"failed": str(error).strip().splitlines()[-1][:160]}
        rows[name] = got
    return {
        "what": f"ZeRO-3, S={base.seq_len}, SP={sp}, tied lm_head, tiling on: does the first step run",
        "expected": {name: "runs, 1.0" for name in runs},
        "rows": rows,
    }


def markdown(name: str, result: dict) -> str:
    lines = [
        f"**{name}**: {result['what']}",
        "",
        "| run | loss | grad norm | / one process | lm_head grad norm | / one process | expected |",
        "|---|---|---|---|---|---|---|",
    ]
    for run, row in result["rows"].items():
        expected = result["expected"].get(run, "")
        if "failed" in row:
            lines.append(f"| {run} | fails: `{row['failed']}` | | | | | {expected} |")
            continue
        ratios = (f"{row['norm_ratio']:.4f}", f"{row['head_ratio']:.4f}") if "norm_ratio" in row else ("1", "1")
        lines.append(
            f"| {run} | {row['loss']:.6f} | {row['norm']:.6g} | {ratios[0]} | {row['head_norm']:.6g} | "
            f"{ratios[1]} | {expected} |"
        )
    return "\n".join(lines) + "\n"
