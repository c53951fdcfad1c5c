"""The core reshaping (linear plan builder, documents found once), before (4a51805) against after (this checkout).

    git worktree add --detach /work/wt-before 4a51805      # once
    python -m benchmarks run attention.core_shape --before /work/wt-before   # ~5-10 min on 2 busy cores

Every measurement runs in a worker subprocess under the hybridsp of the tree it measures (the
"before" worktree, or this checkout; :mod:`benchmarks.common.trees`), alternating before / after
round by round so that the machine's load drifts over both alike:

1. **Plan building**: ``hybridsp.layout._block_plan.build_plan(65536, 4, "zigzag", causal=True, docs=(bounds,),
   window=None, batch=1)`` for 1,000 / 8,000 / 32,000 random (seeded) document boundaries, the
   plan cache cleared before every build; medians of process CPU time and wall time.
2. **One training step of a switched 4-layer Llama** (hidden 64, 4 heads, 2 KV heads, vocab 128)
   on a packed batch (S = 1024, 16 documents, position ids restarting at 0) at U2 x R2 on 4 gloo
   ranks: shard_batch, forward, sharded_cross_entropy, backward, the plan cache cleared first (a new
   batch). Counted by wrapping torch.distributed's functions (calls per rank) and the plan builder
   (calls of ``build_plan`` and plans actually built = cache misses). "before": the model called as
   the README showed (input_ids, position_ids); "after": the same call, and with
   ``hybridsp_documents=local["documents"]``. Step wall time: median over interleaved steps.
3. **Per-call overhead of hybrid_attn_func on a 1 x 1 mesh** (world-1 gloo group) against the bare
   kernel (``get_kernel("torch").forward`` then ``.backward``) and torch's own SDPA with autograd,
   B=1, S=64, H=2, D=16 fp32 causal, forward+backward, interleaved (harness.interleave); ratio of
   medians (:mod:`benchmarks.common.overhead`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.common import ROOT
from benchmarks.common.harness import (
    combine,
    command,
    interleave,
    launch,
    load,
    machine_info,
    results_path,
    software_info,
    write_results,
)
from benchmarks.common.overhead import overhead_rank
from benchmarks.common.trees import tree_head, tree_process, tree_result

MODULE = "benchmarks.attention.core_shape"

SEQ_PLAN, RING_PLAN = 65_536, 4
DOC_COUNTS = (1_000, 8_000, 32_000)
MODEL_SEQ, MODEL_DOCS = 1024, 16
MODEL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    attn_implementation="sdpa",
)
OVERHEAD_SMALL, OVERHEAD_LARGE = (1, 64, 2, 16), (1, 512, 4, 32)  # [B, S, H, D]; the larger for context
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "batch_isend_irecv",
    "send",
    "recv",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
)


# --------------------------------------------------------------------------------------------
# the tree under test (inside a worker subprocess)


def _plan_cache():
    """The lru-cached function that builds plans: build_plan before, masks._build_plan after."""
    import hybridsp.layout._block_plan as masks

    return getattr(masks, "_build_plan", masks.build_plan)


def random_bounds(docs: int, seq: int = SEQ_PLAN, seed: int = 0) -> tuple[int, ...]:
    """``docs`` documents over ``seq`` tokens: 0, docs - 1 distinct random cut points, seq."""
    cuts = sorted(random.Random(seed).sample(range(1, seq), docs - 1))
    return tuple([0, *cuts, seq])


def plan_times(docs: int, repeats: int) -> dict:
    """{"cpu": [s], "wall": [s], "pieces": n} of ``repeats`` cold builds of the plan for ``docs`` documents."""
    from hybridsp.layout._block_plan import build_plan

    bounds, cache = random_bounds(docs), _plan_cache()
    cpu, wall = [], []
    for _ in range(repeats):
        cache.cache_clear()
        start, cpu_start = time.perf_counter(), time.process_time()
        plan = build_plan(SEQ_PLAN, RING_PLAN, "zigzag", causal=True, docs=(bounds,), window=None, batch=1)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    cache.cache_clear()
    return {"cpu": cpu, "wall": wall, "pieces": sum(len(p) for p in plan.pieces.values())}


class CallCounter:
    """Count calls of torch.distributed's collectives and of the plan builder while active.

    isend/irecv are not wrapped (P2POp requires the originals); their ops are counted inside
    batch_isend_irecv (``p2p ops``). ``build_plan`` is wrapped in every loaded hybridsp module that
    imported it; ``plans built`` = misses of the plan cache.
    """

    def __init__(self):
        self.calls: dict[str, int] = {}
        self._saved: list[tuple] = []

    def _bump(self, name: str, n: int = 1) -> None:
        self.calls[name] = self.calls.get(name, 0) + n

    def _wrap(self, owner, name: str, label: str, extra=None) -> None:
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            self._bump(label)
            if extra is not None:
                extra(*args)
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapped)

    def __enter__(self):
        import hybridsp.layout._block_plan as masks

        self._cache = _plan_cache()  # before wrapping: masks.build_plan itself is the cache before
        self._misses = self._cache.cache_info().misses
        for name in COLLECTIVES:
            if hasattr(dist, name):
                extra = (lambda ops: self._bump("p2p ops", len(ops))) if name == "batch_isend_irecv" else None
                self._wrap(dist, name, name, extra)
        builder = masks.build_plan
        for module in [m for n, m in sys.modules.items() if n.startswith("hybridsp") and m is not None]:
            if getattr(module, "build_plan", None) is builder:
                self._wrap(module, "build_plan", "build_plan calls")
        return self

    def __exit__(self, *exc):
        self.calls["plans built"] = self._cache.cache_info().misses - self._misses
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        return False


def packed_batch(seed: int = 0) -> dict:
    """input_ids/labels [1, S], position_ids restarting at 0 at each of MODEL_DOCS random documents."""
    bounds = random_bounds(MODEL_DOCS, MODEL_SEQ, seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, MODEL["vocab_size"], (1, MODEL_SEQ), generator=gen)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])[None]  # [1, S]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


def _model_rank(rank: int, world: int, variants: list[str], iters: int) -> dict:
    """Per variant: calls during one counted step (this rank) and the per-iteration step times."""
    import transformers

    import hybridsp
    from hybridsp.integrations import transformers as hf

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).float()
    mesh = hybridsp.init_mesh(ulysses=2, ring=2)
    handle = hf.apply(model, mesh, backend="torch")
    batch = packed_batch()

    def step(variant: str) -> float:
        model.zero_grad(set_to_none=True)
        local = hybridsp.shard_batch(batch, mesh)
        extra = {"hybridsp_documents": local["documents"]} if variant == "documents" else {}
        logits = model(
            input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False, **extra
        ).logits
        loss = hybridsp.sharded_cross_entropy(logits, local["shift_labels"], mesh)
        loss.backward()
        return loss.detach().item()

    result = {}
    for variant in variants:
        step(variant)  # warm-up
        _plan_cache().cache_clear()  # a new batch: its plan is not cached yet (clearing resets the counts)
        with CallCounter() as counter:
            loss = step(variant)
        result[variant] = {"calls": counter.calls, "loss": loss}
    fresh = {v: (lambda v=v: (_plan_cache().cache_clear(), step(v))) for v in variants}  # a new batch each step
    times = interleave(fresh, iters, group=mesh.context_group)
    handle.undo()
    for variant in variants:
        result[variant]["times"] = times[variant]
    return result


def worker(part: str, args: dict) -> dict:
    """One measurement in this process's tree; the result is printed as the last stdout line."""
    import hybridsp

    out = {"hybridsp": hybridsp.__file__}
    if part == "plan":
        out["plan"] = {str(n): plan_times(int(n), r) for n, r in args["repeats"].items() if r > 0}
    elif part == "model":
        ranks = launch(_model_rank, 4, args["variants"], args["iters"])
        out["model"] = {
            v: {
                "calls": [r[v]["calls"] for r in ranks],
                "loss": ranks[0][v]["loss"],
                "time": combine([r[v]["times"] for r in ranks]),
            }
            for v in args["variants"]
        }
    elif part == "overhead":
        shapes = launch(overhead_rank, 1, args["shapes"])[0]
        out["overhead"] = {shape: {name: combine([t]) for name, t in times.items()} for shape, times in shapes.items()}
    return out


