"""The core reshaping of issue 19, before (4a51805) against after (this checkout), in one run.

    git worktree add --detach /work/wt-before 4a51805      # once
    python benchmarks/bench_core_shape.py --before /work/wt-before        # ~5-10 min on 2 busy cores

Every measurement runs in a subprocess with ``PYTHONPATH`` set to the tree it measures (the
"before" worktree, or this checkout), alternating before / after round by round so that the
machine's load drifts over both alike:

1. **Plan building**: ``hybridsp.masks.build_plan(65536, 4, "zigzag", causal=True, docs=(bounds,),
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
   medians.
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
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import combine, interleave, launch, load, machine_info, software_info, write_results  # noqa: E402

SEQ_PLAN, RING_PLAN = 65_536, 4
DOC_COUNTS = (1_000, 8_000, 32_000)
MODEL_SEQ, MODEL_DOCS = 1024, 16
MODEL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, attn_implementation="sdpa")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "all_to_all", "all_to_all_single", "batch_isend_irecv", "send", "recv", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "barrier")


# --------------------------------------------------------------------------------------------
# the tree under test (inside a worker subprocess)


def _plan_cache():
    """The lru-cached function that builds plans: build_plan before, masks._build_plan after."""
    import hybridsp.masks as masks
    return getattr(masks, "_build_plan", masks.build_plan)


def random_bounds(docs: int, seq: int = SEQ_PLAN, seed: int = 0) -> tuple[int, ...]:
    """``docs`` documents over ``seq`` tokens: 0, docs - 1 distinct random cut points, seq."""
    cuts = sorted(random.Random(seed).sample(range(1, seq), docs - 1))
    return tuple([0, *cuts, seq])


def plan_times(docs: int, repeats: int) -> dict:
    """{"cpu": [s], "wall": [s], "pieces": n} of ``repeats`` cold builds of the plan for ``docs`` documents."""
    from hybridsp.masks import build_plan

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
        import hybridsp.masks as masks

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
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False,
                       **extra).logits
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
    times = interleave({v: (lambda v=v: (_plan_cache().cache_clear(), step(v))) for v in variants}, iters, group=mesh.context_group)
    handle.undo()
    for variant in variants:
        result[variant]["times"] = times[variant]
    return result


def _overhead_rank(rank: int, world: int, iters: int) -> dict:
    """harness.interleave times of hybrid_attn_func / bare kernel / SDPA fwd+bwd on a 1 x 1 mesh."""
    import hybridsp
    from hybridsp.kernels import get_kernel

    mesh = hybridsp.init_mesh(ulysses=1, ring=1)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 64, 2, 16, generator=gen) for _ in range(4))  # [B, S, H, D]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kernel, scale = get_kernel("torch"), 16 ** -0.5

    def hybrid():
        hybridsp.hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend="torch").backward(dout)

    def bare():
        out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), causal=True, softmax_scale=scale)
        kernel.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal=True, softmax_scale=scale)

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)  # [B, H, S, D]
        out.transpose(1, 2).backward(dout)

    calls = {"hybrid_attn_func": hybrid, "bare kernel": bare, "torch SDPA": sdpa}
    for call in calls.values():
        for _ in range(20):
            call()
    return interleave(calls, iters)


def worker(part: str, args: dict) -> dict:
    """One measurement in this process's tree; the result is printed as the last stdout line."""
    import hybridsp

    out = {"hybridsp": hybridsp.__file__}
    if part == "plan":
        out["plan"] = {str(n): plan_times(n, r) for n, r in args["repeats"].items() if r > 0}
    elif part == "model":
        ranks = launch(_model_rank, 4, args["variants"], args["iters"])
        out["model"] = {v: {"calls": [r[v]["calls"] for r in ranks], "loss": ranks[0][v]["loss"],
                            "time": combine([r[v]["times"] for r in ranks])} for v in args["variants"]}
    elif part == "overhead":
        times = launch(_overhead_rank, 1, args["iters"])[0]
        out["overhead"] = {name: combine([t]) for name, t in times.items()}
    return out


# --------------------------------------------------------------------------------------------
# the driver (this checkout's Python; each measurement in a subprocess)


def run_worker(tree: str, part: str, args: dict, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", part, "--args", json.dumps(args)]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd="/tmp")
    if done.returncode != 0:
        raise RuntimeError(f"{part} in {tree} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["hybridsp"].startswith(tree):
        raise RuntimeError(f"{tree}: imported {result['hybridsp']}")
    print(f"  {part} {tree}: {time.perf_counter() - started:.1f} s (load {load()})", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="/work/wt-before")
    parser.add_argument("--after", default=str(HERE.parent))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("plan", "model", "overhead"), action="append")
    parser.add_argument("--prefix", default=str(HERE / "results_core_shape"))
    parser.add_argument("--worker")
    parser.add_argument("--args")
    opts = parser.parse_args()
    if opts.worker:
        print(json.dumps(worker(opts.worker, json.loads(opts.args))))
        return
    from bench_core_shape_report import report

    trees = {"before": opts.before, "after": opts.after}
    parts = opts.only or ["plan", "model", "overhead"]
    raw = {"before": [], "after": []}
    start_load = load()
    for i in range(opts.rounds):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        print(f"round {i + 1}/{opts.rounds}", flush=True)
        for part in parts:
            for name in order:
                raw[name].append(run_worker(trees[name], part, _part_args(part, name, i), timeout=900))
    data = {"machine": machine_info(), "software": software_info(), "load_start": start_load,
            "load_end": load(), "rounds": opts.rounds, "trees": trees, "raw": raw}
    markdown, summary = report(data)
    data["summary"] = summary
    write_results(opts.prefix, markdown, data)
    print(markdown)


def _part_args(part: str, tree: str, round_index: int) -> dict:
    """Repeats per round: the old quadratic builder gets one 32,000-document build in round 1 only."""
    if part == "plan":
        if tree == "before":
            return {"repeats": {1000: 3, 8000: 1, 32000: 1 if round_index == 0 else 0}}
        return {"repeats": {1000: 5, 8000: 5, 32000: 3}}
    if part == "model":
        return {"variants": ["plain"] if tree == "before" else ["plain", "documents"], "iters": 4}
    return {"iters": 1500}


if __name__ == "__main__":
    main()
