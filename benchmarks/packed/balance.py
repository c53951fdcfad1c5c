"""Document-balanced token layouts at the plan level: design choices side by side (no kernels).

Run:  python -m benchmarks run packed.balance [--seeds 100] [--repeats 15] [--out PREFIX]

For each pack set (one batch row's document boundaries) and each design, from the runs that
``hybridsp.layout._balance.tries`` returns for every ring slot:

* **work max/mean**: cells per slot (a token at offset p of its document attends to
  min(p + 1, W) keys), the busiest slot over the mean; the worst pack of the set and the mean;
* **runs**: contiguous runs summed over the slots (gather/scatter pieces), mean over packs;
* **doc pieces**: (slot, document) pairs summed over the slots (varlen segments);
* **K/V rows**: sum over slots of the rows of *other* slots that belong to documents the slot
  also holds (a proxy for the K/V a slot must read), **causal rows**: only those rows that
  precede the slot's last token of that document (what causal attention can see), and **hull
  rows**: per slot pair the span of the sender's local rows from the first to the last row the
  receiver sees (what hybridsp's block plan ships); ratios to zigzag on the same packs;
* **build ms**: host time of one layout (min over ``--repeats``; the machine is shared).

Designs (all ``hybridsp.layout._balance.tries.design_slot_runs`` knobs, except zigzag):
zigzag; ``headtail`` (every document of >= 2R tokens per-document zigzag over all slots, as
TransformerEngine's THD; shorter ones whole); ``lpt`` (every document whole, most work first,
cut only to make token counts exact); ``lpt+balancer``; ``hybrid 0.35 (no balancer)`` (documents
with >= 0.35 W* work split over all slots, the rest whole in units, no balancer); ``first try``
(the first of ``TRIES``: only documents of >= S/R tokens split, units, balancer) and one-knob
variants; ``split x W*`` (tries with a split threshold; ``over all R``: TE-style spread instead
of just enough slots); ``contiguous ...`` (the balancer and split documents in consecutive
pieces plus the local search); ``split as needed`` (``_build_greedy``); ``nested tries
(before)`` (the nested tries in order, first within 1%: what shipped before the K/V objective);
``contiguous on k hosts`` (the hosted tries: only k slots keep room for the balancer);
**``balanced (tries)``** (``balanced_slot_runs``, what ships: fewest hull rows within 3%). Writes benchmarks/results/packed/balance.md and .json.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time

from benchmarks.common.harness import load, machine_info, results_path, revision, write_results
from benchmarks.common.packs import lognormal_pack
from hybridsp._formulas import zigzag_slot_runs
from hybridsp.layout._balance.bound import kv_rows_lower_bound
from hybridsp.layout._balance.tries import SPLITS, balanced_slot_runs, design_slot_runs
from hybridsp.layout._balance.work import hull_rows, slot_work

INF = math.inf
DESIGNS = {
    "zigzag": None,
    "headtail": dict(split_share=0, split_length=0, unit_share=0, unit_work=0, balancer=False, spread_all=True),
    "lpt": dict(split_share=INF, split_length=INF, unit_share=0, unit_work=0, balancer=False),
    "lpt+balancer": dict(split_share=INF, split_length=INF, unit_share=0, unit_work=0),
    "hybrid 0.35 (no balancer)": dict(split_share=0.35, balancer=False),
    "first try": {},
    "first try, no units": dict(unit_share=0, unit_work=0),
    "first try, reserve 0.25": dict(reserve=0.25),
    "split 0.5 W*": dict(split_share=0.5),
    "split 0.35 W*": dict(split_share=0.35),
    "split 0.35 W* over all R": dict(split_share=0.35, spread_all=True),
    "split 0.1 W*": dict(split_share=0.1),
    "contiguous first try": dict(contiguous=True),
    "contiguous split 0.35 W*": dict(split_share=0.35, contiguous=True),
    "split as needed 0.5 W*": dict(greedy=0.5),
    "contiguous on 1 host": dict(contiguous=True, host_share=0.0),
    "contiguous on R/2 hosts": dict(contiguous=True, host_share=0.5),
    "contiguous on R-1 hosts": dict(contiguous=True, host_share=1.0),
    "nested tries (before)": {},
    "balanced (tries)": {},
}


def uniform_cuts(seq_len: int, documents: int, seed: int) -> tuple[int, ...]:
    """``documents`` documents at uniformly random cut points (exponential-like lengths)."""
    cuts = sorted(random.Random(seed).sample(range(1, seq_len), documents - 1))
    return (0, *cuts, seq_len)


ISSUE_PACK = (2396, 840, 420, 1731, 708, 1070, 135, 296, 595, 1)  # attention.masks' 10 documents (RESULTS.md)


def pack_sets(seeds: int) -> list[dict]:
    """(name, S, R, window, list of bounds) of every pack set."""
    issue = tuple(sum(ISSUE_PACK[:i]) for i in range(len(ISSUE_PACK) + 1))
    sets = [
        dict(
            name=f"lognormal S=16384 R={r}",
            seq_len=16384,
            ring=r,
            window=None,
            packs=[lognormal_pack(16384, s) for s in range(seeds)],
        )
        for r in (2, 4, 8)
    ]
    sets += [
        dict(
            name="lognormal S=16384 R=4 W=512",
            seq_len=16384,
            ring=4,
            window=512,
            packs=[lognormal_pack(16384, s) for s in range(seeds)],
        ),
        dict(name="attention.masks' 10 documents S=8192 R=4", seq_len=8192, ring=4, window=None, packs=[issue]),
        dict(
            name="4 documents S=8192 R=4",
            seq_len=8192,
            ring=4,
            window=None,
            packs=[uniform_cuts(8192, 4, s) for s in range(seeds)],
        ),
        dict(
            name="100 documents S=65536 R=8",
            seq_len=65536,
            ring=8,
            window=None,
            packs=[uniform_cuts(65536, 100, s) for s in range(min(seeds, 20))],
        ),
        dict(
            name="8000 documents S=65536 R=4",
            seq_len=65536,
            ring=4,
            window=None,
            packs=[uniform_cuts(65536, 8000, s) for s in range(min(seeds, 5))],
        ),
    ]
    return sets


def layout(design: str, bounds, seq_len: int, ring: int, window):
    if DESIGNS[design] is None:
        return zigzag_slot_runs(seq_len, ring)
    if design == "balanced (tries)":
        return balanced_slot_runs(bounds, seq_len, ring, window=window)
    if design == "nested tries (before)":
        return nested_tries(bounds, seq_len, ring, window)
    return design_slot_runs(bounds, seq_len, ring, window=window, **DESIGNS[design])


def nested_tries(bounds, seq_len: int, ring: int, window):
    """What ``balanced_slot_runs`` did before contiguous tries and the K/V objective: the nested
    tries of ``SPLITS`` in order, the first within 1% of the mean work, else the best."""
    best = None
    for split_share, reserve in SPLITS:
        slots = design_slot_runs(bounds, seq_len, ring, window=window, split_share=split_share, reserve=reserve)
        work = slot_work(slots, bounds, window)
        ratio = max(work) * ring / sum(work)
        if best is None or ratio < best[0]:
            best = (ratio, slots)
        if ratio <= 1.01:
            break
    return best[1]


def holdings(runs_per_slot, bounds) -> list[dict[int, list[tuple[int, int, int]]]]:
    """Per slot: document -> its pieces (global start, global end, local offset) in that slot."""
    from bisect import bisect_right

    out = []
    for runs in runs_per_slot:
        docs: dict[int, list[tuple[int, int, int]]] = {}
        offset = 0
        for start, n in runs:
            pos, end, d = start, start + n, bisect_right(bounds, start) - 1
            while pos < end:
                stop = min(end, bounds[d + 1])
                docs.setdefault(d, []).append((pos, stop, offset + pos - start))
                pos, d = stop, d + 1
            offset += n
        out.append(docs)
    return out


def kv_rows(runs_per_slot, bounds) -> dict[str, int]:
    """K/V traffic proxies of one layout (causal, window ignored), summed over ordered slot pairs
    (q, s), q != s: ``rows``: s's rows of documents q also holds; ``causal``: those before q's
    last token of the document (the rows q's queries see); ``hull``: the span of s's *local*
    rows from the first to the last row q sees (what a sender that ships a hull per peer, as
    hybridsp's plan does, sends); ``pairs``: pairs with anything visible; ``pieces``: (slot,
    document) pairs."""
    held = holdings(runs_per_slot, bounds)
    out = dict(rows=0, causal=0, hull=0, pairs=0, pieces=sum(len(docs) for docs in held))
    for q, mine in enumerate(held):
        last = {d: max(stop for _, stop, _ in pieces) for d, pieces in mine.items()}
        for s, theirs in enumerate(held):
            if s == q:
                continue
            lo = hi = None
            for d, pieces in theirs.items():
                if d not in last:
                    continue
                for start, stop, local in pieces:
                    out["rows"] += stop - start
                    seen = min(stop, last[d]) - start
                    if seen > 0:
                        out["causal"] += seen
                        lo = local if lo is None else min(lo, local)
                        hi = local + seen if hi is None else max(hi, local + seen)
            if lo is not None:
                out["hull"] += hi - lo
                out["pairs"] += 1
    return out


def check(runs_per_slot, seq_len: int, ring: int) -> None:
    """Exact partition with S/R tokens per slot (the benchmark refuses to report a broken layout)."""
    spans = sorted(run for runs in runs_per_slot for run in runs)
    assert all(sum(n for _, n in runs) == seq_len // ring for runs in runs_per_slot)
    assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] == seq_len


def measure(pack_set: dict) -> dict:
    """Every design's numbers on one pack set."""
    seq_len, ring, window = pack_set["seq_len"], pack_set["ring"], pack_set["window"]
    out = {}
    for design in DESIGNS:
        ratios, runs, traffic = [], [], []
        for bounds in pack_set["packs"]:
            slots = layout(design, bounds, seq_len, ring, window)
            check(slots, seq_len, ring)
            work = slot_work(slots, bounds, window)
            ratios.append(max(work) * ring / sum(work))
            runs.append(sum(len(r) for r in slots))
            traffic.append(kv_rows(slots, bounds))
        total = {key: sum(t[key] for t in traffic) for key in traffic[0]}
        out[design] = dict(
            work_max=max(ratios),
            work_mean=statistics.fmean(ratios),
            over_105=sum(x > 1.05 for x in ratios),
            runs=statistics.fmean(runs),
            pieces=total["pieces"] / len(traffic),
            pairs=total["pairs"] / len(traffic),
            kv_rows=total["rows"],
            kv_causal=total["causal"],
            kv_hull=total["hull"],
        )
    for design in DESIGNS:
        for key in ("kv_rows", "kv_causal", "kv_hull"):
            out[design][key + "_vs_zigzag"] = out[design][key] / max(1, out["zigzag"][key])
    return out


def bound_rows(pack_set: dict) -> dict | None:
    """Hull rows of zigzag and of the balanced layout beside ``kv_rows_lower_bound`` (Note [rows bound]):
    at 1.05 balance (the balanced layout's target) and at the balance the layout reached, summed over packs;
    ``infeasible``: packs on which no layout within 1.05 balance ships <= 1.05 x zigzag's rows.
    None with a window (the bound assumes full causal attention)."""
    if pack_set["window"] is not None:
        return None
    seq_len, ring = pack_set["seq_len"], pack_set["ring"]
    out = dict(zigzag=0, balanced=0, bound_105=0, bound_reached=0, infeasible=0)
    for bounds in pack_set["packs"]:
        zig = hull_rows(zigzag_slot_runs(seq_len, ring), bounds)
        runs = balanced_slot_runs(bounds, seq_len, ring)
        work = slot_work(runs, bounds)
        at_105 = kv_rows_lower_bound(bounds, seq_len, ring, 1.05)
        out["zigzag"] += zig
        out["balanced"] += hull_rows(runs, bounds)
        out["bound_105"] += at_105
        out["bound_reached"] += kv_rows_lower_bound(bounds, seq_len, ring, max(work) * ring / sum(work))
        out["infeasible"] += at_105 > 1.05 * zig
    return out


def build_times(repeats: int) -> list[dict]:
    """Host time of balanced_slot_runs for 1,000 / 8,000 / 32,000 documents: wall and CPU time
    (``time.process_time``, less disturbed by other jobs on a shared machine), min and median."""
    rows = []
    for documents, seq_len in ((1000, 65536), (8000, 65536), (32000, 262144)):
        for ring in (4, 8):
            bounds = uniform_cuts(seq_len, documents, 0)
            wall, cpu = [], []
            for _ in range(repeats):
                start, cpu_start = time.perf_counter(), time.process_time()
                balanced_slot_runs(bounds, seq_len, ring)
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - cpu_start)
            rows.append(
                dict(
                    documents=documents,
                    seq_len=seq_len,
                    ring=ring,
                    min_ms=min(wall) * 1e3,
                    median_ms=statistics.median(wall) * 1e3,
                    cpu_min_ms=min(cpu) * 1e3,
                    cpu_median_ms=statistics.median(cpu) * 1e3,
                )
            )
    return rows


