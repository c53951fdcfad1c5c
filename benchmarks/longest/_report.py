"""The markdown report of longest.context (tables, breakdowns and a reading, from its rows).

python -m benchmarks run longest.context --render benchmarks/results/longest_context/longest_context.json
"""

from __future__ import annotations

import json

MIB, GIB = 2**20, 2**30


def relative_error(predicted: float, measured: float) -> float | None:
    return None if not measured else (predicted - measured) / measured


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def _slope(fit: dict | None) -> str:
    return "-" if fit is None else f"{fit['slope']:,.0f}"


def markdown(rows: list[dict], meta: dict, checks: list[dict], clusters: str | None) -> str:
    budget = meta["budget_total"]
    limit_base = "the imports" if meta["limit_from"] == "imports" else "the imports and the engine build"
    lines = [
        "# Longest context of one training step on this machine, measured vs the planner",
        "",
        f"- Date: {meta['date']}",
        f"- Command: `{meta['command']}` ({meta['total_s'] / 60:.1f} min in all)",
        f"- Machine: {meta['machine']}",
        f"- Software: {meta['software']}",
        f"- Model: `examples/train.py` defaults ({meta['model']}), fp32, ZeRO-3 from the shipped "
        f"`ds_configs/cpN.json` through `hybridsp.integrations.deepspeed.initialize`; one `train.train_step` "
        f"(forward + backward + AdamW step, micro-batch 1) on a window of the byte corpus. Ranks: gloo, "
        f"`hybridsp.testing.run_distributed`, one launch per attempt, {meta['threads_note']}.",
        f"- Memory limit: each rank sets the soft `RLIMIT_{meta['limit'].upper()}` to its VmData after {limit_base} "
        f"+ {budget / GIB:g} GiB / world size; glibc serves allocations >= {meta['mmap_threshold'] // 1024} KiB "
        f"by mmap (`mallopt(M_MMAP_THRESHOLD)`, so freed tensors go back to the OS). Search: doubling from "
        f"{meta['start_note']}, then bisection to {meta['granularity']} tokens (multiples of lcm(granularity, 2RU) "
        f"for the zigzag layout); a failed or timed-out attempt counts as too long.",
        "- Measured, per rank, max over ranks: **allocated** (torch's view, the analogue of "
        "`torch.cuda.max_memory_allocated`) = live tensor bytes after the engine build (unique storages of every "
        "tensor the garbage collector tracks) + the step's peak of torch's own allocations (profiler memory "
        "events); **RSS** (the OS's view) = VmHWM - VmRSS after the imports, minus the growth of file-backed RSS "
        "(code pages); **saved** = unique storages autograd saved for backward (parameters excluded). `step` "
        "columns count only the step, over the footprint after the engine build (what the limit counted).",
        "- Planner: `hybridsp.planner.memory_use` for the same model (ModelSpec H=8, Hkv=4, D=32, h=256, I=640, "
        "L=4, V=256, tied embeddings), S, DP=1 x U x R, ZeRO-3, no checkpointing, `dtype_bytes=4`; `step` = "
        "activations + logits + workspace; `planner longest` = `longest_context` on a 1-node cluster of `world` "
        "ranks with memory = budget per rank + the planner's model states, nothing reserved, restricted to the "
        "same mesh (the last column lets the planner choose the mesh, ZeRO stage and checkpointing). "
        "Error = (planner - measured) / measured.",
        "",
        "## Measured longest context and the planner's prediction",
        "",
        "| config | world (U x R) | budget/rank MiB | longest S | step s | allocated MiB (init + step) | planner MiB "
        "(states + step) | error | step allocated MiB | planner step MiB | error | saved MiB | planner act. MiB | "
        "error | RSS MiB (step) | error vs RSS | planner longest S (error) | planner's own pick |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, p, e, pl, free = (
            r.get("measured"),
            r.get("planner"),
            r.get("errors", {}),
            r["planner_longest"],
            r["planner_longest_free"],
        )
        head = f"| {r['config']} | {r['world']} ({r['ulysses']} x {r['ring']}) | {_mib(r['budget_per_rank'])} | "
        pick = (
            f"{free['seq_len']:,} ({free.get('dp')}x{free.get('ulysses')}x{free.get('ring')} ZeRO-"
            f"{free.get('zero_stage')}{' ckpt' if free.get('checkpointing') else ''})"
            if free.get("dp")
            else "-"
        )
        if m is None:
            lines.append(head + f"{r['longest']:,} |" + " |" * 12 + f" {pl['seq_len']:,} | {pick} |")
            continue
        pl_err = _pct((pl["seq_len"] - r["longest"]) / r["longest"])
        lines.append(
            head + f"{r['longest']:,} | {r['step_s']:.0f} | {_mib(m['alloc_peak'])} ({_mib(m['init_alloc_end'])} + "
            f"{_mib(m['step_alloc_peak'])}) | {_mib(p['total'])} ({_mib(p['model_states'])} + {_mib(p['step'])}) | "
            f"{_pct(e['total_vs_allocated'])} | {_mib(m['step_alloc_peak'])} | {_mib(p['step'])} | "
            f"{_pct(e['step_vs_allocated'])} | {_mib(m['saved_bytes'])} | {_mib(p['activations'])} | "
            f"{_pct(e['activations_vs_saved'])} | {_mib(m['peak_anon_delta'])} ({_mib(m['step_peak_anon_delta'])}) | "
            f"{_pct(e['total_vs_rss'])} | {pl['seq_len']:,} ({pl_err}) | {pick} |"
        )
    lines += [
        "",
        "### Per local token and fixed costs",
        "",
        "Slopes of least-squares lines over every successful attempt of a config, bytes per token a rank holds "
        "(S / C); fixed costs per rank at the longest length.",
        "",
        "| config | step allocated B/token | planner step B/token | error | saved B/token | planner act. B/token | "
        "error | step RSS B/token | engine build: live tensors / RSS / VmData MiB | left allocated by the step MiB "
        "| planner model states MiB | free heap at the limit MiB | RSS after imports MiB | threads |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, p = r.get("measured"), r.get("planner")
        if m is None:
            continue
        sa, ps, sv, pa = (
            r["step_alloc_per_token"],
            r["planner_step_per_token"],
            r["saved_per_token"],
            r["planner_activations_per_token"],
        )
        lines.append(
            f"| {r['config']} | {_slope(sa)} | {_slope(ps)} | "
            f"{_pct(relative_error(ps['slope'], sa['slope'])) if sa and ps else '-'} | {_slope(sv)} | {_slope(pa)} | "
            f"{_pct(relative_error(pa['slope'], sv['slope'])) if sv and pa else '-'} | {_slope(r['step_rss_per_token'])} | "
            f"{_mib(m['init_alloc_end'])} / {_mib(m['init_anon_delta'])} / {_mib(m['init_data_delta'])} | "
            f"{_mib(m['step_alloc_end'])} | {_mib(p['model_states'])} | {_mib(m.get('heap_free_at_limit'))} | "
            f"{_mib(m['base_rss'])} | {m['threads_end']} |"
        )
    lines += [
        "",
        "### Every attempt",
        "",
        "| config | S | result | wall s | step s (forward) | allocated MiB (step) | RSS MiB (step) | step VmData "
        "MiB | saved MiB | planner total / step MiB | load before/after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for a in r["attempt_list"]:
            w = a["worst"]
            load = "/".join(f"{x:.0f}" for x in a["load"])
            plan = f"{_mib(a['planner']['total'])} / {_mib(a['planner']['step'])}"
            if a["ok"]:
                fwd = f" ({w['forward_s']:.0f})" if w.get("forward_s") is not None else ""
                lines.append(
                    f"| {a['config']} | {a['seq_len']:,} | ok | {a['wall_s']:.0f} | {w['step_s']:.0f}{fwd} | "
                    f"{_mib(w['alloc_peak'])} ({_mib(w['step_alloc_peak'])}) | {_mib(w['peak_anon_delta'])} "
                    f"({_mib(w['step_peak_anon_delta'])}) | {_mib(w['step_data_delta_end'])} | {_mib(w['saved_bytes'])} "
                    f"| {plan} | {load} |"
                )
            else:
                lines.append(
                    f"| {a['config']} | {a['seq_len']:,} | **{a['reason']}**: {a['detail'][:100]} | "
                    f"{a['wall_s']:.0f} | | | | | | {plan} | {load} |"
                )
    lines += [
        "",
        "### Which memory limit raises inside torch (checked at the start of the run)",
        "",
        "Each check: one fresh rank after the imports sets the limit to its current value + 256 MiB, then "
        "allocates a 128 MiB tensor (must work) and a 512 MiB one (touched).",
        "",
        "| limit | 512 MiB tensor | what happened |",
        "|---|---|---|",
    ]
    for c in checks:
        what = (
            f"{c.get('error_type', '')}: {c['error']}"
            if c.get("raised")
            else (
                f"allocated and touched; RSS {c.get('rss_after', 0) / MIB:,.0f} MiB"
                if "rss_after" in c
                else c.get("error", "")
            )
        )
        lines.append(f"| RLIMIT_{c['limit'].upper()} | {'raised' if c.get('raised') else 'no error'} | {what} |")
    lines += breakdown_lines(meta)
    lines += ["", reading(rows, meta)]
    if clusters:
        lines += ["", clusters]
    return "\n".join(lines) + "\n"


def _what(node: str, dim: int, dtype: str, h: int = 256, inter: int = 640, head_dim: int = 32) -> str:
    """A reading of one breakdown group for the example's shapes."""
    if dtype.startswith("int"):
        return "token ids / targets"
    if node.startswith("LinearFunction") or node in ("MmBackward0", "AddmmBackward0"):
        return {
            h: "inputs of the linears (q/k/v, o_proj, gate/up: 3 per layer; lm_head)",
            inter: "down_proj input (SiLU(gate) x up)",
        }.get(dim, "linear input")
    if node == "MulBackward0":
        return {
            inter: "MLP: SiLU(gate) and up (their product's operands)",
            h: "RMSNorm: x and x * rstd (2 per norm)",
            1: "RMSNorm: rstd",
            head_dim: "RoPE cos/sin",
        }.get(dim, "")
    if node == "SiluBackward0":
        return "MLP: gate (SiLU's input)"
    if "Kernel" in node or "Ring" in node:
        if dim != head_dim:
            return "attention: fp32 LSE"
        return (
            "attention: q, k, v, out (at U=1 out shares its storage with the o_proj input, counted above)"
            if "Kernel" in node
            else "attention after the all-to-all: q, k, v, out"
        )
    if node.startswith("NllLoss") or node.startswith("LogSoftmax"):
        return "loss: saved log-softmax [T, V]"
    return ""


def breakdown_lines(meta: dict) -> list[str]:
    breakdowns, checks = meta.get("breakdowns"), meta.get("bf16_checks")
    lines = []
    if breakdowns:
        names = list(breakdowns)
        table = {}
        for name, rows in breakdowns.items():
            for node, dim, dtype, per_token in rows:
                table.setdefault((node, dim, dtype), {})[name] = per_token
        lines += [
            "",
            f"### What autograd saves, per local token (one forward at S={meta['breakdown_len']:,}, graph walk)",
            "",
            "| node | last dim | dtype | " + " | ".join(f"{n} B/token" for n in names) + " | what |",
            "|---|---|---|" + "---|" * len(names) + "---|",
        ]
        for (node, dim, dtype), values in sorted(table.items(), key=lambda kv: -max(kv[1].values())):
            if max(values.values()) < 1:
                continue
            cells = " | ".join(f"{values[n]:,.0f}" if n in values else "-" for n in names)
            lines.append(f"| {node} | {dim} | {dtype} | {cells} | {_what(node, dim, dtype)} |")
        totals = " | ".join(f"**{sum(row[3] for row in breakdowns[n]):,.0f}**" for n in names)
        from benchmarks.common.example import CONFIGS, VOCAB, planner_memory  # the planner's view of the example

        length = meta["breakdown_len"]
        planned = []
        for n in names:
            world, ulysses, ring, _ = CONFIGS[n]
            planned.append(f"{planner_memory(ulysses, ring, world, length)['activations'] / (length // world):,.0f}")
        lines.append(
            f"| total | | | {totals} | planner activations: {' / '.join(planned)} (+ the log-softmax, "
            f"{VOCAB * 4:,}, in its logits term) |"
        )
    if checks:
        lines += [
            "",
            "### bf16 checks of two terms (single process, "
            f"T={checks['shapes']['tokens']}, h={checks['shapes']['hidden']}, V={checks['shapes']['vocab']})",
            "",
            "| term | measured | planner |",
            "|---|---|---|",
            f"| loss path (`lm_head` -> bf16 logits kept by the caller -> `.float()` -> cross-entropy), forward + "
            f"backward, allocated peak per token x vocabulary entry | {checks['loss_peak_bytes_per_entry']:.1f} B "
            f"| e + 4 = 6 B |",
            f"| HF `LlamaRMSNorm` + the next linear, saved per token x h | "
            f"{checks['rmsnorm_saved_bytes_per_hidden']:.1f} B | 2e = 4 B (input and output) |",
        ]
    return lines


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return _pct(low) if abs(high - low) < 0.005 else f"{_pct(low)} to {_pct(high)}"


def reading(rows: list[dict], meta: dict) -> str:
    """The short reading: numbers from this run, and what they rest on."""
    done = [r for r in rows if r.get("measured")]
    if not done:
        return "## Reading\n\nNo config produced a successful step."
    err = lambda key: [r["errors"][key] for r in done]  # noqa: E731
    longest = ", ".join(f"{r['config']} {r['longest']:,}" for r in done)
    planned = ", ".join(f"{r['config']} {r['planner_longest']['seq_len']:,}" for r in done)
    w1 = next((r for r in done if r["world"] == 1), done[0])
    bucket = w1["measured"]["init_alloc_end"] / MIB
    checks = meta.get("bf16_checks") or {}
    loss_peak = checks.get("loss_peak_bytes_per_entry", float("nan"))
    norm_saved = checks.get("rmsnorm_saved_bytes_per_hidden", float("nan"))
    slopes = [r["step_alloc_per_token"]["slope"] for r in done if r.get("step_alloc_per_token")]
    spread = max(slopes) / min(slopes) - 1 if slopes else float("nan")
    from benchmarks.common import ROOT
    from benchmarks.common.example import example_model_spec

    zero = json.loads((ROOT / "ds_configs" / w1["ds_config"]).read_text())["zero_optimization"]
    bucket_bytes = int(zero["reduce_bucket_size"]) * 4  # fp32 gradients
    psi = example_model_spec().total_params
    per_param = (w1["measured"]["init_alloc_end"] + w1["measured"]["step_alloc_end"] - bucket_bytes) / psi
    build_rss = [r["measured"]["init_anon_delta"] / MIB for r in done]
    loss_extra = (
        w1["step_alloc_per_token"]["slope"] - w1["saved_per_token"]["slope"]
        if w1.get("step_alloc_per_token") and w1.get("saved_per_token")
        else float("nan")
    )
    shares = ", ".join(f"{r['measured']['saved_bytes'] / r['measured']['step_alloc_peak']:.0%}" for r in done)
    return "\n".join(
        [
            "## Reading",
            "",
            f"- **Longest context** (one fp32 step, {_mib(done[0]['budget_per_rank'] * done[0]['world'])} MiB in all, "
            f"split over the ranks): measured {longest} tokens; the planner, given the same memory, predicts {planned}. "
            "With the total fixed, sequence parallelism on one machine cannot lengthen the context: what this shows is "
            "that U x R spreads the S-dependent memory almost perfectly over the ranks (the step's bytes per local "
            f"token differ by at most {spread:.0%} between configs), and what each extra rank costs on top.",
            f"- **What dominates**: the step's S-dependent memory is almost all autograd's saved activations (saved = "
            f"{shares} of "
            "the step's allocated peak). Per token and layer (fp32, U=1): the MLP keeps 4I = 10 KiB (gate, SiLU(gate), "
            "up, their product), the two RMSNorms 6h = 6 KiB (each its input, the normalised x, and the weighted output "
            "the next linear keeps), attention 2HD + 2HkvD = 3 KiB (q, k, v, out; the o_proj input is a view of out at "
            "U=1 and a fresh tensor after the reverse all-to-all at U>1: +1 KiB); the loss 16 B per vocabulary entry "
            "(the logits `train_step` holds, the saved log-softmax, two fp32 gradients at the start of the backward: "
            f"the step's allocated slope exceeds the saved slope by {loss_extra:,.0f} B/token at world 1, 3 x V x 4). "
            f"Fixed per rank: DeepSpeed's ZeRO-3 reduce bucket (`reduce_bucket_size` {zero['reduce_bucket_size']:.0e} fp32 "
            f"elements = {bucket_bytes / MIB:.0f} MiB, `torch.empty` at init) is {bucket_bytes / MIB / bucket:.0%} of what "
            f"the engine build leaves allocated ({bucket:.0f} MiB at world 1); it is reserved but barely touched (RSS "
            f"after the build is {min(build_rss):.0f}-{max(build_rss):.0f} MiB).",
            f"- **Prediction error**: the step (activations + logits + workspace) is predicted within "
            f"{_span(err('step_vs_allocated'))} of torch's allocated peak; the activation term alone "
            f"{_span(err('activations_vs_saved'))} of the saved tensors. The planner's per-layer formula "
            "e(4h + 3HD + 2Hkv'D + 4I) misses the RMSNorm's normalised x (h per norm, saved by the weight multiply) and "
            "counts the o_proj input separately at U=1 where it is a view of the kernel output. The whole rank is "
            f"off by {_span(err('total_vs_allocated'))}: the planner has no term for DeepSpeed's reduce "
            "bucket, and its model states are mixed-precision Adam (16 B/param) while fp32 ZeRO-3 kept "
            f"{per_param:.1f} B/param at world 1 (fp32 partition + an fp32 master copy + fp32 gradients + Adam m, v); with the budget counted after the "
            f"engine build these fixed costs do not move the longest length, which the planner gets within "
            f"{_span([(r['planner_longest']['seq_len'] - r['longest']) / r['longest'] for r in done])} (it "
            "over-predicts, as its per-token memory is a few % low).",
            "- **Caveats**: RSS is the OS's view and includes glibc's behaviour: with glibc's defaults a step's RSS "
            "was 1.6x torch's allocated peak (freed activations stay in the heap), hence `mallopt(M_MMAP_THRESHOLD)` "
            "(Note [malloc] in the script); with it RSS tracks allocations to within a few %. RLIMIT_DATA counts "
            "reserved, not touched, memory, like a GPU allocator; `allocated` is the analogue of "
            "`max_memory_allocated` (a GPU caching allocator adds its own fragmentation on top). fp32 on CPU only, "
            "micro-batch 1, no activation checkpointing (the planner's own pick would checkpoint and reach ~3x "
            "longer). V = 256 makes the loss term tiny here (4 KiB/token); for Llama-3 (V = 128,256) it is the largest "
            "term: a bf16 check of the same loss path (`lm_head` -> bf16 logits held by the caller -> `.float()` -> "
            f"cross-entropy, forward + backward, profiler allocated peak) peaks at {loss_peak:.0f} B per token x vocabulary "
            f"entry, where the planner counts e + 4 = 6, and HF's bf16 RMSNorm keeps {norm_saved:.0f} B per token x h "
            "per norm (an fp32 copy of x, the normalised x, the weighted output) where the planner counts 4. Step "
            "times are wall times on 2 shared cores (load in the attempt table) and are not a speed result.",
        ]
    )


def clusters_section(module, rows: list[dict]) -> str:
    return (
        "## Planner predictions for real clusters (`python -m hybridsp plan --clusters`)\n\n"
        + module.__doc__.split("\n\n", 2)[2].strip()
        + "\n\n"
        + module.markdown(rows)
    )
