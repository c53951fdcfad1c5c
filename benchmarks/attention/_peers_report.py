"""The markdown report of attention.peers (tables and a reading, computed from its rows).

python -m benchmarks run attention.peers --render benchmarks/results/peers/peers.json   # rewrite the .md
"""

from __future__ import annotations

_TENSORS = ("out", "dq", "dk", "dv")


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def _errors_cell(entry: dict, ref_max: dict, kernel_errors: dict, dtype: str) -> str:
    errors = entry.get("errors")
    if not errors:
        return "-"
    rel = {n: errors[n] / max(ref_max[n], 1e-30) for n in _TENSORS}
    worst = max(rel, key=rel.get)
    if dtype == "fp32":
        return f"{rel[worst]:.1e} ({worst})"
    return f"{rel[worst]:.1e} ({worst}, {errors[worst] / max(kernel_errors.get(worst, 0.0), 1e-30):.2f}x kernel)"


def table(row: dict) -> list[str]:
    b = row["block"]
    lines = [
        f"### world {b['world']}, U{b['ulysses']} x R{b['ring']}, {b['dtype']}, B={b['batch']} S={b['seq']} "
        f"H={b['heads']} Hkv={b['kv_heads']} D={b['head_dim']}, causal; {b['iters']} interleaved rounds, "
        f"load {row['load'][0]} -> {row['load'][1]}",
        "",
        "| method | wall s (median) | CPU s (median) | hybridsp / peer, wall | paired | CPU | sent/rank MB | "
        "sent / min | peak mem MB | err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, e in row["methods"].items():
        if not e.get("ok"):
            reason = e.get("error") or f"wrong result, not timed: {e.get('errors')}"
            lines.append(f"| {method} | **n/a**: {reason} | | | | | | | | |")
            continue
        ratio = lambda k: f"**{e[k]:.3f}**" if k in e else "-"  # noqa: E731
        sent, floor = e["bytes_sent_per_rank"], row["analytic_min_bytes"]
        per_min = "1.00" if sent == floor == 0 else (f"{sent / floor:.2f}" if floor else "-")
        lines.append(
            f"| {method} | {e['median_wall']:.3f} | {e['median_cpu']:.3f} | {ratio('ratio_wall')} | "
            f"{ratio('ratio_wall_paired')} | {ratio('ratio_cpu')} | {_mb(sent)} | {per_min} | "
            f"{e['peak_mem_mb']:.1f} | {_errors_cell(e, row['ref_max'], row['kernel_errors'], b['dtype'])} |"
        )
    return lines + [""]


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# hybridsp vs DeepSpeed-Ulysses vs yunchang (USP) on CPU: causal attention, forward + backward",
        "",
        f"- Date: {meta['date']}; command: `{meta['command']}` ({meta['total_wall_s']:.0f} s in all)",
        f"- Machine: {meta['machine']}; load (1/5/15 min) at the start {meta['load_start']}",
        f"- Software: {meta['software']}; hybridsp at {meta['hybridsp']}; kv_comm modes: {', '.join(meta['kv_modes'])}",
        "- One launch per U x R: hybridsp (every kv_comm mode) and the peer of equal degrees (DeepSpeed-Ulysses "
        "at U = world, yunchang zigzag USP otherwise) in ONE process group, the same aten CPU flash kernel, "
        "one torch thread per rank. Each method is verified once against a single-process fp32 reference "
        "(fp32: max error <= 5e-5 x max|ref|; bf16: <= 2x the single-process bf16 kernel's error), then "
        "timed in rotating order (A B C, B C A, ...), a barrier before every call.",
        "- `wall s`: an iteration's wall time is the max over ranks; `CPU s`: process CPU time summed over "
        "ranks; medians over iterations. `hybridsp / peer`: ratio of the medians (wall, and CPU); `paired`: "
        "median over rounds of the per-round ratio. All ranks share the machine's cores, so time is total "
        "work plus communication and scheduling, not a multi-device speed-up.",
        "- `sent/rank`: bytes per rank per forward + backward (torch.distributed's sending calls wrapped, max "
        "over ranks); `min`: the most any rank must send (`hybridsp.attention._volume.hybrid_bytes`, ring mode): "
        "Ulysses 2 (U-1)/U x (q, k, v, out); K/V rows only where the receiver reads them, forward and backward, "
        "each visited block's dK/dV home once, in the input dtype. `peak mem`: RSS added "
        "by one steady-state forward + backward (VmHWM reset via /proc/self/clear_refs), max over ranks.",
        "",
    ]
    for row in rows:
        lines += table(row)
    lines += reading(rows)
    return "\n".join(lines) + "\n"


def reading(rows: list[dict]) -> list[str]:
    """One line per U x R: the ratios hybridsp / peer."""
    out = ["## Reading", ""]
    for row in rows:
        b, methods = row["block"], row["methods"]
        peer = "deepspeed" if b["ulysses"] == b["world"] else "yunchang"
        parts = [
            f"{m} {e['ratio_wall']:.3f}x wall / {e['ratio_cpu']:.3f}x CPU"
            for m, e in methods.items()
            if "ratio_wall" in e
        ]
        where = f"- W{b['world']} {b['dtype']} Hkv={b['kv_heads']} U{b['ulysses']}xR{b['ring']} vs {peer}: "
        out.append(where + ("; ".join(parts) if parts else "no ratio (a method did not pass)") + ".")
    return out + [""]
