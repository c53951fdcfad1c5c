"""Long-context decoding: K/V cache memory per rank and decode latency, sharded vs one process.

    python -m benchmarks run e2e.generate                       # contexts 2k-16k, W=1 vs W=4 (2x2, 1x4)
    python -m benchmarks run e2e.generate --contexts 4096 --steps 8 --budget-mib 32

The model is ``examples/train.py``'s small Llama (hidden 256, 4 layers, 8 query / 4 K/V heads,
head dim 32, fp32: 4 KiB of K/V per token). For every context S and mesh, one launch (gloo,
one thread per rank) runs the prefill through the hybrid attention
(``hybridsp.integrations.transformers.prefill``), then ``--steps`` decode steps against the
sharded cache (``decode_step``), and records per rank:

- ``cache``: bytes of this rank's K/V buffers (``ShardedKVCache.nbytes``: prompt share plus the
  new tokens it was assigned, preallocated);
- ``step_peak``: the most bytes torch allocated at once inside one decode step (the profiler's
  memory events; the transient above the resident model + cache);
- ``decode_ms``: the median wall time of a decode step (all ranks step together), and the prefill time.

"One process holding the whole cache" is the W=1 row. ``--budget-mib`` is a K/V budget per rank;
the summary says which meshes fit the longest context under it. Results: ``results/generate/generate.json``
and a markdown table on stdout (copied by hand into RESULTS.md). The machine is shared: contexts
and meshes are interleaved in repeated rounds (``--rounds``) and medians reported, with ``uptime``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import harness
from benchmarks.common.example import example

MESHES = {"w1": (1, 1), "u2r2": (2, 2), "u1r4": (1, 4)}  # name: (ulysses, ring)


class StepPeak:
    """Most bytes torch allocated at once inside the block (profiler memory events, in time order)."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        self.profiler.__exit__(*exc)
        events = [e for e in self.profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
        live, self.peak = 0, 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            self.peak = max(self.peak, live)
        self.profiler = None
        return False


def example_model():
    train = example("train")
    args = train.parse_args(["--seq-len", "2048"])  # train.py's defaults; max_position_embeddings >= 2048
    return train.build_model(args, 256).eval()


def run_rank(rank: int, world: int, ulysses: int, ring: int, context: int, steps: int) -> dict:
    """Prefill ``context`` tokens, then ``steps`` decode steps; this rank's measurements."""
    import torch.distributed as dist

    from hybridsp import init_mesh
    from hybridsp.integrations.transformers import apply
    from hybridsp.integrations.transformers._generation import decode_step, prefill

    mesh = init_mesh(ulysses=ulysses, ring=ring)
    model = example_model()
    apply(model, mesh)
    ids = torch.randint(0, 256, (1, context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        dist.barrier()
        start = time.perf_counter()
        state = prefill(model, ids, mesh=mesh, max_new_tokens=steps + 1)
        prefill_s = time.perf_counter() - start
        tokens, times = state.next_logits.argmax(-1), []
        for index in range(steps):
            start = time.perf_counter()
            if index == steps - 1:
                with StepPeak() as peak:
                    logits = decode_step(model, state, tokens, context + index)
            else:
                logits = decode_step(model, state, tokens, context + index)
            times.append(time.perf_counter() - start)
            tokens = logits.argmax(-1)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(
        cache=state.cache.store.nbytes(),
        step_peak=peak.peak,
        params=params,
        prefill_s=prefill_s,
        decode_ms=1000 * statistics.median(times[1:] if len(times) > 1 else times),
    )


def measure(name: str, context: int, steps: int) -> dict:
    ulysses, ring = MESHES[name]
    ranks = harness.launch(run_rank, ulysses * ring, ulysses, ring, context, steps, timeout=1800)
    return dict(
        mesh=name,
        context=context,
        world=ulysses * ring,
        cache_mib=max(r["cache"] for r in ranks) / 2**20,
        step_peak_mib=max(r["step_peak"] for r in ranks) / 2**20,
        params_mib=ranks[0]["params"] / 2**20,
        prefill_s=max(r["prefill_s"] for r in ranks),
        decode_ms=statistics.median(r["decode_ms"] for r in ranks),
    )


def summarize(rows: list[dict], budget_mib: float) -> str:
    """Median over rounds per (mesh, context), as a markdown table."""
    keys = sorted({(r["context"], r["mesh"]) for r in rows}, key=lambda k: (k[0], list(MESHES).index(k[1])))
    header = (
        "| context | mesh (world) | K/V cache per rank | decode-step peak (transient) | resident (params + "
        f"cache + peak) | fits a budget of {budget_mib:g} MiB K/V per rank | decode ms/token | prefill s |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for context, name in keys:
        same = [r for r in rows if r["context"] == context and r["mesh"] == name]
        med = {
            k: statistics.median(r[k] for r in same)
            for k in ("cache_mib", "step_peak_mib", "params_mib", "decode_ms", "prefill_s")
        }
        resident = med["params_mib"] + med["cache_mib"] + med["step_peak_mib"]
        fits = "yes" if med["cache_mib"] <= budget_mib else "**no**"
        lines.append(
            f"| {context:,} | {name} ({same[0]['world']}) | {med['cache_mib']:.2f} MiB | "
            f"{med['step_peak_mib']:.2f} MiB | {resident:.1f} MiB | {fits} | {med['decode_ms']:.1f} | "
            f"{med['prefill_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, default=32.0)
    parser.add_argument("--out", default=harness.results_path("generate", "generate.json"), help="the JSON file")
    args = parser.parse_args(argv)
    rows = []
    for round_index in range(args.rounds):
        for context in args.contexts:
            for name in args.meshes:  # interleaved: every round visits every (context, mesh)
                load = os.getloadavg()[0]
                row = dict(measure(name, context, args.steps), round=round_index, load=load)
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(rows=rows, steps=args.steps, budget_mib=args.budget_mib), indent=1))
    print(summarize(rows, args.budget_mib))
    print(
        "load average (1 min) during the runs: %.1f-%.1f" % (min(r["load"] for r in rows), max(r["load"] for r in rows))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
