"""Measured CPU analog of the planner's ablation: the longest trainable context at cp8 as memory
techniques are added, with the planner's prediction for each row beside it.

    python -m benchmarks run longest.ablation                 # the default rows below (~1.5 h on 2 cores)
    python -m benchmarks run longest.ablation --rows none checkpointing+activation_offload --vocab 32000

Each technique is a flag of a row (``+``-joined names in ``--rows``): ``fused_loss``
(``hybridsp.fused_cross_entropy``), ``tiled_mlp`` (a tiled MLP: :func:`_enable_tiled_mlp` is the
one hook to point at its API), ``checkpointing`` (HF activation checkpointing, non-reentrant),
``activation_offload`` (``hybridsp.offload_activations``; needs checkpointing). A row that needs
a technique this branch lacks is reported "not available" (with the planner's prediction) and
not measured.

Rules (those of longest.context, whose rank machinery this reuses: :mod:`benchmarks.common.longest`): the example
model of ``examples/train.py`` (h=256, 8/4 heads of 32, I=640, tied embeddings, fp32) with
``--vocab`` (default 32000: a realistic vocabulary; token ids are the byte corpus's) and
``--layers``, ZeRO-3 from ``ds_configs/cp8.json`` through ``hybridsp.integrations.deepspeed
.initialize``, U4 x R2 on 8 gloo ranks, one training step (forward, backward, AdamW). After the
engine is built each rank sets the soft ``RLIMIT_DATA`` to its VmData + ``budget / 8``; an
allocation past it raises inside torch and the attempt counts as too long.

Activation offload's host memory is outside the budget, as host memory is outside an
accelerator's: the host copies are ``MAP_SHARED`` mappings of unlinked files in /dev/shm
(:func:`shared_host_tensor`), which ``RLIMIT_DATA`` does not count (it counts private writable
mappings). Copies are synchronous on CPU, so the planner is given ``offload_in_flight=0``.

Planner: ``hybridsp.planner.longest_context`` on a "cluster" of 8 ranks whose memory is the
budget plus what exists after the engine build in the planner's own terms (the parameter,
gradient and optimizer partitions and DeepSpeed's gradient bucket; the gathered units are
allocated during the step, so they count against the budget), nothing reserved, the same mesh,
ZeRO-3 and checkpointing as the row, ``dtype_bytes=4``, ``collective_copies=1`` (gloo's temporaries). Search: start at the planner's
prediction, step by 15% until the outcome flips, then bisect to ``lcm(granularity, 2 R U)``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.common import ROOT, harness
from benchmarks.common import longest as blc
from benchmarks.common.example import example_model_spec
from benchmarks.common.harness import shared_host_tensor
from hybridsp.planner import _calibration as calibration

MODULE = "benchmarks.longest.ablation"

MIB = 2**20
WORLD, ULYSSES, RING, CONFIG = calibration.WORLD, calibration.ULYSSES, calibration.RING, "cp8.json"
FIXTURE = ROOT / "tests" / "data" / "planner_calibration_cpu.json"  # what tests/planner/test_calibration.py reads
TECHNIQUES = ("fused_loss", "tiled_mlp", "checkpointing", "activation_offload")
DEFAULT_ROWS = (  # (vocab, layers, total budget MiB, techniques): the ablation's rows at V=32000, 1.5 GiB (192 MiB
    # per rank: at longest.context's 1 GiB / 8 = 128 MiB nothing trains at V=32000, measured: the step's fixed
    # ZeRO-3 part (the tied 31 MiB embedding re-gathered, the gradient bucket's reduce-scatter copies) is ~146 MiB)
    (32000, 4, 1536, ()),
    (32000, 4, 1536, ("fused_loss",)),
    (32000, 4, 1536, ("fused_loss", "tiled_mlp")),
    (32000, 4, 1536, ("checkpointing", "fused_loss", "tiled_mlp")),
    (32000, 4, 1536, ("checkpointing", "fused_loss", "tiled_mlp", "activation_offload")),
)


class NotAvailable(RuntimeError):
    """A technique this branch does not have."""


# --------------------------------------------------------------------------------------------
# techniques


def _tiled_mlp_function():
    """The tiled-MLP switch ``f(model, mesh)`` if this branch has one (``hybridsp.memory._tiled_mlp``), else None."""
    try:
        import hybridsp.memory._tiled_mlp as tiled
    except ImportError:
        return None
    for name in ("apply_tiled_mlp", "tile_mlp", "apply"):
        if callable(getattr(tiled, name, None)):
            return getattr(tiled, name)
    return None


def unavailable(techniques) -> list[str]:
    """The techniques of a row this branch lacks."""
    import hybridsp

    missing = []
    if "fused_loss" in techniques and not hasattr(hybridsp, "fused_cross_entropy"):
        missing.append("fused_loss")
    if "tiled_mlp" in techniques and _tiled_mlp_function() is None:
        missing.append("tiled_mlp")
    return missing


# --------------------------------------------------------------------------------------------
# inside a rank


def attempt_rank(
    rank: int, world: int, seq_len: int, vocab: int, layers: int, techniques: tuple, budget: int, report_dir: str
) -> dict:
    """One training step at ``seq_len`` under the budget (see the module docstring)."""
    try:
        return _attempt(seq_len, vocab, layers, techniques, budget)
    except BaseException as error:
        harness.lift_limit("data")
        Path(report_dir, f"rank{rank}.txt").write_text(f"{time.time():.6f}\n{type(error).__name__}: {error}")
        raise


def _step(train, engine, mesh, windows, techniques, offload) -> float:
    """train.train_step, or its fused-loss variant (``causal_lm_loss``: the model's decoder and lm_head call
    through ``hybridsp.fused_cross_entropy``, the ZeRO-3 weight gathered by DeepSpeed's own hooks)."""
    if "fused_loss" not in techniques:
        return train.train_step(engine, mesh, windows, 0, 1, 1, offload=offload)
    import hybridsp

    local = hybridsp.shard_batch({"input_ids": windows.batch(0, 1), "labels": windows.batch(0, 1)}, mesh)
    from hybridsp.integrations.transformers import causal_lm_loss

    with offload:
        loss = causal_lm_loss(engine, local, mesh)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _attempt(seq_len: int, vocab: int, layers: int, techniques: tuple, budget: int) -> dict:
    from hybridsp import offload_activations

    harness.tensors_via_mmap(256 * 1024)
    train, text_data, initialize = blc.example_imports()
    tokens, _ = text_data.tokenize(text_data.load_corpus(None), None)
    windows = text_data.TokenWindows(tokens, seq_len, 0)
    argv = ["--deepspeed", str(ROOT / "ds_configs" / CONFIG), "--seq-len", str(seq_len), "--layers", str(layers)]
    args = train.parse_args(argv + (["--activation-checkpointing"] if "checkpointing" in techniques else []))
    engine, _, mesh, _ = initialize(
        train.build_model(args, vocab), train._config_with_lr(args), ulysses=ULYSSES, ring=RING
    )
    if "tiled_mlp" in techniques:
        function = _tiled_mlp_function()
        if function is None:
            raise NotAvailable("tiled_mlp")
        function(engine.module)
    offload = offload_activations(
        engine.module, enabled="activation_offload" in techniques, host_allocator=shared_host_tensor
    )
    gc.collect()
    harness.malloc_trim()
    init, init_tensors = harness.memory_status(), harness.live_tensor_bytes()
    with harness.Allocations() as step_alloc:
        harness.set_limit("data", init, budget)
        started = time.perf_counter()
        try:
            loss = _step(train, engine, mesh, windows, techniques, offload)
            step_s = time.perf_counter() - started
        finally:
            harness.lift_limit("data")
    end = harness.memory_status()
    host = offload.stats.offloaded_bytes
    return {
        "loss": loss,
        "step_s": step_s,
        "init_alloc_end": init_tensors,
        # the profiler also records the /dev/shm host copies: subtract them (they are alive at the peak)
        "step_alloc_peak": step_alloc.peak - host,
        "host_bytes": host,
        "alloc_peak": init_tensors + step_alloc.peak - host,
        "offloaded_tensors": offload.stats.offloaded_tensors,
        "step_data_delta_end": end["VmData"] - init["VmData"],
    }


# --------------------------------------------------------------------------------------------
# the planner's view


def model_spec(vocab: int, layers: int):
    return calibration.model_spec(example_model_spec(), vocab, layers)


def planner_memory(vocab: int, layers: int, techniques, seq_len: int):
    return calibration.memory(example_model_spec(), vocab, layers, techniques, seq_len)


def planner_longest(vocab: int, layers: int, techniques, budget: int, granularity: int) -> int:
    """Longest context in the planner's model for the measured rules (module docstring)."""
    return calibration.longest(example_model_spec(), vocab, layers, techniques, budget, granularity)


# --------------------------------------------------------------------------------------------
# the search


@dataclass
class Attempt:
    seq_len: int
    ok: bool
    reason: str = ""
    detail: str = ""
    wall_s: float = 0.0
    load: list = field(default_factory=list)
    worst: dict = field(default_factory=dict)
    planner: dict = field(default_factory=dict)


def _rank_reports(directory: str) -> list[tuple[float, int, str]]:
    """common.longest's reader, skipping a report a killed rank left half-written."""
    reports = []
    for path in Path(directory).glob("rank*.txt"):
        stamp, _, text = path.read_text().partition("\n")
        try:
            reports.append((float(stamp), int(path.stem[4:]), text))
        except ValueError:
            continue
    return sorted(reports)


def planner_row(vocab: int, layers: int, techniques, seq_len: int) -> dict:
    return calibration.attempt(example_model_spec(), vocab, layers, techniques, seq_len)


def calibration_fixture(rows: list[dict]) -> dict:
    """The measured rows reduced to what the planner's calibration test reads, with the base model."""
    keep = ("vocab", "layers", "budget_total", "techniques", "at", "longest", "complete", "granularity")
    return {
        "source": "benchmarks/longest/ablation.py (results/longest_context/ablation_cpu.json), written by its save step",
        "model": asdict(example_model_spec()),
        "rows": [
            {
                **{key: row[key] for key in keep if key in row},
                "attempt_list": [
                    {
                        "seq_len": a["seq_len"],
                        "ok": a["ok"],
                        "step_alloc_peak": (a.get("worst") or {}).get("step_alloc_peak"),
                    }
                    for a in row.get("attempt_list", [])
                ],
            }
            for row in rows
            if not row.get("not_available")
        ],
    }


def replan(row: dict, granularity: int) -> dict:
    """A stored row with the current planner's numbers (the planner is deterministic)."""
    techniques = tuple(row["techniques"])
    row = {
        **row,
        "planner_longest": planner_longest(
            row["vocab"], row["layers"], techniques, row["budget_total"] // WORLD, granularity
        ),
    }
    for attempt in row.get("attempt_list", []):
        attempt["planner"] = planner_row(row["vocab"], row["layers"], techniques, attempt["seq_len"])
    return row


def run_attempt(vocab, layers, techniques, seq_len, budget, timeout, log) -> Attempt:
    attempt = Attempt(seq_len, False, load=[os.getloadavg()[0]])
    attempt.planner = planner_row(vocab, layers, techniques, seq_len)
    m = planner_memory(vocab, layers, techniques, seq_len)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_ablation_") as reports:
        try:
            ranks = harness.launch(
                attempt_rank,
                WORLD,
                seq_len,
                vocab,
                layers,
                tuple(techniques),
                budget,
                reports,
                timeout=timeout,
                threads=1,
            )
            attempt.ok, attempt.worst = True, blc.worst_rank([{**r, "rank": i} for i, r in enumerate(ranks)])
        except (AssertionError, TimeoutError) as error:
            attempt.reason, attempt.detail = blc.classify_failure(error, _rank_reports(reports))
    attempt.wall_s = time.perf_counter() - started
    attempt.load.append(os.getloadavg()[0])
    if attempt.ok:
        w = attempt.worst
        log(
            f"    S={seq_len:>6}: ok   {attempt.wall_s:4.0f} s; MiB per rank: allocated {w['alloc_peak'] / MIB:.0f} "
            f"(step {w['step_alloc_peak'] / MIB:.0f}, host {w['host_bytes'] / MIB:.0f}); planner "
            f"{m.total / MIB:.0f} (step {attempt.planner['step'] / MIB:.0f}, host {m.host / MIB:.0f}); load "
            f"{attempt.load[0]:.0f}"
        )
    else:
        log(f"    S={seq_len:>6}: FAIL {attempt.wall_s:4.0f} s {attempt.reason}: {attempt.detail[:140]}")
    return attempt


class _Enough(Exception):
    """The search reached its attempt limit."""


def search(
    vocab, layers, techniques, budget, granularity, start, log, timeout, max_attempts: int = 8
) -> tuple[int, list[Attempt], bool]:
    """From ``start`` (the planner's prediction) by 15% steps until the outcome flips, then bisect.
    Returns (longest that fit, attempts, whether the bisection finished within ``max_attempts``)."""
    from hybridsp.layout._layouts import check_sequence_length

    step = math.lcm(granularity, 2 * RING * ULYSSES)
    attempts = []

    def fits(seq_len):
        if len(attempts) >= max_attempts:
            raise _Enough
        check_sequence_length(seq_len, RING, ULYSSES, "zigzag")
        attempt = run_attempt(vocab, layers, techniques, seq_len, budget, timeout, log)
        attempts.append(attempt)
        if attempt.reason == "error":
            raise RuntimeError(f"S={seq_len} failed for a reason other than memory: {attempt.detail}")
        return attempt.ok

    try:
        return (*_bracket_and_bisect(fits, start, step), attempts, True)
    except _Enough:
        return max([a.seq_len for a in attempts if a.ok], default=0), attempts, False


def _bracket_and_bisect(fits, start: int, step: int) -> tuple[int]:
    length = max(step, round(start / step) * step)
    if fits(length):
        low, high = length, None
        while high is None:
            length = max(length + step, math.ceil(length * 1.15 / step) * step)
            low, high = (length, None) if fits(length) else (low, length)
    else:
        low, high = 0, length
        while low == 0 and length > step:
            length = max(step, int(length * 0.85) // step * step)
            low, high = (length, high) if fits(length) else (0, length)
    while low and high - low > step:
        middle = (low + high) // 2 // step * step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return (low,)


# --------------------------------------------------------------------------------------------
# results


def _name(techniques, row: dict | None = None) -> str:
    name = " + ".join(techniques) or "none"
    return f"{name} (log)" if row and row.get("from_log") else name


def _mib(value) -> str:
    return "-" if value is None else f"{value / MIB:,.0f}"


def markdown(rows: list[dict], meta: dict, runs: list[dict] | None = None) -> str:
    runs = runs or [meta]
    lines = ["# Measured CPU analog of the ablation (cp8) with the planner beside it", ""]
    lines += [
        f"- Run {run['date']}: `{run['command']}` ({run.get('total_s', 0) / 60:.1f} min); load (1-min average) "
        f"{run['load_before']:.1f} before, {run.get('load_after', float('nan')):.1f} after"
        for run in runs
    ]
    lines += [
        f"- Machine: {meta['machine']}; {meta['software']}",
        f"- Rules: `examples/train.py`'s model (h=256, 8/4 heads of 32, I=640, tied embeddings, fp32), ZeRO-3 "
        f"(`ds_configs/cp8.json`), U4 x R2 on 8 gloo ranks, one training step; RLIMIT_DATA = VmData after the "
        f"engine build + the row's total budget / 8 per rank (longest.context's rules); "
        f"lengths in multiples of {meta['step']}; offloaded activations in /dev/shm (outside the limit, as host "
        "memory). Planner: `longest_context` with the budget + its own after-build states, same mesh/ZeRO-3/"
        "checkpointing, `offload_in_flight=0` (CPU copies are synchronous). allocated = live tensors after the "
        "build + the step's profiler peak, host copies excluded; the planner's step includes the gathered ZeRO-3 "
        "parameters (allocated during the step). Planner numbers are recomputed with the current planner.",
        "",
        "| V | L | budget MiB | techniques | measured longest S | planner longest S | planner error | attempts | allocated MiB at "
        "the longest (init + step) | planner MiB (total / step, peak phase) | host MiB (measured / planner) | "
        "step s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    logs = sorted({r["from_log"] for r in rows if r.get("from_log")})
    if logs:
        lines[-3] += (
            f" Rows marked (log) were rebuilt from the log of the first run, 07:39-07:58 UTC "
            f"({', '.join(logs)}; it stopped later on a half-written rank report, now skipped): "
            "MiB rounded, no step times."
        )
    fixed = [r for r in rows if r.get("at")]
    rows = [r for r in rows if not r.get("at")]
    for r in rows:
        head = f"| {r['vocab']:,} | {r['layers']} | {r['budget_total'] / MIB:,.0f} |"
        if r.get("not_available"):
            lines.append(
                f"{head} {_name(r['techniques'], r)} | not available on this "
                f"branch ({', '.join(r['not_available'])}) | {r['planner_longest']:,} | | | | | | |"
            )
            continue
        best = next((a for a in r["attempt_list"] if a["ok"] and a["seq_len"] == r["longest"]), None)
        error = f"{r['planner_longest'] / r['longest'] - 1:+.0%}" if r["longest"] else "-"
        if not r.get("complete", True):
            error += " (measured: a lower bound, search cut)"
        if best is None:
            lines.append(
                f"{head} {_name(r['techniques'])} | 0 | {r['planner_longest']:,} "
                f"| - | {len(r['attempt_list'])} | | | | |"
            )
            continue
        w, p = best["worst"], best["planner"]
        lines.append(
            f"{head} {_name(r['techniques'], r)} | {r['longest']:,} | "
            f"{r['planner_longest']:,} | {error} | {len(r['attempt_list'])} | {_mib(w['alloc_peak'])} "
            f"({_mib(w['init_alloc_end'])} + {_mib(w['step_alloc_peak'])}) | {_mib(p['total'])} / {_mib(p['step'])}, "
            f"{p['peak_phase']} | {_mib(w['host_bytes'])} / {_mib(p['host'])} | "
            f"{'-' if w.get('step_s') is None else format(w['step_s'], '.1f')} |"
        )
    if fixed:
        lines += [
            "",
            "### At a fixed length (one attempt each, no search): what the step allocates",
            "",
            "| V | L | budget MiB | S | techniques | result | step allocated MiB (measured / planner, error) | "
            "whole rank MiB (measured / planner) | host MiB (measured / planner) | step s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in fixed:
            head = f"| {r['vocab']:,} | {r['layers']} | {r['budget_total'] / MIB:,.0f} | {r['at']:,} | {_name(r['techniques'])} |"
            if r.get("not_available"):
                lines.append(f"{head} not available ({', '.join(r['not_available'])}) | | | | |")
                continue
            a = r["attempt_list"][0]
            w, p = a["worst"], a["planner"]
            if not a["ok"]:
                lines.append(f"{head} **{a['reason']}** | - / {_mib(p['step'])} | - / {_mib(p['total'])} | | |")
                continue
            lines.append(
                f"{head} ok | {_mib(w['step_alloc_peak'])} / {_mib(p['step'])} "
                f"({p['step'] / w['step_alloc_peak'] - 1:+.0%}) | {_mib(w['alloc_peak'])} / {_mib(p['total'])} | "
                f"{_mib(w['host_bytes'])} / {_mib(p['host'])} | {w['step_s']:.0f} |"
            )
    lines += [
        "",
        "### Every attempt",
        "",
        "| V | L | techniques | S | result | wall s | allocated MiB (step) | "
        "planner MiB (step) | host MiB | load before/after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for a in r.get("attempt_list", []):
            w, p = a["worst"], a["planner"]
            result = "ok" if a["ok"] else f"**{a['reason']}**: {a['detail'][:90]}"
            allocated = f"{_mib(w['alloc_peak'])} ({_mib(w['step_alloc_peak'])})" if a["ok"] else ""
            lines.append(
                f"| {r['vocab']:,} | {r['layers']} | {_name(r['techniques'])} | {a['seq_len']:,} | {result} | "
                f"{a['wall_s']:.0f} | {allocated} | {_mib(p['total'])} ({_mib(p['step'])}) | "
                f"{_mib(w.get('host_bytes')) if a['ok'] else ''} | {a['load'][0]:.0f}/{a['load'][1]:.0f} |"
            )
    return "\n".join(lines) + "\n"


def rows_from_log(path: Path) -> list[dict]:
    """Rows rebuilt from a run's log lines (``results/longest_context/ablation_cpu_run1.log``: that run stopped at a
    later row on a half-written rank report, since skipped): per attempt the length, the outcome and
    the logged MiB (allocated, step, host; rounded to 1 MiB); the planner is recomputed."""
    import re

    rows, row = [], None
    head = re.compile(r"V=(\d+) L=(\d+) budget (\d+) MiB (.+?): planner ([\d,]+)(; not available \((.+)\))?$")
    ok = re.compile(r"S=\s*(\d+): ok\s+(\d+) s; MiB per rank: allocated (\d+) \(step (\d+), host (\d+)\).*load (\d+)")
    fail = re.compile(r"S=\s*(\d+): FAIL\s+(\d+) s (\w+): (.*)$")
    for line in path.read_text().splitlines():
        if match := head.search(line):
            vocab, layers, budget, name, planned, _, missing = match.groups()
            techniques = [] if name == "none" else name.split(" + ")
            row = {
                "vocab": int(vocab),
                "layers": int(layers),
                "budget_total": int(budget) * MIB,
                "techniques": techniques,
                "planner_longest": int(planned.replace(",", "")),
                "from_log": str(path.name),
            }
            if missing:
                row["not_available"] = missing.split(", ")
            else:
                row.update(attempt_list=[], complete=True)
            rows.append(row)
        elif (match := ok.search(line)) or (match_fail := fail.search(line)):
            if match:
                seq_len, wall, allocated, step, host, load = (int(v) for v in match.groups())
                worst = {
                    "alloc_peak": allocated * MIB,
                    "step_alloc_peak": step * MIB,
                    "host_bytes": host * MIB,
                    "init_alloc_end": (allocated - step) * MIB,
                }
                attempt = Attempt(seq_len, True, wall_s=wall, load=[load, load], worst=worst)
            else:
                seq_len, wall, reason, detail = match_fail.groups()
                attempt = Attempt(int(seq_len), False, reason, detail, wall_s=int(wall), load=[float("nan")] * 2)
            attempt.planner = planner_row(row["vocab"], row["layers"], row["techniques"], attempt.seq_len)
            row["attempt_list"].append(attempt.__dict__)
        elif line.strip().startswith("measured") and row is not None:
            row["longest"] = int(line.split()[1].replace(",", ""))
    return [r for r in rows if "not_available" in r or "longest" in r]


def _parse_row(text: str, vocab: int, layers: int, budget_mib: int) -> tuple:
    names = () if text == "none" else tuple(text.split("+"))
    unknown = sorted(set(names) - set(TECHNIQUES))
    if unknown:
        raise SystemExit(f"unknown techniques {unknown}; choose from {', '.join(TECHNIQUES)} (joined by +) or none")
    if "activation_offload" in names and "checkpointing" not in names:
        raise SystemExit("activation_offload needs checkpointing (it offloads the checkpointed layers' inputs)")
    return vocab, layers, budget_mib, names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rows",
        nargs="+",
        help="rows, e.g. none checkpointing+activation_offload (default: "
        "DEFAULT_ROWS, today's path to every technique at V=32000)",
    )
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary of --rows")
    parser.add_argument("--layers", type=int, default=4, help="layers of --rows")
    parser.add_argument("--budget-mib", type=int, default=1536, help="total budget of --rows, split over the 8 ranks")
    parser.add_argument("--granularity", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per attempt")
    parser.add_argument(
        "--out",
        default=harness.results_dir("longest_context"),
        help="folder for ablation_cpu.{json,md} (default benchmarks/results/longest_context)",
    )
    parser.add_argument(
        "--fixture",
        default=str(FIXTURE),
        help="where to write the rows the planner's calibration test reads ('' for nowhere)",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the rows already in the results file (a row measured again replaces its old one)",
    )
    parser.add_argument("--max-attempts", type=int, default=8, help="attempts per row (the search stops there)")
    parser.add_argument("--at", type=int, help="no search: one attempt per row at this length (memory side by side)")
    parser.add_argument("--start", type=int, help="the search's first length (default: the planner's prediction)")
    parser.add_argument(
        "--replan",
        action="store_true",
        help="measure nothing: recompute the planner's numbers of "
        "the stored rows (with --append) and rewrite the results",
    )
    parser.add_argument(
        "--from-log",
        type=Path,
        help="add the rows of a run's log (see rows_from_log); with no --rows nothing is measured",
    )
    args = parser.parse_args(argv)
    rows = (
        [_parse_row(text, args.vocab, args.layers, args.budget_mib) for text in args.rows]
        if args.rows
        else []
        if (args.from_log or args.replan)
        else list(DEFAULT_ROWS)
    )
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    log = lambda text: print(text, flush=True)  # noqa: E731
    blc.warm_forkserver()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    previous = (
        json.loads((out / "ablation_cpu.json").read_text())
        if args.append and (out / "ablation_cpu.json").exists()
        else {"rows": [], "runs": []}
    )
    results = [replan(row, row.get("granularity", args.granularity)) for row in previous["rows"]]
    runs = previous.get("runs", [])
    run_meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": harness.command(MODULE, argv),
        "load_before": load_before,
        "machine": harness.machine_info(),
        "software": harness.software_info(),
        "step": math.lcm(args.granularity, 2 * RING * ULYSSES),
    }
    runs.append(run_meta)

    def save():
        run_meta.update(total_s=time.perf_counter() - started, load_after=os.getloadavg()[0])
        (out / "ablation_cpu.json").write_text(json.dumps({"meta": run_meta, "runs": runs, "rows": results}, indent=1))
        (out / "ablation_cpu.md").write_text(markdown(results, run_meta, runs))
        if args.fixture:
            Path(args.fixture).write_text(json.dumps(calibration_fixture(results), indent=1) + "\n")

    def keep(row):
        key = (row["vocab"], row["layers"], row["budget_total"], tuple(row["techniques"]))
        results[:] = [r for r in results if (r["vocab"], r["layers"], r["budget_total"], tuple(r["techniques"])) != key]
        results.append({**row, "run": run_meta["date"]})
        save()

    for logged in rows_from_log(args.from_log) if args.from_log else []:
        keep(replan(logged, args.granularity))
    for vocab, layers, budget_mib, techniques in rows:
        budget = budget_mib * MIB // WORLD
        predicted = planner_longest(vocab, layers, techniques, budget, args.granularity)
        row = {
            "vocab": vocab,
            "layers": layers,
            "budget_total": budget_mib * MIB,
            "techniques": list(techniques),
            "planner_longest": predicted,
        }
        missing = unavailable(techniques)
        log(
            f"V={vocab} L={layers} budget {budget_mib} MiB {_name(techniques)}: planner {predicted:,}"
            + (f"; not available ({', '.join(missing)})" if missing else "")
        )
        if missing:
            keep({**row, "not_available": missing, **({"at": args.at} if args.at else {})})
            continue
        if args.at:
            attempt = run_attempt(vocab, layers, techniques, args.at, budget, args.timeout, log)
            keep({**row, "at": args.at, "attempt_list": [attempt.__dict__]})
            continue
        longest, attempts, complete = search(
            vocab,
            layers,
            techniques,
            budget,
            args.granularity,
            args.start or predicted,
            log,
            args.timeout,
            args.max_attempts,
        )
        keep(
            {
                **row,
                "longest": longest,
                "complete": complete,
                "granularity": args.granularity,
                "attempt_list": [a.__dict__ for a in attempts],
            }
        )
        log(f"  measured {longest:,}" + ("" if complete else " (search cut at --max-attempts: a lower bound)"))
    save()
    print(markdown(results, run_meta, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