def markdown(results: list[dict], timing: list[dict], info: dict) -> str:
    lines = [
        f"# Document-balanced layouts at the plan level ({info['date']})",
        "",
        f"{info['machine']}; load {info['load']}; hybridsp {info['revision']}.",
        "",
        "work = busiest slot / mean (worst pack, mean over packs, packs over 1.05); runs and doc",
        "pieces summed over slots (mean over packs); K/V rows = rows of other slots in shared",
        "documents (all, and the causal subset), summed over packs, / zigzag's; hull rows = per ordered",
        "slot pair the span of the sender's local rows from the first to the last row the receiver",
        "sees (what hybridsp's plan ships per pass; window ignored), / zigzag's and per pack; visible",
        "slot pairs = ordered pairs with any visible key (R (R - 1) at most), mean over packs.",
        "",
    ]
    for pack_set in results:
        lines += [
            f"## {pack_set['name']} ({pack_set['packs']} packs)",
            "",
            "| design | work max | work mean | >1.05 | runs | doc pieces | K/V rows vs zigzag | causal rows vs zigzag "
            "| hull rows vs zigzag | hull rows / pack | visible slot pairs |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for design, m in pack_set["designs"].items():
            lines.append(
                f"| {design} | {m['work_max']:.3f} | {m['work_mean']:.3f} | {m['over_105']} | {m['runs']:.1f} | "
                f"{m['pieces']:.1f} | {m['kv_rows_vs_zigzag']:.2f} | {m['kv_causal_vs_zigzag']:.2f} | "
                f"{m['kv_hull_vs_zigzag']:.2f} | {m['kv_hull'] / pack_set['packs']:,.0f} | {m['pairs']:.1f} |"
            )
        lines.append("")
    lines += [
        "## K/V rows against a lower bound (`hybridsp.layout._balance.bound.kv_rows_lower_bound`)",
        "",
        "Hull rows summed over the packs; the bound holds for *any* layout whose busiest slot has at most",
        "that balance (Note [rows bound]); *infeasible* = packs on which no layout within 1.05 balance",
        "can ship within 5% of zigzag's rows.",
        "",
        "| packs | zigzag | balanced | balanced / zigzag | bound at 1.05 / zigzag | bound at balanced's "
        "balance / zigzag | balanced / that bound | infeasible packs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for pack_set in results:
        b = pack_set["bound"]
        if b:
            z = max(1, b["zigzag"])
            lines.append(
                f"| {pack_set['name']} | {b['zigzag']:,} | {b['balanced']:,} | {b['balanced'] / z:.2f} | "
                f"{b['bound_105'] / z:.2f} | {b['bound_reached'] / z:.2f} | "
                f"{b['balanced'] / max(1, b['bound_reached']):.2f} | {b['infeasible']} / {pack_set['packs']} |"
            )
    lines.append("")
    lines += [
        "## Build time of `balanced_slot_runs` (uniform random cut points)",
        "",
        "| documents | S | R | wall min ms | wall median ms | CPU min ms | CPU median ms |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {t['documents']:,} | {t['seq_len']:,} | {t['ring']} | {t['min_ms']:.1f} | {t['median_ms']:.1f} | "
        f"{t['cpu_min_ms']:.1f} | {t['cpu_median_ms']:.1f} |"
        for t in timing
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100, help="packs per random pack set")
    parser.add_argument("--repeats", type=int, default=15, help="build-time repeats (min reported)")
    parser.add_argument(
        "--out",
        default=results_path("packed", "balance"),
        help="output prefix (default benchmarks/results/packed/balance)",
    )
    args = parser.parse_args(argv)
    info = dict(date=time.strftime("%Y-%m-%d"), machine=machine_info(), load=load(), revision=revision())
    results = []
    for pack_set in pack_sets(args.seeds):
        print(f"{pack_set['name']} ...", flush=True)
        results.append(
            dict(
                name=pack_set["name"],
                seq_len=pack_set["seq_len"],
                ring=pack_set["ring"],
                window=pack_set["window"],
                packs=len(pack_set["packs"]),
                designs=measure(pack_set),
                bound=bound_rows(pack_set),
            )
        )
    timing = build_times(args.repeats)
    info["load_after"] = load()
    text = markdown(results, timing, info)
    print(text)
    write_results(
        args.out,
        text,
        dict(info=info, designs={k: v for k, v in DESIGNS.items()}, pack_sets=results, build_times=timing),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