# --------------------------------------------------------------------------------------------
# the driver (this checkout's Python; each measurement in a subprocess)


def _process(tree: str, part: str, args: dict) -> dict:
    return tree_process(MODULE, tree, "--worker", part, "--args", json.dumps(args))


def run_worker(tree: str, part: str, args: dict, timeout: float = 900) -> dict:
    started = time.perf_counter()
    done = subprocess.run(**_process(tree, part, args), capture_output=True, text=True, timeout=timeout)
    result = tree_result(tree, part, done.returncode, done.stdout, done.stderr)
    print(f"  {part} {tree}: {time.perf_counter() - started:.0f} s (load {load()})", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="/work/wt-before")
    parser.add_argument("--after", default=str(ROOT))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--slow-timeout",
        type=float,
        default=1800,
        help="wall seconds for the old builder's one 32,000-document build (runs alongside)",
    )
    parser.add_argument("--prefix", default=results_path("core_shape", "core_shape"))
    parser.add_argument("--worker")
    parser.add_argument("--args")
    opts = parser.parse_args(argv)
    if opts.worker:
        print(json.dumps(worker(opts.worker, json.loads(opts.args))))
        return 0
    trees = {"before": opts.before, "after": opts.after}
    raw = {"before": [], "after": []}
    start_load, started = load(), time.perf_counter()
    slow = subprocess.Popen(
        **_process(opts.before, "plan", {"repeats": {str(DOC_COUNTS[-1]): 1}}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for i in range(opts.rounds):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        print(f"round {i + 1}/{opts.rounds}", flush=True)
        for part in ("plan", "overhead", "model"):
            if part == "model" and i > 0:
                continue  # counts are exact; one step-time sample per tree is enough here
            for name in order:
                raw[name].append(run_worker(trees[name], part, _part_args(part, name)))
    try:
        stdout, stderr = slow.communicate(timeout=max(1.0, opts.slow_timeout - (time.perf_counter() - started)))
        raw["before"].append(tree_result(opts.before, "plan", slow.returncode, stdout, stderr))
        slow_note = None
    except subprocess.TimeoutExpired:
        slow.kill()
        slow_note = f"not finished within {opts.slow_timeout:.0f} s wall"
    data = {
        "command": command(MODULE, argv),
        "machine": machine_info(),
        "software": software_info(),
        "load_start": start_load,
        "load_end": load(),
        "uptime": _uptime(),
        "rounds": opts.rounds,
        "trees": trees,
        "revisions": {name: tree_head(tree) for name, tree in trees.items()},
        "slow_note": slow_note,
        "raw": raw,
    }
    os.makedirs(os.path.dirname(os.path.abspath(opts.prefix)), exist_ok=True)
    with open(opts.prefix + ".json", "w") as handle:  # the raw data first, in case the report fails
        json.dump(data, handle, indent=1)
    markdown, data["summary"] = report(data)
    write_results(opts.prefix, markdown, data)
    print(markdown)
    return 0


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _part_args(part: str, tree: str) -> dict:
    """Repeats per round (the old builder's 32,000-document build runs once, alongside: see main)."""
    if part == "plan":
        return {"repeats": {"1000": 3, "8000": 1} if tree == "before" else {"1000": 5, "8000": 5, "32000": 3}}
    if part == "model":
        return {"variants": ["plain"] if tree == "before" else ["plain", "documents"], "iters": 4}
    return {"shapes": [[list(OVERHEAD_SMALL), 600], [list(OVERHEAD_LARGE), 30]]}


# --------------------------------------------------------------------------------------------
# the report


def _med(values: list) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(raw: dict) -> dict:
    """Merge the rounds: plan times per document count, overhead times per shape and call, model counts."""
    out = {}
    for tree, results in raw.items():
        plan, overhead, model = {}, {}, {}
        for result in results:
            for n, times in result.get("plan", {}).items():
                entry = plan.setdefault(n, {"cpu": [], "wall": [], "pieces": times["pieces"]})
                entry["cpu"] += times["cpu"]
                entry["wall"] += times["wall"]
            for shape, calls in result.get("overhead", {}).items():
                for name, times in calls.items():
                    entry = overhead.setdefault(shape, {}).setdefault(name, {"cpu": [], "wall": []})
                    entry["cpu"] += times["cpu"]
                    entry["wall"] += times["wall"]
            model.update(result.get("model", {}))
        out[tree] = {
            "plan": {
                n: {"repeats": len(t["cpu"]), "cpu_s": _med(t["cpu"]), "wall_s": _med(t["wall"]), "pieces": t["pieces"]}
                for n, t in plan.items()
            },
            "overhead": {
                shape: {
                    name: {"iters": len(t["cpu"]), "cpu_us": 1e6 * _med(t["cpu"]), "wall_us": 1e6 * _med(t["wall"])}
                    for name, t in calls.items()
                }
                for shape, calls in overhead.items()
            },
            "model": {
                v: {
                    "calls_rank0": m["calls"][0],
                    "ranks_agree": all(c == m["calls"][0] for c in m["calls"]),
                    "loss": m["loss"],
                    "step_wall_s": m["time"]["median_wall"],
                    "step_cpu_s_all_ranks": m["time"]["median_cpu"],
                }
                for v, m in model.items()
            },
        }
    return out


def _plan_table(summary: dict, slow_note) -> list[str]:
    lines = [
        "| documents | before CPU s | after CPU s | CPU ratio | before wall s | after wall s | wall ratio | "
        "repeats b/a | pieces b/a |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in map(str, DOC_COUNTS):
        b, a = summary["before"]["plan"].get(n), summary["after"]["plan"].get(n)
        if a is None:
            continue
        if b is None:
            lines.append(
                f"| {int(n):,} | ({slow_note}) | {a['cpu_s'] * 1e3:.1f} ms | | | {a['wall_s'] * 1e3:.1f} ms "
                f"| | 0/{a['repeats']} | -/{a['pieces']} |"
            )
            continue
        lines.append(
            f"| {int(n):,} | {b['cpu_s']:.3f} | {a['cpu_s']:.4f} | {b['cpu_s'] / a['cpu_s']:.0f}x | "
            f"{b['wall_s']:.3f} | {a['wall_s']:.4f} | {b['wall_s'] / a['wall_s']:.0f}x | "
            f"{b['repeats']}/{a['repeats']} | {b['pieces']}/{a['pieces']} |"
        )
    return lines


def _model_table(summary: dict) -> list[str]:
    rows = {
        "before": summary["before"]["model"].get("plain"),
        "after": summary["after"]["model"].get("plain"),
        "after + hybridsp_documents": summary["after"]["model"].get("documents"),
    }
    names = sorted({k for r in rows.values() if r for k in r["calls_rank0"]})
    lines = [
        "| variant | " + " | ".join(n for n in names) + " | ranks agree | step wall s (median) | loss |",
        "|---|" + "---|" * (len(names) + 3),
    ]
    for label, r in rows.items():
        if r:
            counts = " | ".join(str(r["calls_rank0"].get(n, 0)) for n in names)
            lines.append(f"| {label} | {counts} | {r['ranks_agree']} | {r['step_wall_s']:.3f} | {r['loss']:.6f} |")
    return lines


def _overhead_table(summary: dict) -> list[str]:
    lines = [
        "| shape B x S x H x D | tree | hybrid_attn_func us | bare kernel us | torch SDPA us | "
        "hybrid / kernel (CPU) | hybrid / kernel (wall) | hybrid / SDPA (CPU) | iters |",
        "|---|" + "---|" * 8,
    ]
    for shape in summary["after"]["overhead"]:
        for tree in ("before", "after"):
            t = summary[tree]["overhead"].get(shape)
            if not t:
                continue
            h, k, s = t["hybrid_attn_func"], t["bare kernel"], t["torch SDPA"]
            lines.append(
                f"| {shape} | {tree} | {h['cpu_us']:.0f} | {k['cpu_us']:.0f} | {s['cpu_us']:.0f} | "
                f"{h['cpu_us'] / k['cpu_us']:.2f} | {h['wall_us'] / k['wall_us']:.2f} | "
                f"{h['cpu_us'] / s['cpu_us']:.2f} | {h['iters']} |"
            )
    return lines


def report(data: dict) -> tuple[str, dict]:
    """(markdown, summary) of a run."""
    summary = summarise(data["raw"])
    lines = [
        "# The core reshaping, before (4a51805) vs after",
        "",
        f"`{data.get('command', 'python benchmarks/bench_core_shape.py')}` ({data['rounds']} rounds, before/after alternating; "
        f"revisions {data.get('revisions', 'not recorded')}). {data['machine']}; {data['software']}.",
        f"Load average (1/5/15 min) at start {data['load_start']}, at end {data['load_end']}; `{data['uptime']}`. "
        "The machine was shared with other jobs: CPU times (process_time) are the steadier measure, "
        "wall times include waiting for a core.",
        "",
        f"## 1. Plan building: S = {SEQ_PLAN:,}, R = {RING_PLAN}, zigzag, causal, random documents (seed 0)",
        "",
        "Medians over cold builds (plan cache cleared before each). The old builder's 32,000-document build ran once, "
        "alongside the rest.",
        "",
        *_plan_table(summary, data.get("slow_note")),
        "",
        f"## 2. One step of a switched 4-layer Llama, packed batch (S = {MODEL_SEQ}, {MODEL_DOCS} documents), "
        "U2 x R2, 4 gloo ranks",
        "",
        "Calls per rank (rank 0; `ranks agree`: all 4 ranks counted the same) during one step: shard_batch, forward, "
        "sharded_cross_entropy, backward, plan cache cleared first. `p2p ops`: isend/irecv ops inside "
        "batch_isend_irecv; `build_plan calls`: calls of masks.build_plan; `plans built`: plan cache misses. "
        "Step wall: median of 4 interleaved steps (max over ranks).",
        "",
        *_model_table(summary),
        "",
        "## 3. Per-call overhead of hybrid_attn_func on a 1 x 1 mesh (world-1 gloo group), fp32 causal fwd+bwd",
        "",
        "Medians per call (us, process CPU time) over interleaved repeats (harness.interleave); bare kernel = "
        '`get_kernel("torch").forward` + `.backward`; torch SDPA = F.scaled_dot_product_attention with autograd.',
        "",
        *_overhead_table(summary),
        "",
    ]
    return "\n".join(lines), summary


if __name__ == "__main__":
    sys.exit(main())
